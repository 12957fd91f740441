"""The trunk every model shares: norms, RoPE, attention over a permuted sequence, MLPs, adaLN.

Design choices:

* Every sequence the models see is *permuted*: slot ``t`` holds the token at original
  position ``pos[t]``. RoPE and learned position tables are therefore indexed by the given
  positions, never by ``arange`` (that is what makes the models permutation-equivariant).
* Masks are boolean, ``True`` = may attend, shaped ``(B, 1, Tq, Tk)``; the plain causal case
  is passed as the string ``"causal"`` so that SDPA takes its ``is_causal`` fast path, and
  ``None`` means bidirectional. :func:`block_mask` builds the block-causal and block-strict
  masks from block ids.
* A row with nothing to attend to (the first block under a strict mask) gives a zero output
  on every backend: we let it attend to key 0 and multiply the result by zero, instead of
  relying on how a kernel treats a fully masked row.
* Attention is split into :meth:`Attention.project` and :meth:`Attention.attend` so that
  the two streams of ARMD and the KV cache reuse the same weights and code.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.config import ModelConfig

Mask = Tensor | str | None
KVHook = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # see anyorder.cache


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The configured normalisation layer (RMSNorm, or LayerNorm for GPT-2 weights)."""
    dim = dim or cfg.d_model
    if cfg.norm == "layernorm":
        return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)
    return RMSNorm(dim, eps=cfg.norm_eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


# ----------------------------------------------------------------------------- positions


def rope_angles(pos: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos and sin of RoPE for explicit positions ``pos`` (B, T) -> two (B, 1, T, head_dim/2)."""
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim
    )
    angles = pos.float()[..., None] * inv_freq  # (B, T, D/2)
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, H, T, D) by the angles of :func:`rope_angles` (half-split layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


def sinusoidal(pos: Tensor, dim: int) -> Tensor:
    """Transformer sinusoidal embedding of integer positions (..., ) -> (..., dim)."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=pos.device) / half)
    angles = pos.float()[..., None] * freq
    emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return F.pad(emb, (0, dim - 2 * half))


# ----------------------------------------------------------------------------- masks


def block_mask(blocks_q: Tensor, blocks_k: Tensor, strict: bool) -> Tensor:
    """Visibility by block id: query sees key iff B(key) <= B(query) (``<`` when strict).

    Args:
        blocks_q: (B, Tq) block id of each query slot.
        blocks_k: (B, Tk) block id of each key slot.
        strict: exclude the query's own block (strictly causal).

    Returns:
        (B, 1, Tq, Tk) boolean mask, True = may attend.
    """
    q = blocks_q[:, None, :, None]
    k = blocks_k[:, None, None, :]
    return k < q if strict else k <= q


def strict_causal_mask(n: int, device: torch.device | None = None) -> Tensor:
    """(1, 1, n, n) mask of ``key < query``: token-level strict causality."""
    idx = torch.arange(n, device=device)
    return (idx[None, :] < idx[:, None])[None, None]


# ----------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Multi-head self-attention with QK-norm and RoPE on given positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.rope = cfg.positional == "rope"
        self.rope_base = cfg.rope_base
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.residual = True  # scaled init
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.dropout = cfg.dropout

    def _heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def _rotate(self, x: Tensor, pos: Tensor | None) -> Tensor:
        if not self.rope:
            return x
        cos, sin = rope_angles(pos, self.head_dim, self.rope_base)
        return apply_rope(x, cos, sin)

    def project(self, x: Tensor, pos: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values (each (B, H, T, D)), normed and rotated to ``pos``."""
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        q = self._rotate(self.q_norm(self._heads(q)), pos)
        k = self._rotate(self.k_norm(self._heads(k)), pos)
        return q, k, self._heads(v)

    def project_q(self, x: Tensor, pos: Tensor | None) -> Tensor:
        """Queries only (the ARMD query stream reads the content stream's keys and values)."""
        d = x.shape[-1]
        bias = self.qkv.bias[:d] if self.qkv.bias is not None else None
        q = F.linear(x, self.qkv.weight[:d], bias)
        return self._rotate(self.q_norm(self._heads(q)), pos)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, empty: Tensor | bool | None = None
    ) -> Tensor:
        """SDPA of (B, H, Tq, D) queries over (B, H, Tk, D) keys/values, merged and projected.

        ``mask`` is ``"causal"`` (square only), ``None`` (all visible) or a boolean
        (B|1, 1, Tq, Tk) tensor; rows with no visible key give zeros. ``empty`` spares the
        host-device sync of looking for such rows (the KV-cache decoders know): ``False``
        promises there are none, a (B, 1, Tq, 1) tensor names them; ``None`` checks.
        """
        p = self.dropout if self.training else 0.0
        if isinstance(mask, str):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        elif mask is None or empty is False:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        else:
            if empty is None:
                empty = ~mask.any(dim=-1, keepdim=True)  # (B, 1, Tq, 1)
                fix = bool(empty.any())
            else:
                fix = True  # named by the caller: fix up without looking (no sync)
            if fix:
                first = torch.zeros_like(mask)
                first[..., 0] = True
                mask = mask | (empty & first)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
                y = y.masked_fill(empty, 0.0)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        B, H, T, D = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))

    def forward(
        self, x: Tensor, pos: Tensor | None, mask: Mask, kv: KVHook | None = None
    ) -> Tensor:
        """Self-attention; ``kv`` (a KV-cache hook) swaps the new keys/values for the cached
        ones plus the new, and then every query must see at least itself in ``mask``."""
        q, k, v = self.project(x, pos)
        if kv is None:
            return self.attend(q, k, v, mask)
        k, v = kv(k, v)
        return self.attend(q, k, v, mask, empty=False)


class MLP(nn.Module):
    """GELU (tanh approximation, as GPT-2) or SwiGLU feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            hidden = int(cfg.mlp_ratio * cfg.d_model * 2 / 3)
            hidden = 64 * math.ceil(hidden / 64)
            self.fc = nn.Linear(cfg.d_model, 2 * hidden, bias=cfg.bias)
        else:
            hidden = int(cfg.mlp_ratio * cfg.d_model)
            self.fc = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)
        self.proj.residual = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        if self.swiglu:
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        else:
            h = F.gelu(h, approximate="tanh")
        return self.drop(self.proj(h))


class AdaLN(nn.Module):
    """Modulation from a condition: ``Linear(SiLU(c)) -> chunks`` of width d, zero-initialised.

    Zero initialisation makes every shift, scale and gate zero, so a freshly built adaLN
    model computes exactly what the unconditioned trunk computes (see :func:`modulate`).
    """

    def __init__(self, cond_dim: int, d_model: int, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(cond_dim, chunks * d_model)
        self.linear.zero_init = True

    def forward(self, cond: Tensor) -> tuple[Tensor, ...]:
        return self.linear(F.silu(cond)).chunk(self.chunks, dim=-1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


class Block(nn.Module):
    """Pre-norm transformer block, optionally adaLN-modulated by a per-slot condition.

    With a condition ``c``: ``h += (1 + gate1) * Attn(norm(h) * (1 + scale1) + shift1)``,
    the same for the MLP. Our choice: the gate is centred on one (not on zero as in DiT), so
    that zero modulation is the plain block; AO-GPT then starts exactly as a GPT and can be
    initialised from GPT weights.
    """

    def __init__(self, cfg: ModelConfig, cond_dim: int | None = None) -> None:
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.ada = AdaLN(cond_dim, cfg.d_model, 6) if cond_dim else None

    def forward(
        self,
        x: Tensor,
        pos: Tensor | None,
        mask: Mask,
        cond: Tensor | None = None,
        kv: KVHook | None = None,
    ) -> Tensor:
        if self.ada is None:
            x = x + self.attn(self.norm1(x), pos, mask, kv)
            return x + self.mlp(self.norm2(x))
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(cond)
        x = x + (1 + gate1) * self.attn(modulate(self.norm1(x), shift1, scale1), pos, mask, kv)
        return x + (1 + gate2) * self.mlp(modulate(self.norm2(x), shift2, scale2))


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """GPT-2 initialisation: N(0, std), residual projections scaled by 1/sqrt(2L), adaLN zero."""
    std = cfg.init_std
    for m in module.modules():
        if isinstance(m, nn.Linear):
            if getattr(m, "zero_init", False):
                nn.init.zeros_(m.weight)
            else:
                s = std / math.sqrt(2 * cfg.n_layer) if getattr(m, "residual", False) else std
                nn.init.normal_(m.weight, mean=0.0, std=s)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
