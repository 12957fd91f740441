"""adaLN: per-slot modulation of the trunk by a condition (AO-GPT's target position).

Design choices:

* Zero-initialised by default, with scales and gates centred on one, so that a freshly
  built adaLN model computes exactly what the unconditioned trunk computes.
* The adaLN linears of every layer read the same condition, so they are joined and applied
  once per forward (:func:`adaln_stack`); a condition that is a table lookup
  (:class:`TargetCondition`) is computed once per *position* and its rows gathered.
* Training saves the (B, T, d) inputs of each modulation and gathers the factors again in
  backward (:class:`Modulation`), instead of storing the gathered rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.layers.linear import Linear, weight_and_bias


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

    decode_casts = False
    """A decode reads this layer's products from a table filled once (``TargetCondition``,
    ``adaln_table``), never its weights pass by pass: no copy cast for them
    (``layers/casts.py``)."""

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
        self.linear = Linear(cond_dim, chunks * d_model)
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
    ones: list[float] = []
    for ada in adas:
        d = ada.linear.out_features // ada.chunks
        ones += [float(i in ada.ones) for i in range(ada.chunks) for _ in range(d)]
    # from a list, not torch.full: on the meta device (count_params) torch.full goes through
    # PyTorch's reference decompositions, which import torch._dynamo (a second of start-up)
    return torch.tensor(ones)


def adaln_table(adas: list[AdaLN], c: Tensor, offset: Tensor) -> Tensor:
    """Every adaLN of ``adas`` applied to ``c`` (..., c) in one matmul: (..., F), F the sum of
    their chunks * d, with the ``1 +`` of the scales and gates folded into the bias."""
    pairs = [weight_and_bias(a.linear) for a in adas]  # LoRA's adapters included
    weight = torch.cat([w for w, _ in pairs])  # (F, c)
    bias = torch.cat([b for _, b in pairs]) + offset.to(pairs[0][1])
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
