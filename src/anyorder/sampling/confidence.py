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
any positions over the static caches); the order lives on the host and is rewritten as
positions are chosen; one host sync per pass reads the chosen positions (and the accepted
counts).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from anyorder.errors import SamplingError
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.sampling.draws import SampleResult, check_controls
from anyorder.sampling.rounds import Engine, Round
from anyorder.sampling.samplers import _decoder_only, _prepare
from anyorder.sampling.speculative import SpeculativeStats
from anyorder.sampling.verify import accept, draw, probabilities


def _confidence(logits: Tensor, temperature: float, candidate: Tensor) -> Tensor:
    """(B, J) the largest probability of each column's conditional; -inf off ``candidate``."""
    top = (logits.float() / temperature).softmax(dim=-1).amax(dim=-1)
    return top.masked_fill(~candidate, float("-inf"))


def _most(score: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest scores per row and their columns, ties to the lower column."""
    vals, cols = score.sort(dim=1, descending=True, stable=True)
    return vals[:, :k], cols[:, :k]


def _reorder(order: np.ndarray, start: np.ndarray, chosen: np.ndarray) -> None:
    """Put the ``chosen`` positions (B, k; -1 padding) at slots ``start..`` of each row's
    order, the other undecided positions after them in their old order (in place)."""
    for b in range(order.shape[0]):
        pick = chosen[b][chosen[b] >= 0]
        if len(pick) == 0:
            continue
        tail = order[b, start[b] :]
        rest = tail[~np.isin(tail, pick)]
        order[b, start[b] :] = np.concatenate([pick, rest])


def _targets(
    order: np.ndarray, first: np.ndarray, n: int, subset: int | None, rng: np.random.Generator
) -> np.ndarray:
    """(B, Q) the positions at slots ``first..n-1`` of each row (or a random ``subset`` of
    them), padded with -1."""
    B = order.shape[0]
    width = int((n - first).max(initial=0))
    if subset is not None:
        width = min(width, subset)
    out = np.full((B, max(width, 0)), -1, dtype=np.int64)
    for b in range(B):
        pool = order[b, first[b] :]
        if subset is not None and len(pool) > subset:
            pool = np.sort(rng.choice(pool, subset, replace=False))
        out[b, : len(pool)] = pool
    return out


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

    Returns:
        A :class:`SampleResult` whose ``order`` is the order chosen; with ``speculative``,
        ``extra["speculative"]`` holds the :class:`~anyorder.sampling.speculative.
        SpeculativeStats`.
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
    ctl = (temperature, top_k, top_p)
    run = _Decode(model, tokens, order, k, ctl, generator, subset, keep_logits)
    return run.speculative(speculative) if speculative else run.parallel(per_pass)


class _Decode:
    """The state of one confidence-ordered decode."""

    def __init__(self, model, tokens, order, k, ctl, generator, subset, keep_logits) -> None:
        B, n = tokens.shape
        self.model, self.n, self.k, self.ctl, self.generator = model, n, k, ctl, generator
        self.subset = subset
        self.device = tokens.device
        self.order = order.cpu().numpy().copy()
        self.tok = torch.cat([tokens, tokens.new_zeros(B, 1), tokens.new_full((B, 1), -1)], 1)
        self.step_of = torch.full((B, n + 1), -1, dtype=torch.long, device=self.device)
        V = model.cfg.vocab_size
        self.logits = torch.zeros(B, n + 1, V, device=self.device) if keep_logits else None
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=_gdev(generator)))
        self.rng = np.random.default_rng(seed)
        self.armd = isinstance(model, ARMD)

    def _ext(self) -> Tensor:
        """The order on the device, with slot ``n`` the padding column."""
        B = self.order.shape[0]
        ext = np.concatenate([self.order, np.full((B, 1), self.n)], axis=1)
        return torch.from_numpy(ext).to(self.device)

    def _record(self, slots: Tensor, logits: Tensor, step: int, on_step=None) -> None:
        """Note the step and logits of the committed ``slots`` (B, J; padding n)."""
        ext = self._ext()
        pos = ext.gather(1, slots)
        self.step_of.scatter_(1, pos, step)
        if self.logits is not None:
            V = logits.shape[-1]
            self.logits.scatter_(1, slots[..., None].expand(-1, -1, V), logits.float())
        if on_step is not None:
            on_step(pos, self.tok.gather(1, pos), step)

    def _result(self, passes: int) -> SampleResult:
        n = self.n
        order = torch.from_numpy(self.order).to(self.device)
        out = SampleResult(self.tok[:, :n].clone(), order, passes, self.step_of[:, :n])
        out.logits = None if self.logits is None else self.logits[:, :n]
        return out

    def parallel(self, per_pass: int) -> SampleResult:
        """``per_pass`` most confident positions per pass, drawn at once."""
        B, n, k = self.order.shape[0], self.n, self.k
        width = n + per_pass
        eng = Engine(self.model, B, n, n + k + per_pass, (per_pass, width) if self.armd else width)
        c, e = k, 0
        passes = 0
        while c < n:
            first = np.full(B, c)
            targets = _targets(self.order, first, n, self.subset, self.rng)
            r = Round.of(self.device, np.full(B, e), np.full(B, e), first - 1, first, targets)
            logits = eng.run(self._ext(), r, self.tok, c - e, passes == 0)
            logits = logits[:, : targets.shape[1]]  # (B, Q, V) the queries (GPU: padded)
            candidate = torch.from_numpy(targets >= 0).to(self.device)
            score = _confidence(logits, self.ctl[0], candidate)
            kk = min(per_pass, n - c, logits.shape[1])
            cols = _most(score, kk)[1]  # (B, kk)
            chosen = np.take_along_axis(targets, cols.cpu().numpy(), 1)  # the host sync
            _reorder(self.order, np.full(B, c), chosen)
            picked = logits.gather(1, cols[..., None].expand(-1, -1, logits.shape[-1]))
            new = draw(probabilities(picked, *self.ctl), cols >= 0, self.generator)
            self.tok.scatter_(1, torch.from_numpy(chosen).to(self.device), new)
            slots = c + torch.arange(kk, device=self.device).expand(B, kk)
            self._record(slots, picked, passes)
            kept = torch.full((B,), c, device=self.device)
            eng.forget(kept, kept)
            e, c, passes = c, c + kk, passes + 1
        out = self._result(passes)
        out.extra["attention_shapes"] = sorted(eng.shapes)
        return out

    def speculative(self, K: int) -> SampleResult:
        """The ``K`` most confident positions drafted, verified by the next pass."""
        B, n, k, device = self.order.shape[0], self.n, self.k, self.device
        eng = Engine(self.model, B, n, 2 * n + k, (K, 2 * n) if self.armd else 2 * n)
        c, e, cc = np.full(B, k), np.zeros(B, np.int64), np.zeros(B, np.int64)
        D = np.zeros(B, np.int64)
        head = False  # whether the closing slot c + D is chosen yet (not before the first pass)
        V = self.model.cfg.vocab_size
        p = torch.zeros(B, max(K - 1, 0), V, dtype=torch.float64, device=device)
        zero = np.zeros(B, dtype=np.int64)
        stats = SpeculativeStats(zero.copy(), zero.copy(), zero.copy(), zero.copy())
        passes = 0
        while bool((c < n).any()):
            active = c < n
            top = np.where(active, c + D, e - 1) if head else c - 1
            qtop = np.where(active, top, cc) if head else c
            targets = _targets(self.order, np.where(active, top + 1, n), n, self.subset, self.rng)
            start = int((c - e)[active].min())
            r = Round.of(device, e, cc, top, qtop, targets)
            raw = eng.run(self._ext(), r, self.tok, start, not passes)
            chain = np.where(active & head, D + 1, 0)  # columns of the chain slots c..c+D
            colpos = _columns(self.order, c, chain, targets, raw.shape[1], active)
            colpos_t = torch.from_numpy(colpos).to(device)
            live = torch.from_numpy(active).to(device)
            if head:
                m, used = self._verify(raw, p, c, D, live), raw
            else:  # the first pass: the most confident position is committed at once
                used = self._first(raw, colpos, colpos_t, c, live)
                m = torch.zeros(B, dtype=torch.long, device=device)
            c_t = torch.from_numpy(c).to(device)
            jj = torch.arange(used.shape[1], device=device)
            done = (jj[None] <= m[:, None]) & live[:, None]
            self._record(torch.where(done, c_t[:, None] + jj, n), used, passes)
            jr = torch.arange(raw.shape[1], device=device)
            decided = (jr[None] <= m[:, None]) & (
                jr[None] < torch.from_numpy(chain).to(device)[:, None]
            )
            if not head:
                decided = jr[None] == self._best[:, None]
            q = probabilities(raw, *self.ctl)
            p, D_next, m_np = self._choose(
                raw, q, colpos_t, (colpos_t >= 0) & ~decided, c, m, K, live
            )
            c_next = c + np.where(active, m_np + 1, 0)
            e_next = c_next if head else c.copy()
            cc_next = (np.maximum(c_next - 1, 0) if self.armd else c_next) if head else c.copy()
            eng.forget(torch.from_numpy(e_next).to(device), torch.from_numpy(cc_next).to(device))
            stats.passes += active
            stats.drafted += np.where(active & head, D, 0)
            stats.accepted += np.where(active, m_np, 0)
            stats.tokens += np.where(active, m_np + 1, 0)
            c, e, cc, D, head, passes = c_next, e_next, cc_next, D_next, True, passes + 1
        out = self._result(passes)
        out.extra["speculative"] = stats
        out.extra["attention_shapes"] = sorted(eng.shapes)
        return out

    def _verify(self, raw: Tensor, p: Tensor, c: np.ndarray, D: np.ndarray, live: Tensor):
        """The ratio tests of the drafts at slots c..c+D-1; the closing token written."""
        device, n = self.device, self.n
        c_t, D_t = torch.from_numpy(c).to(device), torch.from_numpy(D).to(device)
        ext = self._ext()
        cols = torch.arange(p.shape[1], device=device)
        drafts = self.tok.gather(1, ext.gather(1, (c_t[:, None] + cols).clamp(max=n)))
        m, closing = accept(probabilities(raw, *self.ctl), p, drafts, D_t, self.generator)
        m = torch.where(live, m, 0)
        close_pos = ext.gather(1, torch.where(live, c_t + m, n)[:, None])
        self.tok.scatter_(1, close_pos, closing[:, None])
        return m

    def _first(self, raw: Tensor, colpos: np.ndarray, colpos_t: Tensor, c, live) -> Tensor:
        """The first pass: slot ``c`` is the most confident position, drawn at once from its
        exact conditional. Returns its logits (B, 1, V)."""
        best = _confidence(raw, self.ctl[0], colpos_t >= 0).argmax(dim=1)
        self._best = best
        pick = np.take_along_axis(colpos, best.cpu().numpy()[:, None], 1)
        _reorder(self.order, c, np.where(live.cpu().numpy()[:, None], pick, -1))
        used = raw.gather(1, best[:, None, None].expand(-1, 1, raw.shape[-1]))
        token = draw(probabilities(used[:, 0], *self.ctl), live, self.generator)
        pos = torch.from_numpy(np.where(live.cpu().numpy()[:, None], pick, self.n)).to(self.device)
        self.tok.scatter_(1, pos, token[:, None])
        return used

    def _choose(self, raw, q, colpos, candidate, c, m, K: int, live):
        """The next slots: the ``K`` most confident candidates (fewer near the end) go to
        slots ``c'..`` (``c' = c + m + 1``); all but the last are drafted. One host read
        (the accepted counts and the positions chosen). Returns the drafts' laws, their
        counts and the accepted counts (host)."""
        B, device, n = len(c), self.device, self.n
        Kmax = min(K, raw.shape[1])
        vals, cols = _most(_confidence(raw, self.ctl[0], candidate), Kmax)
        c_next = torch.from_numpy(c).to(device) + torch.where(live, m + 1, 0)
        room = (n - c_next).clamp(0, K)
        valid = (torch.arange(Kmax, device=device)[None] < room[:, None]) & torch.isfinite(vals)
        chosen = torch.where(valid & live[:, None], colpos.gather(1, cols), -1)  # (B, Kmax)
        host = torch.cat([m[:, None], chosen], dim=1).cpu().numpy()  # the host sync
        m_np, chosen_np = host[:, 0], host[:, 1:]
        _reorder(self.order, c + np.where(c < n, m_np + 1, 0), chosen_np)
        D_next = np.maximum((chosen_np >= 0).sum(1) - 1, 0)
        Kd = max(K - 1, 0)
        V = q.shape[-1]
        law = q.gather(1, cols[:, :Kd, None].expand(-1, -1, V)) if Kd else q[:, :0]
        pos = chosen[:, :Kd]
        if Kd > law.shape[1]:  # fewer columns than drafts: padding (never drafted)
            law = torch.cat([law, law.new_zeros(B, Kd - law.shape[1], V)], dim=1)
            pos = torch.cat([pos, pos.new_full((B, Kd - pos.shape[1]), -1)], dim=1)
        real = (pos >= 0) & (
            torch.arange(Kd, device=device)[None] < (chosen >= 0).sum(1, keepdim=True) - 1
        )
        y = draw(law, real, self.generator)
        pos = torch.where(real, pos, n)
        self.tok.scatter_(1, pos, torch.where(real, y, self.tok.gather(1, pos)))
        return law, D_next, m_np


def _columns(order, c, chain, targets, J: int, active) -> np.ndarray:
    """(B, J) the position each output column predicts: chain slots ``c..`` then the
    queries' targets (-1: padding)."""
    out = np.full((len(c), J), -1, dtype=np.int64)
    for b in np.flatnonzero(active):
        out[b, : chain[b]] = order[b, c[b] : c[b] + chain[b]]
        t = targets[b][targets[b] >= 0]
        out[b, chain[b] : chain[b] + len(t)] = t
    return out


def _gdev(generator: torch.Generator | None) -> torch.device:
    return generator.device if generator is not None else torch.device("cpu")
