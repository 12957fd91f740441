"""Any-order speculative sampling on the static KV cache (Guo & Ermon, ICLR 2026).

A decoder-only any-order model gives, in one pass, both parallel guesses of the next slots
of an order (the parallel prediction mask) and the exact sequential conditionals of slots
whose earlier tokens are written as content. So it can draft several slots and check them
itself, and the output follows the one-token-per-pass sequential sampler exactly.

One pass is one round, verification and the next draft fused. A row that has committed the
slots ``< c`` of its order and holds drafts ``y_0..y_{D-1}`` of slots ``c..c+D-1``:

* writes the *chain*: the entries of slots ``c..c+D``, causal among themselves, the drafts
  as content (AO-GPT: slot ``c+j``'s input is ``y_{j-1}``; ARMD: content rows of the drafts,
  then query rows). Chain entry ``c+j`` gives ``q_j``, slot ``c+j``'s conditional given the
  committed prefix and ``y_<j``: the sequential sampler's conditional whenever ``y_<j``
  are accepted. Entry ``c`` sees only committed tokens, so a pass always commits a token;
* asks ``K - 1`` *draft queries* of slots ``c+D+1..``, each seeing the chain but not one
  another (AO-GPT repeats the chain's last input with the new targets; ARMD: query-stream
  slots), guesses given the slots ``< c+D``;
* accepts ``y_j`` with probability ``min(1, q_j / p_j)`` in turn; at the first rejection
  ``m`` draws slot ``c+m`` from normalised ``(q_m - p_m)+``; if all ``D`` pass, draws slot
  ``c+D`` from ``q_D`` (a bonus). It commits ``m + 1`` tokens (``c' = c + m + 1``);
* drafts the next round from this pass's outputs at slots ``c'..c'+K-2``: chain outputs
  past a rejection (given a rejected draft) or the draft queries. A draft distribution
  may depend on anything drawn so far: the ratio test makes each committed token follow
  its exact conditional given the committed prefix, whatever the draft was.

So passes never exceed tokens (each commits at least one), and a row whose drafts are all
accepted commits ``K`` tokens per pass.

Design choices:

* **Entry ``t`` at cache slot ``t``.** Chain entries are kept at their order slot's cache
  slot (ARMD: content of slot ``t`` at content slot ``t``, its query row at query slot
  ``t``), so the entries after a rejection are overwritten by the next pass, and are
  masked at once: after the ratio tests every cache slot past a row's commit gets the rank
  ``BIG`` (seen by nobody; a fixed-width pass after the first leaves that to the next
  pass, which rewrites those ranks before it reads any). The tests show that later queries
  never see them.
* **Nothing read back in the loop.** The rows' commit counts stay on the device and each
  pass's table is built there (:mod:`anyorder.sampling.rounds`; after the first pass, it
  and the rest of a round's index bookkeeping are looked up by the counts in tables made
  once per decode, :mod:`anyorder.sampling.lookups`: a few kernels); the host keeps upper
  bounds of the counts (:class:`~anyorder.sampling.rounds.HostCounts`, read two passes late
  from pinned memory on a GPU, once in eight passes or when the read may end the decode)
  for the cache slots a pass reads and the loop's end, which comes at most two passes
  after the last commit (never after more passes than tokens).
* **Bounded shapes on a GPU**: every pass after the first has the widths of the widest
  round and reads one of seven key levels (ARMD two, shared by its caches): at most eight
  attention shapes whatever ``n``; on the CPU a pass reads the keys it needs.
* **Captured rounds on a GPU** (``graphs="auto"``): a round after the first (its table, the
  pass, the ratio tests, the closing token, the next drafts, the counters) is a function
  of static tensors updated in place, so each key level's round is captured once as a
  CUDA graph and replayed: a pass is three eager draws of the randoms (drawn ahead in the
  live sequence, :class:`~anyorder.sampling.verify.AheadRandoms`: the same tokens as the
  eager rounds, tested bit for bit), one replay, and the counts' copy to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import Tensor

from anyorder.errors import SamplingError
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.sampling.draws import SampleResult, check_controls, current_top_p_rule
from anyorder.sampling.graphs import RoundRunner, capture_report, resolve_mode
from anyorder.sampling.lookups import Counts, lookups
from anyorder.sampling.lookups import table as lookups_table
from anyorder.sampling.rounds import Engine, HostCounts, Round, extend
from anyorder.sampling.samplers import _decoder_only, _prepare
from anyorder.sampling.verify import (
    AheadRandoms,
    LiveRandoms,
    accept,
    close,
    probabilities,
    ratio_tests,
)

MAX_DRAFT = 64
"""The most tokens a speculative pass may commit (past the slots left, K is the slots left):
the lookup tables of :mod:`anyorder.sampling.lookups` take about 38 MB at K = 64."""


@dataclass
class SpeculativeStats:
    """Per-row counts of a speculative decode (numpy int64 arrays of shape (B,))."""

    passes: np.ndarray
    """Passes in which the row decided something (each commits at least one token)."""
    drafted: np.ndarray
    """Drafts the row verified."""
    accepted: np.ndarray
    """Drafts the row accepted."""
    tokens: np.ndarray
    """Tokens the row generated (the prompt left out)."""

    def __post_init__(self) -> None:
        # the sampler's promise, checked on every decode (the counts are on the host already)
        if (self.passes > self.tokens).any() or (self.accepted > self.drafted).any():
            raise RuntimeError(
                f"speculative counts broke their invariants (a sampler bug): passes "
                f"{self.passes.tolist()} tokens {self.tokens.tolist()} accepted "
                f"{self.accepted.tolist()} drafted {self.drafted.tolist()}"
            )

    def summary(self) -> str:
        """One line of totals: passes, drafted, accepted, tokens per pass."""
        p, d, a, t = (int(x.sum()) for x in (self.passes, self.drafted, self.accepted, self.tokens))
        rate = a / d if d else 0.0
        return (
            f"speculative: {p} passes for {t} tokens ({t / max(p, 1):.2f} tokens/pass), "
            f"{d} drafted, {a} accepted ({rate:.1%})"
        )


@torch.no_grad()
def speculative_sample(
    model: AnyOrderLM,
    n: int,
    draft: int,
    *,
    batch: int = 1,
    order: str | Tensor | None = None,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    keep_logits: bool = False,
    on_step=None,
    on_round=None,
    graphs: bool | str = "auto",
) -> SampleResult:
    """Any-order speculative sampling: exactly the sequential sampler's law, fewer passes.

    Each pass verifies the row's drafts against the sequential conditionals and drafts the
    next ``draft - 1`` slots of its order (see the module notes), so a row commits between
    1 and ``draft`` tokens per pass. The output has the law of :func:`~anyorder.sampling.
    samplers.sequential_sample` with the same order and controls (temperature, top-k and
    top-p filter the draft and the target alike).

    Args:
        model: ``aogpt`` (any variant) or ``armd``.
        n: sequence length.
        draft: ``K``, the most tokens one pass commits (``K = 1``: the sequential sampler;
            a ``K`` above the slots to decode acts as that many).
        batch, order, prompt, known, temperature, top_k, top_p, generator, keep_logits:
            as :func:`~anyorder.sampling.samplers.sequential_sample`.
        on_step: called after each pass with the committed positions and tokens (B, Q)
            (padding: position ``n``, token 0) and the pass index (:data:`~anyorder.
            sampling.draws.StepHook`).
        on_round: called after each pass with a dict of (B, ...) device tensors: the
            ``positions`` and ``tokens`` of the verified drafts (padding: position ``n``,
            token 0; a finished row's closing position and token too),
            how many of them were ``accepted``, and the ``position`` and ``token`` that
            closed the round (a replacement after a rejection, else the bonus).
        graphs: capture each round after the first as a CUDA graph (one per key level) and
            replay it (:mod:`~anyorder.sampling.graphs`): ``"auto"`` (on CUDA), True,
            False, or ``"emulate"`` (the same bookkeeping without a graph, on any device).
            The randoms are drawn ahead in the live sequence: the tokens do not depend on it.

    Returns:
        A :class:`SampleResult`; ``forward_passes`` counts model calls and
        ``extra["speculative"]`` holds the :class:`SpeculativeStats` per row,
        ``extra["count_reads"]`` how often the host read the rows' counts (on a GPU: when
        a read may end the decode, else every :attr:`~anyorder.sampling.rounds.HostCounts.
        every` passes).
    """
    check_controls(temperature, top_k, top_p)
    _decoder_only(model, "speculative sampling")
    if model.kind == "gpt":
        raise SamplingError(
            "gpt cannot draft positions ahead (it has no target position); use aogpt or armd "
            "for --speculative"
        )
    if isinstance(draft, bool) or not isinstance(draft, int) or draft < 1:
        raise SamplingError(f"--speculative K={draft} must be an integer >= 1 (tokens per pass)")
    tokens, _, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    draft = min(draft, max(n - k, 1))  # a pass never commits more than the slots left
    if draft > MAX_DRAFT:
        raise SamplingError(
            f"--speculative K={draft} drafts more than {MAX_DRAFT} tokens a pass (a round's "
            f"lookup tables grow as K**3, and few drafts pass their tests); use K <= {MAX_DRAFT}"
        )
    ctl = (temperature, top_k, top_p, current_top_p_rule())  # the rule read here, once
    mode = resolve_mode(graphs, tokens.device)
    return _run(
        model, tokens, order, k, draft, ctl, generator, keep_logits, on_step, on_round, mode
    )


class _Loop:
    """One speculative decode: the rows' state in static device tensors, updated in place by
    :meth:`round` (one pass), so that a round can be captured as a CUDA graph and replayed
    (:class:`~anyorder.sampling.graphs.RoundRunner`). The rows' counters stay on the device;
    the host keeps only bounds (:class:`HostCounts`)."""

    def __init__(self, model, tokens, order, k, K, ctl, generator, keep_logits, mode) -> None:
        B, n = tokens.shape
        device = self.device = tokens.device
        V = model.cfg.vocab_size
        Kd = max(K - 1, 0)
        self.n, self.k, self.K, self.ctl, self.mode = n, k, K, ctl, mode
        self.armd = isinstance(model, ARMD)
        widths = (K, 2 * K - 1) if self.armd else 2 * K - 1
        self.eng = Engine(model, B, n, k + 2 * K, widths, static=True if mode != "off" else None)
        self.host = HostCounts(np.full(B, k), K, n, self.eng.static, device)
        self.ext = extend(order)
        self.tok = torch.cat([tokens, tokens.new_zeros(B, 1), tokens.new_full((B, 1), -1)], 1)
        # the rows' counters, one (5, B) tensor that a round after the first moves on with
        # one add: the committed slots c, the drafts D the next pass verifies, the drafts
        # verified and accepted so far, and the pass (the same in every row)
        self.state = torch.zeros(5, B, dtype=torch.long, device=device)
        self.state[0] = k
        self.c, self.D, self.step = self.state[0], self.state[1], self.state[4]
        self.counts = self.state[2:4]  # drafted, accepted
        # the lean rounds' lookups (:mod:`~anyorder.sampling.lookups`): the orders' values,
        # the pass table's codes per count, what follows the ratio tests per count and m
        # (tables of O(K^3) entries, whatever n)
        self.values = lookups(self.ext, K) if self.eng.static else None
        self.looks = Counts(n, K, self.armd, bool(self.eng.static), device)
        self.after = self.looks.after
        # the drafts' laws, then a row of zeros: the law a closing token's residual takes
        # off when every draft was accepted (lookups.After.p_row); draft-major (Kd + 1, B,
        # V), so that the laws are one contiguous block for the gather that writes them (a
        # compiled round refuses a strided ``out=``)
        self.p_rows = torch.zeros(Kd + 1, B, V, dtype=torch.float64, device=device)
        self.p = self.p_rows[:Kd].transpose(0, 1)  # (B, Kd, V)
        self.drafts = torch.zeros(B, Kd, dtype=torch.long, device=device)
        self.step_of = torch.full((B, n + 1), -1, dtype=torch.long, device=device)
        self.logits = torch.zeros(B, n + 1, V, device=device) if keep_logits else None
        self.cols = torch.arange(Kd, device=device)
        if mode == "off":
            self.rnd = LiveRandoms(generator)
        else:  # drawn ahead, in the live sequence: uniforms, the closing pick, the drafts
            draws = [("uniform", (B, Kd)), ("pick", (B, V))] + (
                [("pick", (B, Kd, V))] if Kd else []
            )
            self.rnd = AheadRandoms(draws, device, generator)
        self.runners: dict[int, RoundRunner] = {}
        self.hooks = False

    def static(self) -> list[Tensor]:
        """The tensors a round updates in place (a captured round keeps their storage)."""
        kept = [self.state, self.p_rows, self.drafts, self.tok]
        return kept + [self.step_of] + ([] if self.logits is None else [self.logits])

    def decode(self, on_step, on_round) -> int:
        """Every pass until each row has committed all ``n`` slots; returns the passes."""
        self.hooks = on_step is not None or on_round is not None
        host, passes = self.host, 0
        while not host.finished():
            first = passes == 0
            if isinstance(self.rnd, AheadRandoms):
                self.rnd.fill()
            reach = host.reach()
            if first or self.mode == "off":  # the first pass has its own widths
                info = self.round(first, reach)
            else:
                key = self.eng.fixed_keys(reach)
                runner = self.runners.get(key)
                if runner is None:
                    fn = partial(self.round, False, self.eng.canonical(reach))
                    runner = self.runners[key] = RoundRunner(fn, self.mode, self.static)
                info = runner()
            host.note(self.c)
            if info is not None:  # the hooks get their own copies (a replay rewrites these)
                info = {name: t.clone() for name, t in info.items()}
                if on_round is not None:
                    on_round({name: info[name] for name in ROUND_FIELDS})
                if on_step is not None:
                    on_step(info["decided"], info["decided_tokens"], passes)
            passes += 1
        return passes

    def round(self, first: bool, reach: int) -> dict | None:
        """One pass of every row, the state updated in place; the hooks' tensors (or None)."""
        n, K, k, eng, ext, tok, c, D = (
            self.n, self.K, self.k, self.eng, self.ext, self.tok, self.c, self.D
        )  # fmt: skip
        self.rnd.begin()
        start = k if first else 0  # the catch-up's prompt columns are not asked for
        at_c = self.looks.index(c)  # the rows' counts' index into the lookup tables
        if eng.static and not first:  # the fixed widths: the table looked up by the counts
            codes = self.looks.codes_at(at_c, c)
            table = lookups_table(self.values, codes.view(len(c), -1, 2 * K - 1 + K * self.armd))
            logits = eng.run(ext, None, tok, start, first, reach, table=table)
        else:
            if first:
                e = cc = torch.zeros_like(c)
            else:
                e, cc = c, (c - 1).clamp(min=0) if self.armd else c
            logits = eng.run(ext, _round(ext, c, e, cc, D, K, n), tok, start, first, reach)
        # drafts: (B, K-1) the tokens the last pass drew for slots c..c+D-1 (any past D)
        q = probabilities(logits, *self.ctl)  # (B, J, V)
        # a finished row (c = n, D = 0) commits nothing: m <= D is 0, and its closing token
        # and its one "committed" column land in the padding slot n (position n)
        m, closing, after = self._verify(q, first, at_c)
        at = self.after
        pos = ext.gather(1, after[:, at.positions])  # closing | committed | next drafts
        tok.scatter_(1, pos[:, :1], closing[:, None])
        J = logits.shape[1]
        slots = after[:, 1 : 1 + J]  # the committed columns' slots (padding n), as wide as J
        self.step_of.scatter_(1, pos[:, 1 : 1 + J], self.step[:, None].expand(slots.shape))
        if self.logits is not None:
            V = logits.shape[-1]
            self.logits.scatter_(1, slots[..., None].expand(-1, -1, V), logits.float())
        info = None
        if self.hooks:
            dslot = (c[:, None] + self.cols).clamp(max=n)
            real = self.cols < D[:, None]  # the verified drafts
            verified = ext.gather(1, torch.where(real, dslot, n))
            decided = pos[:, 1 : 1 + min(J, K)]  # (B, K), padding n: at most K per pass
            # tokens 0 at the padding (position n: what padding drew there)
            drafts = self.drafts * real
            info = dict(positions=verified, tokens=drafts, accepted=m, position=pos[:, 0],
                        token=closing * (pos[:, 0] < n), decided=decided)  # fmt: skip
        # c' = c + m + 1 for a live row (none for a finished one), the next drafts (none
        # real once a row is done), the counts (a finished row's D and m are 0), the pass
        if first:  # (eager) it verified no draft: D was 0, not D(c), and the counts stay
            self.state[:2].copy_(after[:, at.state].T)
            self.step.add_(1)
        else:
            self.state.add_(after[:, at.moves].T)
        # every cache entry up to the commit is kept: ARMD's content one short of it (the
        # closing token is written by the next pass). A fixed-width pass after the first
        # leaves nothing to hide: past the commit only its chain's entries can be seen (c ..
        # c + D; ARMD's content c - 1 .. c + D - 1), and the next pass, 2K - 1 columns from
        # c' (content K from c' - 1), rewrites their ranks before it reads any
        if first or not eng.static:
            eng.forget(c, after[:, at.keep_content] if self.armd else None)
        self._next_drafts(q, after, pos)
        if info is not None:
            decided = info["decided"]
            info["decided_tokens"] = tok.gather(1, decided) * (decided < n)
        return info

    def _verify(self, q: Tensor, first: bool, at_c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The ratio tests of the drafts and the closing token (:func:`~anyorder.sampling.
        verify.accept`); the round's row of :class:`~anyorder.sampling.lookups.After` (B, Y).
        After the first pass the row also says which row of ``p_rows`` the residual takes
        off (``p_m`` after a rejection, zeros after none). ``at_c``: the counts' index
        (:meth:`~anyorder.sampling.lookups.Counts.index`)."""
        c, D, rnd, looks = self.c, self.D, self.rnd, self.looks
        if first or not self.p.shape[1]:  # (the first pass verifies none: D is 0, not D(c))
            m, closing = accept(q, self.p, self.drafts, D, rnd)
            return m, closing, looks.after_at(at_c, c, m)
        run, q = ratio_tests(q, self.p, self.drafts, None, rnd)  # m = min(run, D): looked up
        after = looks.after_at(at_c, c, run)  # (B, Y): what follows, by (c, run)
        m = after[:, self.after.accepted]
        row = after[None, :, self.after.p_row, None].expand(1, -1, q.shape[-1])
        return m, close(q, m, self.p_rows.gather(0, row)[0], rnd), after

    def _next_drafts(self, q: Tensor, after: Tensor, pos: Tensor) -> None:
        """The next round's drafts: this pass's outputs at slots ``c'..c'+D'-1`` (columns
        ``m + 1 + i``), drawn and written into the token buffer; their laws into ``p`` and
        themselves into ``drafts``. Past ``D'`` a draft is padding, drawn all the same (no
        kernel spent zeroing it): the next pass's accepted count stops at ``D'`` whatever
        its tests say, and it lands in the padding column ``n``, read by padding entries
        only. A finished row has ``D' = 0``: no draft is real. ``after``, ``pos``: the
        round's row of :class:`~anyorder.sampling.lookups.After` and its positions."""
        B, J, V = q.shape
        Kd = self.p.shape[1]
        if Kd == 0:
            return
        at = self.after
        cols = after[:, at.cols]
        if J < 2 * self.K - 1:  # a narrower pass (the first, or the CPU's)
            cols = cols.clamp(max=J - 1)
        index = cols.T[..., None].expand(Kd, B, V)  # draft-major, as p_rows
        torch.gather(q.transpose(0, 1), 0, index, out=self.p_rows[:Kd])
        self.rnd.pick(self.p, out=self.drafts)
        self.tok.scatter_(1, pos[:, at.next_drafts], self.drafts)


ROUND_FIELDS = ("positions", "tokens", "accepted", "position", "token")
"""What ``on_round`` gets of a pass."""


def _run(model, tokens, order, k, K, ctl, generator, keep_logits, on_step, on_round, mode):
    """Decode, and gather the result and the statistics."""
    loop = _Loop(model, tokens, order, k, K, ctl, generator, keep_logits, mode)
    passes = loop.decode(on_step, on_round)
    n = loop.n
    B = len(loop.c)
    out = SampleResult(
        loop.tok[:, :n].clone(), order, forward_passes=passes, step_of=loop.step_of[:, :n]
    )
    out.logits = None if loop.logits is None else loop.logits[:, :n]
    drafted, accepted = loop.counts.cpu().numpy()  # a row's passes commit its n - k tokens,
    made = np.full(B, n - k)  # one closing token each and its accepted drafts
    out.extra["speculative"] = SpeculativeStats(made - accepted, drafted, accepted, made)
    out.extra["attention_shapes"] = sorted(loop.eng.shapes)
    out.extra["count_reads"] = loop.host.reads  # the host's reads of the rows' counts
    captured = capture_report(mode, loop.runners.values())
    if captured is not None:
        out.extra["graphs"] = captured
    return out


def _round(ext: Tensor, c: Tensor, e: Tensor, cc: Tensor, D: Tensor, K: int, n: int) -> Round:
    """A pass of every row: the chain of slots ``e..c+D`` (catch-up, then the verified
    drafts and the closing slot ``c+D``), and draft queries of the next ``K - 1`` slots."""
    active = c < n
    top = torch.where(active, c + D, e - 1)
    nq = torch.where(active, (n - 1 - top).clamp(0, K - 1), 0)
    i = torch.arange(max(K - 1, 0), device=c.device)[None]
    ahead = ext.gather(1, (top[:, None] + 1 + i).clamp(0, n - 1))
    targets = torch.where(i < nq[:, None], ahead, -1)
    return Round(e, cc, top, torch.where(active, top, cc), targets)


def check_request(draft: int | None, steps: int | None, streams: int | None, order) -> None:
    """Refuse what speculative sampling and the confidence order cannot combine with (the
    CLI's and the API's check)."""
    if order == "confidence" and (steps is not None or streams is not None):
        raise SamplingError(
            "--order confidence chooses its own positions per pass; leave out --steps/--streams "
            "(--per-pass N sets the tokens per pass)"
        )
    if draft is None:
        return
    if steps is not None or streams is not None:
        raise SamplingError(
            "--speculative drafts and verifies along one order, one exact token at a time; "
            "leave out --steps/--streams"
        )
    if order == "strided":
        raise SamplingError("--speculative follows a random or l2r order; leave out strided")
