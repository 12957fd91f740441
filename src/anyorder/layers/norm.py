"""Normalisation: RMSNorm (ours) or LayerNorm (GPT-2 and sigma-GPT weights), chosen by
``model.norm``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.config import ModelConfig
from anyorder.layers import casts


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The configured normalisation layer (RMSNorm, or LayerNorm for GPT-2 weights)."""
    dim = dim or cfg.d_model
    if cfg.norm == "layernorm":
        return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)
    return RMSNorm(dim, eps=cfg.norm_eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain.

    Under bf16 autocast the input is bf16 and the gain fp32; ``F.rms_norm`` then falls back
    to its unfused implementation (with a warning per call), so the gain is cast to the
    input's dtype first, as the fused kernel wants (a no-op in fp32; in a decode, the cast
    it made once, ``layers/casts.py``).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), casts.gain(self.weight, x.dtype), self.eps)
