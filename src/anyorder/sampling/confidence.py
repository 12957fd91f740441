"""Confidence-ordered decoding: the order chosen as decoding goes, most confident first.

A heuristic, not an exact sampler of the model's joint law: which position comes next
depends on the model's own predictions, so the samples follow no fixed-order sequential
sampler (as in the confidence-based remasking of MaskGIT and LLaDA). Each pass scores the
remaining positions (all of them, or a fixed-size random subset) from the current context
in one pass, through the parallel prediction mask (AO-GPT: queries that repeat the last
decided token with each remaining position as target; ARMD: query-stream slots), and
commits the most confident.

* **Confidence** of a position: the largest probability of its conditional at the sampling
  temperature (before top-k/top-p), ties to the lower column.
* Alone (``speculative=None``): each pass commits the ``per_pass`` most confident
  positions and draws them at once from their parallel conditionals (like Lemma 1, the
  tokens of one pass do not see one another).
* With ``speculative=K``: the ``K`` most confident positions become the next slots of the
  order; the first ``K - 1`` are drafted, and the next pass verifies them against the
  sequential conditionals (:mod:`anyorder.sampling.speculative`'s ratio test) while it
  scores the rest. Each committed token then follows the model's exact conditional given
  the tokens before it in the order chosen; only the choice of the order is a heuristic.

Design choices: the passes are :mod:`anyorder.sampling.rounds`' (the chain and queries of
any positions over the static caches). The order, the rows' counters and the scored subsets
live on the device and are rewritten there as positions are chosen (a sort by keys), so the
host never reads a chosen position: without verification the counts of a pass are known in
advance; with it the host keeps bounds (:class:`~anyorder.sampling.rounds.HostCounts`), as
the speculative sampler does. On a GPU every pass after the first queries all ``n``
positions' columns (padding past the remaining ones); on the CPU a pass is as wide as its
remaining positions.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from torch import Tensor

from anyorder.errors import SamplingError
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.sampling.draws import (
    SampleResult,
    check_controls,
    current_top_p_rule,
    draw_limit,
)
from anyorder.sampling.graphs import RoundRunner, capture_report, resolve_mode
from anyorder.sampling.rounds import Engine, HostCounts, Round, arange, const, extend
from anyorder.sampling.samplers import _decoder_only, _prepare
from anyorder.sampling.speculative import SpeculativeStats
from anyorder.sampling.verify import AheadRandoms, LiveRandoms, Randoms, accept, probabilities


def _confidence(logits: Tensor, temperature: float, candidate: Tensor) -> Tensor:
    """(B, J) the largest probability of each column's conditional; -inf off ``candidate``.
    The max of one float32 softmax (one fused kernel on a GPU, the cast included), in
    chunks of columns, so that the float32 temporaries stay within the draws' bound
    (scoring every position of a (16, 2048) pass over GPT-2's vocabulary would be 6.6 GB at
    once); a typical GPU pass is one chunk."""
    B, J, V = logits.shape
    step = max(1, draw_limit(logits.device) // max(B * V, 1))
    parts = []
    for j in range(0, J, step):
        x = logits[:, j : j + step]
        if temperature != 1.0:  # a kernel saved at the default (x / 1 is x)
            x = x.float() / temperature
        parts.append(torch.softmax(x, dim=-1, dtype=torch.float32).amax(dim=-1))
    if not parts:
        return logits.new_full((B, 0), float("-inf"), dtype=torch.float)
    top = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return torch.where(candidate, top, const(float("-inf"), logits.device))


def _most(score: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest scores per row and their columns, ties to the lower column."""
    vals, cols = score.sort(dim=1, descending=True, stable=True)
    return vals[:, :k], cols[:, :k]


def _reorder(order: Tensor, start: Tensor, chosen: Tensor) -> Tensor:
    """The order with the ``chosen`` positions (B, k; padding ``n``) at slots ``start..``
    (B,) of each row, the other undecided positions after them in their old order.

    A sort by keys, the keys made by scatter (a kernel each on a GPU, where comparing every
    slot with every chosen position took five): slot ``s`` keeps ``s`` below ``start`` and
    moves to ``s + k`` from it on, unless its position is the ``r``-th chosen one (never
    below ``start``: those are decided), whose key is ``start + r``. The keys are
    distinct."""
    B, n = order.shape
    k = chosen.shape[1]
    slot = arange(n, order.device)[None]
    first = start[:, None]
    kept = torch.where(slot < first, slot, arange(n, order.device, start=k)[None])
    ranked = order.new_full((B, n + 1), n + k)  # by position; column n: the padding's
    ranked.scatter_(1, chosen, first + arange(k, order.device)[None])
    key = torch.minimum(ranked.gather(1, order), kept)
    return order.gather(1, key.argsort(dim=1))


def _targets(order: Tensor, first: Tensor, subset: int | None, rnd: Randoms, trim: bool) -> Tensor:
    """(B, Q) the positions at slots ``first..n-1`` (B,) of each row (or a random ``subset``
    of them, in position order), padded with -1; ``trim``: as wide as the widest row (a
    read), else ``n`` (or ``subset``) columns."""
    B, n = order.shape
    idx = first[:, None] + arange(n, order.device)[None]
    valid = idx < n
    pool = torch.where(valid, order.gather(1, idx.clamp(max=n - 1)), const(-1, order.device))
    if subset is not None and subset < n:
        key = torch.where(valid, rnd.uniform((B, n), order), 2.0)
        pick = pool.gather(1, key.topk(subset, dim=1, largest=False).indices)
        pool = torch.where(pick < 0, n, pick).sort(dim=1).values
        pool = torch.where(pool >= n, -1, pool)
    if trim:
        pool = pool[:, : int((pool >= 0).sum(dim=1).max())]
    return pool


def _columns(order: Tensor, c: Tensor, chain: Tensor, targets: Tensor, J: int) -> Tensor:
    """(B, J) the position each output column predicts: chain slots ``c..`` then the
    queries' targets (-1: padding)."""
    n, Q = order.shape[1], targets.shape[1]
    j = arange(J, order.device)[None]
    in_chain = order.gather(1, (c[:, None] + j).clamp(max=n - 1))
    t = j - chain[:, None]
    query = targets.gather(1, t.clamp(0, max(Q - 1, 0))) if Q else torch.full_like(t, -1)
    query = torch.where(t < Q, query, const(-1, order.device))  # t < 0: the chain's
    return torch.where(j < chain[:, None], in_chain, query)


@torch.no_grad()
def confidence_sample(
    model: AnyOrderLM,
    n: int,
    per_pass: int = 1,
    *,
    speculative: int | None = None,
    subset: int | None = None,
    batch: int = 1,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    keep_logits: bool = False,
    on_step=None,
    graphs: bool | str = "auto",
) -> SampleResult:
    """Confidence-ordered decoding (a heuristic; see the module notes).

    Args:
        model: ``aogpt`` or ``armd``.
        n: sequence length.
        per_pass: without ``speculative``, positions committed per pass.
        speculative: ``K``: draft the ``K`` most confident positions and verify them
            (exact given the order chosen); ``per_pass`` is then unused.
        subset: score a random subset of this many remaining positions per pass (None:
            all of them).
        batch, prompt, known, temperature, top_k, top_p, generator, keep_logits, on_step:
            as :func:`~anyorder.sampling.samplers.sequential_sample` (``keep_logits``: the
            logits each committed token was drawn from or verified against, slot-aligned).
        graphs: capture the passes of the steady rounds as CUDA graphs (one per key level;
            ``"auto"``: on CUDA), as :func:`~anyorder.sampling.speculative.
            speculative_sample` does; the tokens do not depend on it.

    Returns:
        A :class:`SampleResult` whose ``order`` is the order chosen; with ``speculative``,
        ``extra["speculative"]`` holds the :class:`~anyorder.sampling.speculative.
        SpeculativeStats` and ``extra["count_reads"]`` the host's reads of the counts.
    """
    check_controls(temperature, top_k, top_p)
    _decoder_only(model, "confidence-ordered decoding")
    if model.kind == "gpt":
        raise SamplingError(
            "gpt cannot score positions out of order (it has no target position); use aogpt "
            "or armd for --order confidence"
        )
    for name, v in (("per_pass", per_pass), ("speculative", speculative), ("subset", subset)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise SamplingError(f"confidence order: {name}={v} must be an integer >= 1")
    tokens, _, order, k = _prepare(model, n, batch, prompt, known, "l2r", generator)
    # counts above the slots to decode act as that many (and keep the passes' widths finite)
    left = max(n - k, 1)
    per_pass, subset = min(per_pass, left), None if subset is None else min(subset, left)
    speculative = None if speculative is None else min(speculative, left)
    ctl = (temperature, top_k, top_p, current_top_p_rule())  # the rule read here, once
    mode = resolve_mode(graphs, tokens.device)
    run = _Decode(model, tokens, order, k, ctl, generator, subset, keep_logits, on_step, mode)
    out = run.speculative(speculative) if speculative else run.parallel(per_pass)
    captured = capture_report(mode, run.runners.values())
    if captured is not None:
        out.extra["graphs"] = captured
    return out


class _Decode:
    """The state of one confidence-ordered decode, in device tensors updated in place by
    each pass, so that the steady passes can be captured as CUDA graphs and replayed
    (:class:`~anyorder.sampling.graphs.RoundRunner`, one per key level); the first passes
    and a short last one run eagerly. The randoms of a captured pass are drawn ahead in the
    live sequence (:class:`~anyorder.sampling.verify.AheadRandoms`)."""

    def __init__(
        self, model, tokens, order, k, ctl, generator, subset, keep_logits, on_step, mode
    ) -> None:
        B, n = tokens.shape
        self.model, self.n, self.k, self.ctl, self.generator = model, n, k, ctl, generator
        self.subset = subset
        self.device = device = tokens.device
        # the order as extend() gives it (slot n the padding's), kept so: a pass reads it
        # as it is; ``order`` is a view of it
        self.ext = extend(order)
        self.order = self.ext[:, :n]
        self.tok = torch.cat([tokens, tokens.new_zeros(B, 1), tokens.new_full((B, 1), -1)], 1)
        self.step_of = torch.full((B, n + 1), -1, dtype=torch.long, device=device)
        V = model.cfg.vocab_size
        self.logits = torch.zeros(B, n + 1, V, device=device) if keep_logits else None
        self.armd = isinstance(model, ARMD)
        self.on_step = on_step
        self.mode = mode
        self.live = LiveRandoms(generator)
        self.rnd: Randoms = self.live
        # the rows' counters, one (9, B) tensor, so that a pass moves them on in a few ops:
        # the committed slots c, the kept entries e (ARMD: query stream) and cc (ARMD:
        # content), the drafts D the next pass verifies, the pass (the same in every row),
        # and the speculative statistics (live passes, drafted, accepted, made)
        self.state = torch.zeros(9, B, dtype=torch.long, device=device)
        self.state[0] = k
        self.c, self.e, self.cc, self.D, self.step = self.state[:5]
        self.counts = self.state[5:]
        self.p = torch.zeros(0, device=device)  # the drafts' laws (speculative)
        self.runners: dict[tuple, RoundRunner] = {}

    def static(self) -> list[Tensor]:
        """The tensors a pass updates in place (a captured pass keeps their storage)."""
        kept = [self.state, self.p, self.tok, self.ext, self.step_of]
        return kept + ([] if self.logits is None else [self.logits])

    def _draws(self, tail: list[tuple[str, tuple[int, ...]]]) -> AheadRandoms | None:
        """The randoms of a steady pass drawn ahead: the scored subset's, then ``tail``
        (None when nothing is captured: the eager passes draw live)."""
        if self.mode == "off":
            return None
        B, n = self.order.shape
        head = [("uniform", (B, n))] if self.subset is not None and self.subset < n else []
        return AheadRandoms(head + tail, self.device, self.generator)

    def _run(self, fn, key: tuple | None, passes: int) -> None:
        """A pass: eagerly (no graphs, or ``key`` None: an irregular pass), else through the
        runner of ``key`` (its randoms drawn ahead first); the hook called after it."""
        if self.mode == "off" or key is None:
            self.rnd = self.live
            info = fn()
        else:
            self.rnd = self.ahead
            self.ahead.fill()
            runner = self.runners.get(key)
            if runner is None:
                runner = self.runners[key] = RoundRunner(fn, self.mode, self.static)
            info = runner()
        if info is not None:  # the hook gets its own copies (a replay rewrites these)
            self.on_step(info["pos"].clone(), info["tok"].clone(), passes)

    def _record(self, slots: Tensor, logits: Tensor) -> dict | None:
        """Note the step and logits of the committed ``slots`` (B, J; padding n) of the
        order; the hook's tensors. The caller moves the step on."""
        pos = self.ext.gather(1, slots)
        self.step_of.scatter_(1, pos, self.step[:, None].expand(pos.shape))
        if self.logits is not None:
            V = logits.shape[-1]
            self.logits.scatter_(1, slots[..., None].expand(-1, -1, V), logits.float())
        if self.on_step is None:
            return None
        return dict(pos=pos, tok=self.tok.gather(1, pos))

    def _result(self, passes: int) -> SampleResult:
        n = self.n
        order = self.order.clone()
        out = SampleResult(self.tok[:, :n].clone(), order, passes, self.step_of[:, :n])
        out.logits = None if self.logits is None else self.logits[:, :n]
        return out

    def parallel(self, per_pass: int) -> SampleResult:
        """``per_pass`` most confident positions per pass, drawn at once (every row commits
        as many per pass: the counts are known before decoding)."""
        B, n, k = self.order.shape[0], self.n, self.k
        width = n + per_pass
        static = True if self.mode != "off" else None
        eng = Engine(self.model, B, n, n + k + per_pass, (per_pass, width) if self.armd else width,
                     static=static)  # fmt: skip
        V = self.model.cfg.vocab_size
        most = min(per_pass, self.subset or n)  # a steady pass's count (fewer: the last)
        # what a pass that commits ``most`` from c = e + most adds to c, e, cc, D, the step
        moves = torch.tensor([[most], [most], [0], [0], [1]], device=self.device)
        self.most, self.moves = most, moves
        self.ahead = self._draws([("pick", (B, most, V))])
        c, e, passes = k, 0, 0  # the host's copies (every row alike)
        while c < n:
            kk = min(per_pass, n - c, self.subset or n)
            steady = passes > 0 and eng.static and kk == most == c - e
            key = (eng.fixed_keys(e),) if steady else None
            reach = eng.canonical(e) if steady else e  # a steady pass stands for its level
            fn = partial(self._parallel, eng, kk, passes == 0, c - e, reach)
            self._run(fn, key, passes)
            e, c, passes = c, c + kk, passes + 1
        out = self._result(passes)
        out.extra["attention_shapes"] = sorted(eng.shapes)
        return out

    def _parallel(self, eng: Engine, kk: int, first: bool, start: int, reach: int) -> dict | None:
        """One pass of :meth:`parallel`: score, choose ``kk`` positions, draw them."""
        c, e = self.c, self.e
        self.rnd.begin()
        trim = not eng.static or first  # the first pass has its own widths
        targets = _targets(self.order, c, self.subset, self.rnd, trim)
        r = Round(e, e, c - 1, c, targets)
        logits = eng.run(self.ext, r, self.tok, start, first, reach=reach)
        logits = logits[:, : targets.shape[1]]  # (B, Q, V) the queries (GPU: padded)
        score = _confidence(logits, self.ctl[0], targets >= 0)
        cols = _most(score, kk)[1]  # (B, kk): fewer candidates than kk never happens
        chosen = targets.gather(1, cols)
        self.order.copy_(_reorder(self.order, c, chosen))
        picked = logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))
        new = self.rnd.pick(probabilities(picked, *self.ctl))
        self.tok.scatter_(1, chosen, new)
        slots = c[:, None] + arange(kk, self.device)
        info = self._record(slots, picked)
        eng.forget(c, c)
        if start == kk == self.most:  # c - e = kk: one add moves c, e and the step
            self.state[:5].add_(self.moves)
        else:
            e.copy_(c)
            c.add_(kk)
            self.step.add_(1)
        return info

    def speculative(self, K: int) -> SampleResult:
        """The ``K`` most confident positions drafted, verified by the next pass."""
        B, n, k, device = self.order.shape[0], self.n, self.k, self.device
        static = True if self.mode != "off" else None
        eng = Engine(self.model, B, n, 2 * n + k, (K, 2 * n) if self.armd else 2 * n, static)
        host = HostCounts(np.full(B, k), K, n, eng.static, device)
        V, Kd = self.model.cfg.vocab_size, max(K - 1, 0)
        self.p = torch.zeros(B, Kd, V, dtype=torch.float64, device=device)
        tail = [("uniform", (B, Kd)), ("pick", (B, V))] + ([("pick", (B, Kd, V))] if Kd else [])
        self.ahead = self._draws(tail)
        passes = 0
        while not host.finished():
            # the first pass chooses slot k; the second catches its entry up (column 1 on)
            start = k if passes == 0 else 1 if passes == 1 else 0
            reach = host.reach()
            key = (eng.fixed_keys(reach),) if passes > 1 else None
            if key is None:
                fn = partial(self._speculative, eng, K, passes, start, reach)
            else:  # a steady pass stands for every pass of its key level (start = 0)
                fn = partial(self._speculative, eng, K, 2, start, eng.canonical(reach))
            self._run(fn, key, passes)
            host.note(self.c)
            passes += 1
        out = self._result(passes)
        out.extra["speculative"] = SpeculativeStats(*self.counts.cpu().numpy())
        out.extra["attention_shapes"] = sorted(eng.shapes)
        out.extra["count_reads"] = host.reads
        return out

    def _speculative(self, eng: Engine, K: int, passes: int, start: int, reach: int) -> dict | None:
        """One pass of :meth:`speculative`: verify the drafts, score, choose, draft."""
        n, c, e, cc, D = self.n, self.c, self.e, self.cc, self.D
        self.rnd.begin()
        head = passes > 0  # whether the closing slot c + D is chosen yet (not on the first)
        live = c < n
        top = torch.where(live, c + D, e - 1) if head else c - 1
        qtop = torch.where(live, top, cc) if head else c
        first = torch.where(live, top + 1, const(n, self.device))
        trim = not eng.static or passes == 0  # the first pass has its own widths
        targets = _targets(self.order, first, self.subset, self.rnd, trim)
        # the verified chain, slots c..c+D (D is 0 in a finished row); from the third pass on
        # e = c, so it is also the Round's chain (top - e + 1, or 0 in a finished row)
        chain = D + live if head else torch.zeros_like(c)
        r = Round(e, cc, top, qtop, targets, chain if passes > 1 else None)
        raw = eng.run(self.ext, r, self.tok, start, not passes, reach)
        colpos = _columns(self.order, c, chain, targets, raw.shape[1])
        if head:
            m, used = self._verify(raw, c, D, live), raw
        else:  # the first pass: the most confident position is committed at once
            used, best = self._first(raw, colpos, c, live)
            m = torch.zeros_like(c)
        jj = arange(used.shape[1], self.device)
        done = (jj[None] <= m[:, None]) & live[:, None]
        info = self._record(torch.where(done, c[:, None] + jj, const(n, self.device)), used)
        jr = arange(raw.shape[1], self.device)[None]
        decided = (jr <= m[:, None]) & (jr < chain[:, None]) if head else jr == best[:, None]
        made = m + live  # tokens committed by each row (m is 0 in a finished one)
        c_next = c + made
        D_next = self._choose(raw, colpos, (colpos >= 0) & ~decided, c_next, K)
        if head:
            e_next = c_next
            cc_next = (c_next - 1).clamp(min=0) if self.armd else c_next
        else:
            e_next = cc_next = c
        eng.forget(e_next, cc_next)
        # the step and the statistics; a finished row has D = 0 (it chose no draft), as has
        # every row before the first pass
        self.state[4:].add_(torch.stack([const(1, self.device).expand_as(c), live, D, m, made]))
        if head:  # c, e, cc, D in one op (each a new tensor)
            torch.stack([c_next, e_next, cc_next, D_next], out=self.state[:4])
        else:  # (eager) e and cc take the old c
            e.copy_(c)
            cc.copy_(c)
            c.copy_(c_next)
            D.copy_(D_next)
        return info

    def _verify(self, raw: Tensor, c: Tensor, D: Tensor, live: Tensor) -> Tensor:
        """The ratio tests of the drafts at slots c..c+D-1; the closing token written."""
        n, ext = self.n, self.ext
        cols = arange(self.p.shape[1], self.device)
        drafts = self.tok.gather(1, ext.gather(1, (c[:, None] + cols).clamp(max=n)))
        chain = raw[:, : self.p.shape[1] + 1]  # the verified slots and the closing one
        m, closing = accept(probabilities(chain, *self.ctl), self.p, drafts, D, self.rnd)
        m = m * live
        close_pos = ext.gather(1, torch.where(live, c + m, const(n, self.device))[:, None])
        self.tok.scatter_(1, close_pos, closing[:, None])
        return m

    def _first(self, raw: Tensor, colpos: Tensor, c: Tensor, live: Tensor):
        """The first pass: slot ``c`` is the most confident position, drawn at once from its
        exact conditional. Returns its logits (B, 1, V) and its column (B,)."""
        best = _confidence(raw, self.ctl[0], colpos >= 0).argmax(dim=1)
        pick = colpos.gather(1, best[:, None])
        pick = torch.where(live[:, None], pick, const(self.n, c.device))  # padding: n
        self.order.copy_(_reorder(self.order, c, pick))
        used = raw.gather(1, best[:, None, None].expand(-1, 1, raw.shape[-1]))
        token = self.rnd.pick(probabilities(used[:, 0], *self.ctl)) * live
        self.tok.scatter_(1, pick, token[:, None])
        return used, best

    def _choose(self, raw, colpos, candidate, c_next, K: int) -> Tensor:
        """The next slots: the ``K`` most confident candidates (fewer near the end) go to
        slots ``c'..`` (``c_next``: ``c + m + 1``, a finished row's ``n``); all but the last
        are drafted (their laws into ``p``). Returns the drafts' counts."""
        B, device, n = len(c_next), self.device, self.n
        Kmax = min(K, raw.shape[1])
        vals, cols = _most(_confidence(raw, self.ctl[0], candidate), Kmax)
        # slots left (none in a finished row), a candidate each (confidences: -inf off the
        # candidates, else probabilities): a prefix of the columns, ``many`` long
        valid = (c_next[:, None] + arange(Kmax, device)[None] < n) & (vals > float("-inf"))
        chosen = torch.where(valid, colpos.gather(1, cols), const(n, device))
        self.order.copy_(_reorder(self.order, c_next, chosen))  # (padding n)
        many = valid.sum(dim=1)
        Kd = max(K - 1, 0)
        if Kd == 0:
            return (many - 1).clamp(min=0)
        V = raw.shape[-1]
        picked = raw.gather(1, cols[:, :Kd, None].expand(-1, -1, V))
        law = probabilities(picked, *self.ctl)  # the drafts' laws: K - 1 columns, not all
        pos = chosen[:, :Kd]
        if Kd > law.shape[1]:  # fewer columns than drafts: padding (never drafted)
            stand_in = law.new_zeros(B, Kd - law.shape[1], V)  # a point mass at token 0
            stand_in[..., 0] = 1.0
            law = torch.cat([law, stand_in], dim=1)
            pos = torch.cat([pos, pos.new_full((B, Kd - pos.shape[1]), n)], dim=1)
        real = arange(Kd, device)[None] < many[:, None] - 1  # the chosen but the last
        y = self.rnd.pick(law) * real
        pos = torch.where(real, pos, const(n, device))
        self.tok.scatter_(1, pos, torch.where(real, y, self.tok.gather(1, pos)))
        self.p.copy_(law)
        return (many - 1).clamp(min=0)
