"""Progress reporting: a line every few seconds or percent when the stream is not a terminal."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from anyorder.progress import LineProgress, estimate, format_duration, progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_non_tty_gets_lines_by_fraction_and_at_close():
    out = io.StringIO()
    bar = progress(total=100, desc="eval", unit="passes", stream=out, every_s=1e9, every_frac=0.25)
    assert isinstance(bar, LineProgress)
    for _ in range(100):
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [ln.split(":")[1].split()[0] for ln in lines] == [
        "25/100",
        "50/100",
        "75/100",
        "100/100",
    ]
    assert lines[0].startswith("eval: 25/100 passes (25%)")


def test_non_tty_lines_by_time(monkeypatch):
    clock = iter(range(0, 10_000, 5))  # 5 s per call to perf_counter
    monkeypatch.setattr("anyorder.progress.time.perf_counter", lambda: float(next(clock)))
    out = io.StringIO()
    bar = progress(total=1000, desc="train", unit="steps", stream=out, every_s=9.0)
    for _ in range(4):
        bar.update(1)  # 5 s, 10 s, 15 s, 20 s after the start: lines at 10 s and 20 s
    assert len(out.getvalue().splitlines()) == 2
    assert "left" in out.getvalue()


def test_iteration_and_disabled():
    out = io.StringIO()
    assert list(progress(range(7), desc="x", stream=out, every_s=1e9, every_frac=2.0)) == list(
        range(7)
    )
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]  # only at close
    assert out.getvalue().startswith("x: 7/7 it (100%)")
    quiet = io.StringIO()
    bar = progress(total=3, stream=quiet, enabled=False)
    bar.update(3)
    bar.close()
    assert quiet.getvalue() == ""


def test_terminal_gets_tqdm():
    from tqdm import tqdm

    bar = progress(total=3, stream=_Tty())
    assert isinstance(bar, tqdm)
    bar.close()


def test_estimate_and_durations():
    out = io.StringIO()
    seconds = estimate("ensemble x8", 1200, 0.175, stream=out)
    assert seconds == 1200 * 0.175
    assert out.getvalue() == "ensemble x8: about 3.5 min (1,200 passes x 0.175 s measured)\n"
    assert [format_duration(s) for s in (42, 210, 7200)] == ["42 s", "3.5 min", "2.0 h"]


# ----------------------------------------------------------------------------- long commands


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    """An ``anyorder`` command with stdout and stderr piped (not terminals, as in a log)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "anyorder.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_train_prints_an_estimate_and_progress_lines_in_a_log(tmp_path):
    (tmp_path / "c.yaml").write_text("{}\n")
    out = _cli(
        "train", "c.yaml", "model.kind=aogpt", "model.n_layer=1", "model.d_model=32",
        "model.n_head=2", "model.seq_len=32", "train.steps=12", "train.eval_every=6",
        "train.log_every=3", "train.out_dir=run", "data.cache_dir=cache", cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "train: 8 more steps and 2 validation(s): about " in out.stdout
    assert " steps x " in out.stdout and " s measured)" in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("train: ")]
    assert lines[-1].startswith("train: 12/12 steps (100%)") and "\r" not in out.stderr
    assert "nats/token = " in out.stderr and "bits/byte" in out.stderr  # units on the line
    assert "step 6: loss " in out.stdout and " nats/token; validation left to right" in out.stdout


def test_experiment_prints_an_estimate_and_progress_lines_in_a_log(tmp_path):
    out = _cli("experiment", "progressive", "--smoke", "--out", "exp", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # the smoke arms of the progressive experiment: uniform and one run per rho
    assert "experiment: training 3 of 3 run(s) (0 reused): about " in out.stdout
    assert "calibrated, one thread)" in out.stdout
    assert "train: 4/4 steps (100%)" in out.stderr and "\r" not in out.stderr


def test_import_makes_openmp_threads_sleep_while_they_wait() -> None:
    """``import anyorder`` sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (spinning
    threads collapse training on a busy machine: docs/performance.md, "Under load"); a value
    the user set is kept, and so is torch's own state when torch came first."""
    import os
    import subprocess
    import sys

    code = "import anyorder, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = [sys.executable, "-c", code]
    assert subprocess.run(run, env=env, capture_output=True, text=True).stdout == "PASSIVE\n"
    user = {**env, "OMP_WAIT_POLICY": "ACTIVE"}
    assert subprocess.run(run, env=user, capture_output=True, text=True).stdout == "ACTIVE\n"
    late = [sys.executable, "-c", "import torch; " + code]
    assert subprocess.run(late, env=env, capture_output=True, text=True).stdout == "None\n"
