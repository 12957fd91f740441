"""The demo: a fixed, reproducible budget; its report; what it prints while it runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anyorder.config import load_config, to_dict
from anyorder.demo import corpus_word_share, demo, demo_config
from anyorder.errors import ConfigError
from anyorder.progress import format_duration

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
    t = time.perf_counter()
    first = _run_demo(tmp_path / "a", "--steps", "6", "--threads", "1")
    elapsed = time.perf_counter() - t
    assert first.returncode == 0, first.stderr
    # the estimate is measured on the first steps (train's), never a constant from elsewhere;
    # in a log (stderr is a pipe here): lines, no \r
    assert "calibrated" not in first.stdout and "demo (training" not in first.stdout
    assert "train: 2 more steps and 1 validation(s): about" in first.stdout
    assert "steps x" in first.stdout and "s measured)" in first.stdout
    assert "train: 6/6 steps (100%)" in first.stderr and "\r" not in first.stderr
    assert "corpus words" in first.stdout and "report written to" in first.stdout
    report = (tmp_path / "a" / "report.md").read_text()
    lines = report.splitlines()
    # the first line after the title: this run's steps and time, measured (training.jsonl)
    sessions = [json.loads(x) for x in (tmp_path / "a" / "training.jsonl").read_text().splitlines()]
    assert [(s["from_step"], s["to_step"], s["planned"]) for s in sessions] == [(0, 6, 6)]
    timing = json.loads((tmp_path / "a" / "timing.json").read_text())
    assert lines[2] == (
        "**This run** (measured here): 6 of 6 planned training steps took "
        f"{format_duration(sessions[0]['wall_s'])} of wall time (start-up and data included) "
        f"and {format_duration(sessions[0]['cpu_s'])} of CPU time on 1 thread(s); evaluation "
        f"and samples took {format_duration(timing['phases_s']['evaluate'])} and "
        f"{format_duration(timing['phases_s']['sample'])}."
    )
    assert sessions[0]["cpu_s"] > 0 and 0 < sessions[0]["train_s"] < sessions[0]["wall_s"]
    assert sessions[0]["wall_s"] + timing["phases_s"]["evaluate"] < elapsed
    # 6 steps do not teach spelling, and the report does not claim they did
    info = json.loads((tmp_path / "a" / "demo.json").read_text())
    assert info["word_share"] < 0.5 and "has learnt the spelling" not in report
    assert f"{info['word_share']:.0%} of the words it writes left to right" in lines[4]
    assert "most of what it writes is not yet words" in lines[4]
    heads = [ln for ln in lines if ln.startswith("#")]
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
    # the recipe names the precision the run trained in (the demo's config: fp32)
    assert info["config"]["train"]["dtype"] == "fp32"
    assert "weight decay 0.1, fp32 (no autocast) (the number of threads" in report
    assert "bf16" not in report
    passes = {d["decoder"]: d["passes"] for d in info["samples"]["decoders"]}
    assert passes["l2r"] == passes["random"] == 80 and passes["lemma1"] <= 20
    assert passes["strided"] == 4 + 80 // 4 - 1
    assert json.loads((tmp_path / "a" / "timing.json").read_text())["cpu_s"] > 0
    # the same command again (in-process this time): the same report, byte for byte but for
    # the line of this run's time
    demo(tmp_path / "b", steps=6, threads=1, progress=False)
    again = (tmp_path / "b" / "report.md").read_text().splitlines()
    assert again[2].startswith("**This run** (measured here): 6 of 6 planned")
    assert again[:2] + again[3:] == lines[:2] + lines[3:]
    assert (tmp_path / "b" / "loss.png").read_bytes() == (tmp_path / "a" / "loss.png").read_bytes()


def _start_demo(out: Path, steps: int) -> subprocess.Popen:
    """``anyorder demo`` in a child, once its first steps are timed (the estimate's line)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "anyorder.cli", "demo", "--out", str(out), "--steps", str(steps),
           "--threads", "1", "--no-progress"]  # fmt: skip
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if "more steps and" in line:  # train's estimate: 4 steps are done
            return p
    p.kill()
    raise AssertionError(f"no estimate line: {p.stderr.read()}")


def _stop(p: subprocess.Popen, sig: int) -> tuple[str, float]:
    """Send ``sig``; the rest of stdout and the seconds until the child exited."""
    t = time.perf_counter()
    p.send_signal(sig)
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    return out, time.perf_counter() - t


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def test_a_stopped_demo_saves_exits_at_once_writes_no_report_and_resumes_bit_exactly(
    tmp_path,
) -> None:
    import torch

    from anyorder.checkpoint import latest_checkpoint
    from anyorder.training.loop import train

    out, steps = tmp_path / "d", 40
    p = _start_demo(out, steps)
    said, took = _stop(p, signal.SIGINT)
    assert p.returncode == 130 and took < 10, (p.returncode, took)
    ckpt = latest_checkpoint(out)
    step = int(ckpt.name.split("_")[1])
    assert 4 <= step < steps
    assert said.strip().splitlines()[-1] == (
        f"demo: SIGINT: stopped at step {step} of {steps} (saved in {ckpt}); no report "
        f"written; run `anyorder demo --out {out} --steps {steps} --threads 1` again to resume "
        "from there and write the report"
    )
    assert not (out / "report.md").exists() and not (out / "demo.json").exists()
    # the same command again: resumes from the saved step and writes the report
    again = _run_demo(out, "--steps", str(steps), "--threads", "1", "--no-progress")
    assert again.returncode == 0, again.stderr
    assert f"continuing the demo saved at step {step} of {steps}" in again.stdout
    assert f"resuming from {ckpt} at step {step}" in again.stdout
    report = (out / "report.md").read_text().splitlines()
    assert report[2].startswith(f"**This run** (measured here): {steps} of {steps} planned")
    assert "in 2 sessions (stopped and resumed)" in report[2]
    # the same weights as a training that was never stopped
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train(demo_config(tmp_path / "ref", steps), resume=False, progress=False)
    finally:
        torch.set_num_threads(before)
    mine, theirs = _weights(latest_checkpoint(out)), _weights(Path(ref["checkpoint"]))
    assert latest_checkpoint(out).name == f"step_{steps:07d}" and mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    # a demo stopped after training (while evaluating) is only evaluated again
    (out / "report.md").unlink()
    third = _run_demo(out, "--steps", str(steps), "--threads", "1", "--no-progress")
    assert third.returncode == 0, third.stderr
    assert f"continuing the demo saved at step {steps} of {steps}" in third.stdout
    assert "resuming from" not in third.stdout and "train:" not in third.stdout
    redone = (out / "report.md").read_text().splitlines()
    assert redone[:2] + redone[3:] == report[:2] + report[3:]  # all but this run's times
    assert redone[2].split("; evaluation")[0] == report[2].split("; evaluation")[0]


def test_what_to_expect_says_what_was_measured() -> None:
    from anyorder.demo.report import expectation

    info = {"step": 4500, "tokens_seen": 9_216_000, "params": 440_000, "word_share": 0.81,
            "eval": {"l2r_bpb": 1.904}, "unigram": 4.707}  # fmt: skip
    learnt = expectation(info)
    assert learnt.startswith(
        "**What to expect.** 4,500 training steps (9.2M bytes of text seen) gave a "
        "0.4M-parameter model: 81% of the words it writes left to right are words of the "
        "corpus (left to right 1.90 bits/byte, the unigram baseline 4.71); it has learnt the "
        "spelling, the common words and the layout of Python's documentation"
    )
    info |= {"step": 34, "tokens_seen": 69_632, "word_share": 0.12, "eval": {"l2r_bpb": 5.9}}
    early = expectation(info)
    assert "12% of the words" in early and "has learnt" not in early
    assert "most of what it writes is not yet words" in early


def test_sigterm_stops_the_demo_and_removes_the_last_report(tmp_path) -> None:
    """A time limit's SIGTERM: saved, exit 143 at once, and the report of the demo that was
    there before is gone (it would pass for this one's)."""
    out = tmp_path / "d"
    out.mkdir()
    (out / ".anyorder-demo").write_text("")
    (out / "report.md").write_text("# an earlier demo's report\n")
    p = _start_demo(out, 60)
    said, took = _stop(p, signal.SIGTERM)
    assert p.returncode == 143 and took < 10, (p.returncode, took)
    assert "demo: SIGTERM: stopped at step " in said and "no report written" in said
    assert "evaluating" not in said and not (out / "report.md").exists()


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
