"""Crash safety and determinism of training, sampling and evaluation.

* SIGKILL at random moments: ``anyorder train`` runs as a subprocess and is killed with
  ``kill -9`` at a random moment (after a randomly chosen checkpoint appears, plus a random
  delay, so the kill lands in a step, a save or a metrics write); the same command resumes
  it. The final raw and EMA weights equal those of an uninterrupted run bit for bit and the
  loss curve is the same floats; each kill loses at most one checkpoint interval. The
  moments come from ``ANYORDER_KILL_SEED`` (random when unset; printed to reproduce).
* SIGTERM and SIGINT: the run saves a checkpoint of the step it is in and exits with
  128 + signal; resuming gives the uninterrupted run again.
* A NaN loss stops the run with a message naming the step, after saving the last good
  state; ``train.skip_nonfinite`` skips such steps instead.
* The same seed gives the same training curve (CPU), the same samples and the same
  Monte-Carlo likelihood; the seed is recorded in every output.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from anyorder import checkpoint as ck
from anyorder.config import load_config
from anyorder.errors import TrainingError
from anyorder.training.loop import train
from anyorder.training.metrics import MetricsLog, read_metrics

STEPS = 48
CKPT_EVERY = 4
BASE = {
    "model.kind": "armd",
    "model.n_layer": 2,
    "model.n_head": 2,
    "model.d_model": 32,
    "model.seq_len": 32,
    "data.source": "builtin:pydoc",
    "data.max_documents": 40,
    "train.steps": STEPS,
    "train.batch_size": 8,
    "train.lr": 0.01,
    "train.warmup_steps": 2,
    "train.eval_every": 0,
    "train.eval_batches": 1,
    "train.ckpt_every": CKPT_EVERY,
    "train.keep_last": 2,
    "train.log_every": 1,
    "train.ema": 0.9,
    "train.seed": 3,
    "train.device": "cpu",
    "order.kind": "uniform",
}


def _overrides(run: Path, cache: Path, **extra) -> list[str]:
    values = {**BASE, "data.cache_dir": str(cache), "train.out_dir": str(run), **extra}
    return [f"{k}={v}" for k, v in values.items()]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _train_cmd(run: Path, cache: Path, *flags: str, **extra) -> list[str]:
    return [
        sys.executable, "-m", "anyorder.cli", "train", "--no-progress", *flags,
        "DEFAULTS", *_overrides(run, cache, **extra),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A config file (the defaults) and a prepared data cache, shared by the module."""
    from anyorder.data import prepare

    root = tmp_path_factory.mktemp("reliability")
    (root / "defaults.yaml").write_text("{}\n")
    cfg = load_config(None, _overrides(root / "unused", root / "cache"))
    prepare(cfg.data, cfg.model.seq_len, progress=False)
    return root


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [str(cwd / "defaults.yaml") if c == "DEFAULTS" else c for c in cmd]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)


def _popen(cmd: list[str], cwd: Path) -> subprocess.Popen:
    cmd = [str(cwd / "defaults.yaml") if c == "DEFAULTS" else c for c in cmd]
    return subprocess.Popen(
        cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    """The uninterrupted run (a subprocess, as the interrupted ones)."""
    run = workdir / "reference"
    out = _run(_train_cmd(run, workdir / "cache"), workdir)
    assert out.returncode == 0, out.stderr
    return run


def _weights(run: Path, which: str) -> dict[str, torch.Tensor]:
    return ck.load_model(run, weights=which).model.state_dict()


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]


def assert_same_run(a: Path, b: Path) -> None:
    """Bit-identical final raw and EMA weights, loss curve and final validation."""
    assert ck.latest_checkpoint(a).name == ck.latest_checkpoint(b).name == f"step_{STEPS:07d}"
    for which in ("raw", "ema"):
        wa, wb = _weights(a, which), _weights(b, which)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{which} {k} differs"
    la, lb = _losses(a), _losses(b)
    assert [s for s, _ in la] == list(range(1, STEPS + 1))
    assert la == lb
    va = [r for r in read_metrics(a) if "val/l2r_bpb" in r]
    vb = [r for r in read_metrics(b) if "val/l2r_bpb" in r]
    assert va == vb and len(va) == 1


def _ckpt_step(run: Path) -> int:
    latest = ck.latest_checkpoint(run)
    return int(latest.name.split("_")[1]) if latest else 0


def _kill_at_random(cmd, cwd: Path, run: Path, rng: random.Random, at_least: int = 0) -> dict:
    """Start ``cmd``; once its training loop runs and a checkpoint at or past a random step
    (and at or past ``at_least``) exists, wait a random part of a checkpoint interval and
    SIGKILL it. Returns what was seen."""
    before = max(_ckpt_step(run), at_least)
    # 0-2 intervals past the last checkpoint, far enough from the end that the run is still
    # going after the delay (0: the kill lands within the first steps after the resume)
    target = min(before + CKPT_EVERY * rng.randint(0, 2), STEPS - 3 * CKPT_EVERY)
    target = max(before, target)
    proc = _popen(cmd, cwd)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        # "data: ..." is printed just before the loop, by a fresh and a resumed run alike
        while proc.poll() is None and (
            _ckpt_step(run) < target or not any(ln.startswith("data: ") for ln in lines)
        ):
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.002)
        # a delay of up to one checkpoint interval (step time from the last metrics rows)
        rows = [r for r in read_metrics(run) if "elapsed_s" in r][-2:]
        per_step = 0.02
        if len(rows) == 2 and rows[1]["step"] > rows[0]["step"]:
            per_step = (rows[1]["elapsed_s"] - rows[0]["elapsed_s"]) / (
                rows[1]["step"] - rows[0]["step"]
            )
        time.sleep(rng.uniform(0, CKPT_EVERY * min(max(per_step, 0.001), 0.2)))
        alive = proc.poll() is None
        if alive:
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        reader.join(timeout=60)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert alive, f"the run ended before the kill (target step {target}): {err}"
    assert proc.returncode == -signal.SIGKILL
    logged = max((r["step"] for r in read_metrics(run) if "loss" in r), default=0)
    return {"target": target, "logged": logged, "checkpoint": _ckpt_step(run)}


def _kills(workdir: Path, reference: Path, n: int, name: str) -> None:
    seed = int(os.environ.get("ANYORDER_KILL_SEED", secrets.randbits(32)))
    print(f"\nANYORDER_KILL_SEED={seed}")
    rng = random.Random(seed)
    run = workdir / name
    survived = 0
    for i in range(n):
        flags = ("--resume",) if i % 2 and ck.latest_checkpoint(run) else ()
        # the last kill comes after a checkpoint, so the final run has one to resume from
        # (earlier kills may land before the first: the next run then starts afresh)
        floor = CKPT_EVERY if i == n - 1 else 0
        cmd = _train_cmd(run, workdir / "cache", *flags)
        seen = _kill_at_random(cmd, workdir, run, rng, at_least=floor)
        # at most one checkpoint interval of logged steps is lost
        assert seen["logged"] - seen["checkpoint"] <= CKPT_EVERY, seen
        assert seen["checkpoint"] >= seen["target"], seen
        print(f"kill {i + 1}: {seen}")
        survived += 1
    out = _run(_train_cmd(run, workdir / "cache"), workdir)
    assert out.returncode == 0, out.stderr
    assert "resuming from" in out.stdout
    assert_same_run(reference, run)
    print(f"kills survived / tried: {survived} / {n}")


def test_sigkill_at_a_random_moment_then_resume_is_exact(workdir, reference):
    _kills(workdir, reference, n=3, name="killed")


@pytest.mark.slow
def test_sigkill_many_times_then_resume_is_exact(workdir, reference):
    _kills(workdir, reference, n=10, name="killed_many")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_save_and_exit_cleanly(workdir, reference, sig):
    run = workdir / f"signalled_{sig.name}"
    proc = _popen(_train_cmd(run, workdir / "cache"), workdir)
    try:
        while _ckpt_step(run) < 2 * CKPT_EVERY and proc.poll() is None:
            time.sleep(0.002)
        assert proc.poll() is None, "the run ended before the signal"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and err.strip() == "", err
    line = next(ln for ln in out.splitlines() if ln.startswith(f"{sig.name}: stopped at step "))
    step = int(line.split("stopped at step ")[1].split(";")[0])
    assert 2 * CKPT_EVERY <= step < STEPS
    assert _ckpt_step(run) == step  # a checkpoint of exactly the step it stopped at
    assert max(s for s, _ in _losses(run)) == step
    done = _run(_train_cmd(run, workdir / "cache"), workdir)
    assert done.returncode == 0, done.stderr
    assert_same_run(reference, run)


# ----------------------------------------------------------------------------- NaN


def test_nan_loss_stops_after_saving_the_last_good_state(workdir):
    run = workdir / "nan"
    cfg = load_config(None, _overrides(run, workdir / "cache", **{"train.lr": "1.0e30"}))
    with pytest.raises(TrainingError, match=r"^loss is nan at step 2; the state after step 1 is "):
        train(cfg, progress=False)
    assert TrainingError.exit_code == 3
    assert [p.name for p in ck.list_checkpoints(run)] == ["step_0000001"]
    good = ck.load_model(run, weights="raw").model.state_dict()
    assert all(torch.isfinite(v).all() for v in good.values())
    assert [s for s, _ in _losses(run)] == [1]  # the bad step is not logged
    state = ck.read_state(ck.latest_checkpoint(run))
    assert state["step"] == 1 and state["sampler"]["position"] == 8  # the data of step 1 only

    # told to skip: the run goes on; no update is applied at a NaN step
    skip = workdir / "nan_skip"
    cfg = load_config(
        None,
        _overrides(skip, workdir / "cache", **{"train.lr": "1.0e30", "train.steps": 4})
        + ["train.skip_nonfinite=true", "train.ckpt_every=0"],
    )
    summary = train(cfg, progress=False)
    assert summary["step"] == 4 and summary["skipped_steps"] == 3
    final = ck.load_model(skip, weights="raw").model.state_dict()
    for k in good:  # the weights after step 1, untouched by the three skipped steps
        assert torch.equal(final[k], good[k]), k


def test_nan_loss_through_the_cli_is_one_line_exit_3(workdir):
    run = workdir / "nan_cli"
    out = _run(_train_cmd(run, workdir / "cache", **{"train.lr": "1e30"}), workdir)
    assert out.returncode == 3
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert lines[0].startswith("anyorder train: error: loss is nan at step 2; the state after ")
    assert lines[0].endswith("set train.skip_nonfinite=true to skip such steps")


def test_a_half_written_metrics_row_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    log = MetricsLog(tmp_path, True, resume_step=1, seed=5)
    log.write({"step": 2, "loss": 1.25})
    log.close()
    rows = read_metrics(tmp_path)
    assert rows == [{"step": 1, "loss": 2.0}, {"step": 2, "seed": 5, "loss": 1.25}]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 2


def test_a_damaged_metrics_row_is_dropped_on_resume_not_a_crash(tmp_path):
    """A row whose step is not a whole number (null, text, 1e400, a list, JSON nested 100,000
    deep) crashed the resume with a TypeError/ValueError/OverflowError/RecursionError
    traceback; it is dropped as a half-written row is."""
    path = tmp_path / "metrics.jsonl"
    damaged = ['{"step": null}', '{"step": "x"}', '{"step": 1e400}', '{"step": true}', "[1]"]
    damaged.append("[" * 100_000 + "]" * 100_000)
    rows = ['{"step": 1, "loss": 2.0}', *damaged, '{"step": 2, "loss": 1.5}']
    path.write_text("".join(r + "\n" for r in rows))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    MetricsLog(tmp_path, True, resume_step=1, seed=5).close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def test_prune_leaves_no_half_deleted_checkpoint(workdir, reference):
    # keep_last=2: only the last two complete checkpoints, no temporary folders
    names = sorted(p.name for p in (reference / ck.CHECKPOINTS).iterdir())
    assert names == [f"step_{STEPS - CKPT_EVERY:07d}", f"step_{STEPS:07d}"]


# ----------------------------------------------------------------------------- determinism


def _short(run: Path, cache: Path, seed: int):
    extra = {"train.steps": 5, "train.ckpt_every": 0, "train.seed": seed}
    return load_config(None, _overrides(run, cache, **extra))


def test_same_seed_same_training_curve_and_the_seed_is_recorded(workdir):
    cache = workdir / "cache"
    a = train(_short(workdir / "seed_a", cache, 11), progress=False)
    b = train(_short(workdir / "seed_b", cache, 11), progress=False)
    c = train(_short(workdir / "seed_c", cache, 12), progress=False)
    la, lb, lc = (_losses(workdir / n) for n in ("seed_a", "seed_b", "seed_c"))
    assert la == lb and la != lc
    wa, wb = _weights(workdir / "seed_a", "raw"), _weights(workdir / "seed_b", "raw")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the seed in every output of a run: metrics rows, checkpoint, summary
    assert {r["seed"] for r in read_metrics(workdir / "seed_a")} == {11}
    assert {r["seed"] for r in read_metrics(workdir / "seed_c")} == {12}
    manifest = ck.read_manifest(ck.latest_checkpoint(workdir / "seed_a"))
    assert manifest["seed"] == 11
    assert ck.read_config(ck.latest_checkpoint(workdir / "seed_a")).train.seed == 11
    summary = json.loads((workdir / "seed_a" / "summary.json").read_text())
    assert summary["seed"] == a["seed"] == b["seed"] == 11 and c["seed"] == 12


def test_same_seed_same_samples_and_likelihood(reference):
    import anyorder

    model = anyorder.load(reference)
    for kw in ({}, {"steps": 4}, {"streams": 4}):
        one = model.generate(n=32, num_samples=2, seed=5, **kw)
        assert one == model.generate(n=32, num_samples=2, seed=5, **kw)
        assert one != model.generate(n=32, num_samples=2, seed=6, **kw)
    assert model.infill("ab[MASK:6]cd", seed=1) == model.infill("ab[MASK:6]cd", seed=1)
    text = "The quick brown fox jumps over the lazy dog. " * 2
    s1 = model.score(text, order="any", num_orders=3, seed=9)
    s2 = model.score(text, order="any", num_orders=3, seed=9)
    s3 = model.score(text, order="any", num_orders=3, seed=10)
    assert s1 == s2 and s1["seed"] == 9
    assert s1["nats_per_token"] != s3["nats_per_token"] and math.isfinite(s1["nats_per_token"])


def test_sample_and_eval_outputs_record_the_seed(workdir, reference):
    cmd = [sys.executable, "-m", "anyorder.cli", "sample", str(reference), "--json"]
    outs = [_run([*cmd, "--seed", "7", "--num-samples", "2"], workdir) for _ in range(2)]
    for o in outs:
        assert o.returncode == 0, o.stderr
    a, b = (json.loads(o.stdout) for o in outs)
    assert a["seed"] == b["seed"] == 7
    assert a["samples"] == b["samples"]
    res = workdir / "eval_out"
    ev = _run(
        [sys.executable, "-m", "anyorder.cli", "eval", str(reference), "--seed", "4",
         "--orders", "2", "--max-blocks", "4", "--out", str(res), "--no-progress"],
        workdir,
    )  # fmt: skip
    assert ev.returncode == 0, ev.stderr
    lik = json.loads((res / "likelihood.json").read_text())
    assert lik["seed"] == 4 and math.isfinite(lik["any_order"]["nats_per_token"])
