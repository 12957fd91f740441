"""The transformer block, its MLP, the output head and the weight initialisation.

Design choices:

* Pre-norm blocks, optionally adaLN-modulated, with the gate centred on one so that zero
  modulation is the plain block (AO-GPT then starts exactly as a GPT).
* A padded vocabulary table keeps its padding rows (weights map one to one) but the head
  never predicts them.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.config import ModelConfig
from anyorder.layers import casts
from anyorder.layers.adaln import AdaLN, Modulation, TargetCondition
from anyorder.layers.attention import Attention, KVHook
from anyorder.layers.linear import Linear, linear
from anyorder.layers.masks import Mask, Packing
from anyorder.layers.norm import make_norm
from anyorder.layers.rope import Positions


class MLP(nn.Module):
    """GELU (the tanh approximation, as GPT-2, or exact: ``model.gelu``) or SwiGLU
    feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"
        hidden = cfg.mlp_hidden
        self.fc = Linear(cfg.d_model, (2 if self.swiglu else 1) * hidden, bias=cfg.bias)
        self.proj = Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.proj.residual = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.swiglu:
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        else:
            h = F.gelu(h, approximate=self.approximate)
        out = self.proj(h)
        return self.drop(out) if self.training and self.drop.p > 0 else out  # no call at p=0


class Block(nn.Module):
    """Pre-norm transformer block, optionally adaLN-modulated by a per-slot condition.

    With a condition ``c``: ``h += (1 + gate1) * Attn(norm(h) * (1 + scale1) + shift1)``,
    the same for the MLP. Our choice: the gate is centred on one (not on zero as in DiT), so
    that zero modulation is the plain block; AO-GPT then starts exactly as a GPT and can be
    initialised from GPT weights. ``model.adaln_gate_offset=false`` uses the raw gate
    (``h += gate1 * ...``), as the AO-GPT reference does.
    """

    def __init__(self, cfg: ModelConfig, cond_dim: int | None = None) -> None:
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.ada = None
        if cond_dim:
            ones = (1, 2, 4, 5) if cfg.adaln_gate_offset else (1, 4)  # scales (and gates)
            self.ada = AdaLN(cond_dim, cfg.d_model, 6, ones, zero=cfg.adaln_init == "zero")

    def forward(
        self,
        x: Tensor,
        pos: Positions,
        mask: Mask,
        cond: Tensor | TargetCondition | Modulation | None = None,
        kv: KVHook | None = None,
        packing: Packing | None = None,
        qpos: Positions = None,
    ) -> Tensor:
        if self.ada is None:
            x = x + self.attn(self.norm1(x), pos, mask, kv, packing, qpos)
            return x + self.mlp(self.norm2(x))
        # factors: mul = 1 + scale, gate = (1 +) gate (a Modulation: worked out beforehand)
        m = cond if isinstance(cond, Modulation) else Modulation(self.ada(cond))
        x = m.gate(2, x, self.attn(m.modulate(0, self.norm1(x)), pos, mask, kv, packing, qpos))
        return m.gate(5, x, self.mlp(m.modulate(3, self.norm2(x))))


class Head(Linear):
    """The output projection ``d -> V``. With a padded table (``model.padded_vocab``) it holds
    the padding rows (so that weights map one to one and a tied head stays the token table)
    but computes the logits of the first ``vocab_size`` ids only: padding ids are never
    predicted, so no sampler, score or loss can pick them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.d_model, cfg.table_vocab, bias=cfg.head_bias)
        self.used = cfg.vocab_size

    def forward(self, x: Tensor) -> Tensor:
        if self.used == self.out_features:
            return super().forward(x)
        weight, bias = casts.cast(self.weight), casts.cast(self.bias)  # a decode's casts
        bias = bias[: self.used] if bias is not None else None
        return linear(x, weight[: self.used], bias)  # views of the first rows: no copy


def init_normal(tensor: Tensor, std: float, cfg: ModelConfig) -> None:
    """N(0, std) in place, truncated at 3 std under ``model.init_truncate``."""
    if cfg.init_truncate and std > 0:
        nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std)
    else:
        nn.init.normal_(tensor, mean=0.0, std=std)


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """GPT-2 initialisation: N(0, std), residual projections scaled by 1/sqrt(2L), adaLN zero
    (unless ``model.adaln_init=normal``).

    A module may carry its own ``init_std`` (AO-GPT's target embedding, read through SiLU by
    a zero-initialised adaLN, starts at unit scale so that the modulation can grow quickly).
    """
    std = cfg.init_std
    for m in module.modules():
        if isinstance(m, nn.Linear):
            if getattr(m, "zero_init", False):
                nn.init.zeros_(m.weight)
            else:
                s = std / math.sqrt(2 * cfg.n_layer) if getattr(m, "residual", False) else std
                init_normal(m.weight, s, cfg)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            init_normal(m.weight, getattr(m, "init_std", std), cfg)
