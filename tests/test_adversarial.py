"""The classes of issue 17, tried as an attacker would, through the real CLI.

Most single bad inputs are rows of docs/errors.md (tests/test_errors.py runs each one and
checks the line, the exit code and that no file changed); the server's are in
tests/test_serve.py. Here are the cases that need more than one command or a process
limit:

1. two trainings into one run folder (the second is refused, naming the first's PID; the
   first one's files stay its own), and temporary folders of a live writer are left alone;
   readers retry once when the latest checkpoint is pruned under them;
3. a data shard edited after it was written is caught when the cache is opened;
4. a corpus that is one large .txt file trains (the split says so in one line);
5. an EMA entry removed from a manifest is an error for sampling and for resuming;
6. a disk that fills up during a save: one line, the earlier checkpoint intact, no temp
   folder left, and the same command resumes once there is room.

No test depends on timing beyond generous waits for a process to reach a state.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from anyorder import checkpoint as ck
from anyorder.training.metrics import read_metrics

CONFIG = """\
model: {kind: armd, n_layer: 2, n_head: 2, d_model: 32, seq_len: 32}
data: {source: "builtin:pydoc", max_documents: 40, cache_dir: cache}
train: {out_dir: run, steps: 2, batch_size: 8, lr: 0.01, warmup_steps: 1, eval_every: 0,
        eval_batches: 1, ckpt_every: 0, keep_last: 2, log_every: 1, device: cpu, seed: 3}
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def cli(cwd: Path, *args: str, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "anyorder.cli", *args],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600, preexec_fn=preexec,
    )  # fmt: skip


def one_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return tmp_path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run trained for 2 steps (one checkpoint, step 2) and its data cache."""
    root = tmp_path_factory.mktemp("adversarial")
    (root / "cfg.yaml").write_text(CONFIG)
    out = cli(root, "train", "cfg.yaml", "--no-progress", "train.ema=0.9")
    assert out.returncode == 0, out.stderr
    return root


def _copy(trained: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(trained, dest, symlinks=True)
    return dest


# ----------------------------------------------------------------------------- 1. one writer


def test_two_trainings_into_one_run_folder(folder) -> None:
    long = ["train", "cfg.yaml", "--no-progress", "train.steps=100000", "train.ckpt_every=5"]
    first = subprocess.Popen(
        [sys.executable, "-m", "anyorder.cli", *long],
        cwd=folder, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        lock = folder / "run" / ".lock"
        deadline = time.monotonic() + 300
        while not (lock.is_file() and lock.read_text().strip() == str(first.pid)):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first training never took the lock"
            time.sleep(0.1)
        for seed in (3, 5):  # the same config, and another seed
            second = cli(folder, *long, f"train.seed={seed}")
            assert second.returncode == 2
            assert one_line(second) == (
                f"anyorder train: error: train.out_dir='run' is in use by another training "
                f"(PID {first.pid}); wait for it to finish, stop it, or pick another "
                "train.out_dir"
            )
        while ck.latest_checkpoint(folder / "run") is None:  # let it save once
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGTERM)  # saves the step it is in and exits 143
        _, err = first.communicate(timeout=300)
    assert first.returncode == 143, err
    run = folder / "run"
    assert not (run / ".lock").exists()
    # every file is the first run's: config, every metrics row, every checkpoint
    assert "seed: 3" in (run / "config.yaml").read_text()
    rows = read_metrics(run)
    assert rows and {r["seed"] for r in rows} == {3}
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))
    for path in ck.list_checkpoints(run):
        assert ck.verify(path)["seed"] == 3
    assert not list((run / "checkpoints").glob(".step_*"))


def test_a_save_removes_only_its_own_or_dead_writers_temp_folders(tmp_path) -> None:
    from anyorder.config import RunConfig
    from anyorder.data import ByteTokenizer

    from conftest import tiny_model

    model = tiny_model("gpt", vocab_size=257, seq_len=8)
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        live_tmp = root / f".step_0000009.tmp-{alive.pid}-abc"
        dead_tmp = root / f".step_0000009.tmp-{dead.pid}-abc"
        own_tmp = root / f".step_0000009.tmp-{os.getpid()}-abc"
        for p in (live_tmp, dead_tmp, own_tmp):
            p.mkdir()
        cfg = RunConfig(model=model.cfg)
        ck.save_checkpoint(tmp_path / "run", 1, model=model, config=cfg, tokenizer=ByteTokenizer())
        assert live_tmp.is_dir() and not dead_tmp.exists() and not own_tmp.exists()
    finally:
        alive.kill()
        alive.wait()


def test_a_reader_retries_once_when_the_latest_checkpoint_is_pruned(trained, tmp_path, monkeypatch):
    import shutil

    from anyorder.checkpoint import load as ck_load

    run = _copy(trained, tmp_path / "w") / "run"
    latest = ck.latest_checkpoint(run)
    older = latest.with_name("step_0000001")
    shutil.copytree(latest, older)  # a second complete checkpoint (a copy: same files)
    manifest = json.loads((older / "manifest.json").read_text())
    (older / "manifest.json").write_text(json.dumps({**manifest, "step": 1}))
    real = ck.resolve_checkpoint
    calls = []

    def resolve_then_prune(path):
        found = real(path)
        if not calls:  # a training prunes the checkpoint just found, before it is read
            os.replace(found, found.with_name(".gone"))
        calls.append(found.name)
        return found

    monkeypatch.setattr(ck_load, "resolve_checkpoint", resolve_then_prune)  # load_model's lookup
    loaded = ck.load_model(run)
    assert calls == ["step_0000002", "step_0000001"] and loaded.step == 1


# ----------------------------------------------------------------------------- 3. shards


def test_edited_validation_tokens_are_caught_when_the_cache_opens(trained, tmp_path) -> None:
    w = _copy(trained, tmp_path / "w")
    ok = cli(w, "eval", "run", "--orders", "1", "--no-l2r", "--no-progress")
    assert ok.returncode == 0, ok.stderr
    (cache,) = (w / "cache").iterdir()
    val = cache / "val.bin"
    data = bytearray(val.read_bytes())
    data[100:164] = bytes(64)  # token 0 x 32: other text, same size
    val.write_bytes(bytes(data))
    bad = cli(w, "eval", "run", "--orders", "1", "--no-l2r", "--no-progress")
    assert bad.returncode == 2
    assert one_line(bad) == (
        f"anyorder eval: error: shard {Path('cache') / cache.name / 'val.bin'} does not match "
        f"its checksum; delete {Path('cache') / cache.name} and prepare again"
    )


# ----------------------------------------------------------------------------- 4. one .txt


@pytest.mark.parametrize("hashed_to", ["train", "val"])
def test_a_corpus_that_is_one_large_text_file_trains(folder, hashed_to: str) -> None:
    import math
    from pydoc_data.topics import topics

    from anyorder.data import is_val_document

    text = "".join(topics.values()).encode("ascii", "ignore").decode()[:100_000]
    i = 0  # the file's hash puts the one document in one split or the other
    while is_val_document(text, 0.05) != (hashed_to == "val"):
        text, i = text[:100_000] + f"\n{i}", i + 1
    (folder / "book.txt").write_text(text)
    # training on it (the other case only prepares it: the same code, a faster test)
    command = ["train", "--no-progress"] if hashed_to == "train" else ["data"]
    out = cli(folder, *command, "cfg.yaml", "data.source=book.txt")
    assert out.returncode == 0, out.stderr
    total = len(text) + 1  # bytes + EOS
    val = math.ceil(0.05 * total)  # the default data.val_fraction
    assert (
        f"data: 'book.txt' has too few documents to hold some out; its last {val:,} tokens "
        f"({val / total:.1%}) are the validation split"
    ) in out.stdout.splitlines()
    (cache,) = (folder / "cache").iterdir()
    splits = json.loads((cache / "manifest.json").read_text())["splits"]
    assert splits["val"]["split_tokens"] == val
    assert splits["train"]["tokens"] == total - val and splits["val"]["tokens"] == val
    assert splits["val"]["bytes"] == val - 1  # the EOS ends the text and has no bytes
    assert splits["train"]["bytes"] == len(text) - (val - 1)
    # the two splits are the text, cut at one place
    train = np.fromfile(cache / "train.bin", dtype=np.uint16)
    held = np.fromfile(cache / "val.bin", dtype=np.uint16)
    assert bytes(train.tolist()) == text.encode()[: len(train)]
    assert bytes(held[: val - 1].tolist()) == text.encode()[-(val - 1) :][: len(held)]


def test_a_corpus_below_two_blocks_says_so(folder) -> None:
    (folder / "small.txt").write_text("x" * 40)
    out = cli(folder, "train", "cfg.yaml", "--no-progress", "data.source=small.txt")
    assert out.returncode == 2
    assert one_line(out) == (
        "anyorder train: error: corpus 'small.txt' has 41 tokens, fewer than one train and one "
        "validation block of seq_len=32 (64 tokens); use a larger corpus or a smaller "
        "model.seq_len"
    )
    assert sorted(p.name for p in folder.iterdir()) == ["cfg.yaml", "small.txt"]


# ----------------------------------------------------------------------------- 5. manifests


def test_an_ema_entry_removed_from_the_manifest_is_an_error(trained, tmp_path) -> None:
    w = _copy(trained, tmp_path / "w")
    ckpt = ck.latest_checkpoint(w / "run")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["ema.safetensors"]
    manifest["has_ema"] = False  # a careful edit: the manifest is consistent in itself
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    rel = ckpt.relative_to(w)
    out = cli(w, "sample", "run")
    assert out.returncode == 2
    assert one_line(out) == (
        f"anyorder sample: error: {rel / 'manifest.json'} does not list ema.safetensors, which "
        f"is there; the manifest is damaged: delete {rel} and use an earlier checkpoint, or "
        "pass --weights raw"
    )
    assert cli(w, "sample", "run", "--weights", "raw").returncode == 0  # the explicit choice
    out = cli(w, "train", "cfg.yaml", "--no-progress", "train.ema=0.9", "train.steps=4")
    assert out.returncode == 2
    assert one_line(out) == (
        f"anyorder train: error: {rel} has no EMA weights but train.ema=0.9; resume with "
        "train.ema=0 or start a new run"
    )
    assert ck.latest_checkpoint(w / "run") == ckpt  # nothing was trained or saved


@pytest.mark.parametrize("field", ["position", "epoch", "tokens_seen"])
def test_a_state_pt_holding_infinity_for_a_count_is_damaged_not_a_crash(trained, tmp_path, field):
    """The manifest made to match an edited state.pt (a foreign run folder): infinity where a
    count belongs ended the resume in an OverflowError traceback."""
    import hashlib

    import torch

    w = _copy(trained, tmp_path / "w")
    ckpt = ck.latest_checkpoint(w / "run")
    state = torch.load(ckpt / "state.pt", weights_only=True)
    (state["sampler"] if field != "tokens_seen" else state)[field] = float("inf")
    torch.save(state, ckpt / "state.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    raw = (ckpt / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    out = cli(w, "train", "cfg.yaml", "--no-progress", "train.ema=0.9", "train.steps=4")
    assert out.returncode == 2
    rel = ckpt.relative_to(w)
    assert one_line(out) == (
        f"anyorder train: error: {rel / 'state.pt'} is damaged (OverflowError: cannot convert "
        f"float infinity to integer); delete {rel} and use an earlier checkpoint"
    )
    assert ck.latest_checkpoint(w / "run") == ckpt  # nothing was trained or saved


# ----------------------------------------------------------------------------- 6. disk full


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child: writes past `limit` bytes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_full_disk_during_a_save_is_one_line_and_loses_nothing(trained, tmp_path) -> None:
    w = _copy(trained, tmp_path / "w")
    before = ck.latest_checkpoint(w / "run")
    args = ["train", "cfg.yaml", "--no-progress", "train.ema=0.9", "train.steps=4"]
    # model.safetensors is ~136 KB: the save of step 4 cannot complete
    out = cli(w, *args, preexec=_file_size_limit(100_000))
    assert out.returncode == 2
    line = one_line(out)
    rel = before.relative_to(w)
    assert line.startswith(
        f"anyorder train: error: cannot write checkpoint {rel.parent}/step_0000004 ("
    )
    assert line.endswith(
        f"; {rel} is intact; free disk space or fix the folder's permissions, then resume"
    )
    assert ck.list_checkpoints(w / "run") == [before]
    ck.verify(before)
    assert not list((w / "run" / "checkpoints").glob(".step_*"))
    assert not (w / "run" / ".lock").exists()
    again = cli(w, *args)  # room again: the same command resumes and finishes
    assert again.returncode == 0, again.stderr
    assert ck.latest_checkpoint(w / "run").name == "step_0000004"


def test_a_prune_leaves_a_checkpoint_a_reader_holds(tmp_path) -> None:
    from anyorder.config import RunConfig
    from anyorder.data import ByteTokenizer

    from conftest import tiny_model

    model = tiny_model("gpt", vocab_size=257, seq_len=8)
    cfg, run = RunConfig(model=model.cfg), tmp_path / "run"

    def save(step: int) -> Path:
        return ck.save_checkpoint(
            run, step, model=model, config=cfg, tokenizer=ByteTokenizer(), keep_last=1
        )

    first = save(1)
    with ck.reading(first):  # as load_model holds it
        save(2)
        save(3)
        assert [p.name for p in ck.list_checkpoints(run)] == ["step_0000001", "step_0000003"]
        ck.verify(first)
    save(4)
    assert [p.name for p in ck.list_checkpoints(run)] == ["step_0000004"]
