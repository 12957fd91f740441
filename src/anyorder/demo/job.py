"""The demo's job: check the flags and the folder, pin the threads, train (or resume a
stopped demo), measure, write the report, ``demo.json`` and ``timing.json``.

Design choices:

* ``--minutes N`` trades the fixed budget for a wall-clock one (the steps a planning rate
  fits into it, fitted again to this machine's speed after the first steps by ``train``).
* A folder is replaced only when a demo wrote it (its marker file) or it is empty; the data
  cache is kept across demos. A demo of the same recipe that was stopped (or finished) is
  continued instead: training resumes from its checkpoint (bit for bit as if never stopped)
  and the report is written at the end.
* A signal (SIGINT, SIGTERM; a time limit's kill) stops the demo within a step: the training
  is saved, the console says how to resume, and no report is written (the last one is
  removed when a demo starts), so nothing left behind passes for a finished demo.
* Every time the report and the console state is measured on this run (the training's
  sessions are kept in ``training.jsonl``); nothing is a constant calibrated elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from anyorder.config import RunConfig
from anyorder.demo.measure import DECODERS, corpus_words, ensemble_bits, evaluate_bits, samples
from anyorder.demo.recipe import (
    CALIBRATED_REST_S,
    CALIBRATED_S_PER_STEP,
    ENSEMBLE,
    ENSEMBLE_BLOCKS,
    PROMPTS,
    STEPS,
    THREADS,
    demo_config,
)
from anyorder.errors import ConfigError
from anyorder.precision import use_bf16

_MARKER = ".anyorder-demo"
_OWN_FILES = (
    "checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "tb", "judge", "training.jsonl",
)  # fmt: skip
_REPORT_FILES = ("report.md", "demo.json", "timing.json", "loss.png")
_SESSIONS = "training.jsonl"
"""One line per training session of the demo in its folder: steps, wall and CPU seconds."""


class DemoStopped(Exception):
    """A signal stopped the demo; its training is saved (``signal``: the signal's name)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.signal = name


def _busy_hint(threads: int) -> str | None:
    """A line for a busy machine where OpenMP threads spin while they wait (the user set
    ``OMP_WAIT_POLICY=ACTIVE``): more runnable threads than cores then slow PyTorch's CPU
    kernels many-fold (docs/performance.md, "Under load"). ``import anyorder`` makes them
    sleep instead, and then 2 threads stay the faster choice under load. Fewer threads give
    the same report: it does not depend on the number of threads (tests/test_demo.py)."""
    import os

    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "ACTIVE":
        return None
    try:
        cores = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    if threads < 2 or load + threads <= cores + 0.5:
        return None
    return (
        f"demo: this machine is busy (load {load:.1f} on {cores} cores) and OMP_WAIT_POLICY="
        f"ACTIVE makes {threads} waiting threads spin: unset it, or use --threads 1 (the same "
        "report)"
    )


def demo(
    out: str | Path = "runs/demo",
    *,
    steps: int = STEPS,
    minutes: float | None = None,
    threads: int = THREADS,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume), evaluate, sample and write ``out/report.md``; returns what the
    report shows, or ``{"stopped": SIGNAL, ...}`` when a signal stopped it.

    Args:
        out: the run folder. A stopped or finished demo of the same recipe in it is
            continued (its training resumed); another demo's run is replaced; a folder
            holding anything else is refused.
        steps: optimizer steps (the default is the demo's budget).
        minutes: a wall-clock budget for the whole demo instead: planned with a fixed rate,
            then fitted to this machine's speed after the first steps and cut short by a
            time limit (the result then depends on the machine). Such a run starts afresh.
        threads: torch threads (pinned for the run).
        progress: progress lines (a bar on a terminal).
    """
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--minutes={minutes} must be positive")
    if steps < 1:
        raise ConfigError(f"--steps={steps} must be positive")
    if threads < 1:
        raise ConfigError(f"--threads={threads} must be positive")
    out = Path(out)
    marker = out / _MARKER
    if out.exists() and not (out.is_dir() and (marker.exists() or not any(out.iterdir()))):
        raise ConfigError(
            f"--out {out} already holds files that are not a demo's; pick an empty or new folder"
        )
    limit = None
    if minutes is not None:
        # A plan for the schedules only; train() fits train.steps to the measured speed
        # after its first steps and stops at the limit in any case.
        limit = max(10.0, 60.0 * minutes - CALIBRATED_REST_S)
        steps = max(10, int(limit / CALIBRATED_S_PER_STEP))
    cfg = demo_config(out, steps)
    again = _again_command(out, steps, minutes, threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _signals_stop() as stopped:
            try:
                return _run(out, cfg, limit, threads, progress, wall0, cpu0)
            except KeyboardInterrupt:
                name = stopped[0] if stopped else "SIGINT"
                return _say_stopped(out, cfg, name, again, resumes=minutes is None)
            except DemoStopped as e:
                return _say_stopped(out, cfg, e.signal, again, resumes=minutes is None)
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _signals_stop() -> Iterator[list[str]]:
    """SIGINT and SIGTERM stop the demo wherever it is (training installs its own handlers,
    which save the step first): a KeyboardInterrupt; the list holds the signal's name.
    Only in the main thread; the previous handlers are restored."""
    import threading

    names: list[str] = []
    old: dict[int, Any] = {}

    def handle(signum: int, frame: Any) -> None:
        names.append(signal.Signals(signum).name)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handle)
    try:
        yield names
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _again_command(out: Path, steps: int, minutes: float | None, threads: int) -> str:
    """The command that continues this demo (the same folder and budget)."""
    cmd = ["anyorder demo"]
    if out != Path("runs/demo"):
        cmd.append(f"--out {out}")
    if minutes is not None:
        cmd.append(f"--minutes {minutes:g}")
    elif steps != STEPS:
        cmd.append(f"--steps {steps}")
    if threads != THREADS:
        cmd.append(f"--threads {threads}")
    return " ".join(cmd)


def _say_stopped(out: Path, cfg: RunConfig, name: str, again: str, resumes: bool) -> dict[str, Any]:
    """The console line of a stopped demo: where its training is saved, how to go on (a
    ``--minutes`` demo starts afresh: its budget was this session's)."""
    from anyorder.checkpoint import latest_checkpoint
    from anyorder.training.resume import step_of

    planned = cfg.train.steps
    ckpt = latest_checkpoint(out) if out.is_dir() else None
    step = step_of(ckpt) or 0
    if ckpt is None or not resumes:
        where = "before its first checkpoint" if ckpt is None else f"at step {step:,}"
        how = f"run `{again}` to start it again"
    elif step >= planned:
        where = f"after training ({step:,} of {planned:,} steps, saved in {ckpt})"
        how = f"run `{again}` again to evaluate it and write the report"
    else:
        where = f"at step {step:,} of {planned:,} (saved in {ckpt})"
        how = f"run `{again}` again to resume from there and write the report"
    print(f"demo: {name}: stopped {where}; no report written; {how}", flush=True)
    return {"stopped": name, "step": step, "planned": planned, "checkpoint": ckpt}


def _run(
    out: Path,
    cfg: RunConfig,
    limit: float | None,
    threads: int,
    progress: bool,
    wall0: float,
    cpu0: float,
) -> dict[str, Any]:
    """The job in its phases: prepare the folder, say what runs, train, measure, report."""
    from anyorder.demo.report import plot_curve, write_report
    from anyorder.progress import format_duration
    from anyorder.training.metrics import read_metrics

    resumable = limit is None and _resumable(out, cfg)
    _prepare_folder(out, keep_run=resumable)
    _announce(out, cfg, limit, threads, resumable)
    phases: dict[str, float] = {}
    summary = _train(out, cfg, limit, threads, progress, resumable, phases)
    if summary.get("interrupted"):
        raise DemoStopped(summary["interrupted"])
    ev, ens, smp, data = _measure(out, cfg, phases)
    rows = read_metrics(out)
    plot = plot_curve(rows, data.bytes_per_token("train"), summary["unigram_bpb"], out / "loss.png")
    l2r = smp["decoders"][0]
    info = {
        "eval": ev,
        "ensemble": ens,
        "samples": smp,
        "word_share": l2r["hits"] / max(1, l2r["words"]),
        "unigram": summary["unigram_bpb"],
        "params": summary["params"],
        "step": summary["step"],
        "planned": summary["config"]["train"]["steps"],
        "config": summary["config"],
        "tokens_seen": summary["step"] * cfg.train.batch_size * cfg.model.seq_len,
        "plot": plot,
        "threads": threads,
        "time_limited": limit is not None,
        "training": _sessions(out),
    }
    timing = {
        "wall_s": time.perf_counter() - wall0,
        "cpu_s": time.process_time() - cpu0,
        "phases_s": phases,
        "train_tokens_per_s": summary["tokens_per_s"],
        "threads": threads,
    }
    info["timing"] = timing
    _write_json(out / "demo.json", info)
    _write_json(out / "timing.json", timing)
    report = write_report(out, info)  # last: a report is there only when all else is
    print(
        f"demo: validation {ev['l2r_bpb']:.3f} bits/byte left to right, {ev['ao_bpb']:.3f} ± "
        f"{ev['ao_se']:.3f} any order (unigram baseline {summary['unigram_bpb']:.3f}); "
        f"{info['word_share']:.0%} of the words written left to right are corpus words"
    )
    print(
        f"demo: report written to {report} ({format_duration(timing['wall_s'])} in all, "
        f"{format_duration(timing['cpu_s'])} of CPU)"
    )
    return info


def _write_json(path: Path, obj: Any) -> None:
    from anyorder.atomic import write_text

    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _resumable(out: Path, cfg: RunConfig) -> bool:
    """Whether ``out`` holds a demo of this recipe to continue (a checkpoint of the same
    config; the folder's spelling may differ)."""
    from anyorder.checkpoint import latest_checkpoint, read_config
    from anyorder.errors import AnyorderError
    from anyorder.training.resume import config_diff

    if not (out / _MARKER).exists():
        return False
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        return False
    try:
        diff = config_diff(read_config(ckpt), cfg)
    except AnyorderError:  # unreadable: replaced, as any other demo's run
        return False
    return set(diff) <= {"train.out_dir", "data.cache_dir"}


def _prepare_folder(out: Path, keep_run: bool) -> None:
    """Mark ``out`` as a demo's; remove the last report (so a stopped demo leaves none) and,
    unless it is continued, the last demo's run (not its data cache)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / _MARKER).write_text("written by anyorder demo: a new demo may replace its run\n")
    names = _REPORT_FILES if keep_run else _REPORT_FILES + _OWN_FILES
    for name in names:  # a new demo replaces the last one's run, not its data cache
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _train(
    out: Path,
    cfg: RunConfig,
    limit: float | None,
    threads: int,
    progress: bool,
    resumable: bool,
    phases: dict[str, float],
) -> dict[str, Any]:
    """Train (resuming a stopped demo), or read a finished demo's summary; each training
    session's steps, wall and CPU seconds go to ``training.jsonl``."""
    from anyorder.training.loop import train

    done = _finished_summary(out, cfg) if resumable else None
    if done is not None:
        phases["train"] = 0.0
        return done
    t, c = time.perf_counter(), time.process_time()
    summary = train(cfg, resume="auto" if resumable else False, progress=progress,
                    time_limit_s=limit)  # fmt: skip
    phases["train"] = time.perf_counter() - t
    record = {
        "from_step": summary["step"] - summary["steps_run"],
        "to_step": summary["step"],
        "planned": summary["config"]["train"]["steps"],
        "wall_s": phases["train"],
        "train_s": summary["train_time_s"],
        "cpu_s": time.process_time() - c,
        "threads": threads,
        "stopped_by": summary.get("interrupted"),
    }
    with open(out / _SESSIONS, "a") as f:
        f.write(json.dumps(record) + "\n")
    return summary


def _finished_summary(out: Path, cfg: RunConfig) -> dict[str, Any] | None:
    """The summary of a demo in ``out`` that trained to its last step (None otherwise):
    continuing it only evaluates, samples and reports."""
    from anyorder.checkpoint import latest_checkpoint
    from anyorder.training.resume import step_of

    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    step = summary.get("step")
    if summary.get("interrupted") or step != cfg.train.steps:
        return None
    return summary if step_of(latest_checkpoint(out)) == step else None


def _sessions(out: Path) -> list[dict[str, Any]]:
    """The training sessions of the demo in ``out`` (``training.jsonl``), oldest first."""
    try:
        lines = (out / _SESSIONS).read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _announce(out: Path, cfg: RunConfig, limit: float | None, threads: int, resumed: bool) -> None:
    """The busy-machine hint and what runs; the estimate comes from ``train``, measured on
    its first steps."""
    from anyorder.checkpoint import latest_checkpoint
    from anyorder.progress import format_duration
    from anyorder.training.resume import step_of

    m = cfg.model
    busy = _busy_hint(threads)
    if busy:
        print(busy, flush=True)
    what = f"a tiny ARMD ({m.n_layer} layers x {m.d_model}) on {threads} thread(s) -> {out}"
    if limit is not None:
        print(f"demo: {what}, trained for up to {format_duration(limit)}", flush=True)
    elif resumed:
        step = step_of(latest_checkpoint(out)) or 0
        print(
            f"demo: {what}: continuing the demo saved at step {step:,} of {cfg.train.steps:,}",
            flush=True,
        )
    else:
        print(f"demo: {what}, {cfg.train.steps:,} steps", flush=True)


def _measure(out: Path, cfg: RunConfig, phases: dict[str, float]) -> tuple[dict, dict, dict, Any]:
    """Evaluate and sample the trained model (its EMA weights) on the validation blocks:
    ``(evaluation, ensemble, samples, data)``; the seconds of each go to ``phases``."""
    from anyorder.checkpoint import load_model
    from anyorder.data import prepare

    loaded = load_model(out, weights="ema")
    model, tok = loaded.model, loaded.tokenizer
    data = prepare(cfg.data, cfg.model.seq_len, progress=False)  # the cache train() made
    val = data.batch("val", range(data.num_blocks("val")))
    bpt = data.bytes_per_token("val")
    # bf16 where training used it: where this CPU computes it faster (anyorder.precision)
    bf16 = use_bf16(cfg.train.dtype, torch.device("cpu"), cfg.model.d_model)
    t = time.perf_counter()
    print(f"demo: evaluating on {len(val)} validation blocks", flush=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ev = evaluate_bits(model, val, bpt)
        print(f"demo: context-order ensemble x{ENSEMBLE} on {ENSEMBLE_BLOCKS} blocks", flush=True)
        ens = ensemble_bits(model, val, bpt)
    phases["evaluate"] = time.perf_counter() - t
    t = time.perf_counter()
    print(f"demo: sampling ({len(DECODERS)} decoders x {PROMPTS} prompts, and an infill)")
    words = corpus_words(data)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        smp = samples(model, tok, val, words)
    phases["sample"] = time.perf_counter() - t
    return ev, ens, smp, data
