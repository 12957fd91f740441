"""Processes: one code path for one process and for ``torchrun``, and the state that spans ranks.

Design choices:

* Rank and world size come from the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
  or from a process group the caller already initialised; the backend is NCCL on CUDA and
  gloo on the CPU. A failed rendezvous is one line (c10d's C++ retry logs are held back and
  dropped), its wait bounded by :data:`DIST_TIMEOUT_ENV`.
* DDP by default; FSDP2 ``fully_shard`` when ``train.fsdp`` (imported only then). The loss
  goes through a small wrapper module's ``__call__`` (``setup.LossModule``), so DDP's hooks
  see every forward, including the encoder's ELBO that never calls ``forward``. Under FSDP
  the model is the root unit (``denoise`` registered as a second entry point for the
  encoder) and each block entered through its own ``__call__`` is a unit; ARMD's two-stream
  blocks stay in the root unit because the two-stream layer reaches into their submodules,
  and AO-GPT's blocks are sharded as attention and MLP, their adaLN in the root, because the
  joined adaLN reads every block's adaLN weights at once (:func:`fsdp_units`).
* Checkpoints hold full (unsharded) state dicts: under FSDP every rank takes part in
  gathering them to the CPU and only rank 0 writes.
* Only rank 0 writes (metrics, config): its write error is broadcast at the next point every
  rank reaches (:func:`raise_rank0_error`), so every rank stops with its line instead of
  waiting at a collective rank 0 never joins.
* Decisions taken from a clock (the time limit, the fitted horizon) are rank 0's, broadcast
  with :func:`from_rank0`, so every rank stops at the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from anyorder import checkpoint as ckpt_mod
from anyorder.config import RunConfig
from anyorder.errors import AnyorderError, ConfigError, preview
from anyorder.precision import use_bf16

DIST_TIMEOUT_ENV = "ANYORDER_DIST_TIMEOUT_S"
"""Seconds to wait for the torchrun rendezvous and for collectives (default 1800)."""


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
    shown = preview(name)  # a user's value, perhaps of 100,000 characters
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"{what}={shown} but CUDA is not available here; use cpu or auto")
        try:
            dev = torch.device(f"cuda:{local_rank}") if name == "cuda" else torch.device(name)
        except RuntimeError:
            raise ConfigError(f"{what}={shown} is not a device; use cuda or cuda:N") from None
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{what}={shown} but this machine has {torch.cuda.device_count()} GPU(s); "
                "use cuda or a smaller index"
            )
        return dev
    raise ConfigError(f"{what}={shown} is not a device; use auto, cpu, cuda or cuda:N")


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


def barrier(env: DistEnv) -> None:
    """Wait for every rank (nothing to do alone)."""
    if env.distributed:
        dist.barrier()


def gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def from_rank0(value: int, env: DistEnv) -> int:
    """Rank 0's ``value`` on every rank (decisions taken from one clock)."""
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.long, device=env.device)
    dist.broadcast(t, 0)
    return int(t.item())


def raise_rank0_error(error: AnyorderError | None, env: DistEnv) -> None:
    """Raise rank 0's ``error`` (a write that failed there: only rank 0 writes) on every
    rank, with its message, so no rank waits at the next collective for a rank 0 that left.
    Every rank calls this at the same point; it costs one broadcast of a flag, and one of
    the message when there is an error.

    Raises:
        AnyorderError: rank 0's error (its class and message), on every rank.
    """
    if env.distributed:
        failed = from_rank0(int(error is not None), env)
        if not failed:
            return
        box: list[Any] = [(type(error).__name__, str(error)) if error is not None else None]
        dist.broadcast_object_list(box, src=0)
        if error is None:
            from anyorder import errors

            name, message = box[0]
            cls = getattr(errors, name, AnyorderError)
            error = (
                cls(message)
                if isinstance(cls, type) and issubclass(cls, AnyorderError)
                else AnyorderError(message)
            )
    if error is not None:
        raise error


# ----------------------------------------------------------------------------- wrapping


def is_fsdp(cfg: RunConfig, env: DistEnv) -> bool:
    """Whether this run shards its model (``train.fsdp`` under more than one process)."""
    return cfg.train.fsdp and env.distributed


def fsdp_units(model: nn.Module, cfg: RunConfig) -> list[nn.Module]:
    """The modules FSDP2 shards as units of their own, below the model (the root unit).

    A unit's weights are whole only inside its own ``__call__`` (FSDP's hooks unshard
    there), so a module whose weights are read from outside stays in the root unit:
    ARMD's two-stream layers reach into their blocks' submodules (those blocks stay whole
    in the root), and AO-GPT's joined adaLN reads every block's adaLN linear in one matmul
    before any block runs (there each block's attention and MLP are the units, its adaLN
    and norms stay in the root).
    """
    first = getattr(model, "l2s", 0) if cfg.model.kind == "armd" else 0
    units: list[nn.Module] = []
    for block in list(model.blocks)[first:]:
        if getattr(block, "ada", None) is None:
            units.append(block)
        else:
            units += [block.attn, block.mlp]
    return units


def wrap_model(model: nn.Module, wrapper: nn.Module, cfg: RunConfig, env: DistEnv) -> nn.Module:
    """The module the training step calls: ``wrapper`` (the loss over ``model``) alone, under
    DDP, or over a model sharded in place by FSDP2 (see the module docstring)."""
    device = env.device
    if is_fsdp(cfg, env):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = use_bf16(cfg.train.dtype, device, cfg.model.d_model)
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
        )
        for unit in fsdp_units(model, cfg):
            fully_shard(unit, mp_policy=mp)
        # The model itself is the root unit, so validation (which calls the model, not the
        # loss wrapper) unshards it too; token_nll (trunk and head in chunks, not through
        # forward) and the encoder's denoise() are entry points as well.
        fully_shard(model, mp_policy=mp)
        from torch.distributed.fsdp import register_fsdp_forward_method

        for entry in ("token_nll", "denoise") if cfg.model.kind == "mdm" else ("token_nll",):
            register_fsdp_forward_method(model, entry)
        return wrapper
    if env.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(wrapper, device_ids=[device.index] if device.type == "cuda" else None)
    return wrapper


# ----------------------------------------------------------------------------- full state


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


def load_weights_into(
    model: nn.Module, path: Path, fsdp: bool, adapters: frozenset[str] | None = None
) -> None:
    """Load a checkpoint's safetensors file into ``model`` (sharded or not): every weight,
    or a LoRA run's ``adapters`` alone (the base stays as it is)."""
    if adapters is not None:
        state = ckpt_mod.read_adapters(model, path)
        if not fsdp:
            model.load_state_dict({**model.state_dict(), **state}, strict=True)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, state, options=opts)
        return
    if not fsdp:
        ckpt_mod.load_weights(model, path)
        return
    from safetensors.torch import load_file

    state = load_file(str(path))
    for alias, canonical in ckpt_mod.tied_aliases(model).items():
        state.setdefault(alias, state[canonical])
    set_full_model_state(model, state, fsdp)
