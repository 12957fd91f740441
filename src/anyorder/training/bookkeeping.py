"""What the loop keeps track of between steps, and what it does after each one.

Design choices:

* :class:`LoopState` holds the loop's position and measurements, so each piece of
  bookkeeping is a function of the run's parts and that state.
* A non-finite loss stops the run with the state after the last good step saved (or, with
  ``train.skip_nonfinite``, skips the update and counts it).
* A time limit lowers ``train.steps`` once, after :data:`ESTIMATE_AFTER` timed steps, to what
  fits (so the cosine schedule still ends; 10% of what is left is kept for evaluation and
  saving); rank 0's clock decides, for every rank. The up-front estimate comes at the same
  moment.
* Messages go to stdout on rank 0, above the bar on a terminal; progress lines go to stderr.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anyorder.config import RunConfig
from anyorder.errors import TrainingError
from anyorder.progress import LineProgress, estimate
from anyorder.training.distributed import from_rank0
from anyorder.training.metrics import MetricsLog
from anyorder.training.resume import step_of
from anyorder.training.setup import use_compile
from anyorder.training.state import RunParts, lr_at, save_state
from anyorder.training.validation import count_evaluations

ESTIMATE_AFTER = 4
"""Timed steps (the first, which pays for allocation, left out) before the up-front estimate
(and, with a time limit, the fit of ``train.steps``)."""


@dataclass
class LoopState:
    """Where the loop is and what it measured (rank 0 writes; every rank keeps the same)."""

    run_dir: Path
    log: MetricsLog
    step: int
    tokens_seen: int
    start_step: int
    last_ckpt: Path | None
    unigram: float | None
    to_bpb: float  # nats/token -> the log's bits (per bits_unit)
    t0: float  # when the run began (elapsed_s)
    loop_t0: float  # when the loop began (the time limit)
    end: int = 0  # the last step of this call (train.steps, stop_at, a time limit)
    stop_at: int | None = None
    time_limit_s: float | None = None
    show: bool = False  # a progress bar (rank 0 with progress on)
    loss: float = float("nan")
    val: dict[str, float] = dataclasses.field(default_factory=dict)
    train_time: float = 0.0  # seconds spent in optimizer steps (not evaluation or saving)
    window_time: float = 0.0  # since the last log row
    window_steps: int = 0
    timing: list[float] = dataclasses.field(default_factory=list)
    skipped: int = 0
    bar: Any = None  # opened once the horizon is known (after the fit to a time limit)
    interrupted: str | None = None  # the signal that stopped the run
    bits_unit: str = "bits/byte"  # of the logged loss: bits/token where bytes do not apply


def horizon(cfg: RunConfig, stop_at: int | None) -> int:
    """The step this call stops after: ``train.steps``, or ``stop_at`` when sooner."""
    return cfg.train.steps if stop_at is None else min(cfg.train.steps, stop_at)


def tokens_per_step(parts: RunParts) -> int:
    """Tokens in one global batch."""
    return parts.cfg.train.batch_size * parts.cfg.model.seq_len


def check_finite(parts: RunParts, loop: LoopState, before: dict[str, Any] | None) -> None:
    """A non-finite loss (its update not applied) stops the run with the state after the
    last good step saved, or, with ``train.skip_nonfinite``, is counted and skipped.

    Raises:
        TrainingError: a non-finite loss without ``train.skip_nonfinite``.
    """
    loss, step = loop.loss, loop.step
    if math.isfinite(loss):
        return
    if not parts.cfg.train.skip_nonfinite:
        # The update was not applied: save the state after the last good step (with the data
        # cursor and RNGs of that moment), then stop.
        if step_of(loop.last_ckpt) == step:
            saved = loop.last_ckpt
        else:
            saved = save_state(parts, loop.run_dir, step, loop.tokens_seen, before)
        where = f"; the state after step {step} is in {saved}" if saved else ""
        raise TrainingError(
            f"loss is {loss} at step {step + 1}{where}; lower train.lr and resume with "
            "--resume, or set train.skip_nonfinite=true to skip such steps"
        )
    loop.skipped += 1
    say(parts, loop, f"step {step + 1}: loss is {loss}; update skipped (train.skip_nonfinite)")


def record_step(parts: RunParts, loop: LoopState, dt: float) -> None:
    """Count a step that took ``dt`` seconds; after :data:`ESTIMATE_AFTER` of them (or at the
    horizon if sooner) the estimate and the fit to a time limit; the bar moves on."""
    loop.step += 1
    loop.tokens_seen += tokens_per_step(parts)
    loop.train_time += dt
    loop.window_time += dt
    loop.window_steps += 1
    loop.timing.append(dt)
    timed = len(loop.timing)
    if timed == 1 and use_compile(parts.cfg, parts.env.device):  # paid here: say so
        say(parts, loop, f"step {loop.step}: {dt:.1f} s, compiling the loss and its backward")
    if timed == ESTIMATE_AFTER or (loop.step == loop.end and timed < ESTIMATE_AFTER):
        fit_and_estimate(parts, loop)
    if loop.bar is not None:
        loop.bar.update(1)


def fit_and_estimate(parts: RunParts, loop: LoopState) -> None:
    """The steps after the first (which pays for allocation) set the estimate and, with a
    time limit, the horizon: fitted once, so the schedule and the bar's total never move
    again; 10% of what is left is kept for evaluation and saving."""
    per = float(np.median(loop.timing[1:] or loop.timing))
    step, t = loop.step, parts.cfg.train
    if loop.time_limit_s is not None:
        left = loop.time_limit_s - (time.perf_counter() - loop.loop_t0)
        fit = min(t.steps, step + max(1, int(0.9 * left / per)))
        fit = from_rank0(fit, parts.env)
        if fit != t.steps:
            parts.cfg = dataclasses.replace(parts.cfg, train=dataclasses.replace(t, steps=fit))
            t = parts.cfg.train
            loop.end = horizon(parts.cfg, loop.stop_at)
            say(parts, loop, f"time limit {loop.time_limit_s:.0f} s: train.steps set to {fit}")
        loop.bar = open_bar(loop, loop.end, step - 1)  # this step is counted just after
    if parts.env.is_main and loop.end > step:
        evals = count_evaluations(step, loop.end, t.eval_every)
        estimate(
            f"train: {loop.end - step:,} more steps and {evals} validation(s)",
            loop.end - step,
            per,
            unit="steps",
            stream=sys.stdout,
        )


def log_step(parts: RunParts, loop: LoopState) -> None:
    """Every ``train.log_every`` steps (and at the horizon): a metrics row and the bar's
    postfix, with the throughput over the steps since the last row."""
    every, step = parts.cfg.train.log_every, loop.step
    if not (every and (step % every == 0 or step == loop.end)):
        return
    tok_s = tokens_per_step(parts) * loop.window_steps / max(loop.window_time, 1e-9)
    loop.window_time, loop.window_steps = 0.0, 0
    loop.log.write(
        {
            "step": step,
            "loss": loop.loss,
            "lr": lr_at(step - 1, parts.cfg),
            "tokens_per_s": tok_s,
            "elapsed_s": time.perf_counter() - loop.t0,
        }
    )
    loop.log.agree(parts.env)  # rank 0's write error, on every rank
    if loop.bar is not None:
        loop.bar.set_postfix_str(
            f"loss {loop.loss:.3f} nats/token = {loop.loss * loop.to_bpb:.3f} {loop.bits_unit}, "
            f"{tok_s:,.0f} tokens/s"
        )


def check_time_limit(parts: RunParts, loop: LoopState) -> None:
    """At the time limit the horizon becomes this step. Every rank stops at the same step:
    rank 0's clock decides."""
    if loop.time_limit_s is None or loop.step >= loop.end:
        return
    over = int(time.perf_counter() - loop.loop_t0 >= loop.time_limit_s)
    if from_rank0(over, parts.env):
        say(parts, loop, f"time limit reached at step {loop.step}")
        loop.end = loop.step


def open_bar(loop: LoopState, total: int, initial: int) -> Any:
    """The progress bar (tqdm on a terminal, lines in logs; nothing off rank 0)."""
    from anyorder.progress import progress as progress_bar

    return progress_bar(total=total, initial=initial, desc="train", unit="steps", enabled=loop.show)


def say(parts: RunParts, loop: LoopState, msg: str) -> None:
    """A message on stdout (above the bar on a terminal; progress lines go to stderr)."""
    if not parts.env.is_main:
        return
    if loop.bar is not None and not isinstance(loop.bar, LineProgress):  # tqdm on a terminal
        loop.bar.write(msg)
    else:
        print(msg, flush=True)
