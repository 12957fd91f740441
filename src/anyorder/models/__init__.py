"""The four models behind one interface (see :mod:`anyorder.models.base`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from anyorder.config import ModelConfig
from anyorder.memory import check_model_memory
from anyorder.models.aogpt import AOGPT
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.models.gpt import GPT
from anyorder.models.mdm import MDM

MODELS: dict[str, type[AnyOrderLM]] = {"gpt": GPT, "aogpt": AOGPT, "armd": ARMD, "mdm": MDM}


def build_model(cfg: ModelConfig, *, init: bool = True) -> AnyOrderLM:
    """The model of kind ``cfg.kind`` (on the CPU, fp32), freshly initialised, or with
    ``init=False`` its weights left as allocated (not initialised) for a caller that loads
    every one of them: a checkpoint or an export (a 1.2B model's random initialisation is
    seconds of a load that replaces it). Buffers (position tables) are computed either way.

    Raises:
        ConfigError: its weights and tables cannot fit in this machine's memory
            (:func:`anyorder.memory.check_model_memory`; nothing is allocated then).
    """
    check_model_memory(cfg)
    if init:
        return MODELS[cfg.kind](cfg)
    with _inits_off():
        return MODELS[cfg.kind](cfg)


_INITS = (
    "normal_",
    "zeros_",
    "ones_",
    "uniform_",
    "constant_",
    "trunc_normal_",
    "kaiming_uniform_",
)


def count_params(cfg: ModelConfig) -> int:
    """The parameter count of the model ``cfg`` describes, in milliseconds at any size.

    The model is built on the meta device (shapes, no memory) with ``torch.nn.init``
    switched off for the duration: initialising a meta tensor goes through PyTorch's
    reference decompositions, which import ``torch._dynamo`` (seconds).
    """
    import torch

    with _inits_off(), torch.device("meta"):
        return MODELS[cfg.kind](cfg).num_params()  # meta tensors: no memory to check


_INITS_LOCK = threading.Lock()
_inits_saved: dict[str, Any] = {}  # torch.nn.init's own functions while ours stand in
_inits_users = 0  # _inits_off contexts open, all threads together
_inits_local = threading.local()  # .off: this thread's open _inits_off contexts


@contextmanager
def _inits_off() -> Iterator[None]:
    """``torch.nn.init``'s functions, the ones the models' constructors call, return their
    tensor untouched for the duration, in this thread only (restored after, on error too).

    Other threads draw as usual meanwhile, and the originals come back when the last open
    context in any thread closes: each thread saving and restoring the module's functions
    itself left them switched off for good when two loads overlapped (the first to finish
    restored the originals, the second the no-ops it had saved), and every model built later
    in the process kept the uninitialised memory it was allocated (seen: NaN weights).
    """
    from torch.nn import init

    global _inits_users
    with _INITS_LOCK:
        if _inits_users == 0:
            _inits_saved.update({name: getattr(init, name) for name in _INITS})
            for name, fn in _inits_saved.items():
                setattr(init, name, _skipped_here(fn))
        _inits_users += 1
    _inits_local.off = getattr(_inits_local, "off", 0) + 1
    try:
        yield
    finally:
        _inits_local.off -= 1
        with _INITS_LOCK:
            _inits_users -= 1
            if _inits_users == 0:
                for name, fn in _inits_saved.items():
                    setattr(init, name, fn)
                _inits_saved.clear()


def _skipped_here(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, but a no-op returning its tensor in a thread inside :func:`_inits_off`."""

    @functools.wraps(fn)
    def init_fn(tensor, *args, **kwargs):
        if getattr(_inits_local, "off", 0):
            return tensor
        return fn(tensor, *args, **kwargs)

    return init_fn


__all__ = ["AOGPT", "ARMD", "GPT", "MDM", "MODELS", "AnyOrderLM", "build_model", "count_params"]
