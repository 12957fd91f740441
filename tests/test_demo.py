"""The demo: a fixed, reproducible budget; its report; what it prints while it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anyorder.config import load_config, to_dict
from anyorder.demo import corpus_word_share, demo, demo_config
from anyorder.errors import ConfigError

from conftest import REPO


def test_configs_demo_yaml_is_the_demos_recipe(tmp_path) -> None:
    ours = to_dict(demo_config(tmp_path / "d"))
    theirs = to_dict(load_config(REPO / "configs" / "demo.yaml"))
    ours["train"]["out_dir"] = theirs["train"]["out_dir"]  # where the files go may differ
    ours["data"]["cache_dir"] = theirs["data"]["cache_dir"]
    assert theirs == ours


def test_corpus_word_share_counts_the_words_the_model_wrote() -> None:
    words = {"the", "statement", "deletes", "is"}
    # "state|ment": begun in the prompt, finished by the model: counts; "xq" is not a word
    # of the corpus; "targ" runs into the end of the text (it may be cut there): left out
    assert corpus_word_share("The del state", "ment deletes xq a targ", words) == (2, 3)
    assert corpus_word_share("The ", "", words) == (0, 0)


def _run_demo(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "anyorder.cli", "demo", "--out", str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_demo_prints_its_estimate_and_progress_lines_and_twice_writes_the_same_report(
    tmp_path,
) -> None:
    first = _run_demo(tmp_path / "a", "--steps", "6", "--threads", "1")
    assert first.returncode == 0, first.stderr
    # up front: what it will cost; in a log (stderr is a pipe here): lines, no \r
    assert "demo (training, evaluation, samples): about" in first.stdout
    assert "train: 2 more steps and 1 validation(s): about" in first.stdout
    assert "train: 6/6 steps (100%)" in first.stderr and "\r" not in first.stderr
    assert "corpus words" in first.stdout and "report written to" in first.stdout
    report = (tmp_path / "a" / "report.md").read_text()
    heads = [ln for ln in report.splitlines() if ln.startswith("#")]
    assert heads[:4] == [
        "# anyorder demo: a tiny ARMD on Python's documentation",
        "## Samples",
        heads[2],
        "### One prompt, four decoders",
    ]
    assert heads[2].startswith("### Left to right: ") and "corpus words" in heads[2]
    assert "**What to expect.**" in report and "A larger run buys" in report
    for label in ("left to right", "random order", "Lemma 1, 20 steps", "strided, S = 4"):
        assert f"| {label} |" in report
    assert "| any order, same targets |" in report and "nats" not in report
    info = json.loads((tmp_path / "a" / "demo.json").read_text())
    passes = {d["decoder"]: d["passes"] for d in info["samples"]["decoders"]}
    assert passes["l2r"] == passes["random"] == 80 and passes["lemma1"] <= 20
    assert passes["strided"] == 4 + 80 // 4 - 1
    assert json.loads((tmp_path / "a" / "timing.json").read_text())["cpu_s"] > 0
    # the same command again (in-process this time): the same report, byte for byte
    demo(tmp_path / "b", steps=6, threads=1, progress=False)
    again = (tmp_path / "b" / "report.md").read_text()
    assert again == report
    assert (tmp_path / "b" / "loss.png").read_bytes() == (tmp_path / "a" / "loss.png").read_bytes()


def test_demo_refuses_a_folder_it_did_not_write(tmp_path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a demo's; pick an empty or new folder"):
        demo(tmp_path / "mine", steps=1)
    with pytest.raises(ConfigError, match="must be positive"):
        demo(tmp_path / "new", minutes=0)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "new").exists()


def test_the_number_of_threads_does_not_change_training() -> None:
    """Why the demo may suggest --threads 1 on a busy machine: the same bits either way."""
    import torch

    from anyorder import build_model, preset
    from anyorder.orders import uniform

    def train(threads: int) -> list[torch.Tensor]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.manual_seed(0)
            cfg = preset("tiny", kind="armd", n_layer=2, d_model=64, n_head=4, seq_len=64)
            model = build_model(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
            g = torch.Generator().manual_seed(0)
            for _ in range(3):
                x = torch.randint(0, 256, (8, 64), generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model.loss(x, uniform(8, 64, g).order)
                loss.backward()
                opt.step()
                opt.zero_grad()
            return [p.detach().clone() for p in model.parameters()]
        finally:
            torch.set_num_threads(before)

    for a, b in zip(train(1), train(2)):
        assert torch.equal(a, b)
