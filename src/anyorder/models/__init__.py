"""The four models behind one interface (see :mod:`anyorder.models.base`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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


@contextmanager
def _inits_off() -> Iterator[None]:
    """``torch.nn.init``'s functions, the ones the models' constructors call, return their
    tensor untouched for the duration (restored after, on error too)."""
    from torch.nn import init

    saved = {name: getattr(init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


__all__ = ["AOGPT", "ARMD", "GPT", "MDM", "MODELS", "AnyOrderLM", "build_model", "count_params"]
