"""The plan: every forward pass of a decode, worked out on the host before the first pass.

Orders and reveal counts never depend on the sampled tokens, so everything but the tokens
is known before decoding starts. Slot ``t`` of the order is *decided* once its token is
drawn. A pass

* writes the entries that became ready since the last pass (AO-GPT: slot inputs whose token
  is now known; ARMD: content tokens, and query-stream catch-up entries), causal among
  themselves, kept in the cache;
* and asks ``Q`` queries: the next ``Q`` slots of the order, each seeing the cache and the
  writes but not the other queries (the parallel prediction mask), or, in block mode (ARMD's
  strided order), the other queries of its block. Query 0 is the true next slot and is kept
  (all of a block's queries in block mode); the others are scratch.

Design choices:

* **Static shapes.** Each pass is padded to the widths of its *group*, and reads a fixed
  number of leading cache slots (its group's key level): a decode has at most
  :data:`BUDGET` distinct attention shapes, so each group is one CUDA graph. Widths are
  rounded up to powers of two; key levels are chosen greedily where they save the most
  attention work (:func:`_key_levels`).
* **Ranks, not masks.** An entry's visibility is decided on the device from a rank per
  cache slot (:class:`anyorder.cache.StaticKV`): the plan ships per entry its rank limit,
  the slot it writes and the rank it keeps. Every entry is placed at an explicit slot, each
  row's kept entries packed from slot 0, so no cache has gaps (nothing to compact).
* **One table per group** of shape (passes, rows, fields, width), int64, shipped to the
  device in one copy before the loop; a pass reads row ``j`` of it (a view, or an
  ``index_select`` by a device counter inside a CUDA graph). Slot codes become positions
  on the device once, with one gather per table.
* Packing (the real entries of a mostly padded pass run alone through the per-entry layers,
  :class:`anyorder.layers.Packing`) changes shapes from pass to pass: the CPU's eager path
  uses it, CUDA graphs do not.
* The plan costs O(B x entries) host time and memory; the reveal counts arrive as the
  non-empty steps only (:class:`anyorder.sampling.schedules.RevealPlan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from anyorder.cache import BIG
from anyorder.sampling.schedules import check_counts

BUDGET = 8
"""Most distinct attention (queries, keys) shapes in one decode (a bucketed plan)."""
BUCKET_ON_CPU = False
"""Bucket key levels on the CPU's eager path too (off: there a pass reads the keys it needs,
rounded up to a multiple of 16, since a CPU pays for every key it reads and nothing for a
new shape; the benchmarks switch it on to count what a GPU runs)."""
_PACK_BELOW = 0.75  # pack a pass's real entries when at most this fraction of them is real
_ALIGN = 16  # key levels are multiples of this (aligned masks for fused GPU kernels)
# GPT/AO-GPT table fields (codes are order slots: PAD = n, BOS = n + 1; the device turns them
# into tok columns or positions)
G_TOK, G_POS, G_TGT, G_RANK, G_SLOT, G_KEEP = range(6)
# ARMD table fields over [content rows | query rows]
A_TOK, A_POS, A_LIM, A_EMPTY, A_SLOT, A_KEEP, A_QLIM, A_COUNT = range(8)


def _pow2(x: int) -> int:
    return 0 if x <= 0 else 1 << (x - 1).bit_length()


def _align(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


@dataclass
class Pass:
    """One forward pass (host side)."""

    step: int  # the step recorded in step_of for its tokens; -1 for a prefill
    prefill: bool
    seq: int  # its place in the decode (passes run in this order)
    dims: tuple[int, ...]  # needed widths: (W, Q) for AO-GPT, (C, Wg, Q) for ARMD
    state: tuple[np.ndarray, ...]  # per-row counters before the pass
    group: int = -1
    index: int = -1  # its row in the group's table
    keys: int = 0  # cache slots it needs to read (set with its group's widths)
    dense: bool = False  # every query sees every slot it reads: no mask (the CPU's path)
    start: tuple[int, ...] | None = None  # rows alike: the first write slot per cache
    q_offset: int = 0  # its columns in the sampling table
    pack: tuple | None = None  # host packing indices (eager CPU path)
    pack_dev: tuple | None = None


@dataclass
class Group:
    """Passes of one shape: one table, one key level, one CUDA graph."""

    widths: tuple[int, ...]  # (T,) or (C, G)
    keys: int = 0  # slots read (ARMD: of the content cache)
    keys_q: int = -1  # ARMD: slots read of the query-stream cache (-1: ``keys``)
    passes: list[Pass] = field(default_factory=list)
    table: Tensor | None = None  # (P, rows, F, width) on the device
    has_empty: bool = False  # ARMD: some query row sees no content (the first block)

    @property
    def width(self) -> int:
        return sum(self.widths)


class Plan:
    """The passes of one decode and their device tables.

    Args:
        armd: plan ARMD's two streams (else the GPT/AO-GPT slot layout).
        batch, n, k: rows, sequence length, known (prompt) slots per row.
        counts: (P, B) tokens revealed by each row in each non-empty step.
        steps: (P,) the step ids of those rows of ``counts``.
        block_of: (n,) block id per slot for block mode (ARMD's strided order); None: token
            level with the parallel prediction mask.
        prefill: put the prompt in a pass of its own (run on one row, then forked).
        pack: allow packing (the CPU's eager path; CUDA graphs need fixed shapes).
        bucket: at most :data:`BUDGET` attention shapes (a GPU, CUDA graphs); else the
            key level of a pass is the keys it needs (the CPU's eager path).
    """

    def __init__(
        self,
        armd: bool,
        batch: int,
        n: int,
        k: int,
        counts: np.ndarray,
        steps: np.ndarray,
        block_of: np.ndarray | None = None,
        prefill: bool = False,
        pack: bool = True,
        bucket: bool = True,
    ) -> None:
        self.armd, self.batch, self.n, self.k = armd, batch, n, k
        self.block_mode = block_of is not None
        self.rank_of = np.append(block_of if block_of is not None else np.arange(n), BIG)
        self.passes: list[Pass] = []
        B = batch
        check_counts(counts, steps, B, n - k)
        d = np.full(B, k, dtype=np.int64)
        zero = np.zeros(B, dtype=np.int64)
        # (d, w, ptr, cc, gptr): decided slots, first slot without a kept entry, kept
        # entries (AO-GPT) / content kept, query-stream kept (ARMD)
        state = [d, zero, zero, zero, zero]
        if prefill and k > 0:
            state = self._add(state, zero, -1, True)
        for step, c in zip(steps.tolist(), counts):
            state = self._add(state, c.astype(np.int64), step, False)
        self.groups: list[Group] = []
        self.prefill: Group | None = None
        self._group(pack, bucket)

    # -- building --------------------------------------------------------------------------

    def _add(self, state, c: np.ndarray, step: int, prefill: bool):
        d, w, ptr, cc, gptr = state
        if self.armd:
            dims = (int((d - cc).max()), int((d - w).max()), int(c.max()))
        else:
            dims = (int((d - w).max()), int(c.max()))
        p = Pass(step, prefill, len(self.passes), dims, tuple(state) + (c,))
        self.passes.append(p)
        grow = c if self.block_mode else np.minimum(c, 1)
        if self.armd:
            kept = (d - w) + grow
            return [d + c, np.where(c > 0, d + grow, d), ptr, d.copy(), gptr + kept]
        kept = (d - w) + np.minimum(c, 1)
        return [d + c, np.where(c > 0, d + 1, d), ptr + kept, cc, gptr]

    def _base(self, p: Pass) -> tuple[int, ...]:
        """Cache fill before the pass (the most over rows): (ptr,) or (content, query)."""
        d, w, ptr, cc, gptr, c = p.state
        return (int(cc.max()), int(gptr.max())) if self.armd else (int(ptr.max()),)

    def _widths(self, p: Pass, exact: bool = False) -> tuple[int, ...]:
        r = (lambda x: x) if exact else _pow2
        if self.armd:
            C, Wg, Q = p.dims
            return (r(C), max(1, r(Wg + Q)))
        return (max(1, r(p.dims[0] + p.dims[1])),)

    def _keys(self, p: Pass, widths: tuple[int, ...]) -> int:
        base = self._base(p)
        return max(b + w for b, w in zip(base, widths))

    def _shapes(self, widths: tuple[int, ...]) -> int:
        """Attention shapes per key level: AO-GPT one; ARMD (C+G rows over the content, G
        rows over the content in the last two-stream layer and over the query stream)."""
        return 2 if self.armd and widths[0] > 0 else 1

    def _group(self, pack: bool, bucket: bool) -> None:
        main = [p for p in self.passes if not p.prefill]
        budget = BUDGET
        for p in self.passes:
            if p.prefill:
                widths = self._widths(p, exact=True)
                self.prefill = Group(widths, _align(self._keys(p, widths)), passes=[p])
                budget -= self._shapes(widths)
        groups: dict[tuple[int, ...], list[Pass]] = {}
        for p in main:
            groups.setdefault(self._widths(p), []).append(p)
        keys = sorted(groups)
        while len(keys) > 1 and sum(self._shapes(w) for w in keys) > budget:
            # merge the group with the fewest passes into the next wider one
            i = min(range(len(keys) - 1), key=lambda j: len(groups[keys[j]]))
            a, b = keys[i], keys[i + 1]
            merged = tuple(max(x, y) for x, y in zip(a, b))
            joined = groups.pop(a) + groups.pop(b) + groups.pop(merged, [])
            groups[merged] = sorted(joined, key=lambda p: p.seq)  # decode order: the replay
            keys = sorted(groups)  # walks a group's table rows one after the other
        if not bucket:
            self._exact(groups)
            return self._finish(pack)
        needs = {w: [self._keys(p, w) for p in groups[w]] for w in keys}
        levels = _key_levels(needs, {w: self._shapes(w) for w in keys}, budget)
        for w in keys:
            mine = [Group(w, level) for level in levels[w]]  # ascending
            self.groups += mine
            bounds = np.array([g.keys for g in mine])
            for p, need in zip(groups[w], needs[w]):
                g = mine[int(np.searchsorted(bounds, need))]
                p.keys = g.keys
                g.passes.append(p)
        self._finish(pack)

    def _exact(self, groups: dict[tuple[int, ...], list[Pass]]) -> None:
        """The CPU's eager path: each pass reads exactly the slots it needs (one group per
        widths and key counts), and a dense pass needs no mask at all."""
        exact: dict[tuple, Group] = {}
        for w, passes in groups.items():
            for p in passes:
                ks = tuple(b + x for b, x in zip(self._base(p), w))  # (K,) or (Kc, Kg)
                g = exact.get((w, ks))
                if g is None:
                    g = exact[w, ks] = Group(w, ks[0], ks[-1])
                g.passes.append(p)
                p.keys, p.dense = g.keys, self._dense(p, w)
                if all(bool((a == a[0]).all()) for a in p.state):
                    # every row alike: each writes slots base, base + 1, ... (kept entries
                    # come first in a pass), so slice copies replace the scatters
                    p.start = tuple(int(b) for b in self._base(p))
        self.groups = list(exact.values())

    def _dense(self, p: Pass, widths: tuple[int, ...]) -> bool:
        """One query per row, every row alike and real, nothing written beside it but the
        newest content (ARMD): the query sees every slot before it, and itself. Only where
        the pass runs at its own widths (``widths``, its group's): a merged group's padding
        entries would be read unmasked."""
        d, w, ptr, cc, gptr, c = p.state
        if widths != self._widths(p, exact=True):
            return False
        if not bool((c == 1).all()) or p.dims[-2] != 0:
            return False
        if self.armd:
            C = p.dims[0]
            return C <= 1 and bool((d - cc == C).all() and (cc == cc[0]).all())
        return bool((ptr == ptr[0]).all())

    def _finish(self, pack: bool) -> None:
        self.groups = [g for g in self.groups if g.passes]
        for g in self.groups + ([self.prefill] if self.prefill else []):
            g.keys_q = g.keys if g.keys_q < 0 else g.keys_q
        for gi, g in enumerate(self.groups):
            for j, p in enumerate(g.passes):
                p.group, p.index = gi, j
            if any(a.seq >= b.seq for a, b in zip(g.passes, g.passes[1:])):
                raise AssertionError(f"plan: group {gi}'s table rows are not in decode order")
        if self.prefill is not None:
            self.prefill.passes[0].keys = self.prefill.keys
        self._pack = pack

    @property
    def capacity(self) -> int:
        """Cache slots to allocate: the most any pass reads (it writes no further)."""
        groups = self.groups + ([self.prefill] if self.prefill else [])
        return max([max(g.keys, g.keys_q) for g in groups], default=_ALIGN)

    def shapes(self) -> set[tuple[int, int]]:
        """The distinct attention (queries, keys) shapes of the decode."""
        out = set()
        for g in self.groups + ([self.prefill] if self.prefill else []):
            if self.armd:
                C, G = g.widths
                out |= {(C + G, g.keys), (G, g.keys), (G, g.keys_q)}
            else:
                out.add((g.width, g.keys))
        return out

    # -- tables ----------------------------------------------------------------------------

    def _tables(self, passes: list[Pass], widths: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """(P, rows, F, width) int64 entries of passes of one width and their (P, rows,
        width) real masks, built in one go (every row of every pass is independent)."""
        rows = 1 if passes[0].prefill else self.batch
        state = tuple(np.concatenate([p.state[i][:rows] for p in passes]) for i in range(6))
        dims = tuple(np.repeat([p.dims[i] for p in passes], rows) for i in range(len(widths) + 1))
        if self.armd:
            tab, real = _armd_entries(state, dims, widths, self.n, self.rank_of, self.block_mode)
        else:
            tab, real = _gpt_entries(state, dims, widths[0], self.n)
        P = len(passes)
        return tab.reshape(P, rows, *tab.shape[1:]), real.reshape(P, rows, -1)

    def ship(self, order: Tensor) -> tuple[Tensor, Tensor]:
        """Build every table and move it to the device of ``order`` (B, n), converting slot
        codes to tok columns and positions there. Returns the sampling table: (B, 2, sum Q)
        with the decided positions (padding: n) and their slots (padding: n)."""
        n, device = self.n, order.device
        B = order.shape[0]
        ext = torch.cat([order, torch.tensor([[n, n + 1]], device=device).expand(B, 2)], 1)
        flat: list = [0]  # running length, then the index arrays
        # groups of one width (and rows) share one table, converted in one go; each group's
        # table is a slice of it
        classes: dict[tuple, list[Group]] = {}
        for g in self.groups + ([self.prefill] if self.prefill else []):
            classes.setdefault((g.widths, g.passes[0].prefill), []).append(g)
        for (widths, _), groups in classes.items():
            passes = [p for g in groups for p in g.passes]
            spans = np.cumsum([0] + [len(g.passes) for g in groups]).tolist()
            tabs, reals = self._tables(passes, widths)
            for p, real in zip(passes, reals, strict=True):
                if self._pack and not p.prefill and real.sum() <= _PACK_BELOW * real.size:
                    p.pack = self._packing(real, widths, flat)
            table = _convert(torch.from_numpy(tabs).to(device), ext, n, self.armd)
            for g, start in zip(groups, spans[:-1], strict=True):
                stop = start + len(g.passes)
                g.has_empty = self.armd and bool(tabs[start:stop, :, A_EMPTY].any())
                g.table = table[start:stop]
        q_codes, offset = [], 0
        for p in self.passes:
            if p.prefill:
                continue
            d, c = p.state[0], p.state[-1]
            q = np.arange(p.dims[-1])[None]
            q_codes.append(np.where(q < c[:, None], d[:, None] + q, n))
            p.q_offset, offset = offset, offset + p.dims[-1]
        codes = np.concatenate(q_codes, 1) if q_codes else np.zeros((B, 0), np.int64)
        real = codes < n  # every slot after the prompt decided exactly once, in every row
        decided = np.sort(np.where(real, codes, n), axis=1)[:, : n - self.k]
        if not ((real.sum(1) == n - self.k).all() and (decided == np.arange(self.k, n)).all()):
            raise AssertionError("plan: a slot is decided twice, or never")
        slots = torch.from_numpy(codes).to(device)
        pack_dev = torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *flat[1:]]))
        pack_dev = pack_dev.to(device)
        for p in self.passes:
            if p.pack is not None:
                p.pack_dev = tuple(pack_dev[a:b] for a, b in p.pack[0]) + p.pack[1:]
        return torch.stack([ext.gather(1, slots), slots], 1)

    def _packing(self, real: np.ndarray, widths: tuple[int, ...], flat: list) -> tuple:
        """Host packing indices of a pass, appended to ``flat``: ((start, stop), ...) spans."""

        def add(a: np.ndarray) -> tuple[int, int]:
            start = flat[0]
            flat.append(a.astype(np.int64))
            flat[0] += len(a)
            return start, start + len(a)

        if not self.armd:
            return ((add(np.flatnonzero(real)),),)
        C, G = widths
        (bc, jc), (bg, jg) = np.nonzero(real[:, :C]), np.nonzero(real[:, C:])
        both = np.concatenate([bc * (C + G) + jc, bg * (C + G) + C + jg])
        return ((add(both), add(bc * C + jc), add(bg * G + jg)), len(bc))


def _convert(tab: Tensor, ext: Tensor, n: int, armd: bool) -> Tensor:
    """Slot codes of a (P, B, F, W) table to tok columns (field 0) and positions (field 1;
    GPT also field 2, the target), by gathering from ``ext`` (B, n + 2): the order, then
    the padding column n and the BOS column n + 1."""
    P, B, F, W = tab.shape

    def look(f: int) -> Tensor:
        codes = tab[:, :, f].permute(1, 0, 2).reshape(B, P * W)
        return ext.gather(1, codes).view(B, P, W).permute(1, 0, 2)

    tab[:, :, 1] = torch.where(tab[:, :, 1] >= n, 0, look(1))
    if not armd:
        tab[:, :, 2] = look(2).clamp(max=n - 1)
    tab[:, :, 0] = look(0)
    return tab.contiguous()


def _slots(kept: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Cache slot of each entry (B, T): the kept ones from ``base`` on, in entry order, then
    the rest (scratch)."""
    perm = np.argsort(~kept, axis=1, kind="stable")
    offset = np.empty_like(perm)
    np.put_along_axis(offset, perm, np.broadcast_to(np.arange(kept.shape[1]), kept.shape), 1)
    return base[:, None] + offset


def _gpt_entries(state, dims, width: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """AO-GPT/GPT entries: [W writes | Q queries | padding] per row (``dims``: each row's
    pass's (W, Q), arrays over rows)."""
    d, w, ptr, _, _, c = state
    W = dims[0][:, None]
    j = np.arange(width)[None]
    d_, w_ = d[:, None], w[:, None]
    wreal = (j < W) & (j < d_ - w_)
    q = j - W
    qreal = (j >= W) & (q < c[:, None])
    s_w, s_q = w_ + j, d_ + q
    in_code = np.where(wreal, s_w - 1, np.where(qreal, d_ - 1, n))
    in_code = np.where(in_code < 0, n + 1, in_code)  # slot -1: the BOS
    rank = np.where(wreal, s_w, np.where(qreal, d_, BIG))
    kept = wreal | (qreal & (q == 0))
    tab = np.stack(
        [
            in_code,
            in_code,
            np.where(wreal, s_w, np.where(qreal, s_q, n)),
            rank,
            _slots(kept, ptr),
            np.where(kept, rank, BIG),
        ],
        axis=1,
    )
    return tab.astype(np.int64), wreal | qreal


def _armd_entries(state, dims, widths, n: int, rank_of: np.ndarray, block: bool):
    """ARMD entries: [content rows | query rows (Wg writes, Q queries, padding)] per row
    (``dims``: each row's pass's (C, Wg, Q), arrays over rows)."""
    d, w, _, cc, gptr, c = state
    Wg = dims[1][:, None]
    Cw, Gw = widths
    d_, w_, cc_ = d[:, None], w[:, None], cc[:, None]
    # content rows: the tokens decided since the last pass
    j = np.arange(Cw)[None]
    s = cc_ + j
    creal = j < d_ - cc_
    crank = np.where(creal, rank_of[np.minimum(s, n)], BIG)
    code = np.where(creal, s, n)
    big = np.full_like(s, BIG)
    content = [code, code, crank + 1, 0 * s, s, crank, big, 1 + 0 * s]
    # query rows: catch-up writes, then the queries
    j = np.arange(Gw)[None]
    wreal = (j < Wg) & (j < d_ - w_)
    q = j - Wg
    qreal = (j >= Wg) & (q < c[:, None])
    real = wreal | qreal
    slot = np.where(wreal, w_ + j, np.where(qreal, d_ + q, n))
    grank = rank_of[np.minimum(slot, n)] if block else np.where(wreal, slot, d_)
    grank = np.where(real, grank, BIG)
    empty = (d_ == 0) | (real & (grank <= rank_of[0]))
    kept = wreal | (qreal & (block | (q == 0)))
    qlim = np.where(real, grank, BIG) + int(block)  # block mode: <= (padding sees all)
    # how many decided tokens a query row averages (prefix aggregation): those of lower rank
    count = np.minimum(np.searchsorted(rank_of[:n], np.minimum(grank, BIG - 1)), d_)
    query = [
        np.full_like(slot, n),
        slot,
        grank,
        empty.astype(np.int64),
        _slots(kept, gptr),
        np.where(kept, grank, BIG),
        qlim,
        np.maximum(count, 1),
    ]
    tab = np.concatenate([np.stack(content, 1), np.stack(query, 1)], axis=2)
    return tab.astype(np.int64), np.concatenate([creal, real], axis=1)


def _key_levels(
    needs: dict[tuple, list[int]], shapes: dict[tuple, int], budget: int
) -> dict[tuple, list[int]]:
    """Key levels per group: each group starts with one (its largest need); then, while the
    budget of attention shapes allows, the group where one more level saves the most
    attention work (rows x keys over its passes) gets it. Levels split a group's sorted
    needs into equal-count chunks, each read at its chunk's largest need."""

    def split(sorted_needs: np.ndarray, m: int) -> list[int]:
        P = len(sorted_needs)
        cuts = sorted({int(np.ceil(i * P / m)) - 1 for i in range(1, m + 1)})
        return sorted({_align(int(sorted_needs[c])) for c in cuts})

    def cost(sorted_needs: np.ndarray, levels: list[int], rows: int) -> float:
        lv = np.array(levels)
        return float(rows * lv[np.searchsorted(lv, sorted_needs)].sum())

    data = {w: np.sort(np.array(v)) for w, v in needs.items()}
    count = {w: 1 for w in needs}
    used = sum(shapes[w] for w in needs)
    while True:
        best, gain = None, 0.0
        for w, v in data.items():
            if used + shapes[w] > budget or count[w] >= len(np.unique(v)):
                continue
            now = cost(v, split(v, count[w]), sum(w))
            later = cost(v, split(v, count[w] + 1), sum(w))
            if (now - later) / shapes[w] > gain:
                best, gain = w, (now - later) / shapes[w]
        if best is None:
            break
        count[best] += 1
        used += shapes[best]
    return {w: split(v, count[w]) for w, v in data.items()}
