"""The four models behind one interface (see :mod:`anyorder.models.base`)."""

from __future__ import annotations

from anyorder.config import ModelConfig
from anyorder.models.aogpt import AOGPT
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.models.gpt import GPT
from anyorder.models.mdm import MDM

MODELS: dict[str, type[AnyOrderLM]] = {"gpt": GPT, "aogpt": AOGPT, "armd": ARMD, "mdm": MDM}


def build_model(cfg: ModelConfig) -> AnyOrderLM:
    """The model of kind ``cfg.kind``, freshly initialised (on the CPU, fp32)."""
    return MODELS[cfg.kind](cfg)


__all__ = ["AOGPT", "ARMD", "GPT", "MDM", "MODELS", "AnyOrderLM", "build_model"]
