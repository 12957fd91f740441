"""What a speculative round looks up instead of computing: its tables, indexed by the counts.

After the first pass of a speculative decode (:mod:`anyorder.sampling.speculative`), a row
that has committed ``c`` slots of its order drafts ``D = min(K - 1, n - 1 - c)`` of them,
so everything the round's index bookkeeping computes is a function of ``c`` (the pass's
table), then of ``c`` and the accepted drafts ``m`` (the slots committed, the next drafts'
slots and columns, the new counters), and of the row's order. On a GPU each small op on a
(B,) or (B, K) index tensor is a kernel launch, a few microseconds of a replayed round, so
the round computes none of them: the decode computes them once for every ``c`` (and ``m``),
and a round looks up its rows' entries with one index op (and an add), and the order's part
of them with one gather of a per-row table of values.

Design choices:

* **Codes, then values.** A pass table's entry is either a number that depends on ``c``
  alone (a cache slot, a rank limit, ``BIG``) or a lookup in the row's order (an input or
  a target position). Every entry is stored as a *code*, an index into the row's values
  (:func:`lookups`): the numbers ``0 .. n + 2K - 1`` themselves, ``BIG``, ``BIG + 1``,
  then the order's three views. The table of a pass is then ``values.gather(codes[c])``:
  two kernels, whatever the table holds. The codes are built by the formulas of the
  general builders (:func:`gpt_codes`, :func:`armd_codes`; the tests check the tables
  entry for entry against :func:`~anyorder.sampling.rounds.gpt_table` and
  :func:`~anyorder.sampling.rounds.armd_table`).
* **After the ratio tests** (:class:`After`): one row of numbers per ``c`` and leading run
  ``r`` of passed tests (the accepted drafts ``m = min(r, D)`` among them), looked up by
  one index op; the positions among them come out of one gather of the order.
* **Rows independent of n** (:func:`by_count`): below the last ``2K`` counts every entry
  of both tables is a constant or ``c`` plus a constant, so those counts share one stored
  row, a base and a 0/1 mask (the row of ``c`` is ``base + c * mask``), and only the last
  ``2K`` counts keep a row each. The round finds its rows' index with one kernel
  (:meth:`Counts.index`) and adds ``c * mask`` with one more per table.
* The tables cost ``(2K + 1) x 2 x F x W`` (a pass table's size) and ``(2K + 1) x K x 2 x
  (4K + 7)`` int64 entries per decode, whatever ``n``: under 1 MB at ``K = 16``, 38 MB at
  ``K = 64`` (a row per count took 460 MB at ``n = 32768``, ``K = 16``), made once, on the
  device.
* **A row per count where that is small** (:data:`DIRECT_BYTES`; ``n = 1024``, ``K = 4``
  takes 1.1 MB, 1.5 MB for ARMD): the round then looks its rows up by the counts
  themselves, three kernels fewer (the index search and the two adds); the same entries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from anyorder.cache import BIG
from anyorder.sampling.rounds import arange


def _offsets(n: int, K: int) -> tuple[int, int, int, int, int]:
    """Where the values of :func:`lookups` start: ``BIG``, ``BIG + 1``, the shifted order,
    the entry positions, the padded order (the numbers ``0 .. n + 2K - 1`` come first)."""
    big = n + 2 * K
    shifted = big + 2
    return big, big + 1, shifted, shifted + n + 2, shifted + 2 * (n + 2)


def lookups(ext: Tensor, K: int) -> Tensor:
    """(B, W) the values a lean table's codes index, per row of the orders ``ext`` (B,
    n + 1), made once per decode: the numbers ``0 .. n + 2K - 1``; ``BIG``; ``BIG + 1``;
    ``shifted`` (n + 2; column ``i`` the position of slot ``i - 1``, column 0 the BOS's,
    ``n + 1``, column ``n + 1`` the padding's, ``n``); ``entry``, the same with 0 for the
    BOS and the padding (an entry's position); ``padded`` (n + 2K - 1), the order with 0
    past slot ``n - 1`` (a column's target)."""
    B, n = ext.shape[0], ext.shape[1] - 1
    shifted = torch.cat([ext.new_full((B, 1), n + 1), ext], dim=1)
    padded = torch.cat([ext[:, :n], ext.new_zeros(B, 2 * K - 1)], dim=1)
    numbers = torch.arange(n + 2 * K, device=ext.device).expand(B, -1)
    bigs = torch.tensor([BIG, BIG + 1], device=ext.device).expand(B, -1)
    return torch.cat([numbers, bigs, shifted, shifted * (shifted < n), padded], dim=1)


def columns(c: Tensor, D: Tensor, K: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``2K - 1`` columns of a pass after the first: their slots ``s = c + j``, which are
    chain entries (``j <= D``) and which are real (``j < D + K``), both only below slot
    ``n`` (a finished row, ``c = n``, has none; a live row has ``D <= n - 1 - c``)."""
    device = c.device
    s = c[:, None] + arange(2 * K - 1, device)[None]
    inside = s < n
    chain = (arange(2 * K - 1, device)[None] <= D[:, None]) & inside
    real = (arange(2 * K - 1, device, start=-K)[None] < D[:, None]) & inside
    return s, chain, real


def gpt_codes(c: Tensor, D: Tensor, K: int, n: int) -> Tensor:
    """(B, 6, 2K - 1) the codes of the AO-GPT table of a pass after the first (rows of
    ``c``, ``D``): after the first pass every row keeps exactly its committed slots (``e =
    c``), and column ``j`` of a live row is slot ``c + j`` either way, a chain entry (``j <=
    D``, its input the token of slot ``c + j - 1``) or a draft query (its input that of slot
    ``c + D - 1``, as the parallel prediction mask repeats it), real while ``j < D + K`` and
    ``c + j < n``."""
    big, _, shifted, entry, padded = _offsets(n, K)
    s, chain, real = columns(c, D, K, n)
    top = (c + D)[:, None]
    # the input slot plus one (column 0: the BOS), the padding's column n + 1 if not real
    slot = torch.where(real, torch.where(chain, s, top), n + 1)
    limit = torch.where(chain, s, torch.where(real, top, big))
    keep = torch.where(chain, s, big)
    target = torch.where(real, padded + s, 0)
    return torch.stack([shifted + slot, entry + slot, target, limit, s, keep], 1)


def armd_codes(c: Tensor, D: Tensor, live: Tensor, K: int, n: int) -> Tensor:
    """(B, 8, K + 2K - 1) the codes of the ARMD table of a pass after the first (``c >=
    1``): content rows of slots ``c - 1 .. c + D - 1`` (the closing token of the last round,
    then the drafts), query rows as :func:`gpt_codes`'s columns."""
    big, big1, _, _, padded = _offsets(n, K)
    j = arange(K, c.device)[None]
    s = (c - 1)[:, None] + j
    creal = (j <= D[:, None]) & live[:, None]
    cpos = torch.where(creal, padded + s, 0)  # the position, 0 if not real
    crank = torch.where(creal, s, big)
    fixed = [torch.full_like(s, v) for v in (0, big, 1)]
    content = [torch.where(creal, cpos, n), cpos, torch.where(creal, s + 1, big1), fixed[0], s,
               crank, fixed[1], fixed[2]]  # fmt: skip
    s, chain, real = columns(c, D, K, n)
    lim = torch.where(chain, s, torch.where(real, (c + D)[:, None], big))
    rows = [
        torch.full_like(s, n),
        torch.where(real, padded + s, 0),
        lim,
        (real & (lim <= 0)).long(),  # sees no content: ARMD's first slot
        s,
        torch.where(chain, s, big),
        lim,
        torch.where(real, lim.clamp(min=1), 1),  # the content a row averages
    ]
    return torch.cat([torch.stack(content, 1), torch.stack(rows, 1)], dim=2)


def drafts_of(c: Tensor, K: int, n: int) -> Tensor:
    """The drafts a row verifies in a pass after the first: ``min(K - 1, n - 1 - c)``."""
    return (n - 1 - c).clamp(0, K - 1)


DIRECT_BYTES = 16 << 20
"""The most bytes a decode's lookup tables take as a row per count (:class:`Counts`); past
it, the counts below the last ``2K`` share one row (:func:`by_count`)."""


def direct_bytes(n: int, K: int, armd: bool, codes: bool) -> int:
    """The bytes of a decode's tables kept as a row per count (0..n), int64: the pass
    table's codes (``F x W``) and :class:`After`'s ``K`` rows of ``4K + 7``."""
    fw = 8 * (3 * K - 1) if armd else 6 * (2 * K - 1)
    return 8 * (n + 1) * ((fw if codes else 0) + K * (4 * K + 7))


def tail_start(n: int, K: int) -> int | None:
    """``c1``, the last count of the steady run (:func:`by_count`): ``n - 2K``, or None when
    the decode is too short to have one (then every count keeps its own row)."""
    return n - 2 * K if n - 2 * K >= 2 else None


def by_count(rows_of, n: int, c1: int | None, device: torch.device | str) -> Tensor:
    """(n - c1 + 1, 2, ...) the rows ``rows_of(c)`` of every count ``c`` (0..n), kept in
    rows independent of ``n``: row 0 holds the steady counts ``c <= c1``, whose every entry
    is a constant or ``c`` plus a constant, as a base (its value at ``c = 0``) and a 0/1
    mask, the row of ``c`` being ``base + c * mask``; row ``t >= 1`` holds count ``c1 + t``
    as it is (mask 0). ``c1`` None: (n + 1, 1, ...), every count's row as it is. Looked up
    by :func:`at_counts`."""
    if c1 is None:
        return rows_of(torch.arange(n + 1, device=device))[:, None]
    rows = rows_of(torch.arange(c1 - 1, n + 1, device=device))  # c1 - 1, c1, then the tail
    mask = rows[1] - rows[0]
    steady = torch.stack([rows[1] - c1 * mask, mask])[None]
    return torch.cat([steady, torch.stack([rows[2:], torch.zeros_like(rows[2:])], 1)])


def at_counts(rows: Tensor, c: Tensor) -> Tensor:
    """The rows (B, ...) of the counts ``c`` (B,) from the (B, 2, ...) base and mask that a
    :func:`by_count` table gave at their index (:meth:`Counts.index`): one kernel (none
    from a (B, 1, ...) row per count)."""
    if rows.shape[1] == 1:
        return rows[:, 0]
    return torch.addcmul(rows[:, 0], c.view(-1, *[1] * (rows.dim() - 2)), rows[:, 1])


def count_codes(c: Tensor, K: int, n: int, armd: bool) -> Tensor:
    """(len(c), F * W) the codes of a pass after the first at the counts ``c`` (a count 0,
    which no such pass sees, as 1)."""
    c = c.clamp(min=1)
    D = drafts_of(c, K, n)
    codes = armd_codes(c, D, c < n, K, n) if armd else gpt_codes(c, D, K, n)
    return codes.flatten(1)


class Counts:
    """The tables a round after the first looks up by its rows' counts ``c``: :attr:`codes`
    (the pass table's codes, for ``c >= 1``) and :attr:`after` (:class:`After`), a row per
    count within :data:`DIRECT_BYTES` (:attr:`direct`), else in rows independent of ``n``
    (:func:`by_count`). :meth:`index` finds the rows' entries (one kernel, shared by both;
    none for a row per count)."""

    def __init__(self, n: int, K: int, armd: bool, codes: bool, device) -> None:
        c1 = tail_start(n, K)
        self.direct = c1 is None or direct_bytes(n, K, armd, codes) <= DIRECT_BYTES
        c1 = None if self.direct else c1
        # count c's row: #{b < c} (a row per count: c itself)
        self.bounds = None if self.direct else torch.arange(c1, n + 1, device=device)
        self.codes = (
            by_count(lambda c: count_codes(c, K, n, armd), n, c1, device) if codes else None
        )
        self.after = After(n, K, c1, device)

    def index(self, c: Tensor) -> Tensor:
        """The rows' indices into the tables: ``max(c - c1, 0)``, in one kernel (``c``
        itself for a row per count)."""
        return c if self.direct else torch.bucketize(c, self.bounds)

    def codes_at(self, i: Tensor, c: Tensor) -> Tensor:
        """(B, F * W) the codes of the pass table at the rows' counts ``c``, index ``i``."""
        return at_counts(self.codes.index_select(0, i), c)

    def after_at(self, i: Tensor, c: Tensor, r: Tensor) -> Tensor:
        """(B, Y) the rows of :class:`After` at the rows' counts ``c`` (index ``i``), runs
        ``r``."""
        return at_counts(self.after.table[i, r], c)


def table(values: Tensor, codes: Tensor) -> Tensor:
    """The table (B, F, W) of the ``codes`` (B, F, W) in the rows' ``values``."""
    return values.gather(1, codes.flatten(1)).view(codes.shape)


def spec_gpt_table(ext: Tensor, c: Tensor, D: Tensor, K: int) -> Tensor:
    """The AO-GPT table (B, 6, 2K - 1) of a pass after the first, as
    :func:`~anyorder.sampling.speculative._round` and :func:`~anyorder.sampling.rounds.
    gpt_table` build it (the tests check they agree)."""
    return table(lookups(ext, K), gpt_codes(c, D, K, ext.shape[1] - 1))


def spec_armd_table(ext: Tensor, c: Tensor, D: Tensor, live: Tensor, K: int) -> Tensor:
    """The ARMD table (B, 8, K + 2K - 1) of a pass after the first, as
    :func:`~anyorder.sampling.speculative._round` and :func:`~anyorder.sampling.rounds.
    armd_table` build it (the tests check they agree)."""
    return table(lookups(ext, K), armd_codes(c, D, live, K, ext.shape[1] - 1))


class After:
    """What a round does after its ratio tests, for every count ``c`` (0..n) and leading run
    ``r`` (0..K-1) of passed tests: one row of numbers per ``(c, r)`` (:meth:`rows`), kept
    by :func:`by_count` in :attr:`table` (n - c1 + 1, K, 2, Y) int64 (a row per count: (n +
    1, K, 1, Y)) and looked up at the rows' ``(c, r)`` by one index op and one add (none
    for a row per count; :meth:`Counts.after_at`). The accepted
    drafts are ``m = min(r, D)``, ``D = min(K - 1, n - 1 - c)`` the drafts of a pass after
    the first (the first pass verifies none: it looks up at ``r = m = 0``). Its columns
    (each an attribute, a slice of them):

    * :attr:`positions` (a prefix, slots of the order, gathered at once): the closing slot
      ``c + m``; the ``2K - 1`` columns' slots, ``c + j`` where committed (``j <= m``),
      else the padding slot ``n``; the next drafts' slots ``c' + i`` (``i < D'``, else
      ``n``), where ``c' = c + m + 1`` (a finished row: ``c``) and ``D' = min(K - 1,
      n - 1 - c')``;
    * :attr:`cols`: the pass's columns the next drafts are drawn from (``m + 1 + i``, at
      most ``2K - 2``);
    * :attr:`state`: ``c'``, ``D'``; :attr:`keep_content`: ``max(c' - 1, 0)`` (ARMD's
      content kept);
    * :attr:`moves`: what a pass after the first adds to the rows' counters ``c``, ``D``,
      the drafts verified and accepted, the pass: ``c' - c``, ``D' - D``, ``D``, ``m``,
      1; :attr:`accepted`: ``m``;
    * :attr:`p_row`: the row of the drafts' laws (``K - 1`` rows, then one of zeros) the
      closing token's residual takes off: ``m`` after a rejection (``m < D``), else the
      zeros (``K - 1``)."""

    def __init__(self, n: int, K: int, c1: int | None, device: torch.device | str) -> None:
        self.n, self.K = n, K
        # (n - c1 + 1, K, 2, Y): a count's base and mask rows (by_count) at each run (or
        # its row alone: (n + 1, K, 1, Y))
        self.table = by_count(self.rows, n, c1, device).transpose(1, 2).contiguous()
        for name, columns in self.layout.items():
            setattr(self, name, columns)
        # the single columns, as indices
        self.keep_content, self.p_row = self.keep_content.start, self.p_row.start
        self.accepted = self.moves.start + 3
        # within the positions: the closing slot (0), the columns' slots (1 .. J), the next
        # drafts'
        J, Kd = 2 * K - 1, max(K - 1, 0)
        self.next_drafts = slice(1 + J, 1 + J + Kd)

    def rows(self, c: Tensor) -> Tensor:
        """(len(c), K, Y) the rows of the counts ``c`` at every run; names the columns."""
        n, K, device = self.n, self.K, c.device
        J, Kd = 2 * K - 1, max(K - 1, 0)
        c = c[:, None, None]
        D = drafts_of(c, K, n)
        m = torch.arange(K, device=device)[None, :, None].minimum(D)  # (len(c), K, 1)
        c2 = c + m + (c < n)
        D2 = drafts_of(c2, K, n)
        jj, i = torch.arange(J, device=device), torch.arange(Kd, device=device)
        real = i < D2
        parts = [  # (name, columns)
            ("positions", [c + m, torch.where(jj <= m, c + jj, n), torch.where(real, c2 + i, n)]),
            ("cols", [(m + 1 + i).clamp(max=J - 1)]),
            ("state", [c2, D2]),
            ("keep_content", [(c2 - 1).clamp(min=0)]),
            ("moves", [c2 - c, D2 - D, D, m, torch.ones_like(m)]),
            ("p_row", [torch.where(m < D, m, Kd)]),
        ]
        grid = (len(c), K, -1)
        columns, at, self.layout = [], 0, {}
        for name, group in parts:
            group = [t.expand(grid) for t in group]
            width = sum(t.shape[2] for t in group)
            self.layout[name] = slice(at, at + width)
            columns += group
            at += width
        return torch.cat(columns, dim=2)
