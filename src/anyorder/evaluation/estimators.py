"""Likelihoods: exact left-to-right and per-order NLL, Monte-Carlo any-order NLL, the
encoder's ELBO, context-order ensembles (AO-GPT Eq. 7), and the exact enumerations that
settle Eq. 5 for tiny ``n``, each on one batch of sequences (over a corpus:
:mod:`anyorder.evaluation.corpus`).

Design choices:

* Everything is in nats and per sequence (B,) or per token; callers convert to perplexity
  or bits per byte with :func:`bits_per_byte` / :func:`anyorder.evaluation.suite.metric`.
* A Monte-Carlo estimate's standard error is over the *orders* (the corpus is fixed).
  Per batch (:func:`any_order_nll`): the mean NLL of the batch under each random order is
  one sample. Per corpus (:mod:`anyorder.evaluation.corpus`): a block gets ``K``
  replicates (orders, mask draws) and the standard error pools the within-block variance,
  ``se = sqrt(sum_b s_b^2 / K) / N`` (``N (K - 1)`` degrees of freedom; ``K = 1`` gives nan).
* Corpus randomness is drawn per block from a generator seeded by ``(seed, block, stream)``:
  results do not depend on the batch size, and the ensemble's identity member is exactly
  the plain any-order pass of the same seed.
* Ensembles combine members in probability space: ``log p_ens = logsumexp_j log p_j - log M``.
  See :func:`member_logprobs` for the exact batched scheme and its cost.
* The enumerations are exact and exponential (``n!`` orders, ``2^n`` mask sets): they exist
  to test the method's identities, for ``n`` up to about 7.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from anyorder import orders as orders_mod
from anyorder.models.base import DEFAULT_MAX_TOKENS, AnyOrderLM
from anyorder.models.mdm import MDM


@dataclass
class Estimate:
    """An estimate in nats per token, with its standard error.

    ``stderr`` is what the producer documents: over the orders for the batch estimators of
    this module; over the blocks of a corpus for
    :func:`anyorder.evaluation.suite.block_estimate`, which puts the order draw's part of it
    in ``stderr_orders`` (None where no order is drawn, as left to right).
    """

    mean: float
    stderr: float
    samples: int
    stderr_orders: float | None = None
    blocks: int | None = None

    def ci95(self) -> tuple[float, float]:
        return self.mean - 1.96 * self.stderr, self.mean + 1.96 * self.stderr


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """Convert nats/token to bits per UTF-8 byte of text."""
    return nats_per_token / math.log(2) / bytes_per_token


@torch.no_grad()
def sequence_nll(
    model: AnyOrderLM,
    tokens: Tensor,
    order: Tensor | None = None,
    blocks: Tensor | None = None,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Tensor:
    """Exact NLL (B,) in nats of each sequence generated in ``order`` with ``blocks``
    (``max_tokens``: the chunk of :meth:`AnyOrderLM.token_nll`)."""
    return model.token_nll(tokens, order, blocks, max_tokens=max_tokens).sum(dim=1)


@torch.no_grad()
def left_to_right_nll(
    model: AnyOrderLM, tokens: Tensor, *, max_tokens: int = DEFAULT_MAX_TOKENS
) -> Tensor:
    """Exact left-to-right NLL (B,) in nats (for ``mdm``: its suffix-masked conditionals)."""
    return sequence_nll(model, tokens, None, None, max_tokens=max_tokens)


def _estimate(per_order: list[Tensor], n: int) -> Estimate:
    vals = torch.stack([v.mean() / n for v in per_order]).double()
    k = len(vals)
    err = float(vals.std(unbiased=True) / math.sqrt(k)) if k > 1 else float("nan")
    return Estimate(float(vals.mean()), err, k)


@torch.no_grad()
def any_order_nll(
    model: AnyOrderLM, tokens: Tensor, num_orders: int, generator: torch.Generator
) -> Estimate:
    """Monte-Carlo any-order NLL (nats/token) over ``num_orders`` uniform orders."""
    B, n = tokens.shape
    per_order = []
    for _ in range(num_orders):
        o = orders_mod.uniform(B, n, generator, tokens.device).order
        per_order.append(sequence_nll(model, tokens, o))
    return _estimate(per_order, n)


@torch.no_grad()
def mdm_elbo(model: MDM, tokens: Tensor, num_samples: int, generator: torch.Generator) -> Estimate:
    """Monte-Carlo ELBO of the encoder (nats/token): ``num_samples`` mask draws per sequence."""
    B, n = tokens.shape
    per = []
    for _ in range(num_samples):
        o = orders_mod.uniform(B, n, generator, tokens.device).order
        per.append(model.elbo_estimate(tokens, o, generator=generator) * n)
    return _estimate(per, n)


# ----------------------------------------------------------------------------- exact, tiny n


@torch.no_grad()
def exact_any_order_nll(model: AnyOrderLM, tokens: Tensor, chunk: int = 720) -> Tensor:
    """Average NLL (B,) in nats over all ``n!`` orders — Eq. 2 exactly, for tiny ``n``."""
    B, n = tokens.shape
    perms = torch.tensor(list(itertools.permutations(range(n))), device=tokens.device)
    total = torch.zeros(B, dtype=torch.float64, device=tokens.device)
    for i in range(0, len(perms), chunk):
        p = perms[i : i + chunk]  # (P, n)
        P = len(p)
        x = tokens.repeat_interleave(P, dim=0)
        o = p.repeat(B, 1)
        total += sequence_nll(model, x, o).double().view(B, P).sum(dim=1)
    return total / len(perms)


@torch.no_grad()
def exact_mdm_elbo(model: MDM, tokens: Tensor) -> Tensor:
    """The encoder's ELBO (B,) in nats, computed exactly by enumerating all mask sets.

    ``ELBO = sum_m (1/m) * mean over |M| = m of sum_{i in M} -log p(x_i | x without M)``
    (Eq. 5 with the nested expectation written out).
    """
    B, n = tokens.shape
    masks = torch.tensor(
        [[(s >> i) & 1 for i in range(n)] for s in range(1, 2**n)],
        dtype=torch.bool,
        device=tokens.device,
    )  # (S, n)
    S = len(masks)
    x = tokens.repeat_interleave(S, dim=0)
    m = masks.repeat(B, 1)
    logits = model.denoise(torch.where(m, model.mask_id, x)).float()
    nll = F.cross_entropy(logits.transpose(1, 2), x, reduction="none")  # (B*S, n)
    size = m.sum(dim=1)
    term = (nll * m).sum(dim=1).double() / size  # (1/m) * sum over the masked set
    count = torch.tensor(
        [math.comb(n, int(k)) for k in size], dtype=torch.float64, device=tokens.device
    )
    return (term / count).view(B, S).sum(dim=1)


# ----------------------------------------------------------------------------- ensembles


def combine_members(logp: Tensor, m: int | None = None) -> Tensor:
    """Ensemble log-probability from member log-probabilities (..., M), in probability space.

    ``log p_ens = logsumexp(logp[..., :m]) - log m`` (float64): the mean of the members'
    *probabilities*, not of their logs. Returns (...).
    """
    lp = logp[..., :m].double() if m else logp.double()
    return torch.logsumexp(lp, dim=-1) - math.log(lp.shape[-1])


def ensemble_cost(n: int, members: int, targets: int | None = None) -> float:
    """Forward passes of ``n`` tokens per block that :func:`member_logprobs` costs.

    ``1 + (M - 1) (n + 1) / 2`` when every target is scored (``n = 1024, M = 8``: 3588.5);
    with ``targets`` random target slots per block, ``1 + (M - 1) targets (n + 1) / (2 n)``
    in expectation. Chunk padding adds a little (the measured count is reported beside it).
    """
    t = n if targets is None else min(targets, n)
    return 1.0 + (members - 1) * t * (n + 1) / (2.0 * n)


MAX_ORDERS = 10_000
"""The most random orders (``K``) and ensemble members (``M``) an evaluation takes, on the
command line and in the harness alike: each order is one pass over the text and each member
about one more, and the any-order NLL's error bar shrinks as 1/sqrt(K) (16 to 64 are the
useful range)."""


def check_counts(
    orders: int, ensemble: int, *, names: tuple[str, str], unit: str, fixes=("16", "8")
) -> None:
    """Refuse more than :data:`MAX_ORDERS` orders or members, in one line.

    Args:
        orders, ensemble: ``K`` and ``M``.
        names: how the caller's surface spells each with its value: ``("--orders {}",
            "--ensemble {}")`` on the command line.
        unit: what one pass covers (``block``, ``request``).
        fixes: the advice for each, after "use e.g.".

    Raises:
        ConfigError: the first count over the bound.
    """
    from anyorder.errors import ConfigError

    if orders > MAX_ORDERS:
        raise ConfigError(
            f"{names[0].format(orders)} must be at most {MAX_ORDERS:,} (each order is one pass "
            f"over every {unit}); use e.g. {fixes[0]}"
        )
    if ensemble > MAX_ORDERS:
        raise ConfigError(
            f"{names[1].format(ensemble)} must be at most {MAX_ORDERS:,} (each member costs "
            f"about one pass per {unit} and order); use e.g. {fixes[1]}"
        )


def check_ensemble_memory(members: int, rows: int, n: int, device, *, name: str, what: str,
                          fix: str) -> None:  # fmt: skip
    """An ensemble draws ``M`` orders of ``n`` positions (float64 keys, int64 orders: 16 bytes
    each) for ``rows`` rows at once: refuse one that cannot fit the device's memory, with the
    estimate and the memory.

    Args:
        members: ``M``.
        rows, n: the rows of one call and their length.
        device: where the orders are drawn.
        name: how the caller spells ``M`` with its value (``--ensemble 64``).
        what: the rows, for the message (``2 block(s) of 1024 tokens``).
        fix: the advice that ends the message.

    Raises:
        ConfigError: more than the device holds.
    """
    from anyorder.errors import ConfigError
    from anyorder.memory import format_bytes, machine_memory

    device = torch.device(device)
    need = rows * members * n * 16
    have = machine_memory(str(device))
    where = "this GPU" if device.type == "cuda" else "this machine"
    if members > 1 and have is not None and need > have:
        raise ConfigError(
            f"{name} needs at least {format_bytes(need)} for the orders of {what} at once, "
            f"more than {where}'s {format_bytes(have)}; {fix}"
        )


def ensemble_orders(order: Tensor, keys: Tensor, slot: Tensor, length: int) -> Tensor:
    """Member orders for targets ``slot``: the context sorted by each member's keys.

    Args:
        order: (P, n) the evaluated order sigma of each pair's sequence.
        keys: (P, M-1, n) one random key per member and *position*.
        slot: (P,) target slot i of each pair, ``i < length``.
        length: slots to return (at least ``max(slot) + 1``).

    Returns:
        (P, M-1, length) orders ``(sigma_<i sorted by key, sigma_i, sigma_(i+1..length-1))``;
        slot ``i`` of row ``j`` predicts ``x[sigma_i]`` from the context in member j's order.
    """
    P, Mm = keys.shape[:2]
    sig = order[:, :length]  # (P, L)
    k = keys.gather(2, sig[:, None, :].expand(P, Mm, length))  # (P, M-1, L) keys in [0, 1)
    s = torch.arange(length, device=order.device, dtype=k.dtype)
    i = slot[:, None, None].to(k.dtype)
    # context (s < i) by key, then the target (2), then the unread filler in sigma order
    k = torch.where(s < i, k, torch.where(s == i, 2.0, 3.0 + s))
    return sig[:, None, :].expand(P, Mm, length).gather(2, k.argsort(dim=-1))


def slot_logprob(
    model: AnyOrderLM,
    tokens: Tensor,
    order: Tensor,
    slot: Tensor,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Tensor:
    """log p of ``tokens[order[r, slot[r]]]`` at slot ``slot[r]`` of each row r: (R,).

    The trunk runs over the rows' slots; the head reads one hidden state per row (the full
    logits of every slot would be (R, T, V)).
    """
    R = len(slot)
    rows = torch.arange(R, device=tokens.device)
    target = tokens.gather(1, order.gather(1, slot[:, None]))[:, 0]
    if not model.has_features():  # a model that only has a forward (test doubles)
        logits = model(tokens, order)[rows, slot]
        return logits.float().log_softmax(dim=-1).gather(1, target[:, None])[:, 0]
    h = model.features(tokens, order)[rows, slot]  # (R, d)
    return -model.head_nll(h, target, max_tokens)


def _targets_by_slot(slots: Tensor, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Every target of ``slots`` (B, S) as ``(row, column, slot)`` (B*S,) each, sorted by slot
    (stable): targets of similar slots, and so of similar truncated length, sit together."""
    B, S = slots.shape
    b_of = torch.arange(B, device=device).repeat_interleave(S)
    col_of = torch.arange(S, device=device).repeat(B)
    slot_of = slots.flatten()
    by_slot = slot_of.argsort(stable=True)
    return b_of[by_slot], col_of[by_slot], slot_of[by_slot]


def _slot_budget(model: AnyOrderLM, max_tokens: int) -> int:
    """Slot evaluations per trunk call of :func:`member_logprobs`."""
    if model.has_features():
        return max_tokens
    # full logits come back: keep them near the hidden size
    d, V = model.cfg.d_model, model.cfg.vocab_size
    return max(1, max_tokens * d // max(d, V))


def _chunk_stop(sl: list[int], start: int, members: int, budget: int) -> int:
    """End (exclusive) of the chunk of targets that starts at ``start`` of ``sl`` (sorted
    slots), for ``members`` truncated rows per target.

    Sorted by slot: a chunk's rows are as long as its last slot + 1. Chunks end at the
    budget or when that length would pad the first row by more than 1/8 (+4 slots).
    """
    stop, cap = start + 1, (sl[start] + 1) * 9 // 8 + 4
    while (
        stop < len(sl)
        and sl[stop] < cap
        and (stop + 1 - start) * members * (sl[stop] + 1) <= budget
    ):
        stop += 1
    return stop


@torch.no_grad()
def member_logprobs(
    model: AnyOrderLM,
    tokens: Tensor,
    order: Tensor,
    keys: Tensor,
    slots: Tensor | None = None,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    on_chunk: Callable[[int], None] | None = None,
) -> tuple[Tensor, int]:
    """Log-probabilities of each target under each context-order ensemble member (Eq. 7).

    Member 0 is the identity (the context in the order ``order`` itself); member ``j >= 1``
    presents the context of target ``i`` sorted by ``keys[:, j-1]``: for every target a
    uniformly random permutation of its context, independent across members (the paper's
    draw), though correlated across targets of one member (which leaves each target's term
    and so the expected total unchanged). Tokens keep their original positions.

    Why this is the cheapest exact scheme we have: in a causal decoder (aogpt; armd's
    strictly causal stack alike) slot ``s`` depends on the first ``s + 1`` entries of the
    order only (its input and its target position). So the conditional of target ``i``
    under context order ``rho`` is slot ``i`` of the sequence ``(rho, sigma_i)``, truncated
    to ``i + 1`` slots. One sequence serves target ``i`` only when its first ``i`` entries
    are a permutation of ``sigma_<i`` and entry ``i`` is ``sigma_i``; serving every target
    at once forces the sequence to be ``sigma`` itself. So the identity costs one pass for
    all targets, and every other (target, member) needs its own truncated sequence: ``n +
    (M - 1) n (n + 1) / 2`` slot evaluations per block, i.e. :func:`ensemble_cost` =
    ``1 + (M - 1)(n + 1)/2`` passes of ``n`` tokens, half of the ``(M - 1) n`` full passes
    of reading one slot per pass. Truncated rows are batched by similar length (waste below
    one chunk) and the head runs only at the slot read (:func:`slot_logprob`). Sharing prefixes
    would save up to another half: key-sorted contexts of consecutive targets share the
    prefix before the newly inserted position, ``n + #inversions ~ n^2/4`` distinct slots
    per member; that needs tree attention masks and is not done here.

    armd: with token-level blocks its conditionals depend on the context order across
    blocks, so ensembles apply; with the whole context in one block they are invariant and
    an ensemble changes nothing. mdm: conditionals depend on the context *set* only —
    ensembles are a no-op (callers skip them).

    Args:
        model: a decoder that accepts orders shorter than ``n`` (aogpt, armd).
        tokens: (B, n) sequences in original positions.
        order: (B, n) the evaluated orders sigma.
        keys: (B, M-1, n) member keys per position, uniform in [0, 1) (float64 is best).
        slots: (B, S) target slots to score (default: all ``n``).
        max_tokens: slot evaluations per trunk call, and the head's chunk (memory bound).
        on_chunk: called with the slot evaluations of each call as it is done (progress).

    Returns:
        ``(logp, evaluated)``: logp (B, S, M) float32 with member 0 the identity, and the
        number of slot evaluations run, padding and the identity pass included.
    """
    B, n = tokens.shape
    M = keys.shape[1] + 1
    keys = keys.to(tokens.device)
    if slots is None:
        slots = torch.arange(n, device=tokens.device).expand(B, n)
    S = slots.shape[1]
    out = torch.zeros(B, S, M, device=tokens.device)
    out[..., 0] = -model.token_nll(tokens, order, max_tokens=max_tokens).gather(1, slots)
    evaluated = B * n
    if on_chunk is not None:
        on_chunk(B * n)
    if M == 1:
        return out, evaluated
    b_of, col_of, slot_of = _targets_by_slot(slots, tokens.device)
    budget = _slot_budget(model, max_tokens)
    sl = slot_of.tolist()
    start = 0
    while start < len(sl):
        stop = _chunk_stop(sl, start, M - 1, budget)
        length = sl[stop - 1] + 1
        b, c, i = b_of[start:stop], col_of[start:stop], slot_of[start:stop]
        rows = ensemble_orders(order[b], keys[b], i, length)  # (P, M-1, L)
        P = len(b)
        lp = slot_logprob(
            model,
            tokens[b].repeat_interleave(M - 1, dim=0),
            rows.reshape(P * (M - 1), length),
            i.repeat_interleave(M - 1),
            max_tokens,
        )
        out[b, c, 1:] = lp.view(P, M - 1)
        evaluated += P * (M - 1) * length
        if on_chunk is not None:
            on_chunk(P * (M - 1) * length)
        start = stop
    return out, evaluated
