"""Passes decided one at a time: the tables of a round and the engine that runs them.

The planned samplers (:mod:`anyorder.sampling.plan`) know every pass before the first. The
speculative and confidence-ordered samplers do not: how many drafts a row accepts, or which
positions are most confident, is known only after a pass. So each pass's table is built on
the device from the rows' counters (device tensors) just before it runs, and goes through
the same engines (:class:`~anyorder.sampling.passes.GPTPasses`, :class:`~anyorder.sampling.
passes.ARMDPasses`): one model, one cache path.

A row's pass (:class:`Round`):

* a *chain* of entries of order slots ``e..chain_end``, causal among themselves and kept
  (AO-GPT: slot ``t``'s input is the token of slot ``t - 1``, its target the position of
  slot ``t``; ARMD: the content of the slots ``cc..qtop-1`` not written yet, then the query
  rows of the chain). Chain entry ``t`` predicts slot ``t`` from slots ``< t``;
* *queries* of any positions (``targets``), each seeing the slots ``< qtop`` and itself only
  (the parallel prediction mask: AO-GPT repeats the input of slot ``qtop``; ARMD uses
  query-stream slots), scratch.

Design choices:

* Entry ``t`` sits at cache slot ``t`` (ARMD: content and query stream alike), queries and
  padding after the chain, so no cache has gaps; :meth:`Engine.forget` hides every slot
  past what a row keeps (rank ``BIG``), and the next pass overwrites them.
* The host needs two numbers per pass, never the rows' counters themselves: the pass's
  widths and the cache slots it reads. On a GPU the first pass has its own widths (a
  prompt's catch-up, known before decoding), every later pass the same fixed ones, and the
  keys read are an upper bound the sampler keeps on the host (:class:`HostCounts`) rounded
  up to one of a few levels (AO-GPT seven; ARMD two, shared by its two caches): at most
  eight attention shapes per decode, the plan's budget (:attr:`Engine.shapes` records
  them), and no pass waits for the one before it. On the CPU (where reading a tensor waits
  for nothing) a pass reads the keys it needs, aligned to 16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor

from anyorder.cache import BIG
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.sampling.graphs import compiling
from anyorder.sampling.passes import ARMDPasses, GPTPasses
from anyorder.sampling.plan import Group

_ALIGN = 16
STATIC_ON_CPU = False
"""Pad, bucket and read the counters late on the CPU too (the tests and benchmarks switch it
on to run what a GPU runs)."""


@dataclass
class Round:
    """One pass of every row (int64 device tensors over rows)."""

    e: Tensor  # AO-GPT: kept entries; ARMD: kept query-stream entries (slots < e)
    cc: Tensor  # ARMD: kept content entries (slots < cc)
    chain_end: Tensor  # the chain is slots e..chain_end (none: e - 1)
    qtop: Tensor  # queries see slots < qtop
    targets: Tensor  # (B, Q) positions the queries predict, a prefix of each row (-1)
    # (B,) chain entries per row, ``max(chain_end - e + 1, 0)``: given by a caller that
    # knows it (three kernels fewer), else computed
    chain: Tensor | None = None
    queries: Tensor = field(init=False)  # (B,) queries per row

    def __post_init__(self) -> None:
        # computed once, here (``cached_property`` takes a lock that torch.compile refuses)
        if self.chain is None:
            self.chain = (self.chain_end - self.e + 1).clamp(min=0)
        self.queries = (self.targets >= 0).sum(dim=1)


_CONSTANTS: dict[tuple, Tensor] = {}


def const(value: int | float, device: torch.device | str) -> Tensor:
    """A 0-dim tensor of ``value`` on ``device`` (long for an int, float32 for a float),
    made once: ``torch.where(c, x, 5)`` fills a new one at every call, a kernel launch on a
    GPU (never written to)."""
    if torch.compiler.is_compiling():  # a compiled pass folds it (a memo would be guarded)
        return torch.tensor(value, device=device)
    key = (value, type(value).__name__, str(device))  # 1 and 1.0 are one dict key
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = torch.tensor(value, device=device)
    return found


def arange(size: int, device: torch.device | str, start: int = 0) -> Tensor:
    """``torch.arange(start, start + size)`` on ``device``, made once (never written to)."""
    if torch.compiler.is_compiling():  # a compiled pass folds it (a memo would be guarded)
        return torch.arange(start, start + size, device=device)
    key = (size, 1, str(device)) if start == 0 else (size, 2, start, str(device))
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = torch.arange(start, start + size, device=device)
    return found


def extend(order: Tensor) -> Tensor:
    """(B, n + 1) the order with slot ``n`` a padding column (position ``n``)."""
    n = order.shape[1]
    return torch.cat([order, order.new_full((order.shape[0], 1), n)], dim=1)


def _queries(r: Round, j: Tensor, L: Tensor) -> tuple[Tensor, Tensor]:
    """Which of the columns ``j`` (1, T) are queries, and their target positions."""
    Q = r.targets.shape[1]
    q = j - L[:, None]
    query = (q >= 0) & (q < r.queries[:, None])
    if Q == 0:
        return query, torch.zeros_like(q)
    target = r.targets.gather(1, q.clamp(0, Q - 1))  # a query's column is < Q
    return query, torch.where(query, target, const(0, q.device))


def _check_width(need: Tensor, width: int, what: str) -> None:
    """A sampler bug if a pass outgrows the widths it was given (checked where reading is
    free: on the CPU, unless it runs the GPU's path)."""
    if torch.compiler.is_compiling():  # a compiled pass reads nothing back
        return
    if need.device.type == "cpu" and not STATIC_ON_CPU and int(need.max()) > width:
        raise RuntimeError(f"a pass of {int(need.max())} {what} in width {width}")


def gpt_table(ext: Tensor, r: Round, width: int | None = None) -> Tensor:
    """AO-GPT entries of one pass, (B, 6, T) int64 in positions (see plan.G_*): per row
    [chain | queries | padding] at cache slots from ``e`` on. ``ext``: :func:`extend`'s."""
    n = ext.shape[1] - 1
    L = r.chain
    if width is None:
        T = int((L + r.queries).max())
    else:
        T = width
        _check_width(L + r.queries, T, "entries")
    device = ext.device
    j = arange(T, device)[None]
    s = r.e[:, None] + j  # chain slot = cache slot
    chain = j < L[:, None]
    query, qtarget = _queries(r, j, L)
    real = chain | query
    in_slot = torch.where(chain, s - 1, r.qtop[:, None] - 1)
    bos = real & (in_slot < 0)
    col = torch.where(real, ext.gather(1, in_slot.clamp(0, n)), const(n, device))
    col = torch.where(bos, const(n + 1, device), col)
    pos = col * (col < n)  # 0 for the BOS (n + 1) and the padding (n)
    target = torch.where(chain, ext.gather(1, s.clamp(0, n)), qtarget)
    big = const(BIG, device)
    limit = torch.where(chain, s, torch.where(query, r.qtop[:, None], big))
    keep = torch.where(chain, s, big)
    return torch.stack([col, pos, target, limit, s, keep], dim=1)


def armd_table(
    ext: Tensor, r: Round, widths: tuple[int, int] | None = None
) -> tuple[Tensor, tuple[int, int]]:
    """ARMD entries of one pass, (B, 8, C + G) int64 in positions (see plan.A_*): content
    rows of slots ``cc..qtop-1``; query rows [chain | queries | padding]."""
    n = ext.shape[1] - 1
    Cn = (r.qtop - r.cc).clamp(min=0)
    L = r.chain
    if widths is None:
        C, G = int(Cn.max()), int((L + r.queries).max())
    else:
        C, G = widths
        _check_width(Cn, C, "content rows")
        _check_width(L + r.queries, G, "query rows")
    device = ext.device
    big = const(BIG, device)
    j = arange(C, device)[None]
    s = r.cc[:, None] + j
    creal = j < Cn[:, None]
    cpos = torch.where(creal, ext.gather(1, s.clamp(0, n)), const(n, device))
    crank = torch.where(creal, s, big)
    fixed = [const(v, device).expand_as(s) for v in (0, BIG, 1)]  # constant rows: no kernel
    content = [cpos, cpos * creal, crank + 1, fixed[0], s, crank, fixed[1], fixed[2]]
    j = arange(G, device)[None]
    s = r.e[:, None] + j
    chain = j < L[:, None]
    query, qtarget = _queries(r, j, L)
    real = chain | query
    lim = torch.where(chain, s, torch.where(query, r.qtop[:, None], big))
    rows = [
        const(n, device).expand_as(s),
        torch.where(chain, ext.gather(1, s.clamp(0, n)), qtarget),
        lim,
        (real & (lim <= 0)).long(),  # sees no content: ARMD's first slot
        s,
        torch.where(chain, s, big),
        lim,
        torch.where(real, lim.clamp(min=1), const(1, device)),  # the content a row averages
    ]
    return torch.cat([torch.stack(content, 1), torch.stack(rows, 1)], dim=2), (C, G)


def _extent(end: Tensor, used: Tensor) -> int:
    """The cache slots the rows with entries reach (``end`` where ``used > 0``; read)."""
    return int(torch.where(used > 0, end, 0).max())


def _level(keys: int, capacity: int, levels: int | None) -> int:
    """Cache slots a pass reads: what it needs, aligned; on a GPU one of ``levels``."""
    step = _ALIGN if levels is None else -(-capacity // levels)
    return min(capacity, -(-keys // step) * step)


class HostCounts:
    """What the host knows of the rows' commit counts ``c`` without waiting for the device.

    After each pass the sampler hands over the new counts (a device tensor). On the CPU they
    are read at once (reading waits for nothing). On a GPU (and under
    :data:`STATIC_ON_CPU`) they are copied to pinned memory behind an event after every
    pass, and read ``lag`` passes late (the host waits at most for the pass before last
    while the last is queued, so the device never idles on the host), and only when the
    read may end the decode or every ``every`` passes: while each row has more slots left
    than its passes could have filled, a read tells the loop nothing it must know. Between
    reads each pass adds at least one and at most ``most`` tokens to a row still decoding,
    which bounds the counts (:meth:`reach`, :meth:`finished`); the decode ends on the same
    pass as with a read after every pass. ``reads`` counts the reads, ``end_checks`` those
    made because they may end the decode.

    Args:
        counts: the counts before the first pass (host).
        most: the most tokens a pass commits per row.
        n: sequence length (a row with ``c >= n`` is done).
        late: read the counts ``lag`` passes late (the GPU's way).
    """

    lag = 2
    every = 8  # passes between reads that cannot end the decode (the key levels' bound)

    def __init__(self, counts: np.ndarray, most: int, n: int, late: bool, device) -> None:
        self.known, self.at = counts.astype(np.int64).copy(), 0  # counts after ``at`` passes
        self.most, self.n, self.passes = most, n, 0
        self.late = late
        cuda = torch.device(device).type == "cuda"
        self.host = [torch.zeros(len(counts), dtype=torch.long, pin_memory=cuda) for _ in range(3)]
        for h in self.host:
            h._anyorder_host_staging = True  # host memory: reading it is no sync
        self.events = [torch.cuda.Event() if cuda else None for _ in range(3)]
        self.reads = self.end_checks = 0  # reads of the counts; those that may end it

    def note(self, counts: Tensor) -> None:
        """The counts after the pass just queued (a device tensor)."""
        self.passes += 1
        if not self.late:
            self.known, self.at = counts.cpu().numpy().copy(), self.passes  # not a view
            self.reads += 1
            return
        slot = self.passes % 3
        self.host[slot].copy_(counts, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        then = self.passes - self.lag  # the pass before last, whose counts may be read
        if then < 1:
            return
        stale = then - self.at >= self.every
        if stale or self._may_end(then):
            old = then % 3
            if self.events[old] is not None:
                self.events[old].synchronize()  # done or nearly: one pass is still queued
            self.known, self.at = self.host[old].numpy().copy(), then
            self.reads += 1
            self.end_checks += not stale

    def _may_end(self, then: int) -> bool:
        """Whether the counts after pass ``then`` may show every row done by now (each row
        at most ``most`` a pass until then, and one a pass since): else :meth:`finished`
        stays False whatever they are, and the read can wait."""
        left = self.n - self.known
        return bool((left <= self.most * (then - self.at) + self.passes - then).all())

    def bound(self) -> np.ndarray:
        """(B,) an upper bound of each row's count now."""
        return np.minimum(self.known + self.most * (self.passes - self.at), self.n)

    def reach(self) -> int:
        """An upper bound of the count of every row that may still be decoding (0: none)."""
        live = self.known < self.n
        return int(self.bound()[live].max(initial=0))

    def finished(self) -> bool:
        """Whether every row is surely done: known done, or so since (a pass commits at
        least one token of every row still decoding)."""
        return bool((self.known + (self.passes - self.at) >= self.n).all())


class Engine:
    """The passes of one decode over the static caches of one model.

    Args:
        model: ``aogpt`` or ``armd``.
        batch, n: rows and sequence length.
        extra: the most cache slots a pass writes past what a row keeps.
        widths: on a GPU, the fixed widths of every pass after the first (``T``; ARMD
            ``(C, G)``); ignored on the CPU.
        static: fixed widths and key levels (None: on a GPU, or :data:`STATIC_ON_CPU`; a
            captured decode asks for them on any device).
    """

    def __init__(
        self,
        model: AnyOrderLM,
        batch: int,
        n: int,
        extra: int,
        widths: int | tuple[int, int],
        static: bool | None = None,
    ) -> None:
        self.armd = isinstance(model, ARMD)
        self.n = n
        self.capacity = -(-(n + extra + 1) // _ALIGN) * _ALIGN
        plan = SimpleNamespace(capacity=self.capacity, block_mode=False)
        engine = ARMDPasses if self.armd else GPTPasses
        self.passes = engine(model, plan, batch)
        self.static = model.device.type == "cuda" or STATIC_ON_CPU if static is None else static
        self.widths = widths
        self.shapes: set[tuple] = set()  # (queries, keys) of every attention call

    def fixed_keys(self, reach: int) -> int:
        """The cache slots a fixed-width pass reads when the rows have kept at most
        ``reach`` slots: one of a few levels (a captured round is one graph per level)."""
        width = max(self.widths) if self.armd else self.widths
        keys = _level(reach + width, self.capacity, 2 if self.armd else 7)
        self._note(self.widths, keys, keys)  # here, outside any compiled round
        if not torch.compiler.is_compiling() and compiling() is not None:
            self.passes.prepare_reads(Group((), keys, keys))  # views made before it compiles
        return keys

    def _note(self, widths: int | tuple[int, int], kc: int, kq: int) -> None:
        """Record a pass's attention shapes (a host set: a compiled pass leaves it alone,
        else its guards would read the set and recompile as it grows)."""
        if torch.compiler.is_compiling():
            return
        if self.armd:
            C, G = widths
            self.shapes |= {(C + G, kc), (G, kc), (G, kq)}
        else:
            self.shapes.add((widths, kc))

    def canonical(self, reach: int) -> int:
        """The one ``reach`` that stands for its key level (:meth:`fixed_keys` gives the same
        level): a round captured or compiled at some reach of a level keeps that value, and
        a compiled round's guards hold for every decode only if the value is the level's."""
        width = max(self.widths) if self.armd else self.widths
        return self.fixed_keys(reach) - width

    def run(
        self,
        ext: Tensor,
        r: Round,
        tok: Tensor,
        start: int,
        first: bool,
        reach: int,
        table: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, J, V) of the pass's columns ``start..`` (chain, then queries).

        Args:
            ext: the rows' orders (:func:`extend`).
            r: the pass of every row.
            tok: the token buffer.
            start: the first column returned.
            first: the first pass (its own widths and keys).
            reach: an upper bound of ``e`` over the rows with entries (from
                :class:`HostCounts`), for the fixed-width passes; the first pass and the
                CPU read the exact extent from ``r`` instead.
            table: on a GPU after the first pass, the pass's table, built by the sampler
                in fewer ops than :func:`gpt_table`/:func:`armd_table` (``r`` unused).
        """
        fixed = not first and self.static
        widths = self.widths if fixed else None
        levels = (2 if self.armd else 7) if fixed else None
        used = None if fixed else r.chain + r.queries
        if table is not None and used is not None:
            raise RuntimeError("a ready table is for the fixed-width passes only")
        if self.armd:
            if table is None:
                tab, (C, G) = armd_table(ext, r, widths)
            else:
                tab, (C, G) = table, widths
            if used is None:  # one level for both caches (cc <= e): two shapes per level
                kc = kq = self.fixed_keys(reach)
            else:  # exactly the slots the real entries need
                content = (r.qtop - r.cc).clamp(min=0)
                kc = _level(_extent(r.qtop, content), self.capacity, levels)
                kq = _level(_extent(r.e + used, used), self.capacity, levels)
                if levels is not None:
                    kc = kq = max(kc, kq)
            group = Group((C, G), kc, kq)
            # after the first pass every query row sees some content (the samplers commit
            # a token per row and pass); where reading is free, look
            group.has_empty = first or (not fixed and bool(tab[:, 3, C:].any()))
            self._note((C, G), kc, kq)
            queries = slice(start, G)
        else:
            tab = gpt_table(ext, r, widths) if table is None else table
            T = tab.shape[2]
            if used is None:
                kk = self.fixed_keys(reach)
            else:
                kk = _level(_extent(r.e + used, used), self.capacity, levels)
            group = Group((T,), kk)
            self._note(T, kk, kk)
            queries = slice(start, T)
        return self.passes.run(tab, tok, group, queries=queries)

    def forget(self, keep: Tensor, keep_content: Tensor | None = None) -> None:
        """Hide every cache slot at or past ``keep`` (B,) (ARMD: the query stream; its
        content past ``keep_content``): the entries built on rejected drafts, scratch."""
        caches = [(self.passes.cache, keep)]
        if self.armd:
            cache = self.passes.cache
            caches = [(cache.content, keep_content), (cache.query, keep)]
        for cache, limit in caches:
            cache.rank.masked_fill_(cache.slot_ids[None] >= limit[:, None], BIG)
