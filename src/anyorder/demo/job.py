"""The demo's job: check the flags and the folder, pin the threads, train, measure, write
the report, ``demo.json`` and ``timing.json``.

Design choices:

* ``--minutes N`` trades the fixed budget for a wall-clock one (the steps the calibration
  fits into it, cut short where the machine is slower).
* A folder is replaced only when a demo wrote it (its marker file) or it is empty; the data
  cache is kept across demos.
* Timings go to the console and ``timing.json``, never to the report.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
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
    estimate_s,
)
from anyorder.errors import ConfigError
from anyorder.precision import use_bf16

_MARKER = ".anyorder-demo"
_OWN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "tb", "judge")


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
    """Train, evaluate, sample and write ``out/report.md``; returns what the report shows.

    Args:
        out: the run folder; a previous demo's checkpoints and metrics in it are replaced
            (a folder holding anything else is refused).
        steps: optimizer steps (the default is the calibrated budget).
        minutes: a wall-clock budget for the whole demo instead: the steps the calibration
            fits into it, cut short by a time limit where this machine is slower (the result
            then depends on the machine).
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
        # The steps the calibration fits into the budget (so the schedules are planned for
        # them), cut short by the time limit where this machine is slower.
        limit = max(10.0, 60.0 * minutes - CALIBRATED_REST_S)
        steps = max(10, int(limit / CALIBRATED_S_PER_STEP))
    cfg = demo_config(out, steps)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(out, cfg, limit, threads, progress, wall0, cpu0)
    finally:
        torch.set_num_threads(before)


def _run(
    out: Path,
    cfg: RunConfig,
    limit: float | None,
    threads: int,
    progress: bool,
    wall0: float,
    cpu0: float,
) -> dict[str, Any]:
    """The job in its phases: clear the folder, say what runs, train, measure, report."""
    from anyorder.demo.report import plot_curve, write_report
    from anyorder.progress import format_duration
    from anyorder.training.loop import train
    from anyorder.training.metrics import read_metrics

    _clear(out)
    _announce(out, cfg, limit, threads)
    phases: dict[str, float] = {}
    t = time.perf_counter()
    summary = train(cfg, resume=False, progress=progress, time_limit_s=limit)
    phases["train"] = time.perf_counter() - t
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
        "config": summary["config"],
        "tokens_seen": summary["step"] * cfg.train.batch_size * cfg.model.seq_len,
        "plot": plot,
        "threads": threads,
        "time_limited": limit is not None,
    }
    report = write_report(out, info)
    timing = {
        "wall_s": time.perf_counter() - wall0,
        "cpu_s": time.process_time() - cpu0,
        "phases_s": phases,
        "train_tokens_per_s": summary["tokens_per_s"],
        "threads": threads,
    }
    (out / "demo.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    print(
        f"demo: validation {ev['l2r_bpb']:.3f} bits/byte left to right, {ev['ao_bpb']:.3f} ± "
        f"{ev['ao_se']:.3f} any order (unigram baseline {summary['unigram_bpb']:.3f}); "
        f"{info['word_share']:.0%} of the words written left to right are corpus words"
    )
    print(
        f"demo: report written to {report} ({format_duration(timing['wall_s'])} in all, "
        f"{format_duration(timing['cpu_s'])} of CPU)"
    )
    return info | {"timing": timing}


def _clear(out: Path) -> None:
    """Mark ``out`` as a demo's and remove the last demo's run (not its data cache)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / _MARKER).write_text("written by anyorder demo: a new demo may replace its run\n")
    for name in _OWN_FILES:  # a new demo replaces the last one's run, not its data cache
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _announce(out: Path, cfg: RunConfig, limit: float | None, threads: int) -> None:
    """The busy-machine hint, what runs, and the up-front cost estimate."""
    from anyorder.progress import estimate, format_duration

    m = cfg.model
    busy = _busy_hint(threads)
    if busy:
        print(busy, flush=True)
    if limit is None:
        steps = cfg.train.steps
        print(
            f"demo: a tiny ARMD ({m.n_layer} layers x {m.d_model}), {steps:,} steps on "
            f"{threads} thread(s) -> {out}",
            flush=True,
        )
        estimate(
            "demo (training, evaluation, samples)",
            steps,
            estimate_s(steps) / steps,
            unit="steps",
            how="calibrated on 2 idle cores",
            stream=sys.stdout,
        )
    else:
        print(f"demo: a tiny ARMD, trained for up to {format_duration(limit)} -> {out}")


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
