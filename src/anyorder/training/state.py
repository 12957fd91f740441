"""What a run is made of and what a checkpoint keeps of it: the schedule, EMA, RNGs, resume.

Design choices:

* :class:`RunParts` holds the objects set-up builds (model, wrapper, optimizer, EMA, the
  generators, the data cursor), so that each phase of the loop is a function of it.
* Exact resume: a checkpoint holds model, EMA, optimizer, step, the data cursor and every
  RNG (torch, CUDA, python, numpy, the order generator, the per-rank loss generator). The
  learning rate is a pure function of the step (no scheduler object to save). ``2N`` steps
  straight and ``N`` + resume + ``N`` give the same bits on the CPU.
* EMA weights are a shadow list beside the parameters, swapped in for evaluation and saving;
  validation reports the EMA model when EMA is on.
* A step whose loss is not finite is not applied; the state saved for it is the one taken
  before the step (:func:`snapshot`), so the checkpoint is the state after the last good one.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from anyorder import checkpoint as ckpt_mod
from anyorder.config import RunConfig
from anyorder.errors import CheckpointError
from anyorder.orders import OrderSampler
from anyorder.training.distributed import (
    DistEnv,
    barrier,
    full_model_state,
    gather_objects,
    load_optimizer_state,
    load_weights_into,
    optimizer_state,
    print0,
)

if TYPE_CHECKING:
    from anyorder.data import BlockSampler, TokenData


def lr_at(step: int, cfg: RunConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up, then cosine to min_lr_ratio."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class EMA:
    """Exponential moving average of the parameters, kept in fp32 beside them."""

    def __init__(self, params: list[Tensor], decay: float, warmup: bool) -> None:
        self.params = params
        self.decay = decay
        self.warmup = warmup
        self.shadow = [p.detach().clone().float() for p in params]

    def decay_at(self, step: int) -> float:
        """Decay of the update after step ``step`` (0-based). Warm-up ramps it as the AO-GPT
        reference's EMA does (``ema.py``: the ``u``-th update, ``u = step + 1``, decays by
        ``min(decay, (1 + u) / (10 + u))``), from 2/11."""
        if not self.warmup:
            return self.decay
        u = step + 1
        return min(self.decay, (1 + u) / (10 + u))

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


@dataclass
class RunParts:
    """The objects of one run, built by :func:`anyorder.training.setup.build_parts`.

    Identical on every rank but for the loss generator, the torch RNG and the sampler's rank.
    ``cfg`` is the run's config; a time limit may lower its ``train.steps`` once (the
    schedule, the checkpoints and the summary then see the fitted horizon).
    """

    cfg: RunConfig
    env: DistEnv
    data: TokenData
    model: nn.Module
    train_module: nn.Module  # what a micro-step calls: the loss wrapper, maybe under DDP
    opt: torch.optim.Optimizer
    params: list[Tensor]  # the trainable parameters (clipped, averaged by EMA)
    ema: EMA | None
    order_sampler: OrderSampler
    order_gen: torch.Generator  # the global batch's orders: the same on every rank
    loss_gen: torch.Generator  # the encoder's mask levels: per rank
    sampler: BlockSampler
    autocast: contextlib.AbstractContextManager
    fsdp: bool
    aliases: dict[str, str]  # tied weights, for the checkpoint's safetensors file
    n_params: int
    micro: int  # rows per micro-step on this rank
    base: dict[str, str] | None = None  # a LoRA run's base: its folder and state_digest
    adapters: frozenset[str] | None = None  # a LoRA run's adapter keys: what it saves


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


def snapshot(parts: RunParts) -> dict[str, Any]:
    """What a step advances (the data cursor, the torch generators), taken before each step
    so that a NaN step can be saved as the state after the last good one. (The python and
    numpy RNGs are not drawn from in a step.) A few microseconds."""
    device = parts.env.device
    snap = {
        "sampler": parts.sampler.state_dict(),
        "order_generator": parts.order_gen.get_state(),
        "torch": torch.get_rng_state(),
        "loss_generator": parts.loss_gen.get_state(),
    }
    if device.type == "cuda":
        snap["cuda"] = torch.cuda.get_rng_state(device)
    return snap


def save_state(
    parts: RunParts,
    run_dir: Path,
    step: int,
    tokens_seen: int,
    before: dict[str, Any] | None = None,
) -> Path | None:
    """Write the checkpoint of ``step`` (every rank calls; rank 0 writes and gets its path).

    ``before`` is a :func:`snapshot` whose data cursor and generators stand in for the
    current ones (the state before a step that was not applied).
    """
    env, model, fsdp, ema = parts.env, parts.model, parts.fsdp, parts.ema
    rng = rng_state(parts.loss_gen, env.device)
    now = {"sampler": parts.sampler.state_dict(), "order_generator": parts.order_gen.get_state()}
    if before is not None:
        now = before
        rng.update({k: before[k] for k in ("torch", "loss_generator", "cuda") if k in before})
    fs = _saved(full_model_state(model, fsdp), parts.adapters)
    ema_sd = None
    if ema is not None:
        with ema.swapped():
            ema_sd = _saved(full_model_state(model, fsdp), parts.adapters)
    opt_sd = optimizer_state(model, parts.opt, fsdp)
    rngs = gather_objects(rng, env)
    path = None
    if env.is_main:
        state = {
            "step": step,
            "tokens_seen": tokens_seen,
            "optimizer": opt_sd,
            "scheduler": {"kind": "warmup_cosine", "step": step, "lr": lr_at(step, parts.cfg)},
            "sampler": now["sampler"],
            "order_generator": now["order_generator"],
            "rng": rngs,
            "world_size": env.world_size,
        }
        path = ckpt_mod.save_checkpoint(
            run_dir,
            step,
            model=fs,
            config=parts.cfg,
            tokenizer=parts.data.tokenizer,
            ema=ema_sd,
            state=state,
            aliases=parts.aliases,
            base=parts.base,
        )
    barrier(env)
    return path


def _saved(state: dict[str, Tensor], adapters: frozenset[str] | None) -> dict[str, Tensor]:
    """What a checkpoint keeps of the weights: all of them, or a LoRA run's adapters (its
    base is named in the manifest, not copied)."""
    return state if adapters is None else {k: v for k, v in state.items() if k in adapters}


def restore_state(parts: RunParts, resume_from: Path) -> tuple[int, int]:
    """Load a checkpoint into the run's objects; returns its step and tokens seen.

    Raises:
        CheckpointError: a checkpoint without EMA weights for a run that keeps them, or files
            that do not match its manifest.
    """
    env, model, fsdp, ema = parts.env, parts.model, parts.fsdp, parts.ema
    state = ckpt_mod.read_state(resume_from)
    if parts.adapters is not None:
        ckpt_mod.check_base(resume_from, parts.base)
    listed = ckpt_mod.verify(resume_from, [ckpt_mod.MODEL_FILE, ckpt_mod.EMA_FILE])["files"]
    if ema is not None:
        if ckpt_mod.EMA_FILE not in listed:  # never load an EMA file nothing vouches for
            raise CheckpointError(
                f"{resume_from} has no EMA weights but train.ema={parts.cfg.train.ema}; resume "
                "with train.ema=0 or start a new run"
            )
        load_weights_into(model, resume_from / ckpt_mod.EMA_FILE, fsdp, parts.adapters)
        ema.load_from_params()
    load_weights_into(model, resume_from / ckpt_mod.MODEL_FILE, fsdp, parts.adapters)
    try:
        load_optimizer_state(model, parts.opt, state["optimizer"], fsdp)
        step = int(state["step"])
        tokens_seen = int(state.get("tokens_seen", 0))
        parts.sampler.load_state_dict(state["sampler"])
        parts.order_gen.set_state(state["order_generator"])
        rngs = state["rng"]
        if len(rngs) == env.world_size:
            set_rng_state(rngs[env.rank], parts.loss_gen, env.device)
        else:  # another number of processes: exact only for the shared generators
            print0(f"resuming {len(rngs)} process(es) as {env.world_size}: per-rank RNGs reseeded")
    except (
        KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, OverflowError,
    ) as e:  # fmt: skip
        # keys of the right names holding the wrong content: an edited or foreign state.pt
        # (int() of an infinity is an OverflowError)
        raise CheckpointError(
            f"{resume_from / ckpt_mod.STATE_FILE} is damaged ({type(e).__name__}: "
            f"{str(e).strip()[:120]}); delete {resume_from} and use an earlier checkpoint"
        ) from None
    print0(f"resuming from {resume_from} at step {step}")
    return step, tokens_seen
