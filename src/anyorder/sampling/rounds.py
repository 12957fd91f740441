"""Passes decided one at a time: the tables of a round and the engine that runs them.

The planned samplers (:mod:`anyorder.sampling.plan`) know every pass before the first. The
speculative and confidence-ordered samplers do not: how many drafts a row accepts, or which
positions are most confident, is known only after a pass. So each pass's table is built on
the host from the rows' counters just before it runs, and goes through the same engines
(:class:`~anyorder.sampling.passes.GPTPasses`, :class:`~anyorder.sampling.passes.
ARMDPasses`): one model, one cache path.

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
* On a GPU the first pass has its own widths (a prompt's catch-up), every later pass the
  same fixed ones, and the keys read are rounded up to one of a few levels (AO-GPT seven;
  ARMD two, shared by its two caches): at most eight attention shapes per decode, the
  plan's budget (:attr:`Engine.shapes` records them). On the CPU a pass reads the keys it
  needs, aligned to 16.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor

from anyorder.cache import BIG
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.sampling.passes import ARMDPasses, GPTPasses
from anyorder.sampling.plan import Group

_ALIGN = 16
STATIC_ON_CPU = False
"""Pad and bucket on the CPU too (the benchmarks switch it on to count what a GPU runs)."""


@dataclass
class Round:
    """One pass of every row (numpy int64 arrays over rows)."""

    e: np.ndarray  # AO-GPT: kept entries; ARMD: kept query-stream entries (slots < e)
    cc: np.ndarray  # ARMD: kept content entries (slots < cc)
    chain_end: np.ndarray  # the chain is slots e..chain_end (none: e - 1)
    qtop: np.ndarray  # queries see slots < qtop
    targets: np.ndarray  # (B, Q) positions the queries predict, a prefix of each row (-1)

    @property
    def chain(self) -> np.ndarray:
        return np.maximum(self.chain_end - self.e + 1, 0)

    @property
    def queries(self) -> np.ndarray:
        return (self.targets >= 0).sum(axis=1)


def _lookup(order: np.ndarray, n: int):
    ext = np.concatenate([order, np.full((order.shape[0], 1), n)], axis=1)  # slot n: padding
    return lambda slots: np.take_along_axis(ext, np.clip(slots, 0, n), 1)


def _queries(r: Round, j: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which of the columns ``j`` (1, T) are queries, and their target positions."""
    Q = r.targets.shape[1]
    q = j - L[:, None]
    query = (q >= 0) & (q < r.queries[:, None])
    padded = np.concatenate([r.targets, np.full((len(L), 1), -1)], axis=1)
    target = np.take_along_axis(padded, np.where(query, q, Q), 1)
    return query, np.where(query, target, 0)


def gpt_table(order: np.ndarray, r: Round, n: int, width: int | None = None) -> np.ndarray:
    """AO-GPT entries of one pass, (B, 6, T) int64 in positions (see plan.G_*): per row
    [chain | queries | padding] at cache slots from ``e`` on."""
    look = _lookup(order, n)
    L = r.chain
    T = int((L + r.queries).max()) if width is None else width
    if int((L + r.queries).max()) > T:
        raise RuntimeError(f"a pass of {int((L + r.queries).max())} entries in width {T}")
    j = np.arange(T)[None]
    s = r.e[:, None] + j  # chain slot = cache slot
    chain = j < L[:, None]
    query, qtarget = _queries(r, j, L)
    real = chain | query
    in_slot = np.where(chain, s - 1, r.qtop[:, None] - 1)
    bos = real & (in_slot < 0)
    col = np.where(bos, n + 1, np.where(real, look(in_slot), n))
    pos = np.where(real & ~bos, col, 0)
    target = np.where(chain, look(s), qtarget)
    limit = np.where(chain, s, np.where(query, r.qtop[:, None], BIG))
    keep = np.where(chain, s, BIG)
    return np.stack([col, pos, target, limit, s, keep], axis=1).astype(np.int64)


def armd_table(
    order: np.ndarray, r: Round, n: int, widths: tuple[int, int] | None = None
) -> tuple[np.ndarray, tuple[int, int]]:
    """ARMD entries of one pass, (B, 8, C + G) int64 in positions (see plan.A_*): content
    rows of slots ``cc..qtop-1``; query rows [chain | queries | padding]."""
    look = _lookup(order, n)
    Cn = np.maximum(r.qtop - r.cc, 0)
    L = r.chain
    C, G = (int(Cn.max()), int((L + r.queries).max())) if widths is None else widths
    if int(Cn.max()) > C or int((L + r.queries).max()) > G:
        raise RuntimeError(f"a pass wider than its widths {(C, G)}")  # a sampler bug
    j = np.arange(C)[None]
    s = r.cc[:, None] + j
    creal = j < Cn[:, None]
    cpos = np.where(creal, look(s), n)
    crank = np.where(creal, s, BIG)
    ones = np.ones_like(s)
    content = [cpos, np.where(creal, cpos, 0), crank + 1, 0 * s, s, crank, BIG * ones, ones]
    j = np.arange(G)[None]
    s = r.e[:, None] + j
    chain = j < L[:, None]
    query, qtarget = _queries(r, j, L)
    real = chain | query
    lim = np.where(chain, s, np.where(query, r.qtop[:, None], BIG))
    ones = np.ones_like(s)
    rows = [
        n * ones,
        np.where(chain, look(s), qtarget),
        lim,
        (real & (lim <= 0)).astype(np.int64),  # sees no content: ARMD's first slot
        s,
        np.where(chain, s, BIG),
        lim,
        np.where(real, np.maximum(lim, 1), 1),  # the content a query row averages
    ]
    tab = np.concatenate([np.stack(content, 1), np.stack(rows, 1)], axis=2)
    return tab.astype(np.int64), (C, G)


def _level(keys: int, capacity: int, levels: int | None) -> int:
    """Cache slots a pass reads: what it needs, aligned; on a GPU one of ``levels``."""
    step = _ALIGN if levels is None else -(-capacity // levels)
    return min(capacity, -(-keys // step) * step)


class Engine:
    """The passes of one decode over the static caches of one model.

    Args:
        model: ``aogpt`` or ``armd``.
        batch, n: rows and sequence length.
        extra: the most cache slots a pass writes past what a row keeps.
        widths: on a GPU, the fixed widths of every pass after the first (``T``; ARMD
            ``(C, G)``); ignored on the CPU.
    """

    def __init__(
        self, model: AnyOrderLM, batch: int, n: int, extra: int, widths: int | tuple[int, int]
    ) -> None:
        self.armd = isinstance(model, ARMD)
        self.n = n
        self.capacity = -(-(n + extra + 1) // _ALIGN) * _ALIGN
        plan = SimpleNamespace(capacity=self.capacity, block_mode=False)
        engine = ARMDPasses if self.armd else GPTPasses
        self.passes = engine(model, plan, batch)
        self.static = model.device.type == "cuda" or STATIC_ON_CPU
        self.widths = widths
        self.shapes: set[tuple] = set()  # (queries, keys) of every attention call

    def run(self, order: np.ndarray, r: Round, tok: Tensor, start: int, first: bool) -> Tensor:
        """Logits (B, J, V) of the pass's columns ``start..`` (chain, then queries)."""
        widths = None if first or not self.static else self.widths
        levels = None if first or not self.static else (2 if self.armd else 7)
        if self.armd:
            tab, (C, G) = armd_table(order, r, self.n, widths)
            kc = _level(int((r.cc + C).max()), self.capacity, levels)
            kq = _level(int((r.e + G).max()), self.capacity, levels)
            if levels is not None:  # one level for both caches: two shapes per level
                kc = kq = max(kc, kq)
            group = Group((C, G), kc, kq)
            group.has_empty = bool(tab[:, 3, C:].any())
            self.shapes |= {(C + G, kc), (G, kc), (G, kq)}
            queries = slice(start, G)
        else:
            tab = gpt_table(order, r, self.n, widths)
            T = tab.shape[2]
            kk = _level(int((r.e + T).max()), self.capacity, levels)
            group = Group((T,), kk)
            self.shapes.add((T, kk))
            queries = slice(start, T)
        tab = torch.from_numpy(tab).to(tok.device)
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
