"""The training loop: :func:`train`, one code path for one process and for ``torchrun``.

A run reads top to bottom as its phases (:func:`_train`): prepare the data and find the
checkpoint to resume; build the run's parts (:mod:`~anyorder.training.setup`); restore
them (:mod:`~anyorder.training.state`); a dry run stops after one step; otherwise open the
run folder, step, and write the summary. Each iteration (:func:`_iteration`) is one
optimizer step (:mod:`~anyorder.training.step`) followed by its bookkeeping
(:mod:`~anyorder.training.bookkeeping`: a non-finite loss, the estimate and the fit to a
time limit, the log), validation (:mod:`~anyorder.training.validation`), checkpoints, and
signals (:mod:`~anyorder.training.signals`).

Design choices:

* Everything that can be checked without data (the config, the folders, the checkpoint to
  resume, the run folder's lock) is checked before the run folder is created.
* One writer per run folder: rank 0 holds :class:`~anyorder.runlock.RunLock` from before the
  resume decision to the end, and every rank stops when another training holds it.
* Validation and a checkpoint come every ``train.eval_every`` / ``train.ckpt_every`` steps
  and at the horizon; a signal saves the current step (unless just saved) and stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from anyorder import checkpoint as ckpt_mod
from anyorder.atomic import check_utf8_path, os_error_line, write_errors
from anyorder.config import RunConfig, to_dict
from anyorder.errors import AnyorderError, ConfigError, WriteError
from anyorder.memory import check_training_memory
from anyorder.runlock import RUN_MARKER, RunLock, check_run_folder, check_writable_dir
from anyorder.training.bookkeeping import (
    LoopState,
    check_finite,
    check_time_limit,
    horizon,
    log_step,
    open_bar,
    record_step,
    say,
    tokens_per_step,
)
from anyorder.training.distributed import (
    DistEnv,
    from_rank0,
    print0,
    raise_rank0_error,
    setup_distributed,
)
from anyorder.training.metrics import MetricsLog, config_yaml, write_atomic
from anyorder.training.muon import describe as describe_optimizer
from anyorder.training.resume import check_resume_early, find_resume, step_of
from anyorder.training.setup import (
    build_parts,
    check_config,
    enable_tf32,
    prepare_data,
    resolve_vocab,
    use_compile,
)
from anyorder.training.signals import StopSignals
from anyorder.training.state import RunParts, restore_state, save_state, snapshot
from anyorder.training.step import train_step
from anyorder.training.validation import evaluate_run, format_val


def train(
    cfg: RunConfig,
    *,
    resume: bool | str = "auto",
    dry_run: bool = False,
    progress: bool = True,
    stop_at: int | None = None,
    time_limit_s: float | None = None,
) -> dict[str, Any]:
    """Train a model as ``cfg`` says; the same call in one process and under ``torchrun``.

    Args:
        cfg: the run config (``model.vocab_size`` is set from the tokenizer).
        resume: ``"auto"`` continues the latest checkpoint of ``train.out_dir`` when its
            config matches (bookkeeping keys may differ) and starts fresh when there is none;
            ``True`` requires a checkpoint and also allows train.* and order.* changes;
            ``False`` starts fresh (an error if the folder has checkpoints); a path resumes
            from that checkpoint or run folder.
        dry_run: build everything and take one optimizer step on a small batch; writes
            nothing (data that is not prepared yet goes to a temporary folder, capped at
            :data:`~anyorder.training.setup.DRY_RUN_DOCUMENTS` documents). The run folder
            and the checkpoint the run would resume are checked as the run checks them (a
            folder of the user's files, a file, a run of another config), then left alone.
        progress: show a tqdm progress bar on rank 0.
        stop_at: stop after this step as if interrupted (a checkpoint is written); the
            schedule still spans ``train.steps``. For tests and time-sliced jobs.
        time_limit_s: wall-clock budget in seconds. After a few timed steps ``train.steps`` is
            lowered to what fits (so the cosine schedule still ends), and training stops at
            the limit in any case.

    Returns:
        A summary: run_dir, step, loss, tokens_per_s, elapsed_s, params, the last
        validation metrics, unigram_bpb and the last checkpoint (None in a dry run).

    Raises:
        ConfigError, DataError, CheckpointError: bad settings, data or run folder, raised
            before the run folder is created.
    """
    env = setup_distributed(cfg.train.device)
    from anyorder.interop.hub import init_model_config  # train.init_from: the model comes from it

    for key, path in (("train.out_dir", cfg.train.out_dir), ("data.cache_dir", cfg.data.cache_dir)):
        check_utf8_path(path, key)  # a run others cannot read back is refused at the start
    cfg = init_model_config(cfg)
    check_config(cfg, env.world_size)
    # before anything is built; a dry run's step takes at most 2 rows
    check_training_memory(cfg, env.world_size, str(env.device), 2 if dry_run else None)
    check_writable_dir(cfg.data.cache_path(), "data.cache_dir")
    # a dry run too, reading only: it refuses the run folder the run would refuse
    check_run_folder(cfg.train.out_dir)
    check_writable_dir(cfg.train.out_dir, "train.out_dir")
    if not dry_run:  # a dry run writes no files to spare: find_resume checks it, after the data
        check_resume_early(cfg, resume)
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory())) if dry_run else None
        if not dry_run:  # one writer per run folder, from before the resume decision to the end
            lock = _lock_run_folder(cfg, env)
            if lock is not None:
                stack.callback(lock.release, remove_made=True)
        return _train(cfg, env, resume, dry_run, progress, stop_at, time_limit_s, tmp)


def _lock_run_folder(cfg: RunConfig, env: DistEnv) -> RunLock | None:
    """Rank 0 takes the run folder's lock (:mod:`anyorder.runlock`); every rank learns
    whether it did, and all stop together when another training holds it.

    Raises:
        ConfigError: the folder is in use by another training (its PID named).
    """
    lock, error, holder = None, None, 0
    if env.is_main:
        try:
            lock = RunLock(cfg.train.out_dir).acquire()
        except ConfigError as e:
            error, holder = e, RunLock(cfg.train.out_dir).holder() or -1
        except AnyorderError as e:  # the other ranks must hear of it, not wait in from_rank0
            error, holder = e, -2
    if env.distributed:
        holder = from_rank0(holder, env)
    if error is not None:
        raise error
    if holder == -2:
        raise WriteError(
            f"rank 0 could not write the lock file of train.out_dir={cfg.train.out_dir!r}; "
            "its error says why"
        )
    if holder:
        who = f"PID {holder}" if holder > 0 else "another process"
        raise ConfigError(
            f"train.out_dir={cfg.train.out_dir!r} is in use by another training ({who}); wait "
            "for it to finish, stop it, or pick another train.out_dir"
        )
    return lock


def _train(
    cfg: RunConfig,
    env: DistEnv,
    resume: bool | str,
    dry_run: bool,
    progress: bool,
    stop_at: int | None,
    time_limit_s: float | None,
    tmp: Path | None,
) -> dict[str, Any]:
    """The run's phases, in order (see the module docstring)."""
    t0 = time.perf_counter()
    enable_tf32(env.device)
    cfg, data, run_dir, resume_from = _prepare(cfg, env, resume, dry_run, progress, tmp)
    parts = build_parts(cfg, env, data, resume_from)
    step, tokens_seen = (0, 0) if resume_from is None else restore_state(parts, resume_from)
    unigram = _announce(parts, dry_run)
    if dry_run:
        return _dry_run(parts, run_dir, unigram, t0)
    loop = _open_run(parts, run_dir, resume_from, step, tokens_seen, unigram, t0)
    _set_horizon(parts, loop, stop_at, time_limit_s, show=progress and env.is_main)
    _run_steps(parts, loop)
    return _summarize(parts, loop)


# ----------------------------------------------------------------------------- phases


def _prepare(
    cfg: RunConfig,
    env: DistEnv,
    resume: bool | str,
    dry_run: bool,
    progress: bool,
    tmp: Path | None,
) -> tuple[RunConfig, Any, Path, Path | None]:
    """The data, the config with the tokenizer's vocabulary, the run folder and the
    checkpoint to resume (None for a fresh start or a dry run)."""
    data = prepare_data(cfg, env, dry_run, progress, tmp)
    cfg = resolve_vocab(cfg, data.tokenizer.vocab_size)
    run_dir = Path(cfg.train.out_dir).expanduser()
    found = find_resume(cfg, resume, run_dir)  # a dry run's too: the run's refusals, read only
    resume_from = None if dry_run else found
    if data.num_blocks("val") == 0 and not dry_run:
        raise ConfigError("validation needs blocks: set data.val_fraction > 0 (e.g. 0.05)")
    return cfg, data, run_dir, resume_from


def _announce(parts: RunParts, dry_run: bool) -> float | None:
    """Print what is trained on what; returns the unigram baseline (bits/byte, rank 0, when
    the training split is cheap enough to count)."""
    from anyorder.data import unigram_bits_per_byte

    cfg, env, data = parts.cfg, parts.env, parts.data
    t, m = cfg.train, cfg.model
    B, n = t.batch_size, m.seq_len
    print0(
        f"{m.kind}: {parts.n_params / 1e6:.2f}M parameters, {m.n_layer} layers x "
        f"{m.d_model}, seq_len {n}, {m.positions}; order {parts.order_sampler.describe()}; "
        f"{env.world_size} process(es) on {env.device}, dtype {t.dtype}; "
        f"{describe_optimizer(parts.opt)} at lr {t.lr:g}, "
        f"batch {B} = {env.world_size} x {t.grad_accum} x {parts.micro}"
        + (" (compiled)" if use_compile(cfg, env.device) else "")
        + (" (blocks recomputed in backward)" if t.activation_checkpointing else "")
        + (" (dry run: one micro-batch of at most 2)" if dry_run else "")
    )
    if parts.adapters is not None:
        lo = t.lora
        trained = sum(p.numel() for p in parts.params)
        print0(
            f"LoRA r={lo.r} alpha={lo.alpha:g} on {', '.join(lo.targets)}: {trained:,} "
            "parameters train, the base is frozen"
        )
    print0(
        f"data: {data.num_blocks('train'):,} train / {data.num_blocks('val'):,} val blocks, "
        f"{data.bytes_per_token('train'):.3f} bytes/token ({data.path})"
    )
    if env.is_main and data.num_blocks("train") * n <= 5 * 10**8:  # cheap enough to count
        return unigram_bits_per_byte(data)
    return None


def _dry_run(parts: RunParts, run_dir: Path, unigram: float | None, t0: float) -> dict[str, Any]:
    """One optimizer step on one micro-batch of at most 2 rows and a tiny validation; writes
    nothing."""
    parts = dataclasses.replace(parts, micro=min(parts.micro, 2))
    loss = train_step(parts, 0, rows=parts.micro)
    val = evaluate_run(parts, 1, 1, orders=1, mdm_rows=1) if parts.data.num_blocks("val") else {}
    print0(
        f"dry run: one step done, loss {loss:.4f} nats/token; {format_val(val)}; nothing written"
    )
    return {
        "dry_run": True,
        "run_dir": str(run_dir),
        "step": 1,
        "loss": loss,
        "params": parts.n_params,
        "vocab_size": parts.cfg.model.vocab_size,
        "val": val,
        "unigram_bpb": unigram,
        "elapsed_s": time.perf_counter() - t0,
    }


def _open_run(
    parts: RunParts,
    run_dir: Path,
    resume_from: Path | None,
    step: int,
    tokens_seen: int,
    unigram: float | None,
    t0: float,
) -> LoopState:
    """The run folder exists from here on: its config, its metrics log, the loop's state."""
    env, cfg = parts.env, parts.cfg
    error, log = None, None
    try:  # rank 0 writes; its error reaches every rank (raise_rank0_error)
        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            # first: from here on a later training may write into this folder
            with write_errors(run_dir / RUN_MARKER, "another train.out_dir"):
                (run_dir / RUN_MARKER).write_text(
                    "written by anyorder train: this folder is a run's\n"
                )
            write_atomic(run_dir / "config.yaml", config_yaml(cfg))
        log = MetricsLog(
            run_dir, env.is_main, step if resume_from is not None else None, cfg.train.seed,
            defer=env.distributed,
        )  # fmt: skip
    except AnyorderError as e:
        error = e
    except OSError as e:  # the line the CLI's backstop would print, now on every rank
        error = WriteError(os_error_line(e))
    raise_rank0_error(error, env)
    assert log is not None
    bytes_per_token, unit = _loss_unit(parts)
    return LoopState(
        run_dir=run_dir,
        log=log,
        step=step,
        tokens_seen=tokens_seen,
        start_step=step,
        last_ckpt=ckpt_mod.latest_checkpoint(run_dir) if resume_from else None,
        unigram=unigram,
        to_bpb=1.0 / (math.log(2) * bytes_per_token),
        bits_unit=unit,
        t0=t0,
        loop_t0=time.perf_counter(),
    )


def _loss_unit(parts: RunParts) -> tuple[float, str]:
    """Bytes per token of what the loss covers, and the unit the log shows it in.

    On text the loss scores every slot of blocks of text: bits per byte of that text. Under
    ``order.condition=prompt`` it scores the answers' slots, and those run on with EOS
    padding to the block's end, which has no bytes: per byte of the answers' text the figure
    grows with the padding (hundreds of bits for short answers in long blocks), so the log
    shows bits per answer token, as validation does."""
    if parts.cfg.order.condition == "prompt":
        return 1.0, "bits/token"
    return parts.data.bytes_per_token("train"), "bits/byte"


def _set_horizon(
    parts: RunParts, loop: LoopState, stop_at: int | None, time_limit_s: float | None, show: bool
) -> None:
    """Where this call stops: ``train.steps``, ``stop_at`` when sooner, or a time limit (the
    bar opens once a time limit's fit is known)."""
    loop.stop_at, loop.time_limit_s, loop.show = stop_at, time_limit_s, show
    loop.end = horizon(parts.cfg, stop_at)


def _run_steps(parts: RunParts, loop: LoopState) -> None:
    """Step until the horizon, a time limit or a signal; the bar and the log closed after."""
    if loop.step >= loop.end:
        print0(
            f"{loop.run_dir} is already at step {loop.step} of {loop.end}: nothing to train "
            "(raise train.steps to go on from there, or pick another train.out_dir)"
        )
    if loop.time_limit_s is None:
        loop.bar = open_bar(loop, loop.end, loop.step)
    stop = StopSignals()
    try:
        stop.install()
        while loop.step < loop.end:
            if not _iteration(parts, loop, stop):
                break
    finally:
        stop.restore()
        if loop.bar is not None:
            loop.bar.close()
        loop.log.close()
    loop.interrupted = stop.name


def _iteration(parts: RunParts, loop: LoopState, stop: StopSignals) -> bool:
    """One step and its bookkeeping; False when a signal stopped the run (saved)."""
    s0 = time.perf_counter()
    before = None if parts.cfg.train.skip_nonfinite else snapshot(parts)
    loop.loss = train_step(parts, loop.step)
    check_finite(parts, loop, before)
    record_step(parts, loop, time.perf_counter() - s0)
    log_step(parts, loop)
    check_time_limit(parts, loop)
    step, final, t = loop.step, loop.step >= loop.end, parts.cfg.train
    if (t.eval_every and step % t.eval_every == 0) or final:
        _validate(parts, loop)
    if (t.ckpt_every and step % t.ckpt_every == 0) or final:
        _checkpoint(parts, loop)
    if not final and stop.agreed(parts.env):
        # SIGINT/SIGTERM: save where we are and leave cleanly (resume continues).
        if step_of(loop.last_ckpt) != step:
            _checkpoint(parts, loop)
        say(parts, loop, f"{stop.name}: stopped at step {step}; checkpoint {loop.last_ckpt}")
        return False
    return True


def _validate(parts: RunParts, loop: LoopState) -> None:
    """Validate (every rank), log the figures and say them."""
    loop.val = evaluate_run(parts, parts.cfg.train.eval_batches, parts.micro)
    loop.log.write({"step": loop.step, **loop.val})
    loop.log.agree(parts.env)
    figures = format_val(loop.val, loop.unigram)
    say(parts, loop, f"step {loop.step}: loss {loop.loss:.4f} nats/token; {figures}")


def _checkpoint(parts: RunParts, loop: LoopState) -> None:
    """Save this step (every rank takes part; rank 0 writes and learns the path)."""
    loop.last_ckpt = save_state(parts, loop.run_dir, loop.step, loop.tokens_seen) or loop.last_ckpt


def _summarize(parts: RunParts, loop: LoopState) -> dict[str, Any]:
    """The run's summary, also written to ``RUN/summary.json`` by rank 0."""
    cfg, env = parts.cfg, parts.env
    done = loop.step - loop.start_step
    summary = {
        "dry_run": False,
        "run_dir": str(loop.run_dir),
        "step": loop.step,
        "steps_run": done,
        "loss": loop.loss,
        "tokens_per_s": tokens_per_step(parts) * done / loop.train_time if done else 0.0,
        "train_time_s": loop.train_time,
        "elapsed_s": time.perf_counter() - loop.t0,
        "params": parts.n_params,
        "vocab_size": cfg.model.vocab_size,
        "val": loop.val,
        "unigram_bpb": loop.unigram,
        "checkpoint": str(loop.last_ckpt) if loop.last_ckpt else None,
        "world_size": env.world_size,
        "seed": cfg.train.seed,
        "skipped_steps": loop.skipped,
        "interrupted": loop.interrupted,
        "config": to_dict(cfg),
    }
    if env.is_main:
        kept = f"; {loop.last_ckpt} is intact" if loop.last_ckpt else ""
        write_atomic(loop.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n", kept)
    return summary
