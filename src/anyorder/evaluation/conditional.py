"""The log-likelihood of a text and of a continuation given a known context, as
:meth:`anyorder.api.Model.score` and the evaluation harness's backend ask for them.

Design choices:

* A text longer than the model's context is scored in consecutive windows of ``seq_len``
  tokens, each from scratch (:func:`window_totals`): the corpus paths of
  :mod:`anyorder.evaluation.corpus` on one block per window, so ``score`` and the harness's
  rolling perplexity are one computation.
* A continuation is scored with its context *known*: the context's slots come first, left to
  right, and are not scored; the continuation follows left to right (``l2r``), in ``K``
  uniformly random orders (``any``), or in random orders with each conditional averaged over
  ``M`` context orders in probability space (AO-GPT Eq. 7, ``ensemble=M``: the same member
  orders as :func:`~anyorder.evaluation.estimators.member_logprobs`, the identity among them).
* Every request draws from the generators :func:`~anyorder.evaluation.corpus.block_generator`
  gives block 0 (orders: stream 0, member keys: stream 1, replicate ``k``): a request's value
  does not depend on the batch it ran in or on the other requests, and continuations of one
  length share their orders (common random numbers across the choices of a question).
* ``greedy`` is the harness's ``is_greedy`` for the order used: every continuation token is
  the argmax of the distribution it was scored under (the ensemble's mixture for ``M > 1``),
  in every one of the ``K`` orders.
* Decoders batch requests right-padded: the padding's slots come after every real slot in
  the order, so a causal decoder's real slots never see them. The encoder (mdm) reads every
  position, so it runs one request at a time, without padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from anyorder.errors import ConfigError
from anyorder.evaluation.corpus import (
    block_generator,
    corpus_any_order,
    corpus_ensemble,
    corpus_left_to_right,
    corpus_mdm_elbo,
)
from anyorder.evaluation.estimators import combine_members, ensemble_orders
from anyorder.models.base import AnyOrderLM
from anyorder.models.mdm import MDM

ORDERS = ("l2r", "any")


def check_order(model: AnyOrderLM, order: str, ensemble: int, num_orders: int) -> None:
    """Refuse an order or ensemble the model has no meaning for, in one line."""
    if order not in ORDERS:
        raise ConfigError(f"order={order!r}: use l2r or any")
    if ensemble < 1 or num_orders < 1:
        raise ConfigError("ensemble and num_orders must be at least 1")
    if order == "l2r" and ensemble > 1:
        raise ConfigError("an ensemble averages context orders: use it with order='any'")
    if order == "any" and model.kind == "gpt":
        raise ConfigError("gpt is a left-to-right model: score it with order='l2r'")


@torch.no_grad()
def window_totals(
    model: AnyOrderLM, ids: Sequence[int], order: str, ensemble: int, num_orders: int, seed: int
) -> list[Tensor]:
    """Summed NLL (nats) of each ``seq_len`` window of ``ids``, each scored from scratch:
    a scalar (left to right) or ``(K,)`` replicates over random orders (mask draws for mdm)."""
    n = model.cfg.seq_len
    kw = dict(seed=seed, progress=False)
    totals = []
    for i in range(0, len(ids), n):
        w = torch.tensor(ids[i : i + n], dtype=torch.long)
        blocks = w[None]
        if order == "l2r":
            v = corpus_left_to_right(model, blocks, progress=False)[0]
        elif isinstance(model, MDM):
            v = corpus_mdm_elbo(model, blocks, num_orders, **kw)[0]
        elif ensemble > 1:
            run = corpus_ensemble(model, blocks, num_orders, ensemble, sizes=[ensemble], **kw)
            v = run.values[0, :, 0]
        else:
            v = corpus_any_order(model, blocks, num_orders, **kw)[0]
        totals.append(v.double() * len(w))
    return totals


@dataclass
class Continuations:
    """Per request: the continuation's NLL under each order replicate, and greediness."""

    nll: Tensor
    """(R, K) float64 nats, summed over the continuation's tokens."""
    greedy: Tensor
    """(R,) bool: every continuation token the argmax, in every replicate."""


def _order(ctx: int, cont: int, length: int, order: str, k: int, seed: int) -> Tensor:
    """(length,) the context left to right, the continuation in ``order``, then padding."""
    if order == "l2r":
        tail = torch.arange(cont)
    else:
        tail = torch.randperm(cont, generator=block_generator(seed, 0, 0, k))
    return torch.cat([torch.arange(ctx), ctx + tail, torch.arange(ctx + cont, length)])


def _slot_logprobs(
    model: AnyOrderLM, tokens: Tensor, order: Tensor, slots: Tensor, rows: Tensor | None = None
) -> Tensor:
    """Log-softmax (R, V) at slot ``slots[r]`` of row ``rows[r]`` (default: row r): the trunk
    once over the rows, the head on the read slots only."""
    if rows is None:
        rows = torch.arange(len(slots), device=tokens.device)
    if model.has_features():
        logits = model.head_logits(model.features(tokens, order)[rows, slots])
    else:  # a model that only has a forward
        logits = model(tokens, order)[rows, slots]
    return logits.float().log_softmax(dim=-1)


def _members(
    model: AnyOrderLM,
    x: Tensor,
    order: Tensor,
    ctx: int,
    cont: int,
    members: int,
    k: int,
    seed: int,
) -> Tensor:
    """(cont, V, M-1) log-probabilities of one request's continuation slots under the
    ensemble's non-identity members (the context of each target sorted by the member's keys)."""
    length = ctx + cont
    g = block_generator(seed, 0, 1, k)
    # keys for the request's own positions: drawn over the padded batch length, the same
    # generator gave a request different member orders in different batches
    keys = torch.rand(members - 1, length, generator=g, dtype=torch.float64)
    slot = torch.arange(ctx, length)
    rows = ensemble_orders(
        order[None, :length].expand(cont, length),
        keys[None].expand(cont, -1, -1).to(x.device),
        slot.to(x.device),
        length,
    )  # (cont, M-1, length)
    flat = rows.reshape(cont * (members - 1), length)
    lp = _slot_logprobs(
        model,
        x[None, :length].expand(len(flat), length),
        flat,
        slot.to(x.device).repeat_interleave(members - 1),
    )  # (cont*(M-1), V)
    return lp.view(cont, members - 1, -1).transpose(1, 2)


@torch.no_grad()
def continuation_nll(
    model: AnyOrderLM,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    order: str = "l2r",
    num_orders: int = 1,
    ensemble: int = 1,
    seed: int = 0,
    batch_size: int = 8,
    on_done: Callable[[int], None] | None = None,
) -> Continuations:
    """NLL of each ``(context ids, continuation ids)`` request's continuation given its context.

    Args:
        model: any model; ``order='any'`` needs aogpt, armd or mdm, ``ensemble`` a decoder.
        requests: token ids; context plus continuation must fit ``model.cfg.seq_len``, and
            the continuation must not be empty.
        order: ``l2r`` or ``any`` (``num_orders`` random orders of the continuation).
        num_orders: order replicates for ``any`` (ignored for ``l2r``: one).
        ensemble: Eq. 7 members ``M`` (with ``any``), the identity among them.
        seed: seed of the orders and member keys.
        batch_size: requests per trunk call (decoders; the encoder runs one at a time).
        on_done: called with the number of requests finished, as they finish (progress).

    Returns:
        :class:`Continuations`.
    """
    check_order(model, order, ensemble, num_orders)
    if ensemble > 1 and isinstance(model, MDM):
        raise ConfigError("an encoder's conditionals depend on the context set only: no ensemble")
    K = 1 if order == "l2r" else num_orders
    R = len(requests)
    nll = torch.zeros(R, K, dtype=torch.float64)
    greedy = torch.ones(R, dtype=torch.bool)
    rows = 1 if isinstance(model, MDM) else max(1, batch_size)
    by_len = sorted(range(R), key=lambda r: -(len(requests[r][0]) + len(requests[r][1])))
    dev = model.device
    for start in range(0, R, rows):
        idx = by_len[start : start + rows]
        lens = [(len(requests[r][0]), len(requests[r][1])) for r in idx]
        L = max(c + t for c, t in lens)
        x = torch.zeros(len(idx), L, dtype=torch.long)
        for j, r in enumerate(idx):
            ids = list(requests[r][0]) + list(requests[r][1])
            x[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        x = x.to(dev)
        for k in range(K):
            o = torch.stack([_order(c, t, L, order, k, seed) for c, t in lens]).to(dev)
            b = torch.cat([torch.full((t,), j) for j, (c, t) in enumerate(lens)]).to(dev)
            s = torch.cat([torch.arange(c, c + t) for c, t in lens]).to(dev)
            lp = _slot_logprobs(model, x, o, s, b)  # (sum of t, V): the identity member
            target = x[b, o[b, s]]
            if ensemble > 1:
                parts = []
                for j, (c, t) in enumerate(lens):
                    mem = _members(model, x[j], o[j], c, t, ensemble, k, seed)
                    parts.append(torch.cat([lp[b == j][..., None], mem], dim=-1))
                lp = combine_members(torch.cat(parts)).float()  # (sum of t, V)
            tok = lp.gather(1, target[:, None])[:, 0].double()
            hit = lp.argmax(dim=-1) == target
            for j, r in enumerate(idx):
                nll[r, k] = -tok[b == j].sum().cpu()
                greedy[r] &= bool(hit[b == j].all())
        if on_done is not None:
            on_done(len(idx))
    return Continuations(nll, greedy)


def combine_windows(totals: list[Tensor], tokens: int) -> tuple[float, float]:
    """Per-token mean and standard error from per-window summed NLLs.

    Each entry is a scalar (exact) or (K,) replicates over random orders; replicates of a
    window are averaged and their variances pooled: ``se = sqrt(sum_w s_w^2 / K) / tokens``.
    """
    mean = sum(float(t.mean()) for t in totals) / tokens
    var = 0.0
    for t in totals:
        if t.dim() == 0 or t.numel() == 1:
            if t.dim() == 1:  # a single random order: no error bar
                return mean, float("nan")
            continue
        var += float(t.var(unbiased=True)) / t.numel()
    return mean, math.sqrt(var) / tokens


def given_totals(
    model: AnyOrderLM,
    ctx: list[int],
    ids: list[int],
    order: str,
    ensemble: int,
    num_orders: int,
    seed: int,
) -> list[Tensor]:
    """The summed NLL of the continuation ``ids`` given ``ctx`` as :func:`combine_windows`
    reads it: one window, a scalar (``l2r``) or (K,) over the order replicates.

    Raises:
        ConfigError: an empty continuation, or context and continuation over ``seq_len``.
    """
    if not ids:
        raise ConfigError("the text encodes to no tokens; give some text to score")
    if len(ctx) + len(ids) > model.cfg.seq_len:
        raise ConfigError(
            f"context and text are {len(ctx) + len(ids)} tokens, more than the model's "
            f"context of {model.cfg.seq_len}; shorten the context"
        )
    res = continuation_nll(
        model, [(ctx, ids)], order=order, num_orders=num_orders, ensemble=ensemble, seed=seed
    )
    v = res.nll[0]
    return [v[0] if order == "l2r" else v]
