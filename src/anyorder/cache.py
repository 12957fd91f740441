"""The KV cache: preallocated keys and values of the slots a decoder has already seen.

Design choices:

* One :class:`KVCache` holds a stack of attention layers: per layer a key and a value buffer
  ``(B, H, capacity, D)``, allocated once at full capacity on the first write (with the dtype
  of the first keys, so bf16 autocast gets bf16 buffers), and a fill ``length`` that is a
  Python int shared by every row: moving it needs no host-device sync.
* Keys are cached *after* RoPE, at explicit positions. Any-order decoding writes positions in
  any order, so nothing here assumes ``arange``; ``pos`` (B, capacity) records them.
* A call writes its new slots at ``[length, length + T)`` of every layer and attends over
  ``[0, length + T)``; :meth:`KVCache.advance` then keeps a prefix of them. Slots written
  past the kept prefix are scratch (e.g. the extra query slots of a parallel prediction) and
  the next call overwrites them.
* Rows of a batch may keep different slots (per-row reveal counts pad some rows): ``valid``
  (B, capacity) marks the kept slots; ``dense`` says, on the host, that every slot below
  ``length`` is valid, so that callers can drop masks altogether on the fast path.
* :meth:`KVCache.fork` repeats every row ``r`` times (``repeat_interleave``): one prompt is
  prefilled once and then decoded into many samples.
* :class:`ARMDCache` is two such caches plus ARMD's prefix aggregate: the content stream's
  keys/values of the two-stream layers, the query stream's keys/values of the ordinary
  layers, and the running sum and count of the decided tokens' content embeddings.
* :class:`StaticKV` is the samplers' cache (:mod:`anyorder.sampling`): every shape is fixed
  for a whole decode so that a pass can be captured as a CUDA graph. Buffers are zeroed and
  allocated once at full capacity; each pass writes its entries at explicit per-row slots
  (a device index, never a Python offset), and reads a fixed number of leading slots. What
  an entry may see is a *rank* per slot (``BIG`` = empty or scratch): a query of rank ``r``
  sees the slots of rank ``< r`` (plus itself), so masks are one comparison per pass.
  Rows keep their entries packed from slot 0 (no gaps, nothing to compact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

KVHook = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class KVCache:
    """Keys and values of ``n_layers`` attention layers for a batch of ``batch`` rows.

    Args:
        n_layers: attention layers in the stack.
        batch: rows.
        capacity: most slots ever held (kept slots plus the scratch of one call).
        device: where the buffers live.
    """

    def __init__(
        self, n_layers: int, batch: int, capacity: int, device: torch.device | str | None = None
    ) -> None:
        self.n_layers = n_layers
        self.batch = batch
        self.capacity = capacity
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.k: list[Tensor | None] = [None] * n_layers  # each (B, H, capacity, D)
        self.v: list[Tensor | None] = [None] * n_layers
        self.length = 0
        self.dense = True
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.pos = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)
        self.aux: dict = {}  # per-decode tables a model keeps (AO-GPT's adaLN), shared by forks

    # -- writing ------------------------------------------------------------------------

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``, ``v`` (B, H, T, D) at ``[length, length+T)``; return ``[0, length+T)``."""
        T = k.shape[2]
        end = self.length + T
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {end} slots needed, capacity {self.capacity}"
            )  # a sampler bug, not a user error
        if self.k[layer] is None:
            B, H, _, D = k.shape
            self.k[layer] = k.new_empty(B, H, self.capacity, D)
            self.v[layer] = v.new_empty(B, H, self.capacity, D)
        kb, vb = self.k[layer], self.v[layer]
        kb[:, :, self.length : end] = k
        vb[:, :, self.length : end] = v
        return kb[:, :, :end], vb[:, :, :end]

    def hook(self, layer: int) -> KVHook:
        """The cache hook of one layer, for :meth:`anyorder.layers.Attention.forward`."""

        def kv(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            return self.write(layer, k, v)

        return kv

    def advance(self, count: int, keep: Tensor | None = None, pos: Tensor | None = None) -> None:
        """Keep the first ``count`` slots of the last write; later ones become scratch.

        Args:
            count: slots kept (a prefix of what the last call wrote).
            keep: (B, count) boolean, False for padding slots of a row (they stay invisible);
                None keeps them all.
            pos: (B, >= count) positions of the written slots, recorded in ``pos``.
        """
        if count == 0:
            return
        end = self.length + count
        if keep is None:
            self.valid[:, self.length : end] = True
        else:
            self.valid[:, self.length : end] = keep
            self.dense = False
        if pos is not None:
            self.pos[:, self.length : end] = pos[:, :count]
        self.length = end

    def compact(self, index: Tensor, real: Tensor, dense: bool) -> None:
        """Move each row's kept slots to the front: row ``b`` keeps slots ``index[b]``.

        Rows that keep different slots (padding) make ``length`` outgrow what any row holds,
        and every later call attends over the gaps; a compaction closes them. Attention does
        not care where a key sits (its position is in the key), so nothing else changes.

        Args:
            index: (B, M) the slots to keep, in order, per row (any slot where ``real`` is
                False).
            real: (B, M) which of them are kept; the rest become invisible.
            dense: every entry of ``real`` is True (known on the host: no sync).
        """
        M = index.shape[1]
        for buffers in (self.k, self.v):
            for t in buffers:
                if t is not None:
                    B, H, _, D = t.shape
                    rows = t[:, :, : self.length].gather(
                        2, index[:, None, :, None].expand(B, H, M, D)
                    )
                    t[:, :, :M] = rows
        self.pos[:, :M] = self.pos.gather(1, index)
        self.valid[:, :M] = real
        self.length, self.dense = M, dense

    # -- reading ------------------------------------------------------------------------

    def mask(self, new: Tensor) -> Tensor:
        """Full attention mask (B, 1, Tq, length + Tn) from the mask among new slots
        (B|1, Tq, Tn). Every new slot sees every valid cached slot.
        """
        B, (_, Tq, Tn) = self.batch, new.shape
        cached = self.valid[:, None, : self.length].expand(B, Tq, self.length)
        return torch.cat([cached, new.expand(B, Tq, Tn)], dim=-1)[:, None]

    def fork(self, repeats: int) -> KVCache:
        """A cache with every row repeated ``repeats`` times (rows ``b*r .. b*r+r-1``)."""
        out = KVCache(self.n_layers, self.batch * repeats, self.capacity, self.device)
        out.k = [None if t is None else t.repeat_interleave(repeats, dim=0) for t in self.k]
        out.v = [None if t is None else t.repeat_interleave(repeats, dim=0) for t in self.v]
        out.length, out.dense = self.length, self.dense
        out.valid = self.valid.repeat_interleave(repeats, dim=0)
        out.pos = self.pos.repeat_interleave(repeats, dim=0)
        out.aux = self.aux  # row-independent
        return out

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)


@dataclass
class ARMDCache:
    """What ARMD keeps between decoding calls."""

    content: KVCache
    """Content-stream keys/values of the decided tokens, one layer per two-stream layer."""
    query: KVCache
    """Query-stream keys/values, one layer per ordinary layer after the two-stream ones."""
    prefix_sum: Tensor
    """(B, d) sum of the content embeddings of the decided tokens (prefix aggregation)."""
    prefix_count: Tensor
    """(B,) how many decided tokens that sum holds (float, to divide by)."""

    @classmethod
    def empty(
        cls,
        l2s: int,
        n_layer: int,
        batch: int,
        capacity: int,
        d_model: int,
        device: torch.device | str | None = None,
    ) -> ARMDCache:
        """An empty cache for ``l2s`` two-stream layers out of ``n_layer``."""
        return cls(
            KVCache(l2s, batch, capacity, device),
            KVCache(n_layer - l2s, batch, capacity, device),
            torch.zeros(batch, d_model, device=device),
            torch.zeros(batch, device=device),
        )

    def fork(self, repeats: int) -> ARMDCache:
        """Every row repeated ``repeats`` times."""
        return ARMDCache(
            self.content.fork(repeats),
            self.query.fork(repeats),
            self.prefix_sum.repeat_interleave(repeats, dim=0),
            self.prefix_count.repeat_interleave(repeats, dim=0),
        )

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers."""
        return self.content.nbytes() + self.query.nbytes()


BIG = 1 << 40
"""The rank of an empty or scratch slot of a :class:`StaticKV`: below no real limit."""


class StaticKV:
    """Fixed-capacity keys and values of ``n_layers`` attention layers, written at explicit
    per-row slots, with a rank per slot that decides visibility (see the module notes).

    A pass calls :meth:`begin` once (its write slots, the ranks they keep, how many leading
    slots it reads), then each layer's :meth:`write`; the masks come from :meth:`visible`.
    The API of :class:`KVCache` that the models use (``write``, ``hook``, ``advance``,
    ``aux``) is kept, so one ``decode`` method serves both caches.
    """

    def __init__(
        self,
        n_layers: int,
        batch: int,
        capacity: int,
        shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        self.n_layers, self.batch, self.capacity = n_layers, batch, capacity
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        H, D = shape  # heads, head dimension
        # zeros: a masked key must not hold NaN (softmax weight 0 times NaN is NaN)
        self.k = [torch.zeros(batch, H, capacity, D, dtype=dtype, device=self.device)
                  for _ in range(n_layers)]  # fmt: skip
        self.v = [torch.zeros_like(t) for t in self.k]
        self.rank = torch.full((batch, capacity), BIG, dtype=torch.long, device=self.device)
        self.slot_ids = torch.arange(capacity, device=self.device)
        self.aux: dict = {}
        self.keys = capacity  # leading slots the current pass reads
        self.slots: Tensor | None = None  # (B, T) the current pass's write slots
        self.index: Tensor | None = None  # (B, H, T, D) the same, for the buffers
        self.start: int | None = None  # or the first of them, the same in every row
        self.length = 0  # KVCache's fill; a static cache reads ``keys`` slots instead
        self._read: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (layer, keys) views

    def begin(self, slots: Tensor, keep: Tensor, keys: int, start: int | None = None) -> None:
        """Start a pass: its entries go to ``slots`` (B, T) and keep the ranks ``keep`` (B, T)
        (``BIG`` for scratch: no later pass sees them); it reads slots ``[0, keys)``.
        ``start``: the caller knows the slots are ``start + j`` in every row (an eager pass:
        a slice copy is cheaper than a scatter on a CPU)."""
        self.slots, self.keys, self.start = slots, keys, start
        if start is not None:
            self.rank[:, start : start + slots.shape[1]] = keep
            return
        self.rank.scatter_(1, slots, keep)
        if self.k:  # (a cache of no layers: ARMD with only two-stream layers)
            B, H, _, D = self.k[0].shape
            self.index = slots[:, None, :, None].expand(B, H, slots.shape[1], D)

    def visible(self, limit: Tensor, self_slots: Tensor | None = None) -> Tensor:
        """(B, Tq, keys) boolean: slot rank ``< limit`` (B, Tq) per query, or the query's own
        slot (``self_slots`` (B, Tq), for queries that see themselves but no equal rank)."""
        vis = self.rank[:, None, : self.keys] < limit[:, :, None]
        if self_slots is not None:
            vis = vis | (self_slots[:, :, None] == self.slot_ids[: self.keys])
        return vis

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``, ``v`` (B, H, T, D) at the pass's slots; return slots ``[0, keys)``."""
        if self.start is not None:
            stop = self.start + k.shape[2]
            self.k[layer][:, :, self.start : stop] = k
            self.v[layer][:, :, self.start : stop] = v
        else:
            self.k[layer].scatter_(2, self.index, k)
            self.v[layer].scatter_(2, self.index, v)
        read = self._read.get((layer, self.keys))
        if read is None:  # made once per key level (a compiled pass keeps no memo: guards)
            read = self._views(layer, self.keys, keep=not torch.compiler.is_compiling())
        return read

    def _views(self, layer: int, keys: int, keep: bool = True) -> tuple[Tensor, Tensor]:
        """The keys and values a pass of ``keys`` slots reads of ``layer`` (kept if ``keep``)."""
        read = (self.k[layer][:, :, :keys], self.v[layer][:, :, :keys])
        if keep:
            self._read[layer, keys] = read
        return read

    def prepare_reads(self, keys: int) -> None:
        """Make the views a pass of ``keys`` slots reads, before it compiles: read as graph
        inputs, not made inside, they spare the compiled pass a copy of each buffer."""
        for layer in range(len(self.k)):
            if (layer, keys) not in self._read:
                self._views(layer, keys)

    def hook(self, layer: int) -> KVHook:
        """The cache hook of one layer, for :meth:`anyorder.layers.Attention.forward`."""

        def kv(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            return self.write(layer, k, v)

        return kv

    def advance(self, count: int, keep: Tensor | None = None, pos: Tensor | None = None) -> None:
        """Nothing to do: :meth:`begin` already set what the pass keeps."""

    def head(self, rows: int) -> StaticKV:
        """The first ``rows`` rows, sharing the buffers (a prompt prefilled once)."""
        out = StaticKV.__new__(StaticKV)
        out.__dict__.update(self.__dict__)
        out.batch, out.rank = rows, self.rank[:rows]
        out.k, out.v = [t[:rows] for t in self.k], [t[:rows] for t in self.v]
        out._read = {}
        return out

    def fork_first(self) -> None:
        """Copy row 0 (a prefilled prompt) into every other row."""
        for t in (*self.k, *self.v, self.rank):
            if t.shape[0] > 1:
                t[1:].copy_(t[:1].expand_as(t[1:]))

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
