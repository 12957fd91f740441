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
  ``BIG`` (seen by nobody). The tests show that later queries never see them.
* **The tables are built on the host, per pass**, from the rows' commit counts: the one
  host sync per pass reads the accepted counts (one small copy; on the CPU it costs
  nothing). The passes run through the same engines as the planned samplers
  (:class:`~anyorder.sampling.passes.GPTPasses`, :class:`~anyorder.sampling.passes.
  ARMDPasses`): one model, one cache path.
* **Bounded shapes on a GPU**: every pass there has the widths of the widest round and
  reads a key count rounded up to an eighth of the cache, so a decode has at most nine
  attention shapes per width (eight levels and the first pass); on the CPU a pass has the
  widths and keys it needs (a CPU pays for every key read and nothing for a new shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor

from anyorder.cache import BIG
from anyorder.errors import SamplingError
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.sampling.draws import SampleResult, check_controls
from anyorder.sampling.passes import ARMDPasses, GPTPasses
from anyorder.sampling.plan import Group
from anyorder.sampling.samplers import _decoder_only, _prepare
from anyorder.sampling.verify import accept, draw, probabilities

_ALIGN = 16


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

    def summary(self) -> str:
        """One line of totals: passes, drafted, accepted, tokens per pass."""
        p, d, a, t = (int(x.sum()) for x in (self.passes, self.drafted, self.accepted, self.tokens))
        rate = a / d if d else 0.0
        return (
            f"speculative: {p} passes for {t} tokens ({t / max(p, 1):.2f} tokens/pass), "
            f"{d} drafted, {a} accepted ({rate:.1%})"
        )


@dataclass
class _Rows:
    """The host's view of every row: committed slots, kept cache entries, drafts."""

    c: np.ndarray  # slots committed (the prompt included)
    e: np.ndarray  # AO-GPT: kept entries; ARMD: kept query-stream entries
    cc: np.ndarray  # ARMD: kept content entries
    D: np.ndarray  # drafts held for slots c..c+D-1


def _gpt_table(order: np.ndarray, r: _Rows, K: int, n: int, width: int | None):
    """AO-GPT entries of one pass, (B, 6, T) int64 in positions (see plan.G_*): per row
    [catch-up and chain: slots e..c+D | K-1 draft queries | padding], at cache slots from
    ``e`` on. Returns the table and the column of the first chain output."""
    B = len(r.c)
    active = r.c < n
    top = np.where(active, r.c + r.D, r.e - 1)  # the chain's last slot
    L = np.where(active, top - r.e + 1, 0)
    nq = np.where(active, np.clip(n - 1 - top, 0, K - 1), 0)
    T = int((L + nq).max()) if width is None else width
    j = np.arange(T)[None]
    s = r.e[:, None] + j  # chain slot / cache slot
    chain = j < L[:, None]
    query = ~chain & (j < (L + nq)[:, None])
    tgt_slot = np.where(chain, s, top[:, None] + 1 + (j - L[:, None]))
    in_slot = np.where(chain, s - 1, top[:, None] - 1)
    ext = np.concatenate([order, np.full((B, 1), n)], axis=1)  # column n: padding
    real = chain | query
    bos = real & (in_slot < 0)
    col = np.where(
        bos, n + 1, np.where(real, np.take_along_axis(ext, np.clip(in_slot, 0, n), 1), n)
    )
    pos = np.where(real & ~bos, col, 0)
    target = np.where(real, np.take_along_axis(ext, np.clip(tgt_slot, 0, n), 1), 0)
    limit = np.where(chain, s, np.where(query, top[:, None], BIG))
    keep = np.where(chain, s, BIG)
    tab = np.stack([col, pos, target, limit, s, keep], axis=1)
    return tab.astype(np.int64), int((r.c - r.e)[active].max(initial=0))


def _armd_table(order: np.ndarray, r: _Rows, K: int, n: int, widths: tuple | None):
    """ARMD entries of one pass, (B, 8, C + G) int64 in positions (see plan.A_*): content
    rows of slots cc..c+D-1 (the committed tokens not yet written, then the drafts); query
    rows [catch-up and chain: slots e..c+D | K-1 draft queries | padding]."""
    B = len(r.c)
    active = r.c < n
    top = np.where(active, r.c + r.D, r.e - 1)
    Cn = np.where(active, top - r.cc, 0)
    L = np.where(active, top - r.e + 1, 0)
    nq = np.where(active, np.clip(n - 1 - top, 0, K - 1), 0)
    C, G = (int(Cn.max()), int((L + nq).max())) if widths is None else widths
    ext = np.concatenate([order, np.full((B, 1), n)], axis=1)
    look = lambda slots: np.take_along_axis(ext, np.clip(slots, 0, n), 1)  # noqa: E731
    # content rows
    j = np.arange(C)[None]
    s = r.cc[:, None] + j
    creal = j < Cn[:, None]
    cpos = np.where(creal, look(s), n)
    crank = np.where(creal, s, BIG)
    ones = np.ones_like(s)
    content = [cpos, np.where(creal, cpos, 0), crank + 1, 0 * s, s, crank, BIG * ones, ones]
    # query rows
    j = np.arange(G)[None]
    s = r.e[:, None] + j
    chain = j < L[:, None]
    query = ~chain & (j < (L + nq)[:, None])
    real = chain | query
    tgt = np.where(chain, s, top[:, None] + 1 + (j - L[:, None]))
    lim = np.where(chain, s, np.where(query, top[:, None], BIG))
    ones = np.ones_like(s)
    rows = [
        n * ones,
        np.where(real, look(tgt), 0),
        lim,
        (real & (lim <= 0)).astype(np.int64),
        s,
        np.where(chain, s, BIG),
        lim,
        np.where(real, np.maximum(lim, 1), 1),
    ]
    tab = np.concatenate([np.stack(content, 1), np.stack(rows, 1)], axis=2)
    return tab.astype(np.int64), int((r.c - r.e)[active].max(initial=0)), (C, G)


def _level(keys: int, capacity: int, static: bool) -> int:
    """Cache slots a pass reads: what it needs, aligned; on a GPU one of eight levels."""
    if static:
        step = -(-capacity // 8)
        return min(capacity, -(-keys // step) * step)
    return min(capacity, -(-keys // _ALIGN) * _ALIGN)


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
        draft: ``K``, the most tokens one pass commits (``K = 1``: the sequential sampler).
        batch, order, prompt, known, temperature, top_k, top_p, generator, keep_logits:
            as :func:`~anyorder.sampling.samplers.sequential_sample`.
        on_step: called after each pass with the committed positions and tokens (B, Q)
            (padding: position ``n``) and the pass index (:data:`~anyorder.sampling.draws.
            StepHook`).
        on_round: called after each pass with a dict of (B, ...) device tensors: the
            ``positions`` and ``tokens`` of the verified drafts (padding: position ``n``),
            how many of them were ``accepted``, and the ``position`` and ``token`` that
            closed the round (a replacement after a rejection, else the bonus).

    Returns:
        A :class:`SampleResult`; ``forward_passes`` counts model calls and
        ``extra["speculative"]`` holds the :class:`SpeculativeStats` per row.
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
    ctl = (temperature, top_k, top_p)
    return _run(model, tokens, order, k, draft, ctl, generator, keep_logits, on_step, on_round)


class _Engine:
    """The passes of one speculative decode over the static caches of one model."""

    def __init__(self, model: AnyOrderLM, B: int, n: int, k: int, K: int) -> None:
        self.armd = isinstance(model, ARMD)
        self.n, self.K = n, K
        self.capacity = -(-(n + k + 2 * K + 1) // _ALIGN) * _ALIGN
        plan = SimpleNamespace(capacity=self.capacity, block_mode=False)
        self.passes = ARMDPasses(model, plan, B) if self.armd else GPTPasses(model, plan, B)
        self.static = model.device.type == "cuda"
        # on a GPU every round after the first has the widths of the widest one
        self.widths = (K, 2 * K - 1) if self.armd else 2 * K - 1
        self.shapes: set[tuple] = set()

    def run(self, order: np.ndarray, r: _Rows, tok: Tensor, first: bool) -> tuple[Tensor, int]:
        """Logits (B, J, V) of the chain and draft queries (column ``j``: slot ``c + j``)."""
        device = tok.device
        widths = None if first or not self.static else self.widths
        if self.armd:
            tab, off, (C, G) = _armd_table(order, r, self.K, self.n, widths)
            kc = _level(int((r.cc + C).max()), self.capacity, self.static)
            kq = _level(int((r.e + G).max()), self.capacity, self.static)
            group = Group((C, G), kc, kq)
            group.has_empty = bool(tab[:, 3, C:].any())
            self.shapes.add((C, G, kc, kq))
            queries = slice(off, G)
        else:
            tab, off = _gpt_table(order, r, self.K, self.n, widths)
            T = tab.shape[2]
            kk = _level(int((r.e + T).max()), self.capacity, self.static)
            group = Group((T,), kk)
            self.shapes.add((T, kk))
            queries = slice(off, T)
        tab = torch.from_numpy(tab).to(device)
        return self.passes.run(tab, tok, group, queries=queries), off

    def forget(self, c: Tensor) -> None:
        """Hide every cache entry past each row's commit ``c`` (B,): rejected drafts and
        what was built on them (ARMD: content past ``c - 1``, the closing token not written
        yet; the query stream and AO-GPT past ``c``)."""
        if self.armd:
            for cache, limit in ((self.passes.cache.content, c - 1), (self.passes.cache.query, c)):
                cache.rank.masked_fill_(cache.slot_ids[None] >= limit[:, None], BIG)
        else:
            cache = self.passes.cache
            cache.rank.masked_fill_(cache.slot_ids[None] >= c[:, None], BIG)


def _run(model, tokens, order, k, K, ctl, generator, keep_logits, on_step, on_round):
    """The loop: one pass per round until every row has committed all ``n`` slots."""
    B, n = tokens.shape
    device = tokens.device
    V = model.cfg.vocab_size
    eng = _Engine(model, B, n, k, K)
    order_np = order.cpu().numpy()
    ext = torch.cat([order, torch.full((B, 1), n, device=device)], dim=1)  # slot n: padding
    tok = torch.cat([tokens, tokens.new_zeros(B, 1), tokens.new_full((B, 1), -1)], dim=1)
    zero = np.zeros(B, dtype=np.int64)
    r = _Rows(np.full(B, k, dtype=np.int64), zero.copy(), zero.copy(), zero.copy())
    stats = SpeculativeStats(zero.copy(), zero.copy(), zero.copy(), zero.copy())
    p = torch.zeros(B, max(K - 1, 0), V, dtype=torch.float64, device=device)  # drafts' law
    step_of = torch.full((B, n + 1), -1, dtype=torch.long, device=device)
    logits_buf = torch.zeros(B, n + 1, V, device=device) if keep_logits else None
    passes, first = 0, True
    while bool((r.c < n).any()):
        active = r.c < n
        logits, _ = eng.run(order_np, r, tok, first)
        first, passes = False, passes + 1
        c = torch.from_numpy(r.c).to(device)
        D = torch.from_numpy(r.D).to(device)
        cols = torch.arange(max(K - 1, 0), device=device)
        dslot = (c[:, None] + cols).clamp(max=n)
        drafts = tok.gather(1, ext.gather(1, dslot))  # (B, K-1) the drafts in the cache
        q = probabilities(logits, *ctl)  # (B, J, V)
        m, closing = accept(q, p, drafts, D, generator)
        live = torch.from_numpy(active).to(device)
        m = torch.where(live, m, 0)
        close_pos = ext.gather(1, torch.where(live, c + m, n)[:, None])[:, 0]
        tok.scatter_(1, close_pos[:, None], closing[:, None])
        jj = torch.arange(logits.shape[1], device=device)
        done = (jj[None] <= m[:, None]) & live[:, None]  # (B, J) columns committed now
        slots = torch.where(done, c[:, None] + jj, n)
        step_of.scatter_(1, ext.gather(1, slots), passes - 1)
        if logits_buf is not None:
            logits_buf.scatter_(1, slots[..., None].expand(-1, -1, V), logits.float())
        c_new = torch.where(live, c + m + 1, c)
        eng.forget(c_new)
        if on_round is not None:
            verified = ext.gather(1, torch.where(cols < D[:, None], dslot, n))
            on_round(
                dict(positions=verified, tokens=drafts, accepted=m, position=close_pos,
                     token=closing)
            )  # fmt: skip
        m_np = m.cpu().numpy()  # the one host sync of a round
        c_np = r.c + np.where(active, m_np + 1, 0)
        D_next = np.where(c_np < n, np.clip(n - 1 - c_np, 0, K - 1), 0)
        p = _next_drafts(q, m, D_next, p, generator, tok, ext, c_new, live)
        if on_step is not None:
            decided = ext.gather(1, slots)[:, : int(m_np.max()) + 1]  # (B, Q), padding n
            on_step(decided, tok.gather(1, decided), passes - 1)
        stats.passes += active
        stats.drafted += np.where(active, r.D, 0)
        stats.accepted += np.where(active, m_np, 0)
        stats.tokens += np.where(active, m_np + 1, 0)
        # every entry up to the commit is kept: ARMD's content one short of it (the closing
        # token is written by the next pass)
        r = _Rows(c_np, c_np.copy(), np.maximum(c_np - 1, 0) if eng.armd else c_np, D_next)
    out = SampleResult(tok[:, :n].clone(), order, forward_passes=passes, step_of=step_of[:, :n])
    out.logits = None if logits_buf is None else logits_buf[:, :n]
    out.extra["speculative"] = stats
    return out


def _next_drafts(q, m, D_next, p, generator, tok, ext, c_new, live):
    """The next round's drafts: this pass's outputs at slots ``c'..c'+D'-1`` (columns
    ``m + 1 + i``), drawn and written into the token buffer. Returns their laws (B, K-1, V)."""
    B, J, V = q.shape
    Kd = p.shape[1]
    if Kd == 0:
        return p
    device = q.device
    i = torch.arange(Kd, device=device)
    real = (i[None] < torch.from_numpy(D_next).to(device)[:, None]) & live[:, None]
    cols = (m[:, None] + 1 + i).clamp(max=J - 1)
    law = q.gather(1, cols[..., None].expand(B, Kd, V))
    y = draw(law, real, generator)
    pos = ext.gather(1, torch.where(real, c_new[:, None] + i, ext.shape[1] - 1))
    tok.scatter_(1, pos, torch.where(real, y, tok.gather(1, pos)))
    return law


def check_request(draft: int | None, steps: int | None, streams: int | None, order) -> None:
    """Refuse what speculative sampling cannot combine with (the CLI's and the API's check)."""
    if draft is None:
        return
    if steps is not None or streams is not None:
        raise SamplingError(
            "--speculative drafts and verifies along one order, one exact token at a time; "
            "leave out --steps/--streams"
        )
    if order == "strided":
        raise SamplingError("--speculative follows a random or l2r order; leave out strided")
