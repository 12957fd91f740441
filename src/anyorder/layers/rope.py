"""Positions of a permuted sequence: RoPE on explicit positions and sinusoidal embeddings.

Design choices:

* Every sequence the models see is *permuted*: slot ``t`` holds the token at original
  position ``pos[t]``. RoPE and learned position tables are therefore indexed by the given
  positions, never by ``arange`` (that is what makes the models permutation-equivariant).
* RoPE tables of positions ``0..seq_len-1`` are computed once per (size, head_dim, base,
  scaling, device) and kept; a forward looks up its positions' rows once
  (:func:`positions`) and every layer shares them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from anyorder.config import ModelConfig

RopeScale = tuple[str, float, float, float, int] | None
"""A RoPE scaling as :attr:`anyorder.config.ModelConfig.rope_scale` gives it: (kind,
factor, low_freq_factor, high_freq_factor, original_max_pos), or None for none."""


def inverse_frequencies(
    head_dim: int, base: float, scale: RopeScale = None, device: torch.device | None = None
) -> Tensor:
    """RoPE's (head_dim/2,) inverse frequencies ``base ** (-2i / head_dim)``, scaled.

    ``linear`` divides every frequency by the factor. ``llama3`` (Llama 3.1) divides those
    whose wavelength ``2 pi / f`` exceeds ``original_max_pos / low_freq_factor`` by the
    factor, keeps those below ``original_max_pos / high_freq_factor``, and between the two
    mixes both, ``(1 - s) f / factor + s f`` with ``s = (original_max_pos / wavelength -
    low) / (high - low)`` rising from 0 to 1 across the band.
    """
    half = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    inv_freq = base ** (-half / head_dim)
    if scale is None:
        return inv_freq
    kind, factor, low, high, original = scale
    if kind == "linear":
        return inv_freq / factor
    wavelength = 2 * math.pi / inv_freq
    s = (original / wavelength - low) / (high - low)
    scaled = (1 - s) * inv_freq / factor + s * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, scaled)
    return torch.where(wavelength < original / high, inv_freq, scaled)


def rope_angles(
    pos: Tensor, head_dim: int, base: float, scale: RopeScale = None
) -> tuple[Tensor, Tensor]:
    """cos and sin of RoPE for explicit positions ``pos`` (B, T) -> two (B, 1, T, head_dim/2)."""
    inv_freq = inverse_frequencies(head_dim, base, scale, pos.device)
    angles = pos.float()[..., None] * inv_freq  # (B, T, D/2)
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, H, T, D) by the angles of :func:`rope_angles` (half-split layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.type_as(x)


Rotary = tuple[Tensor, Tensor]
"""RoPE tables of :func:`rotary`: ``[cos, cos]`` and ``[-sin, sin]``, each (B, 1, T, D)."""
Positions = Tensor | Rotary | None
"""What attention takes as positions: (B, T) original positions, their :data:`Rotary`
tables (built once per forward by :func:`positions` and shared by every layer), or None."""


def rotary(pos: Tensor, head_dim: int, base: float, scale: RopeScale = None) -> Rotary:
    """RoPE tables for positions (B, T), laid out for :func:`rotate` (one multiply-add)."""
    cos, sin = rope_angles(pos, head_dim, base, scale)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


_HALF = (torch.bfloat16, torch.float16)


def rotate(x: Tensor, tables: Rotary) -> Tensor:
    """:func:`apply_rope` with :func:`rotary` tables in three kernels (a product, the halves
    swapped, a fused multiply-add), no angles recomputed per layer: the same numbers to
    within an ulp (``a + (-b)`` is ``a - b`` exactly; the multiply-add rounds once where
    :func:`apply_rope` rounds twice).
    A bf16 or fp16 ``x`` against fp32 tables (autocast) is not cast first: the products
    promote it to fp32 in their own kernels (exactly, as the cast would), one launch fewer
    (not under an autocast of another dtype: its ``cat`` refuses the input's)."""
    cos, sin = tables
    xf = x if _promoted(x, cos) else x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.addcmul(xf * cos, torch.cat([x2, x1], dim=-1), sin).type_as(x)


def _promoted(x: Tensor, cos: Tensor) -> bool:
    """Whether :func:`rotate` may leave the fp32 cast of ``x`` to its products."""
    if x.dtype not in _HALF or cos.dtype != torch.float32:
        return False
    device = x.device.type
    return not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) == x.dtype


def slice_positions(pos: Positions, start: int, stop: int) -> Positions:
    """Slots ``start:stop`` of :data:`Positions`."""
    if pos is None:
        return None
    if isinstance(pos, Tensor):
        return pos[:, start:stop]
    return pos[0][:, :, start:stop], pos[1][:, :, start:stop]


_ROTARY_TABLES: dict[tuple, Rotary] = {}


def rotary_table(
    size: int, head_dim: int, base: float, device: torch.device, scale: RopeScale = None
) -> Rotary:
    """:func:`rotary` of positions ``0..size-1``, each (size, head_dim); computed once per
    (size, head_dim, base, scaling, device) and kept: the same numbers, element by element."""
    key = (size, head_dim, base, scale, str(device))
    table = _ROTARY_TABLES.get(key)
    if table is None:
        cos, sin = rotary(torch.arange(size, device=device)[None], head_dim, base, scale)
        table = _ROTARY_TABLES[key] = (cos[0, 0], sin[0, 0])
    return table


_ROTARY_JOINT: dict[tuple, Tensor] = {}


def positions(cfg: ModelConfig, pos: Tensor) -> Positions:
    """What a model hands its layers for positions ``pos`` (B, T) (all below
    ``cfg.rope_rows``): their RoPE tables, looked up once per forward (cos and sin in one
    lookup), or the positions themselves when the model has no RoPE."""
    if cfg.positional != "rope":
        return pos
    key = (cfg.rope_rows, cfg.d_head, cfg.rope_base, cfg.rope_scale, str(pos.device))
    joint = _ROTARY_JOINT.get(key)
    if joint is None:
        table = rotary_table(*key[:3], pos.device, cfg.rope_scale)
        joint = _ROTARY_JOINT[key] = torch.cat(table, dim=-1)
    cos, sin = F.embedding(pos, joint)[:, None].chunk(2, dim=-1)
    return cos, sin


def sinusoidal(pos: Tensor, dim: int) -> Tensor:
    """Transformer sinusoidal embedding of integer positions (..., ) -> (..., dim)."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=pos.device) / half)
    angles = pos.float()[..., None] * freq
    emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
    return F.pad(emb, (0, dim - 2 * half))
