"""Attention masks of permuted sequences in blocks, and the packing of padded decoding calls.

Design choices:

* Masks are boolean, ``True`` = may attend, shaped ``(B, 1, Tq, Tk)``; the plain causal case
  is passed as the string ``"causal"`` so that SDPA takes its ``is_causal`` fast path (it
  skips the masked half), the strictly causal one as ``"strict"`` (the same kernel on
  shifted queries and keys), and ``None`` means bidirectional. :func:`block_mask` builds the
  block-causal and block-strict masks from block ids; :func:`block_visibility` prepares a
  model's masks once per forward (:class:`PreparedMask`), for every layer.
* A row with nothing to attend to (the first block under a strict mask) lets it attend to
  key 0 and names the row (``empty``), so that attention zeroes its output instead of
  relying on how a kernel treats a fully masked row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from anyorder.layers.flex import _flex_block_mask, flex_enabled

Mask = Tensor | str | None  # or a PreparedMask (defined below)


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


def block_visibility(
    blocks: Tensor | None,
    n: int,
    strict: bool,
    device: torch.device,
    head_dim: int | None = None,
) -> Mask:
    """Self-attention mask of a permuted sequence of ``n`` slots in blocks, for every layer.

    Args:
        blocks: (B, n) block ids, or None for token level (blocks of one slot).
        n: slots.
        strict: a slot sees earlier blocks only (ARMD's query stream); else its own too.
        device: where the mask lives.
        head_dim: the attention's head dimension: FlexAttention only where its kernels take
            it (:func:`~anyorder.layers.flex.flex_enabled`).

    Returns:
        ``"causal"`` / ``"strict"`` at token level (SDPA's causal kernel, see
        :meth:`Attention.attend`); else a :class:`PreparedMask`, with a FlexAttention block
        mask when that backend is on, the device is CUDA and the heads are wide enough, a
        dense boolean mask otherwise.
    """
    if blocks is None:
        return "strict" if strict else "causal"
    ids, empty = blocks, None
    if strict:  # rows of the first block see nothing
        empty = (ids <= ids.min(dim=-1, keepdim=True).values)[:, None, :, None]
    if flex_enabled(device, head_dim):
        return PreparedMask(None, empty, _flex_block_mask(ids, strict))
    dense = block_mask(ids, ids, strict)
    if empty is not None:
        first = torch.zeros(n, dtype=torch.bool, device=device)
        first[0] = True
        dense = dense | (empty & first)
    return PreparedMask(dense, empty)
