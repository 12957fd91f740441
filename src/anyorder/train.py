"""The training loop: one code path for one process and for ``torchrun``.

Design choices:

* Rank and world size come from the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
  or from a process group the caller already initialised; the backend is NCCL on CUDA and
  gloo on the CPU. DDP by default; FSDP2 ``fully_shard`` when ``train.fsdp`` (imported only
  then).
* One global batch per step whatever the number of processes: ``train.batch_size``
  sequences, split over ranks (rank ``r`` takes rows ``r::world`` of the global batch, as
  :class:`~anyorder.data.BlockSampler` hands them out) and then over ``grad_accum``
  micro-steps. The generation orders are drawn for the *global* batch on every rank with
  the same seeded generator and each rank takes its rows, so the orders a row gets do not
  depend on the number of processes either: two ranks reproduce one process. (The encoder's
  mask levels come from a per-rank generator, so an ``mdm`` run matches across world sizes
  in distribution only.)
* Exact resume: a checkpoint holds model, EMA, optimizer, step, the data cursor and every
  RNG (torch, CUDA, python, numpy, the order generator, the per-rank loss generator). The
  learning rate is a pure function of the step (no scheduler object to save). ``2N`` steps
  straight and ``N`` + resume + ``N`` give the same bits on the CPU.
* The loss goes through a small wrapper module's ``__call__``, so DDP's hooks see every
  forward, including the encoder's ELBO that never calls ``forward``. Under FSDP the model
  is the root unit (``denoise`` registered as a second entry point for the encoder) and
  each block entered through its own ``__call__`` is a unit; ARMD's two-stream blocks stay
  in the root unit because the two-stream layer reaches into their submodules.
* Mixed precision: bf16 autocast on CUDA by default; fp32 on the CPU unless
  ``train.dtype=bf16`` (this CPU has bf16 units: about 2x faster for the tiny models).
  Losses are computed in fp32 (the models upcast the logits).
* EMA weights are a shadow list beside the parameters, swapped in for evaluation and saving;
  validation reports the EMA model when EMA is on.
* Validation runs on every rank over the same blocks (simple, and FSDP needs every rank in
  every forward); only rank 0 writes. The encoder's left-to-right figure costs one encoder
  pass per token, so it is measured on at most :data:`MDM_L2R_ROWS` sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from anyorder import checkpoint as ckpt_mod
from anyorder.config import RunConfig, to_dict
from anyorder.errors import CheckpointError, ConfigError, TrainingError
from anyorder.orders import OrderSampler
from anyorder.progress import LineProgress, estimate
from anyorder.runlock import RunLock, check_writable_dir

ESTIMATE_AFTER = 4
"""Timed steps (the first, which pays for allocation, left out) before the up-front estimate
(and, with a time limit, the fit of ``train.steps``)."""
MDM_L2R_ROWS = 4
"""Sequences the encoder's (costly: one pass per token) left-to-right NLL is measured on."""
VAL_ORDERS = 2
"""Random orders per validation batch for the Monte-Carlo any-order NLL."""
VAL_SEED = 1234
"""Seed of the validation orders: the same orders at every evaluation."""
DRY_RUN_DOCUMENTS = 2000
"""A dry run without a prepared cache tokenizes at most this many documents (in a temp dir)."""

# Keys that may differ between a run folder's checkpoint and the config it is resumed with.
# auto-resume: only bookkeeping; --resume: also the optimisation settings.
_RESUME_FREE = {
    "train.out_dir",
    "train.steps",
    "train.eval_every",
    "train.eval_batches",
    "train.ckpt_every",
    "train.keep_last",
    "train.log_every",
    "train.device",
    "train.compile",
    "train.skip_nonfinite",
    "data.cache_dir",
    "data.streaming",
}
_RESUME_FORCED_FREE = {"train.", "order."}


# ----------------------------------------------------------------------------- processes


@dataclass
class DistEnv:
    """Where this process sits: rank, world size, device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_rank() -> int:
    """This process's rank: from the process group if there is one, else ``$RANK``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only."""
    if env_rank() == 0:
        print(*args, **kwargs, flush=True)


def resolve_device(name: str, local_rank: int = 0, what: str = "train.device") -> torch.device:
    """``auto``/``cpu``/``cuda``/``cuda:N`` to a device (``cuda`` means ``cuda:LOCAL_RANK``).

    Args:
        name: the device name.
        local_rank: this process's local rank (the GPU ``cuda`` means).
        what: how the user set it, for messages (``train.device``, ``--device``).

    Raises:
        ConfigError: CUDA asked for where there is none (or a GPU index beyond the last),
            or an unknown name.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"{what}={name!r} but CUDA is not available here; use cpu or auto")
        try:
            dev = torch.device(f"cuda:{local_rank}") if name == "cuda" else torch.device(name)
        except RuntimeError:
            raise ConfigError(f"{what}={name!r} is not a device; use cuda or cuda:N") from None
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{what}={name!r} but this machine has {torch.cuda.device_count()} GPU(s); "
                "use cuda or a smaller index"
            )
        return dev
    raise ConfigError(f"{what}={name!r} is not a device; use auto, cpu, cuda or cuda:N")


DIST_TIMEOUT_ENV = "ANYORDER_DIST_TIMEOUT_S"
"""Seconds to wait for the torchrun rendezvous and for collectives (default 1800)."""


@contextlib.contextmanager
def _held_stderr() -> Iterator[list[str]]:
    """Hold what is written to file descriptor 2 (c10d's C++ logs) until the block ends.

    The text is put back on stderr when the block succeeds and dropped when it raises, so a
    failed rendezvous is one line from the CLI, not pages of C++ retry logs.
    """
    held: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile("w+b") as buf:
        os.dup2(buf.fileno(), 2)
        ok = False
        try:
            yield held
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            buf.seek(0)
            held.append(buf.read().decode("utf-8", "replace"))
            if ok and held[0]:
                sys.stderr.write(held[0])
                sys.stderr.flush()


def setup_distributed(device: str) -> DistEnv:
    """Join the process group named by the environment (or the caller's) and pick the device.

    A run with ``WORLD_SIZE`` > 1 and no process group yet initialises one: NCCL on CUDA,
    gloo on the CPU. One process without ``WORLD_SIZE`` runs alone.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_available() and dist.is_initialized():
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raw = os.environ.get(DIST_TIMEOUT_ENV, "1800")
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise ConfigError(f"{DIST_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        try:
            with _held_stderr():
                dist.init_process_group(
                    "nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout)
                )
        except (RuntimeError, ValueError, TimeoutError, ConnectionError) as e:
            # DistError (a RuntimeError): a closed port, a rank that never came, no MASTER_ADDR
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(
                f"the torchrun rendezvous at {where} failed within {timeout:g}s ({first}); "
                f"start every rank with the same MASTER_ADDR/MASTER_PORT, or raise "
                f"{DIST_TIMEOUT_ENV}"
            ) from None
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev)
    return DistEnv(0, 1, local_rank, dev)


def _barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


# ----------------------------------------------------------------------------- pieces


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up, then cosine to min_lr_ratio."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, cfg: RunConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (>= 2-D) only; norms, biases, BOS undecayed."""
    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # fused AdamW on CUDA; the CPU keeps the default (foreach) implementation.
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), **extra)


class EMA:
    """Exponential moving average of the parameters, kept in fp32 beside them."""

    def __init__(self, params: list[Tensor], decay: float, warmup: bool) -> None:
        self.params = params
        self.decay = decay
        self.warmup = warmup
        self.shadow = [p.detach().clone().float() for p in params]

    def decay_at(self, step: int) -> float:
        """Decay of the update after step ``step`` (0-based); warm-up ramps it from 0.1."""
        return min(self.decay, (1 + step) / (10 + step)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        w = 1.0 - self.decay_at(step)
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], w)

    @torch.no_grad()
    def load_from_params(self) -> None:
        """Set the shadow to the current parameters (after loading EMA weights into them)."""
        for s, p in zip(self.shadow, self.params):
            s.copy_(p.detach())

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Put the EMA weights into the parameters for the duration (restored exactly)."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)


class LossModule(nn.Module):
    """``wrapper(tokens, order, blocks, generator) = model.loss(...)``: the one forward that
    DDP and FSDP wrap, so their hooks run for every model kind."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        tokens: Tensor,
        order: Tensor | None,
        blocks: Tensor | None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        return self.model.loss(tokens, order, blocks, generator=generator)


COMPILE_AUTO = {"cpu": False, "cuda": False}
"""What ``train.compile=auto`` means on each device type. Off everywhere for now: on this
project's CPU a compiled step is no faster (docs/performance.md), and compiled against eager
on a GPU is measured side by side by ``benchmarks/gpu_check.sh`` (``train_step.py --compile
both``); turn ``cuda`` on here when that table shows a win."""
COMPILE_KWARGS: dict[str, Any] = {}
"""Extra ``torch.compile`` arguments of a compiled run (tests use ``backend="aot_eager"``)."""


def use_compile(cfg: RunConfig, device: torch.device) -> bool:
    """Whether this run compiles: ``train.compile``, with ``auto`` resolved per device."""
    c = cfg.train.compile
    return c if isinstance(c, bool) else COMPILE_AUTO.get(device.type, False)


def compile_modules(model: nn.Module, train_module: nn.Module) -> None:
    """Compile, in place, the training entry point (the loss, so the cross-entropy over the
    vocabulary is compiled with the model) and the model itself: its ``forward`` and, for the
    models that have one, its ``features`` trunk, which validation's ``token_nll`` calls
    before the head runs in chunks.

    In place (``Module.compile``), so nothing is wrapped: parameters, ``state_dict`` keys
    (no ``_orig_mod.``), EMA and checkpoints see the plain modules. ``train_module`` is the
    outermost wrapper (DDP's, so that dynamo splits the graph at DDP's gradient buckets;
    under FSDP2 the loss module over the sharded model, whose hooks dynamo leaves to run
    eagerly). Calls of the compiled model inside the compiled loss are traced inline.
    """
    model.compile(**COMPILE_KWARGS)
    if model.has_features():  # an instance attribute: the class and state_dict are untouched
        model.features = torch.compile(model.features, **COMPILE_KWARGS)
    train_module.compile(**COMPILE_KWARGS)


def autocast_context(cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (``auto``) or when asked for; fp32 otherwise."""
    dtype = cfg.train.dtype
    if dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.dtype={dtype!r}: use auto, bf16 or fp32")
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _flat(prefix: str, d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(key + ".", v))
        else:
            out[key] = v
    return out


def config_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    fa, fb = _flat("", to_dict(a)), _flat("", to_dict(b))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def check_config(cfg: RunConfig, world_size: int = 1) -> None:
    """Checks that need no data: run before anything is read or written.

    Raises:
        ConfigError: a batch that does not split, an order the model cannot train on, bad
            intervals or dtype.
    """
    t, o, m = cfg.train, cfg.order, cfg.model
    OrderSampler(o)  # unknown order kinds and bad progressive settings
    for name in ("steps", "batch_size", "grad_accum"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be a positive integer")
    for name in ("eval_every", "ckpt_every", "log_every", "warmup_steps", "eval_batches"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0")
    if t.keep_last < 1:
        raise ConfigError(f"train.keep_last={t.keep_last} must be at least 1")
    if not 0.0 < t.lr <= 1e30:  # beyond, AdamW's fp32 step size overflows
        raise ConfigError(f"train.lr={t.lr} must be a positive number (at most 1e30), e.g. 1e-3")
    if not 0.0 <= t.ema < 1.0:
        raise ConfigError(f"train.ema={t.ema} must be in [0, 1) (0 disables)")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    per = world_size * t.grad_accum
    if t.batch_size % per:
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not split over {world_size} process(es) x "
            f"{t.grad_accum} accumulation step(s); use a multiple of {per}"
        )
    if t.dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.dtype={t.dtype!r}: use auto, bf16 or fp32")
    if not 0.0 < cfg.data.val_fraction < 1.0:  # validation runs at the end of every run
        raise ConfigError(
            f"data.val_fraction={cfg.data.val_fraction} must lie in (0, 1) for training "
            "(validation runs at the end); use e.g. 0.05"
        )
    if isinstance(t.compile, str) and t.compile != "auto":
        raise ConfigError(f"train.compile={t.compile!r}: use true, false or auto")
    block_orders = o.kind == "sbp" or (o.kind == "strided" and o.streams > 1)
    if block_orders and m.kind in ("gpt", "aogpt"):
        raise ConfigError(
            f"order.kind={o.kind} trains on blocks of several tokens, which only armd and mdm "
            "take; use model.kind=armd or a token-level order"
        )
    if o.kind == "strided" and m.seq_len % o.streams:
        raise ConfigError(
            f"order.streams={o.streams} does not divide model.seq_len={m.seq_len}; pick a divisor"
        )
    if o.kind == "sbp" and any(m.seq_len % s for s in o.sbp_streams):
        raise ConfigError(
            f"order.sbp_streams={list(o.sbp_streams)} must all divide model.seq_len={m.seq_len}"
        )


def resolve_vocab(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """The config with ``model.vocab_size`` set to the tokenizer's.

    Raises:
        ConfigError: the config asked for fewer ids than the tokenizer has.
    """
    if cfg.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{vocab_size} ids; remove the setting or set model.vocab_size={vocab_size}"
        )
    if cfg.model.vocab_size != vocab_size:
        print0(f"model.vocab_size {cfg.model.vocab_size} -> {vocab_size} (from the tokenizer)")
    model = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    return dataclasses.replace(cfg, model=model)


# ----------------------------------------------------------------------------- state I/O


def _is_fsdp(cfg: RunConfig, env: DistEnv) -> bool:
    return cfg.train.fsdp and env.distributed


def full_model_state(model: nn.Module, fsdp: bool) -> dict[str, Tensor]:
    """The unsharded state dict (gathered to CPU under FSDP; every rank must call)."""
    if not fsdp:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def set_full_model_state(model: nn.Module, state: dict[str, Tensor], fsdp: bool) -> None:
    if not fsdp:
        model.load_state_dict(state, strict=True)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_model_state_dict(model, state, options=opts)


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, fsdp: bool) -> dict[str, Any]:
    if not fsdp:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, opt, options=opts)


def load_optimizer_state(
    model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any], fsdp: bool
) -> None:
    if not fsdp:
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, opt, state, options=opts)


def rng_state(loss_gen: torch.Generator, device: torch.device) -> dict[str, Any]:
    """Every RNG this process may draw from (numpy's as tensors, for weights_only loading)."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "loss_generator": loss_gen.get_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], loss_gen: torch.Generator, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    loss_gen.set_state(state["loss_generator"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- validation


@torch.no_grad()
def validate(
    model: nn.Module,
    data: Any,
    cfg: RunConfig,
    device: torch.device,
    *,
    batches: int,
    batch_size: int,
    num_orders: int = VAL_ORDERS,
    autocast: contextlib.AbstractContextManager | None = None,
    mdm_l2r_rows: int = MDM_L2R_ROWS,
) -> dict[str, float]:
    """Validation NLL in nats/token and bits/byte: exact left-to-right, Monte-Carlo any-order.

    The any-order figure is the mean over ``num_orders`` uniform orders per batch (the
    encoder's: its ELBO), with a standard error over the orders; the orders come from a
    generator seeded with :data:`VAL_SEED`, so every evaluation scores the same orders.

    Returns:
        ``val/l2r_nll``, ``val/l2r_bpb`` and, except for ``gpt``, ``val/ao_nll``,
        ``val/ao_bpb``, ``val/ao_bpb_se``; plus ``val/blocks``.
    """
    from anyorder.data import iter_eval_blocks
    from anyorder.evaluation.estimators import (
        any_order_nll,
        bits_per_byte,
        left_to_right_nll,
        mdm_elbo,
    )

    kind = cfg.model.kind
    bpt = data.bytes_per_token("val")
    gen = torch.Generator().manual_seed(VAL_SEED)
    was_training = model.training
    model.eval()
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    l2r_sum, l2r_count = 0.0, 0
    ao_means: list[float] = []
    ao_vars: list[float] = []
    blocks = 0
    n = data.seq_len
    max_blocks = max(1, batches) * batch_size
    try:
        for x in iter_eval_blocks(data, "val", max_blocks, batch_size=batch_size):
            x = x.to(device)
            blocks += x.shape[0]
            rows = x if kind != "mdm" else x[: max(0, mdm_l2r_rows - l2r_count)]
            if len(rows):
                with ctx:
                    l2r_sum += float(left_to_right_nll(model, rows).double().sum())
                l2r_count += len(rows)
            if kind == "gpt":
                continue
            with ctx:
                if kind == "mdm":
                    est = mdm_elbo(model, x, num_orders, gen)
                else:
                    est = any_order_nll(model, x, num_orders, gen)
            ao_means.append(est.mean)
            ao_vars.append(est.stderr**2 if num_orders > 1 else 0.0)
    finally:
        model.train(was_training)
    out: dict[str, float] = {"val/blocks": float(blocks)}
    nll = l2r_sum / max(1, l2r_count * n)
    out["val/l2r_nll"] = nll
    out["val/l2r_bpb"] = bits_per_byte(nll, bpt)
    if ao_means:
        k = len(ao_means)
        mean = sum(ao_means) / k
        se = math.sqrt(sum(ao_vars)) / k
        out["val/ao_nll"] = mean
        out["val/ao_bpb"] = bits_per_byte(mean, bpt)
        out["val/ao_bpb_se"] = bits_per_byte(se, bpt)
    return out


# ----------------------------------------------------------------------------- logging


class MetricsLog:
    """``RUN/metrics.jsonl`` (and TensorBoard when installed), written by rank 0 only.

    Every row carries the run's seed. A row is appended with one ``write``; a process killed
    mid-row leaves a partial last line, which the resumed run drops with the rows after its
    checkpoint (the file is then replaced atomically).
    """

    def __init__(
        self, run_dir: Path | None, active: bool, resume_step: int | None, seed: int = 0
    ) -> None:
        self.path = run_dir / "metrics.jsonl" if (run_dir and active) else None
        self.seed = seed
        self.tb = None
        if self.path is None:
            return
        if resume_step is not None and self.path.exists():
            # Rows after the checkpoint belong to a run that was cut short: drop them.
            keep = [
                line
                for line in self.path.read_text(errors="replace").splitlines()
                if _step_of_row(line) is not None and _step_of_row(line) <= resume_step
            ]
            _write_atomic(self.path, "".join(k + "\n" for k in keep))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:  # tensorboard is optional
            self.tb = None

    def write(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        row = {"step": row.get("step"), "seed": self.seed, **row}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k not in ("step", "seed") and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _step_of_row(line: str) -> int | None:
    """The step of a metrics row, or None for a blank or partial (killed mid-write) line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return int(row.get("step", 0)) if isinstance(row, dict) else None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``RUN/metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if _step_of_row(line) is not None]


# ----------------------------------------------------------------------------- the loop


def _check_model_of(found: Path, old: RunConfig, cfg: RunConfig, vocab: int | None) -> None:
    """A checkpoint to resume must hold the config's model kind and the tokenizer's vocabulary.

    Raises:
        CheckpointError: another kind, or ``vocab`` (the run's tokenizer) of another size.
    """
    if old.model.kind != cfg.model.kind:
        raise CheckpointError(
            f"{found} holds model.kind={old.model.kind} but the config asks for "
            f"model.kind={cfg.model.kind}; set model.kind={old.model.kind} to resume it, or pick "
            "another train.out_dir"
        )
    if vocab is not None and vocab != old.model.vocab_size:
        raise CheckpointError(
            f"data.tokenizer={cfg.data.tokenizer!r} has {vocab} token ids but {found} was "
            f"trained with {old.model.vocab_size} ({old.data.tokenizer!r}); use the run's "
            f"tokenizer, e.g. data.tokenizer={found / ckpt_mod.TOKENIZER_DIR}"
        )


def _early_tokenizer_vocab(cfg: RunConfig, unless: str | None = None) -> int | None:
    """The vocabulary size of ``data.tokenizer`` when it loads without the corpus (not
    ``bpe:N``, which is trained on it) and differs from ``unless``; else None."""
    spec = cfg.data.tokenizer
    if spec == unless or spec.startswith("bpe:"):
        return None
    from anyorder.data import load_tokenizer

    return load_tokenizer(spec).vocab_size


def check_resume_early(cfg: RunConfig, resume: bool | str) -> None:
    """Before any data is prepared: the checkpoint to resume (or ``train.init_from``) holds
    the config's model kind and the tokenizer's vocabulary, so a mismatch leaves no files.

    Raises:
        CheckpointError / ConfigError: as :func:`_find_resume`, or a model of another kind,
            or a tokenizer of another vocabulary size.
    """
    run_dir = Path(cfg.train.out_dir).expanduser()
    found = _locate_resume(resume, run_dir)
    if found is not None:
        old = ckpt_mod.read_config(found)
        _check_model_of(found, old, cfg, _early_tokenizer_vocab(cfg, unless=old.data.tokenizer))
        return
    if cfg.train.init_from:  # the model section came from init_from (init_model_config)
        vocab = _early_tokenizer_vocab(cfg)
        if vocab is not None and vocab != cfg.model.vocab_size:
            raise CheckpointError(
                f"train.init_from={cfg.train.init_from!r} reads {cfg.model.vocab_size} token "
                f"ids but data.tokenizer={cfg.data.tokenizer!r} has {vocab}; set "
                "data.tokenizer to the tokenizer init_from was made with (its folder)"
            )


def _locate_resume(resume: bool | str, run_dir: Path) -> Path | None:
    """The checkpoint ``resume`` names, or None for a fresh start (no config checks)."""
    if resume is False:
        if ckpt_mod.latest_checkpoint(run_dir) is not None:
            raise ConfigError(
                f"{run_dir} already holds checkpoints; resume it (--resume), or pick another "
                "train.out_dir"
            )
        return None
    if isinstance(resume, str) and resume != "auto":
        found: Path | None = ckpt_mod.resolve_checkpoint(resume)
    else:
        found = ckpt_mod.latest_checkpoint(run_dir)
    if found is None and resume is True:
        raise CheckpointError(
            f"nothing to resume: {run_dir} holds no checkpoint; drop --resume to start"
        )
    if found is None:
        # Step folders without a readable manifest: damaged checkpoints, not a new run. A
        # fresh start would delete metrics.jsonl and overwrite them, so it must be asked for.
        root = run_dir / ckpt_mod.CHECKPOINTS
        broken = sorted(p.name for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
        if broken:
            raise CheckpointError(
                f"{root} holds {len(broken)} checkpoint folder(s) without a manifest.json "
                f"({broken[-1]}...); restore them, delete them, or start over with --fresh"
            )
    return found


def _find_resume(cfg: RunConfig, resume: bool | str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start.

    Raises:
        CheckpointError / ConfigError: nothing to resume, a model of another kind or
            vocabulary, or a run folder of another config.
    """
    found = _locate_resume(resume, run_dir)
    if found is None:
        return None
    old = ckpt_mod.read_config(found)
    _check_model_of(found, old, cfg, cfg.model.vocab_size)
    diff = config_diff(old, cfg)
    forced = resume is not False and resume != "auto"
    bad = [
        k
        for k in diff
        if k not in _RESUME_FREE and not (forced and k.startswith(tuple(_RESUME_FORCED_FREE)))
    ]
    if bad:
        how = "" if forced else " (--resume also allows other train.* and order.* changes)"
        raise ConfigError(
            f"{found} was trained with another config (differs in {', '.join(bad)}); use the "
            f"same settings to resume{how}, or pick another train.out_dir"
        )
    return found


def _prepare_data(cfg: RunConfig, env: DistEnv, dry_run: bool, progress: bool, tmp: Path | None):
    from anyorder.data import cache_key, prepare

    data_cfg = cfg.data
    if dry_run:
        ready = Path(data_cfg.cache_dir).expanduser() / cache_key(data_cfg, cfg.model.seq_len)
        if not (ready / "manifest.json").is_file():
            assert tmp is not None
            cap = DRY_RUN_DOCUMENTS
            if data_cfg.max_documents is not None:
                cap = min(cap, data_cfg.max_documents)
            data_cfg = dataclasses.replace(data_cfg, cache_dir=str(tmp), max_documents=cap)
    show = progress and env.is_main
    # Rank 0 tokenizes; the others wait and then read its folder.
    if env.is_main:
        data = prepare(data_cfg, cfg.model.seq_len, progress=show)
    _barrier(env)
    if not env.is_main:
        data = prepare(data_cfg, cfg.model.seq_len, progress=False)
    return data


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
            :data:`DRY_RUN_DOCUMENTS` documents).
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
    from anyorder.interop.hub import init_model_config

    cfg = init_model_config(cfg)
    check_config(cfg, env.world_size)
    check_writable_dir(cfg.data.cache_dir, "data.cache_dir")
    if not dry_run:
        check_writable_dir(cfg.train.out_dir, "train.out_dir")
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
    if env.distributed:
        holder = _from_rank0(holder, env)
    if error is not None:
        raise error
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
    from anyorder.data import BlockSampler, unigram_bits_per_byte
    from anyorder.models import build_model

    t0 = time.perf_counter()
    device = env.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data = _prepare_data(cfg, env, dry_run, progress, tmp)
    cfg = resolve_vocab(cfg, data.tokenizer.vocab_size)
    run_dir = Path(cfg.train.out_dir).expanduser()
    resume_from = None if dry_run else _find_resume(cfg, resume, run_dir)
    if data.num_blocks("val") == 0 and not dry_run:
        raise ConfigError("validation needs blocks: set data.val_fraction > 0 (e.g. 0.05)")

    # ---- model, optimizer, EMA, generators (identical on every rank)
    t = cfg.train
    torch.manual_seed(t.seed)
    model = build_model(cfg.model).to(device)
    if t.init_from and resume_from is None:  # start from converted or exported weights
        from anyorder.interop.hub import init_weights_from

        print0(f"weights from {init_weights_from(model, t.init_from).path}")
    aliases = ckpt_mod.tied_aliases(model)
    n_params = model.num_params()
    wrapper = LossModule(model)
    fsdp = _is_fsdp(cfg, env)
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = t.dtype == "bf16" or (t.dtype == "auto" and device.type == "cuda")
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
        )
        # One FSDP unit per block that is entered through its own __call__ (FSDP's hooks
        # unshard there). ARMD's two-stream layers reach into their block's submodules
        # directly, so those blocks stay in the root unit.
        first = getattr(model, "l2s", 0) if cfg.model.kind == "armd" else 0
        for block in list(model.blocks)[first:]:
            fully_shard(block, mp_policy=mp)
        # The model itself is the root unit, so validation (which calls the model, not the
        # loss wrapper) unshards it too; token_nll (trunk and head in chunks, not through
        # forward) and the encoder's denoise() are entry points as well.
        fully_shard(model, mp_policy=mp)
        from torch.distributed.fsdp import register_fsdp_forward_method

        for entry in ("token_nll", "denoise") if cfg.model.kind == "mdm" else ("token_nll",):
            register_fsdp_forward_method(model, entry)
        train_module: nn.Module = wrapper
    elif env.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_module = DDP(wrapper, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        train_module = wrapper
    if use_compile(cfg, device):  # after wrapping: see compile_modules
        compile_modules(model, train_module)
    opt = make_optimizer(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    ema = EMA(params, t.ema, t.ema_warmup) if t.ema > 0 else None
    order_sampler = OrderSampler(cfg.order)
    # The order generator is the same on every rank (global-batch orders); the loss
    # generator (the encoder's mask levels) is per rank.
    order_gen = torch.Generator().manual_seed(t.seed)
    loss_gen = torch.Generator().manual_seed(t.seed * 1_000_003 + 7919 * (env.rank + 1))
    torch.manual_seed(t.seed + 1000 * env.rank)  # dropout differs between ranks
    sampler = BlockSampler(data.num_blocks("train"), t.batch_size, t.seed, env.rank, env.world_size)
    autocast = autocast_context(cfg, device)

    # ---- resume
    step = 0
    tokens_seen = 0
    if resume_from is not None:
        state = ckpt_mod.read_state(resume_from)
        listed = ckpt_mod.verify(resume_from, [ckpt_mod.MODEL_FILE, ckpt_mod.EMA_FILE])["files"]
        if ema is not None:
            if ckpt_mod.EMA_FILE not in listed:  # never load an EMA file nothing vouches for
                raise CheckpointError(
                    f"{resume_from} has no EMA weights but train.ema={t.ema}; resume with "
                    "train.ema=0 or start a new run"
                )
            _load_into(model, resume_from / ckpt_mod.EMA_FILE, fsdp)
            ema.load_from_params()
        _load_into(model, resume_from / ckpt_mod.MODEL_FILE, fsdp)
        load_optimizer_state(model, opt, state["optimizer"], fsdp)
        step = int(state["step"])
        tokens_seen = int(state.get("tokens_seen", 0))
        sampler.load_state_dict(state["sampler"])
        order_gen.set_state(state["order_generator"])
        rngs = state["rng"]
        if len(rngs) == env.world_size:
            set_rng_state(rngs[env.rank], loss_gen, device)
        else:  # another number of processes: exact only for the shared generators
            print0(f"resuming {len(rngs)} process(es) as {env.world_size}: per-rank RNGs reseeded")
        print0(f"resuming from {resume_from} at step {step}")

    B, n = t.batch_size, cfg.model.seq_len
    local = B // env.world_size
    micro = local // t.grad_accum
    print0(
        f"{cfg.model.kind}: {n_params / 1e6:.2f}M parameters, {cfg.model.n_layer} layers x "
        f"{cfg.model.d_model}, seq_len {n}; order {cfg.order.kind}; {env.world_size} process(es) "
        f"on {device}, dtype {t.dtype}; batch {B} = {env.world_size} x {t.grad_accum} x {micro}"
        + (" (compiled)" if use_compile(cfg, device) else "")
        + (" (dry run: one micro-batch of at most 2)" if dry_run else "")
    )
    if dry_run:
        micro = min(micro, 2)
    print0(
        f"data: {data.num_blocks('train'):,} train / {data.num_blocks('val'):,} val blocks, "
        f"{data.bytes_per_token('train'):.3f} bytes/token ({data.path})"
    )
    unigram = None
    if env.is_main and data.num_blocks("train") * n <= 5 * 10**8:  # cheap enough to count
        unigram = unigram_bits_per_byte(data)

    def one_step(step: int, rows: int | None = None) -> float:
        """One optimizer step; returns the mean loss over the global batch."""
        lr = lr_at(step, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        idx = sampler.next_indices()
        if rows is not None:
            idx = idx[:rows]
        x = data.batch("train", idx).to(device, non_blocking=True)  # (local, n)
        if cfg.model.kind == "gpt":
            order = blocks = None
        else:
            ordering = order_sampler(B, n, step, order_gen)  # the global batch's orders
            order = ordering.order[env.rank :: env.world_size][: len(idx)].to(device)
            mb = ordering.model_blocks
            blocks = None if mb is None else mb[env.rank :: env.world_size][: len(idx)].to(device)
        accum = max(1, math.ceil(len(idx) / micro))
        total = torch.zeros((), device=device)  # the mean loss, checked before the update
        for a in range(accum):
            sl = slice(a * micro, (a + 1) * micro)
            last = a == accum - 1
            if fsdp:
                model.set_requires_gradient_sync(last)
                sync: contextlib.AbstractContextManager = contextlib.nullcontext()
            elif env.distributed and not last:
                sync = train_module.no_sync()
            else:
                sync = contextlib.nullcontext()
            with sync:
                with autocast:
                    loss = train_module(
                        x[sl],
                        None if order is None else order[sl],
                        None if blocks is None else blocks[sl],
                        loss_gen,
                    )
                (loss / accum).backward()
            total += loss.detach() / accum
        if env.distributed:  # every rank sees the same mean, so all skip a bad update alike
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        value = float(total)
        if not math.isfinite(value):  # no update: the weights stay the last good ones
            opt.zero_grad(set_to_none=True)
            return value
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(step)
        return value

    def evaluate_now(
        batches: int, bs: int, orders: int = VAL_ORDERS, mdm_rows: int = MDM_L2R_ROWS
    ) -> dict[str, float]:
        with ema.swapped() if ema is not None else contextlib.nullcontext():
            return validate(
                model,
                data,
                cfg,
                device,
                batches=batches,
                batch_size=bs,
                num_orders=orders,
                autocast=autocast,
                mdm_l2r_rows=mdm_rows,
            )

    if dry_run:
        loss = one_step(0, rows=micro)
        val = evaluate_now(1, 1, orders=1, mdm_rows=1) if data.num_blocks("val") else {}
        print0(
            f"dry run: one step done, loss {loss:.4f} nats/token; {_fmt_val(val)}; nothing written"
        )
        return {
            "dry_run": True,
            "run_dir": str(run_dir),
            "step": 1,
            "loss": loss,
            "params": n_params,
            "vocab_size": cfg.model.vocab_size,
            "val": val,
            "unigram_bpb": unigram,
            "elapsed_s": time.perf_counter() - t0,
        }

    # ---- the run folder exists from here on
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(run_dir / "config.yaml", _yaml(cfg))
    log = MetricsLog(run_dir, env.is_main, step if resume_from is not None else None, t.seed)
    bar: Any = None  # opened once the horizon is known (after the fit to a time limit)
    to_bpb = 1.0 / (math.log(2) * data.bytes_per_token("train"))  # nats/token -> bits/byte

    def open_bar(total: int, initial: int) -> Any:
        from anyorder.progress import progress as progress_bar

        show = progress and env.is_main
        return progress_bar(total=total, initial=initial, desc="train", unit="steps", enabled=show)

    def say(msg: str) -> None:
        """A message on stdout (above the bar on a terminal; progress lines go to stderr)."""
        if not env.is_main:
            return
        if bar is not None and not isinstance(bar, LineProgress):  # tqdm on a terminal
            bar.write(msg)
        else:
            print(msg, flush=True)

    def snapshot() -> dict[str, Any]:
        """What a step advances (the data cursor, the torch generators), taken before each
        step so that a NaN step can be saved as the state after the last good one. (The
        python and numpy RNGs are not drawn from in a step.) A few microseconds."""
        snap = {
            "sampler": sampler.state_dict(),
            "order_generator": order_gen.get_state(),
            "torch": torch.get_rng_state(),
            "loss_generator": loss_gen.get_state(),
        }
        if device.type == "cuda":
            snap["cuda"] = torch.cuda.get_rng_state(device)
        return snap

    def save(step: int, before: dict[str, Any] | None = None) -> Path | None:
        rng = rng_state(loss_gen, device)
        now = {"sampler": sampler.state_dict(), "order_generator": order_gen.get_state()}
        if before is not None:
            now = before
            rng.update({k: before[k] for k in ("torch", "loss_generator", "cuda") if k in before})
        fs = full_model_state(model, fsdp)
        ema_sd = None
        if ema is not None:
            with ema.swapped():
                ema_sd = full_model_state(model, fsdp)
        opt_sd = optimizer_state(model, opt, fsdp)
        rngs = _gather_objects(rng, env)
        path = None
        if env.is_main:
            state = {
                "step": step,
                "tokens_seen": tokens_seen,
                "optimizer": opt_sd,
                "scheduler": {"kind": "warmup_cosine", "step": step, "lr": lr_at(step, cfg)},
                "sampler": now["sampler"],
                "order_generator": now["order_generator"],
                "rng": rngs,
                "world_size": env.world_size,
            }
            path = ckpt_mod.save_checkpoint(
                run_dir,
                step,
                model=fs,
                config=cfg,
                tokenizer=data.tokenizer,
                ema=ema_sd,
                state=state,
                aliases=aliases,
            )
        _barrier(env)
        return path

    tokens_per_step = B * n
    val: dict[str, float] = {}
    last_ckpt: Path | None = ckpt_mod.latest_checkpoint(run_dir) if resume_from else None
    loss = float("nan")
    train_time = 0.0  # seconds spent in optimizer steps (not evaluation or saving)
    window_time, window_steps = 0.0, 0
    tok_s = 0.0
    start_step = step
    timing: list[float] = []
    loop_t0 = time.perf_counter()
    end = t.steps if stop_at is None else min(t.steps, stop_at)
    if step >= end:
        print0(
            f"{run_dir} is already at step {step} of {end}: nothing to train (raise "
            "train.steps to go on from there, or pick another train.out_dir)"
        )
    if time_limit_s is None:
        bar = open_bar(end, step)
    skipped = 0
    stop = _StopSignals()
    try:
        stop.install()
        while step < end:
            s0 = time.perf_counter()
            before = None if t.skip_nonfinite else snapshot()
            loss = one_step(step)
            if not math.isfinite(loss) and not t.skip_nonfinite:
                # The update was not applied: save the state after the last good step (with
                # the data cursor and RNGs of that moment), then stop.
                saved = last_ckpt if _step_of(last_ckpt) == step else save(step, before)
                where = f"; the state after step {step} is in {saved}" if saved else ""
                raise TrainingError(
                    f"loss is {loss} at step {step + 1}{where}; lower train.lr and resume with "
                    "--resume, or set train.skip_nonfinite=true to skip such steps"
                )
            if not math.isfinite(loss):
                skipped += 1
                say(f"step {step + 1}: loss is {loss}; update skipped (train.skip_nonfinite)")
            step += 1
            tokens_seen += tokens_per_step
            dt = time.perf_counter() - s0
            train_time += dt
            window_time += dt
            window_steps += 1
            timing.append(dt)
            if len(timing) == ESTIMATE_AFTER or (step == end and len(timing) < ESTIMATE_AFTER):
                # The steps after the first (which pays for allocation) set the estimate and,
                # with a time limit, the horizon: fitted once, so the schedule and the bar's
                # total never move again; 10% of what is left is kept for evaluation and saving.
                per = float(np.median(timing[1:] or timing))
                if time_limit_s is not None:
                    left = time_limit_s - (time.perf_counter() - loop_t0)
                    fit = min(t.steps, step + max(1, int(0.9 * left / per)))
                    fit = _from_rank0(fit, env)
                    if fit != t.steps:
                        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, steps=fit))
                        t = cfg.train
                        end = t.steps if stop_at is None else min(t.steps, stop_at)
                        say(f"time limit {time_limit_s:.0f} s: train.steps set to {fit}")
                    bar = open_bar(end, step - 1)  # this step is counted just below
                if env.is_main and end > step:
                    evals = _evaluations(step, end, t.eval_every)
                    estimate(
                        f"train: {end - step:,} more steps and {evals} validation(s)",
                        end - step,
                        per,
                        unit="steps",
                        stream=sys.stdout,
                    )
            if bar is not None:
                bar.update(1)
            if t.log_every and (step % t.log_every == 0 or step == end):
                tok_s = tokens_per_step * window_steps / max(window_time, 1e-9)
                window_time, window_steps = 0.0, 0
                log.write(
                    {
                        "step": step,
                        "loss": loss,
                        "lr": lr_at(step - 1, cfg),
                        "tokens_per_s": tok_s,
                        "elapsed_s": time.perf_counter() - t0,
                    }
                )
                if bar is not None:
                    bar.set_postfix_str(
                        f"loss {loss:.3f} nats/token = {loss * to_bpb:.3f} bits/byte, "
                        f"{tok_s:,.0f} tokens/s"
                    )
            if time_limit_s is not None and step < end:
                # Every rank stops at the same step: rank 0's clock decides.
                over = int(time.perf_counter() - loop_t0 >= time_limit_s)
                if _from_rank0(over, env):
                    say(f"time limit reached at step {step}")
                    end = step
            final = step >= end
            if (t.eval_every and step % t.eval_every == 0) or final:
                val = evaluate_now(t.eval_batches, micro)
                log.write({"step": step, **val})
                say(f"step {step}: loss {loss:.4f} nats/token; {_fmt_val(val, unigram)}")
            if (t.ckpt_every and step % t.ckpt_every == 0) or final:
                last_ckpt = save(step) or last_ckpt
            if not final and stop.agreed(env):
                # SIGINT/SIGTERM: save where we are and leave cleanly (resume continues).
                if _step_of(last_ckpt) != step:
                    last_ckpt = save(step) or last_ckpt
                say(f"{stop.name}: stopped at step {step}; checkpoint {last_ckpt}")
                break
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
        log.close()
    elapsed = time.perf_counter() - t0
    done = step - start_step
    summary = {
        "dry_run": False,
        "run_dir": str(run_dir),
        "step": step,
        "steps_run": done,
        "loss": loss,
        "tokens_per_s": tokens_per_step * done / train_time if done else 0.0,
        "train_time_s": train_time,
        "elapsed_s": elapsed,
        "params": n_params,
        "vocab_size": cfg.model.vocab_size,
        "val": val,
        "unigram_bpb": unigram,
        "checkpoint": str(last_ckpt) if last_ckpt else None,
        "world_size": env.world_size,
        "seed": t.seed,
        "skipped_steps": skipped,
        "interrupted": stop.name,
        "config": to_dict(cfg),
    }
    if env.is_main:
        _write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


# ----------------------------------------------------------------------------- helpers


def _step_of(ckpt: Path | None) -> int | None:
    m = ckpt_mod._NAME.match(ckpt.name) if ckpt is not None else None
    return int(m.group(1)) if m else None


class _StopSignals:
    """SIGINT and SIGTERM ask the loop to save and stop after the current step.

    The handlers only record the signal (printing from a handler can re-enter a write);
    the loop checks between steps. A second signal stops at once (KeyboardInterrupt).
    Handlers are installed only in the main thread, and the previous ones are restored.
    """

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.received: list[int] = []
        self.name: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received.append(signum)

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def agreed(self, env: DistEnv) -> bool:
        """Whether any rank got a signal (every rank must call, every step)."""
        flag = self.received[0] if self.received else 0
        if env.distributed:
            t = torch.tensor([flag], dtype=torch.long, device=env.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        if flag:
            self.name = signal.Signals(flag).name
        return bool(flag)


def _from_rank0(value: int, env: DistEnv) -> int:
    """Rank 0's ``value`` on every rank (decisions taken from one clock)."""
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long, device=env.device)
    dist.broadcast(t, 0)
    return int(t.item())


def _load_into(model: nn.Module, path: Path, fsdp: bool) -> None:
    if not fsdp:
        ckpt_mod.load_weights(model, path)
        return
    from safetensors.torch import load_file

    state = load_file(str(path))
    for alias, canonical in ckpt_mod.tied_aliases(model).items():
        state.setdefault(alias, state[canonical])
    set_full_model_state(model, state, fsdp)


def _fmt_val(val: dict[str, float], unigram: float | None = None) -> str:
    if not val:
        return "no validation"
    parts = [f"validation left to right {val['val/l2r_bpb']:.4f}"]
    if "val/ao_bpb" in val:
        parts.append(f"any order {val['val/ao_bpb']:.4f} ± {val['val/ao_bpb_se']:.4f}")
    if unigram is not None:
        parts.append(f"unigram baseline {unigram:.4f}")
    return ", ".join(parts) + " bits/byte"


def _evaluations(step: int, end: int, every: int) -> int:
    """Validations a run from ``step`` to ``end`` makes (every ``every`` steps and at the end)."""
    count = (end // every - step // every) if every else 0
    return count + (0 if every and end % every == 0 else 1)


def _yaml(cfg: RunConfig) -> str:
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
