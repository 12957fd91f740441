"""The trunk every model shares: norms, RoPE, attention over a permuted sequence, MLPs, adaLN.

Design choices:

* Every sequence the models see is *permuted*: slot ``t`` holds the token at original
  position ``pos[t]``. RoPE and learned position tables are therefore indexed by the given
  positions, never by ``arange`` (that is what makes the models permutation-equivariant).
* Masks are boolean, ``True`` = may attend, shaped ``(B, 1, Tq, Tk)``; the plain causal case
  is passed as the string ``"causal"`` so that SDPA takes its ``is_causal`` fast path (it
  skips the masked half), the strictly causal one as ``"strict"`` (the same kernel on
  shifted queries and keys), and ``None`` means bidirectional. :func:`block_mask` builds the
  block-causal and block-strict masks from block ids; :func:`block_visibility` prepares a
  model's masks once per forward (:class:`PreparedMask`), for every layer.
* A row with nothing to attend to (the first block under a strict mask) gives a zero output
  on every backend: we let it attend to key 0 and multiply the result by zero, instead of
  relying on how a kernel treats a fully masked row.
* Attention is split into :meth:`Attention.project` and :meth:`Attention.attend` so that
  the two streams of ARMD and the KV cache reuse the same weights and code.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.config import ModelConfig
from anyorder.errors import ConfigError

Mask = Tensor | str | None  # or a PreparedMask (defined below)
KVHook = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # see anyorder.cache


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
    input's dtype first, as the fused kernel wants (a no-op in fp32).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


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


Rotary = tuple[Tensor, Tensor]
"""RoPE tables of :func:`rotary`: ``[cos, cos]`` and ``[-sin, sin]``, each (B, 1, T, D)."""
Positions = Tensor | Rotary | None
"""What attention takes as positions: (B, T) original positions, their :data:`Rotary`
tables (built once per forward by :func:`positions` and shared by every layer), or None."""


def rotary(pos: Tensor, head_dim: int, base: float) -> Rotary:
    """RoPE tables for positions (B, T), laid out for :func:`rotate` (one multiply-add)."""
    cos, sin = rope_angles(pos, head_dim, base)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: Tensor, tables: Rotary) -> Tensor:
    """:func:`apply_rope` with :func:`rotary` tables: the same numbers (``a + (-b)`` is
    ``a - b`` exactly in floating point), fewer kernels and no angles recomputed per layer."""
    cos, sin = tables
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([x2, x1], dim=-1) * sin).type_as(x)


def slice_positions(pos: Positions, start: int, stop: int) -> Positions:
    """Slots ``start:stop`` of :data:`Positions`."""
    if pos is None:
        return None
    if isinstance(pos, Tensor):
        return pos[:, start:stop]
    return pos[0][:, :, start:stop], pos[1][:, :, start:stop]


_ROTARY_TABLES: dict[tuple, Rotary] = {}


def rotary_table(size: int, head_dim: int, base: float, device: torch.device) -> Rotary:
    """:func:`rotary` of positions ``0..size-1``, each (size, head_dim); computed once per
    (size, head_dim, base, device) and kept: the same numbers, element by element."""
    key = (size, head_dim, base, str(device))
    table = _ROTARY_TABLES.get(key)
    if table is None:
        cos, sin = rotary(torch.arange(size, device=device)[None], head_dim, base)
        table = _ROTARY_TABLES[key] = (cos[0, 0], sin[0, 0])
    return table


_ROTARY_JOINT: dict[tuple, Tensor] = {}


def positions(cfg: ModelConfig, pos: Tensor) -> Positions:
    """What a model hands its layers for positions ``pos`` (B, T) (all below
    ``cfg.seq_len``): their RoPE tables, looked up once per forward (cos and sin in one
    lookup), or the positions themselves when the model has no RoPE."""
    if cfg.positional != "rope":
        return pos
    key = (cfg.seq_len, cfg.head_dim, cfg.rope_base, str(pos.device))
    joint = _ROTARY_JOINT.get(key)
    if joint is None:
        joint = _ROTARY_JOINT[key] = torch.cat(rotary_table(*key[:3], pos.device), dim=-1)
    cos, sin = F.embedding(pos, joint)[:, None].chunk(2, dim=-1)
    return cos, sin


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


@dataclass
class Packing:
    """The real slots of a padded (B, T) decoding call, run through the per-slot layers as
    one row of N.

    Per-row reveal counts pad most rows of a Lemma-1 pass to the row that reveals most; a
    matmul over the padding is wasted work. With a packing, embeddings, norms, adaLN, the
    projections and the MLP see the N real slots only; attention unpacks its queries, keys
    and values to (B, T) (zeros in the padding, which the mask hides) and packs its output.
    """

    index: Tensor
    """(N,) flat indices ``b * T + t`` of the real slots."""
    batch: int
    length: int

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (1, N, ...)."""
        return x.flatten(0, 1).index_select(0, self.index)[None]

    def unpack(self, x: Tensor) -> Tensor:
        """(1, N, F) -> (B, T, F), zeros in the padding."""
        out = x.new_zeros(self.batch * self.length, x.shape[-1])
        out.index_copy_(0, self.index, x[0])
        return out.view(self.batch, self.length, x.shape[-1])


@dataclass
class StreamPacking:
    """:class:`Packing` for ARMD's decoding call: its two-stream layers run ``C`` content rows
    and ``G`` query rows as one (B, C + G) batch, its other layers the query rows alone.
    Packed, the real content rows come first (``n_content`` of them), then the real query
    rows, so that slicing the packed row splits the streams."""

    rows: Packing
    """Both streams, (B, C + G), content rows first."""
    content: Packing
    """The content rows, (B, C), in the same order."""
    query: Packing
    """The query rows, (B, G), in the same order."""
    n_content: int


@dataclass
class PreparedMask:
    """A mask worked out once per forward (or decoding call) and shared by every layer.

    ``dense`` lets every row with nothing to see attend to key 0, ``empty`` names those rows
    (their output is zeroed), so no layer looks for them again; ``flex`` is the same
    visibility as a FlexAttention block mask (CUDA only, see :func:`set_attention_backend`).
    """

    dense: Tensor | None
    """(B|1, 1, Tq, Tk) boolean, True = may attend; None when ``flex`` is set."""
    empty: Tensor | None = None
    """(B|1, 1, Tq, 1) rows without a visible key (None: there are none)."""
    flex: Any = None
    """A ``torch.nn.attention.flex_attention.BlockMask``, or None."""
    additive: dict = field(default_factory=dict, repr=False)
    """``dense`` as SDPA's additive float mask (0 / -inf), per dtype, made by the first layer
    that asks (:meth:`sdpa_mask`): SDPA would convert the boolean mask again in every call."""

    def sdpa_mask(self, dtype: torch.dtype) -> Tensor:
        """``dense`` as an additive mask of ``dtype`` (the queries'), made once."""
        mask = self.additive.get(dtype)
        if mask is None:
            mask = torch.zeros(self.dense.shape, dtype=dtype, device=self.dense.device)
            mask = self.additive[dtype] = mask.masked_fill_(~self.dense, float("-inf"))
        return mask


def prepare_mask(mask: Tensor) -> PreparedMask:
    """:class:`PreparedMask` of a boolean mask, without a host-device sync."""
    empty = ~mask.any(dim=-1, keepdim=True)  # (B, 1, Tq, 1)
    first = torch.zeros(mask.shape[-1], dtype=torch.bool, device=mask.device)
    first[0] = True
    return PreparedMask(mask | (empty & first), empty)


def block_visibility(blocks: Tensor | None, n: int, strict: bool, device: torch.device) -> Mask:
    """Self-attention mask of a permuted sequence of ``n`` slots in blocks, for every layer.

    Args:
        blocks: (B, n) block ids, or None for token level (blocks of one slot).
        n: slots.
        strict: a slot sees earlier blocks only (ARMD's query stream); else its own too.
        device: where the mask lives.

    Returns:
        ``"causal"`` / ``"strict"`` at token level (SDPA's causal kernel, see
        :meth:`Attention.attend`); else a :class:`PreparedMask`, with a FlexAttention block
        mask when that backend is on and the device is CUDA, a dense boolean mask otherwise.
    """
    if blocks is None:
        return "strict" if strict else "causal"
    ids, empty = blocks, None
    if strict:  # rows of the first block see nothing
        empty = (ids <= ids.min(dim=-1, keepdim=True).values)[:, None, :, None]
    if flex_enabled(device):
        return PreparedMask(None, empty, _flex_block_mask(ids, strict))
    dense = block_mask(ids, ids, strict)
    if empty is not None:
        first = torch.zeros(n, dtype=torch.bool, device=device)
        first[0] = True
        dense = dense | (empty & first)
    return PreparedMask(dense, empty)


# ----------------------------------------------------------------------------- FlexAttention
#
# An optional GPU path for block masks: FlexAttention skips the masked tiles that SDPA with a
# dense mask computes. It has no backward on the CPU and needs torch.compile to be fast, so it
# is off unless asked for (``set_attention_backend("flex")`` or ``ANYORDER_ATTENTION=flex``)
# and then used only on CUDA; everywhere else the dense SDPA path runs.

ATTENTION_BACKENDS = ("sdpa", "flex")
_backend = {"name": "sdpa"}
_FLEX: dict[str, Any] = {}  # "ops": what _load_flex found, filled once


def set_attention_backend(name: str) -> None:
    """``sdpa`` (default, every device) or ``flex`` (FlexAttention for block masks on CUDA;
    the CPU keeps SDPA)."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention backend {name!r} is unknown; use one of {', '.join(ATTENTION_BACKENDS)}"
        )
    _backend["name"] = name
    if name == "flex":
        _load_flex()  # here, not inside a compiled forward


def flex_enabled(device: torch.device) -> bool:
    """Whether block masks on ``device`` go through FlexAttention (CUDA, asked for, importable)."""
    return _backend["name"] == "flex" and device.type == "cuda" and _load_flex() is not None


def _load_flex() -> tuple[Callable, Callable, Callable] | None:
    """``(flex_attention, its compiled form, create_block_mask)``, imported once; None if
    absent. Loaded when the backend is chosen, so that a compiled model's trace only reads
    it: inside ``torch.compile`` the plain ``flex_attention`` is called (and compiled with the
    model), outside it the compiled one (FlexAttention is slow uncompiled)."""
    if "ops" not in _FLEX:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError:
            _FLEX["ops"] = None
        else:
            compiled = torch.compile(flex_attention, dynamic=False)
            _FLEX["ops"] = (flex_attention, compiled, create_block_mask)
    return _FLEX["ops"]


if os.environ.get("ANYORDER_ATTENTION") == "flex":
    set_attention_backend("flex")


def _flex_block_mask(ids: Tensor, strict: bool) -> Any:
    """FlexAttention block mask of ``B(key) <= B(query)`` (``<`` when strict) over ids (B, n)."""
    create_block_mask = _load_flex()[2]
    ids = ids.contiguous()
    B, n = ids.shape

    def visible(b, h, q, k):
        return ids[b, k] < ids[b, q] if strict else ids[b, k] <= ids[b, q]

    return create_block_mask(visible, B, None, n, n, device=ids.device)


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

    def _heads(self, x: Tensor, norm: nn.Module | None = None) -> Tensor:
        """(B, T, d) -> (B, H, T, D), normed per head first when ``norm`` is given (on the
        (B, T, H, D) view: a norm of the transposed view would copy its output back)."""
        B, T, _ = x.shape
        x = x.view(B, T, self.n_head, self.head_dim)
        return (x if norm is None else norm(x)).transpose(1, 2)

    def _rotate(self, x: Tensor, pos: Positions) -> Tensor:
        if not self.rope:
            return x
        if isinstance(pos, Tensor):
            pos = rotary(pos, self.head_dim, self.rope_base)
        return rotate(x, pos)

    def project(
        self,
        x: Tensor,
        pos: Positions,
        packing: Packing | None = None,
        qpos: Positions = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values (each (B, H, T, D)), normed and rotated to ``pos``
        (the queries to ``qpos`` where given; with a ``packing``: ``x`` is packed, the
        outputs are not)."""
        qkv = self.qkv(x)
        if packing is not None:
            qkv = packing.unpack(qkv)
        q, k, v = qkv.split(x.shape[-1], dim=-1)
        q = self._rotate(self._heads(q, self.q_norm), pos if qpos is None else qpos)
        k = self._rotate(self._heads(k, self.k_norm), pos)
        return q, k, self._heads(v)

    def project_q(self, x: Tensor, pos: Positions, packing: Packing | None = None) -> Tensor:
        """Queries only (the ARMD query stream reads the content stream's keys and values)."""
        d = x.shape[-1]
        bias = self.qkv.bias[:d] if self.qkv.bias is not None else None
        q = F.linear(x, self.qkv.weight[:d], bias)
        q = q if packing is None else packing.unpack(q)
        return self._rotate(self._heads(q, self.q_norm), pos)

    def project_kv(
        self, x: Tensor, pos: Positions, packing: Packing | None = None
    ) -> tuple[Tensor, Tensor]:
        """Keys and values only (the rows whose queries nobody reads)."""
        d = x.shape[-1]
        bias = self.qkv.bias[d:] if self.qkv.bias is not None else None
        kv = F.linear(x, self.qkv.weight[d:], bias)
        k, v = (kv if packing is None else packing.unpack(kv)).split(d, dim=-1)
        return self._rotate(self._heads(k, self.k_norm), pos), self._heads(v)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask,
        *,
        empty: Tensor | bool | None = None,
        packing: Packing | None = None,
        project: bool = True,
    ) -> Tensor:
        """SDPA of (B, H, Tq, D) queries over (B, H, Tk, D) keys/values, merged and projected
        (``project=False``: merged only, (B, Tq, d), for a caller that projects several at once).

        ``mask`` is ``"causal"`` or ``"strict"`` (key < query; square only), ``None`` (all
        visible), a boolean (B|1, 1, Tq, Tk) tensor or a :class:`PreparedMask`; rows with no
        visible key give zeros. ``empty`` spares the host-device sync of looking for such rows
        in a boolean mask (the KV-cache decoders know): ``False`` promises there are none, a
        (B, 1, Tq, 1) tensor names them; ``None`` checks. A :class:`PreparedMask` names them.
        With a ``packing`` the output is packed (1, N, d).
        """
        p = self.dropout if self.training else 0.0
        if isinstance(mask, PreparedMask):
            if mask.flex is not None:
                if p > 0:
                    raise ConfigError(
                        "the FlexAttention path has no attention dropout; set model.dropout=0 "
                        "or use the sdpa attention backend"
                    )
                plain, compiled, _ = _load_flex()
                flex = plain if torch.compiler.is_compiling() else compiled
                y = flex(q, k, v, block_mask=mask.flex)
            else:
                m = mask.sdpa_mask(q.dtype)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p)
            if mask.empty is not None:
                y = y.masked_fill(mask.empty, 0.0)
        elif isinstance(mask, str) and mask == "strict":
            # key < query is causal attention of queries 1.. over keys ..n-2 (the same
            # softmax sets), so SDPA's causal kernel skips the masked half here too; query 0
            # sees nothing and gets zeros
            if q.shape[2] > 1:
                y = F.scaled_dot_product_attention(
                    q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], is_causal=True, dropout_p=p
                )
                y = F.pad(y, (0, 0, 1, 0))
            else:
                y = torch.zeros_like(q)
        elif isinstance(mask, str):
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
        y = y.transpose(1, 2).reshape(B, T, H * D)
        if not project:
            return y
        return self.proj(y if packing is None else packing.pack(y))

    def forward(
        self,
        x: Tensor,
        pos: Positions,
        mask: Mask,
        kv: KVHook | None = None,
        packing: Packing | None = None,
        qpos: Positions = None,
    ) -> Tensor:
        """Self-attention; ``kv`` (a KV-cache hook) swaps the new keys/values for the cached
        ones plus the new, and then every query must see at least itself in ``mask``.
        ``packing`` (decoding only): ``x`` and the output hold the real slots only.
        ``qpos``: the queries' positions where they differ from the keys' (``pos``)."""
        q, k, v = self.project(x, pos, packing, qpos)
        if kv is None:
            return self.attend(q, k, v, mask, packing=packing)
        k, v = kv(k, v)
        return self.attend(q, k, v, mask, empty=False, packing=packing)


class MLP(nn.Module):
    """GELU (the tanh approximation, as GPT-2, or exact: ``model.gelu``) or SwiGLU
    feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"
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
            h = F.gelu(h, approximate=self.approximate)
        out = self.proj(h)
        return self.drop(out) if self.training and self.drop.p > 0 else out  # no call at p=0


class AdaLN(nn.Module):
    """Modulation from a condition: ``Linear(SiLU(c)) -> chunks`` of width d.

    Zero-initialised (``zero``, our default), every shift, scale and gate starts at zero, so
    with gates centred on one a freshly built adaLN model computes exactly what the
    unconditioned trunk computes (see :class:`Modulation`); the AO-GPT reference initialises it
    like every other linear layer (``model.adaln_init=normal``).
    The chunks listed in ``ones`` (scales, and gates unless ``model.adaln_gate_offset`` is
    off) come back as ``1 + chunk``: the factors the block multiplies by, one add for the
    whole row (or none: it is folded into a table).
    """

    def __init__(
        self,
        cond_dim: int,
        d_model: int,
        chunks: int,
        ones: tuple[int, ...] = (),
        zero: bool = True,
    ):
        super().__init__()
        self.chunks = chunks
        self.ones = ones
        self.linear = nn.Linear(cond_dim, chunks * d_model)
        self.linear.zero_init = zero

    def _offset(self, out: Tensor) -> Tensor:
        d = out.shape[-1] // self.chunks
        offset = torch.zeros(self.chunks, d, dtype=out.dtype, device=out.device)
        for i in self.ones:  # scalar fills: no index tensor copied to the device, no sync
            offset[i] = 1.0
        return out + offset.view(-1)

    def table(self, emb: Tensor) -> Tensor:
        """The modulations of every row of a condition table: (P, c) -> (P, chunks * d)."""
        return self._offset(self.linear(F.silu(emb)))

    def table_of(self, cond: TargetCondition) -> Tensor:
        """This layer's (P, chunks * d) table for ``cond``: kept in ``cond.tables`` when
        there is one and no graph is being recorded, else computed."""
        tables = cond.tables
        table = tables.get(self) if tables is not None else None
        if table is None:
            table = self.table(cond.emb)
            if tables is not None and not torch.is_grad_enabled():  # never keep a graph
                tables[self] = table
        return table

    def forward(self, cond: Tensor | TargetCondition) -> tuple[Tensor, ...]:
        """The per-slot chunks (B, T, d) each (``1 + chunk`` for those in ``ones``)."""
        if isinstance(cond, Tensor):
            return self._offset(self.linear(F.silu(cond))).chunk(self.chunks, dim=-1)
        return F.embedding(cond.target, self.table_of(cond)).chunk(self.chunks, dim=-1)


@dataclass
class TargetCondition:
    """An adaLN condition that is a lookup ``c_t = E[target_t]`` (AO-GPT's target position).

    ``Linear(SiLU(c_t))`` then depends on the target position alone, so every
    :class:`AdaLN` computes it once per *position* (a (P, chunks * d) table) and gathers the
    rows of its slots: the same numbers, with P instead of B*T rows through the linear, and
    nothing per token at decoding time, where ``tables`` keeps them for a whole decode.
    """

    target: Tensor
    """(B, T) the target position of each slot."""
    emb: Tensor
    """(P, c) the condition table (the target-position embedding's weight)."""
    tables: dict | None = None
    """Per-AdaLN tables kept across calls (filled under ``torch.no_grad`` only), or None."""


class _ModulateRows(torch.autograd.Function):
    """``x * mul + shift`` for rows ``mul = col[idx]`` gathered beforehand: saves ``x`` and the
    (P, d) table column, not the (B, T, d) rows (backward gathers ``mul`` again)."""

    @staticmethod
    def forward(ctx, x: Tensor, shift: Tensor, mul: Tensor, col: Tensor, idx: Tensor) -> Tensor:
        ctx.save_for_backward(x, col, idx)
        return torch.addcmul(shift, x, mul)

    @staticmethod
    def backward(ctx, gy: Tensor):
        x, col, idx = ctx.saved_tensors
        need = ctx.needs_input_grad
        gx = (gy * F.embedding(idx, col)).to(x.dtype) if need[0] else None
        g_shift = gy.to(col.dtype) if need[1] else None
        g_mul = (gy * x).to(col.dtype) if need[2] else None
        return gx, g_shift, g_mul, None, None


class _GateRows(torch.autograd.Function):
    """``h + gate * a`` for rows ``gate = col[idx]``: saves ``a`` and the column, not the rows."""

    @staticmethod
    def forward(ctx, h: Tensor, gate: Tensor, a: Tensor, col: Tensor, idx: Tensor) -> Tensor:
        ctx.save_for_backward(a, col, idx)
        return torch.addcmul(h, gate, a)

    @staticmethod
    def backward(ctx, gy: Tensor):
        a, col, idx = ctx.saved_tensors
        need = ctx.needs_input_grad
        ga = (gy * F.embedding(idx, col)).to(a.dtype) if need[2] else None
        g_gate = (gy * a).to(col.dtype) if need[1] else None
        return gy if need[0] else None, g_gate, ga, None, None


class _GatherChunks(torch.autograd.Function):
    """``table[idx].split(d, dim=-1)``: the rows of every chunk in one gather. Backward adds
    each chunk's gradient into its columns of the table, summed in fp32 (or better), instead
    of joining the (B, T, F) gradients of the chunks first."""

    @staticmethod
    def forward(ctx, table: Tensor, idx: Tensor, d: int) -> tuple[Tensor, ...]:
        ctx.save_for_backward(idx)
        ctx.table, ctx.d = (table.shape, table.dtype), d
        return F.embedding(idx, table).split(d, dim=-1)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        (idx,) = ctx.saved_tensors
        (P, F_), dtype = ctx.table
        acc = torch.promote_types(dtype, torch.float32)
        d = ctx.d
        out = torch.zeros(F_ // d, P, d, dtype=acc, device=idx.device)  # contiguous per chunk
        flat = idx.reshape(-1)
        for j, g in enumerate(grads):
            out[j].index_add_(0, flat, g.reshape(-1, d).to(acc))
        return out.to(dtype).transpose(0, 1).reshape(P, F_), None, None


@dataclass
class Modulation:
    """One :class:`AdaLN`'s chunks worked out beforehand (``1 + chunk`` for those in
    ``ones``), and where they were gathered from when they are rows of a table.

    With ``columns`` and ``index`` a training step saves the (B, T, d) inputs of each
    ``x * mul + shift`` and ``h + gate * a`` and gathers the factor again in backward
    (:class:`_ModulateRows`, :class:`_GateRows`) instead of storing it: about ``4 d`` fewer
    stored numbers per slot per layer, for one gather per factor in backward.
    """

    chunks: tuple[Tensor, ...]
    """(B, T, d) each."""
    columns: tuple[Tensor, ...] | None = None
    """(P, d) each: the table columns the chunks are rows of (``chunks[i] = columns[i][index]``)."""
    index: Tensor | None = None
    """(B, T) the table rows gathered."""

    def _rows(self) -> bool:
        return self.index is not None and torch.is_grad_enabled()

    def modulate(self, i: int, x: Tensor) -> Tensor:
        """``x * chunks[i + 1] + chunks[i]`` (shift, then mul = 1 + scale)."""
        shift, mul = self.chunks[i], self.chunks[i + 1]
        if self._rows():
            return _ModulateRows.apply(x, shift, mul, self.columns[i + 1], self.index)
        return torch.addcmul(shift, x, mul)  # one kernel

    def gate(self, i: int, h: Tensor, a: Tensor) -> Tensor:
        """``h + chunks[i] * a`` (the gated residual, gate = 1 + gate)."""
        if self._rows():
            return _GateRows.apply(h, self.chunks[i], a, self.columns[i], self.index)
        return torch.addcmul(h, self.chunks[i], a)


def adaln_offset(adas: list[AdaLN]) -> Tensor:
    """The ``1`` of ``1 + chunk`` of every chunk of ``adas`` in ``ones``, laid out as their
    linears' outputs joined: (sum of chunks * d,), built once per model."""
    rows = []
    for ada in adas:
        d = ada.linear.out_features // ada.chunks
        rows += [torch.full((d,), float(i in ada.ones)) for i in range(ada.chunks)]
    return torch.cat(rows)


def adaln_table(adas: list[AdaLN], c: Tensor, offset: Tensor) -> Tensor:
    """Every adaLN of ``adas`` applied to ``c`` (..., c) in one matmul: (..., F), F the sum of
    their chunks * d, with the ``1 +`` of the scales and gates folded into the bias."""
    weight = torch.cat([a.linear.weight for a in adas])  # (F, c)
    bias = torch.cat([a.linear.bias for a in adas]) + offset.to(adas[0].linear.bias)
    return F.linear(F.silu(c), weight, bias)


def adaln_rows(adas: list[AdaLN], table: Tensor, target: Tensor) -> list[Modulation]:
    """The :class:`Modulation` of every adaLN for slots ``target`` (B, T), from a joined
    (P, F) :func:`adaln_table`: one lookup for every layer (decoding; no gradient)."""
    d = adas[0].linear.out_features // adas[0].chunks
    chunks = F.embedding(target, table).split(d, dim=-1)  # (B, T, d) each
    out, i = [], 0
    for ada in adas:
        out.append(Modulation(chunks[i : i + ada.chunks]))
        i += ada.chunks
    return out


def adaln_stack(
    adas: list[AdaLN], cond: Tensor | TargetCondition, offset: Tensor
) -> list[Modulation]:
    """``[Modulation(ada(cond)) for ada in adas]`` in one matmul.

    The adaLN linears of every layer read the same condition, so their weights are joined
    and applied once per forward (not once per layer), with the ``1 +`` of the scales and
    gates folded into the joined bias (``offset``: :func:`adaln_offset`). On a
    :class:`TargetCondition` the table is computed per position and the slots' rows are
    gathered once for every layer (backward: one fp32 index-add per chunk, no join of the
    chunks' (B, T, d) gradients). The matmul runs under the caller's autocast, as the
    per-layer linears did.
    """
    c = cond.emb if isinstance(cond, TargetCondition) else cond
    table = adaln_table(adas, c, offset)  # (P | B, T, F)
    d = adas[0].linear.out_features // adas[0].chunks
    if isinstance(cond, TargetCondition):
        chunks = _GatherChunks.apply(table, cond.target, d)  # (B, T, d) each
        columns = table.split(d, dim=-1)  # (P, d) each
    else:
        chunks, columns = table.split(d, dim=-1), None
    out, i = [], 0
    for ada in adas:
        cols = None if columns is None else columns[i : i + ada.chunks]
        index = None if columns is None else cond.target
        out.append(Modulation(chunks[i : i + ada.chunks], cols, index))
        i += ada.chunks
    return out


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


class Head(nn.Linear):
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
        bias = self.bias[: self.used] if self.bias is not None else None
        return F.linear(x, self.weight[: self.used], bias)  # views of the first rows: no copy


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
