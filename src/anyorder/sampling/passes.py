"""The passes on the device: one decode of a :class:`~anyorder.sampling.plan.Plan`.

Design choices:

* A pass reads its row of the group's table (slot codes already turned into tok columns and
  positions), gathers its input tokens from the token buffer, sets the ranks its entries
  keep in the static caches, builds its masks from the ranks in a few comparisons (once per
  pass, shared by every layer, as an additive float mask so that attention converts
  nothing per layer), and runs the model's own ``decode``: one model, one cache path.
* Sampling stays outside the pass (and outside a CUDA graph): the float64 draw, the scatter
  of the tokens into the buffer, ``step_of`` and the logits kept on request, all on the
  device. Nothing is read back to the host inside the loop.
* The early stop at EOS is opt-in (``stop_at_eos``, left-to-right orders) and never waits
  for the device: every few passes a flag is copied to pinned host memory behind an event,
  and read once the event has completed (on the CPU at once), so decoding stops a few passes
  late at worst. Only a generated EOS stops a row (a prompt's EOS is context), and what the
  row returns after it does not depend on when the loop stopped: every generated position
  after its first generated EOS is EOS, with step -2 and zero logits (never generated; a
  token drawn there before the loop stopped is discarded). Known tokens are never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from anyorder.cache import ARMDCache, StaticKV
from anyorder.errors import SamplingError
from anyorder.layers import Packing, PreparedMask, StreamPacking, casts
from anyorder.layers.linear import (
    MANY_ROWS,
    ONE_ROW,
    Prepacked,
    prepacked,
    prepacked_for,
    worth_reading,
)
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.models.gpt import BOS
from anyorder.sampling.draws import SampleResult, StepHook, sample_logits
from anyorder.sampling.graphs import PassRunner, capture_report, compiling
from anyorder.sampling.plan import Group, Plan

_EOS_EVERY = 8  # passes between two looks at the early-stop flag


@dataclass
class Controls:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None


def compute_dtype(model: AnyOrderLM) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on, else the weights'."""
    device = model.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return next(model.parameters()).dtype


class _Masks:
    """Additive float masks (0 visible, -inf hidden) in the attention dtype."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.zero = torch.zeros((), dtype=dtype, device=device)
        self.hidden = torch.full((), float("-inf"), dtype=dtype, device=device)

    def __call__(self, vis: Tensor) -> Tensor:
        return torch.where(vis, self.zero, self.hidden)[:, None]  # (B, 1, Tq, K)


EARN_PASSES = 8
"""Many-row prepacked copies of the weights (``layers/linear.py``) are made for a decode of
at least this many passes of two rows or more: a copy costs about what 5-20 such passes save
at 16 rows (more at 2; measured in docs/performance.md), and a batch-1 left-to-right decode
(one multi-row pass, its prompt's) makes none."""
EARN_ONE_ROW_PASSES = 64
"""One-row copies are made once the model has decoded this many one-row passes, this
decode's included: one saves some 15% of a one-row pass and costs about 50 of them."""


def earned(model: AnyOrderLM, plan: Plan, batch: int) -> tuple[Prepacked | None, tuple[int, ...]]:
    """The model's prepacked copies a decode of ``plan`` reads (None: turned off, or a decode
    too short to earn back their check, :func:`~anyorder.layers.linear.worth_reading`) and
    the layouts it makes (:func:`~anyorder.layers.linear.prepacked`), its one-row passes
    counted into the copies."""
    passes = getattr(plan, "passes", None)
    if passes is None:  # a speculative round's engine: drafts, several rows every pass
        packs = prepacked_for(model)
        return packs, () if packs is None else (MANY_ROWS,)
    rows = [batch * sum(p.dims) for p in passes if not p.prefill]
    ones = sum(1 for r in rows if r == 1)
    packs = prepacked_for(model) if worth_reading(len(rows) - ones, ones) else None
    if packs is None:
        return None, ()
    packs.one_row_passes += ones
    out = (MANY_ROWS,) if len(rows) - ones >= EARN_PASSES else ()
    return packs, out + ((ONE_ROW,) if packs.one_row_passes >= EARN_ONE_ROW_PASSES else ())


def _weights(
    model: AnyOrderLM, packs: Prepacked | None, make: tuple[int, ...]
) -> Callable[[], ContextManager]:
    """The context a pass reads the weights in: the CPU's prepacked copies, and under
    autocast the weights cast once for the decode (``layers/casts.py``: a captured pass
    would cast each at every replay); under :func:`~anyorder.sampling.graphs.compiled_passes`
    the casts alone (the compiler makes its own kernels)."""
    cast = casts.for_decode(model)
    if compiling() is not None:
        return partial(casts.reading, cast)
    if cast is None:
        return partial(prepacked, packs, make=make)

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with prepacked(packs, make=make), casts.reading(cast):
            yield

    return both


class GPTPasses:
    """Passes of the GPT/AO-GPT slot layout over one static cache."""

    def __init__(self, model: AnyOrderLM, plan: Plan, batch: int) -> None:
        cfg, dtype = model.cfg, compute_dtype(model)
        self.model = model
        shape = (cfg.kv_heads, cfg.d_head)
        self.cache = StaticKV(cfg.n_layer, batch, plan.capacity, shape, dtype, model.device)
        self.masks = _Masks(dtype, model.device)
        self.packs, self.make = earned(model, plan, batch)  # the CPU's (layers/linear.py)
        self._weights = _weights(model, self.packs, self.make)
        if compiling() is not None:  # the decode's tables before any pass compiles
            model.prepare_decode(self.cache)

    def run(
        self,
        tab: Tensor,
        tok: Tensor,
        group: Group,
        queries: slice | None = None,
        packing: tuple | None = None,
        start: tuple[int, ...] | None = None,
        dense: bool = False,
    ) -> Tensor:
        """Logits of one pass: ``tab`` (rows, F, T) its table row (see plan.G_*); ``start``:
        every row's slots start there (slice copies); ``dense``: every query sees every slot
        read (no mask)."""
        rows, _, T = tab.shape
        cache = self.cache if rows == self.cache.batch else self.cache.head(rows)
        x_col, pos, target, rank, slot, keep = tab.unbind(1)  # (rows, T) each
        cache.begin(slot, keep, group.keys, None if start is None else start[0])
        mask = None if dense else self.masks(cache.visible(rank, slot))
        pk = None if packing is None else Packing(packing[0], rows, T)
        x_in = tok[:rows].gather(1, x_col)
        with self._weights():
            return self.model.decode(cache, x_in, pos, target, mask, queries=queries, packing=pk)

    def fork(self) -> None:
        self.cache.fork_first()

    def prepare_reads(self, group: Group) -> None:
        """The cache views ``group``'s passes read, made before they compile."""
        self.cache.prepare_reads(group.keys)


class ARMDPasses:
    """Passes of ARMD's two streams over two static caches and the prefix aggregate."""

    def __init__(self, model: ARMD, plan: Plan, batch: int) -> None:
        cfg, dtype, device = model.cfg, compute_dtype(model), model.device
        self.model = model
        shape, cap = (cfg.kv_heads, cfg.d_head), plan.capacity
        self.cache = ARMDCache(
            StaticKV(model.l2s, batch, cap, shape, dtype, device),
            StaticKV(cfg.n_layer - model.l2s, batch, cap, shape, dtype, device),
            torch.zeros(0, device=device),  # the prefix aggregate comes from ``emb``
            torch.zeros(0, device=device),
        )
        self.masks = _Masks(dtype, device)
        self.packs, self.make = earned(model, plan, batch)
        self._weights = _weights(model, self.packs, self.make)
        if compiling() is not None:  # the decode's tables before any pass compiles
            model.prepare_decode(self.cache)
        self.batch, self.block = batch, plan.block_mode
        # the content embeddings of the decided tokens, at their content slots: a query
        # row's prefix aggregate is their mean under its mask (counts come with the plan)
        self.emb = torch.zeros(
            batch, cap, cfg.d_model, device=device, dtype=model.tok_emb.weight.dtype
        )

    def prepare_reads(self, group: Group) -> None:
        """The cache views ``group``'s passes read, made before they compile."""
        self.cache.content.prepare_reads(group.keys)
        self.cache.query.prepare_reads(group.keys_q)

    def run(
        self,
        tab: Tensor,
        tok: Tensor,
        group: Group,
        queries: slice | None = None,
        packing: tuple | None = None,
        start: tuple[int, ...] | None = None,
        dense: bool = False,
    ) -> Tensor:
        """Logits of one pass: ``tab`` (rows, F, C + G) its table row (see plan.A_*);
        ``start`` (content and query-stream slots) and ``dense``: as for
        :meth:`GPTPasses.run`."""
        rows, C = tab.shape[0], group.widths[0]
        cache = self.cache
        if rows != self.batch:
            cache = ARMDCache(
                cache.content.head(rows),
                cache.query.head(rows),
                cache.prefix_sum,
                cache.prefix_count,
            )
        col, pos, lim, empty, slot, keep, qlim, count = tab.unbind(1)  # (rows, C + G) each
        K, (sc, sq) = group.keys, (None, None) if start is None else start
        cache.content.begin(slot[:, :C], keep[:, :C], K, sc)
        cache.query.begin(slot[:, C:], keep[:, C:], group.keys_q, sq)
        if dense:  # one query row per row, seeing all the content read: no masks
            emb = self.emb[:rows]

            def mean(h0: Tensor) -> Tensor:
                emb[:, sc : sc + C] = h0  # a dense pass has its rows alike
                return emb[:, :K].sum(dim=1, keepdim=True) / count[:, C:, None]

            with self._weights():
                return self.model.decode(
                    cache, tok[:rows].gather(1, col[:, :C]), pos[:, :C], pos[:, C:],
                    prefix=mean, queries=queries, row_pos=pos,
                )  # fmt: skip
        # two-stream rows over the content: content rows see rank <= their own (lim =
        # rank + 1), query rows rank < theirs; a query row that sees nothing reads slot 0
        # and is zeroed (ARMD's first block)
        vis = cache.content.visible(lim)
        emb, seen = self.emb[:rows], vis[:, C:]

        def prefix(h0: Tensor) -> Tensor:  # (rows, G, d): mean of the earlier tokens
            if sc is None:
                emb.scatter_(1, slot[:, :C, None].expand_as(h0), h0)
            else:
                emb[:, sc : sc + C] = h0
            return (seen.to(h0.dtype) @ emb[:, :K]) / count[:, C:, None]

        rows_empty = None
        if group.has_empty:
            rows_empty = empty.bool()[:, None, :, None]  # (rows, 1, C + G, 1)
            vis = vis | (empty.bool()[:, :, None] & (cache.content.slot_ids[: group.keys] == 0))
        bias = self.masks(vis)
        two = PreparedMask(vis[:, None], rows_empty, additive={bias.dtype: bias})
        # the query stream: rank < own (and itself) token by token; <= in block mode
        own = None if self.block else slot[:, C:]
        query_mask = self.masks(cache.query.visible(qlim[:, C:], own))
        pk = None
        if packing is not None:
            both, cont, query, n_content = packing
            G = tab.shape[2] - C
            pk = StreamPacking(
                Packing(both, rows, C + G), Packing(cont, rows, C), Packing(query, rows, G),
                n_content,
            )  # fmt: skip
        with self._weights():
            return self.model.decode(
                cache,
                tok[:rows].gather(1, col[:, :C]),
                pos[:, :C],
                pos[:, C:],
                query_mask=query_mask,
                packing=pk,
                prefix=prefix,
                two_stream_mask=two,
                queries=queries,
                row_pos=pos,
            )

    def fork(self) -> None:
        c = self.cache
        c.content.fork_first()
        c.query.fork_first()
        self.emb[1:].copy_(self.emb[:1].expand_as(self.emb[1:]))


class _EosWatch:
    """Whether every row has drawn EOS, looked at without waiting for the device."""

    def __init__(self, batch: int, eos: int, device: torch.device) -> None:
        self.eos = eos
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        cuda = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.bool, pin_memory=cuda)
        self.host._anyorder_host_staging = True  # host memory: reading it is no sync
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False

    def stop(self, new: Tensor, i: int) -> bool:
        self.done |= (new == self.eos).any(dim=1)
        if i % _EOS_EVERY != _EOS_EVERY - 1:
            return False
        if not self.pending:
            self.host.copy_(self.done.all(), non_blocking=True)
            if self.event is not None:
                self.event.record()
            self.pending = True
        if self.event is None or self.event.query():  # never blocks
            self.pending = False
            return bool(self.host)
        return False


def run_plan(
    model: AnyOrderLM,
    tokens: Tensor,
    order: Tensor,
    k: int,
    plan: Plan,
    ctl: Controls,
    generator: torch.Generator | None,
    *,
    graphs: str = "off",
    keep_logits: bool = False,
    on_step: StepHook | None = None,
    stop_at_eos: int | None = None,
) -> SampleResult:
    """Run a plan on a decoder: the loop every fast decoder sampler shares."""
    B, n = tokens.shape
    device = tokens.device
    samp = plan.ship(order)  # every table on the device: (B, 2, sum Q) for the draws
    # columns n (padding draws land there) and n + 1 (the BOS)
    tok = torch.cat([tokens, tokens.new_zeros(B, 1), tokens.new_full((B, 1), BOS)], dim=1)
    step_of = torch.full((B, n + 1), -2, dtype=torch.long, device=device)
    step_of.scatter_(1, order[:, :k], -1)
    V = model.cfg.vocab_size
    logits_buf = torch.zeros(B, n + 1, V, device=device) if keep_logits else None
    engine = ARMDPasses(model, plan, B) if isinstance(model, ARMD) else GPTPasses(model, plan, B)
    runners = []
    if graphs != "off":
        for g in plan.groups:
            if compiling() is not None:
                engine.prepare_reads(g)
            runners.append(PassRunner(partial(engine.run, tok=tok, group=g), g.table, graphs))
    watch = _EosWatch(B, stop_at_eos, device) if stop_at_eos is not None else None
    passes = 0
    replays = [0] * len(runners)  # host counts: each runner must read its rows in order
    for i, p in enumerate(plan.passes):
        passes += 1
        if p.prefill:
            # the prompt's keys and values only: no logits (at a 128k vocabulary the head
            # over every prompt slot cost more than the prompt's layers)
            engine.run(plan.prefill.table[0], tok, plan.prefill, queries=slice(0, 0))
            engine.fork()
            continue
        start, Q = p.dims[-2], p.dims[-1]
        if runners:  # every entry's logits: the graph's shape is the group's
            if replays[p.group] != p.index:
                raise AssertionError(
                    f"pass {i} is row {p.index} of its group's table, but "
                    f"the replay would read row {replays[p.group]}"
                )
            replays[p.group] += 1
            logits = runners[p.group]()[:, start : start + Q]
        else:
            g = plan.groups[p.group]
            rows = slice(start, start + Q)
            logits = engine.run(
                g.table[p.index], tok, g, queries=rows, packing=p.pack_dev, start=p.start,
                dense=p.dense,
            )  # fmt: skip
        q = samp[:, :, p.q_offset : p.q_offset + Q]
        q_pos, q_slot = q[:, 0], q[:, 1]  # (B, Q); padding -> column n
        new = sample_logits(logits, generator, ctl.temperature, ctl.top_k, ctl.top_p)
        tok.scatter_(1, q_pos, new)
        step_of.scatter_(1, q_pos, p.step)
        if logits_buf is not None:
            logits_buf.scatter_(1, q_slot[..., None].expand(-1, -1, V), logits.float())
        if on_step is not None:
            on_step(q_pos, new, p.step)
        if watch is not None and watch.stop(new, i):
            break
    out, step_of = tok[:, :n], step_of[:, :n]
    logits = None if logits_buf is None else logits_buf[:, :n]
    if stop_at_eos is not None:
        out, step_of, logits = _after_eos(out, step_of, logits, order, stop_at_eos)
    captured = capture_report(graphs, runners)  # what capturing cost, for the callers
    extra = {} if captured is None else {"graphs": captured}
    return SampleResult(
        out, order, forward_passes=passes, step_of=step_of, logits=logits, extra=extra
    )


def check_stop_order(order: Tensor, k: int) -> None:
    """Refuse an early stop at EOS unless the unknown positions are decoded left to right
    (after the known ones, wherever those are): then "after the first generated EOS" means
    the same in the order and in the text."""
    rest = order[:, k:]
    if not bool((rest[:, 1:] > rest[:, :-1]).all()):
        raise SamplingError(
            "stop at EOS needs a left-to-right order (order='l2r'); truncate the text at EOS "
            "instead"
        )


def _after_eos(
    tokens: Tensor, step_of: Tensor, logits: Tensor | None, order: Tensor, eos: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """A row ends at its first generated EOS: every unknown position after it (in the text,
    which is the order: :func:`check_stop_order`) becomes EOS, step -2, zero logits. Known
    positions keep their tokens, and their EOS stops nothing. All on the device, once."""
    hit = (tokens == eos) & (step_of >= 0)  # (B, n) generated EOS
    after = (hit.cumsum(dim=1) > hit.long()) & (step_of != -1)  # strictly after the first
    tokens = tokens.masked_fill(after, eos)
    step_of = step_of.masked_fill(after, -2)
    if logits is not None:  # slot-aligned; in place: no second (B, n, V) buffer
        logits.masked_fill_(after.gather(1, order)[..., None], 0.0)
    return tokens, step_of, logits
