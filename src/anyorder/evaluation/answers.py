"""A prompt's answer: exact and Monte-Carlo NLLs of the answer given its prompt.

Design choices:

* The answer is the positions from ``prompt_len`` on (padding included: data.format=chat
  pads each answer with EOS to the block's end, and the model learns those too).
* Orders put the prompt first, left to right, and the answer after
  (:func:`anyorder.orders.prompt_first`), as ``order.condition=prompt`` trains and the
  samplers decode: every answer token is predicted from the whole prompt.
* Figures are in nats per answer token of the batch; a Monte-Carlo estimate's standard
  error is over the draws (orders, mask levels), as in :mod:`anyorder.evaluation.estimators`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from anyorder import orders as orders_mod
from anyorder.evaluation.estimators import Estimate
from anyorder.models.base import DEFAULT_MAX_TOKENS, AnyOrderLM
from anyorder.models.mdm import MDM


@torch.no_grad()
def answer_nll(
    model: AnyOrderLM,
    tokens: Tensor,
    prompt_len: Tensor,
    order: Tensor | None = None,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> Tensor:
    """Exact NLL (B,) in nats of each row's answer (positions ``>= prompt_len``) given its
    prompt, generated in ``order`` (None: left to right; an order should put the prompt
    first, :func:`anyorder.orders.prompt_first`)."""
    nll = model.token_nll(tokens, order, None, max_tokens=max_tokens)  # (B, n) by slot
    target = model.resolve_order(tokens, order)
    return (nll * (target >= prompt_len.to(tokens.device)[:, None])).sum(dim=1)


def _answer_estimate(per_draw: list[Tensor], answer_tokens: int) -> Estimate:
    vals = torch.stack([v.double().sum() / answer_tokens for v in per_draw])
    k = len(vals)
    err = float(vals.std(unbiased=True) / math.sqrt(k)) if k > 1 else float("nan")
    return Estimate(float(vals.mean()), err, k)


@torch.no_grad()
def answer_any_order_nll(
    model: AnyOrderLM,
    tokens: Tensor,
    prompt_len: Tensor,
    num_orders: int,
    generator: torch.Generator,
) -> Estimate:
    """Monte-Carlo NLL (nats per answer token) of the answers given their prompts, over
    ``num_orders`` orders with the prompt first and the answer uniform."""
    B, n = tokens.shape
    plen = prompt_len.to(tokens.device)
    per = []
    for _ in range(num_orders):
        o = orders_mod.prompt_first(orders_mod.uniform(B, n, generator, tokens.device).order, plen)
        per.append(answer_nll(model, tokens, plen, o))
    return _answer_estimate(per, int((n - plen).sum()))


@torch.no_grad()
def answer_mdm_elbo(
    model: MDM, tokens: Tensor, prompt_len: Tensor, num_samples: int, generator: torch.Generator
) -> Estimate:
    """Monte-Carlo ELBO of the encoder (nats per answer token) with the prompt unmasked."""
    B, n = tokens.shape
    plen = prompt_len.to(tokens.device)
    r = n - plen
    per = []
    for _ in range(num_samples):
        o = orders_mod.uniform(B, n, generator, tokens.device).order
        per.append(model.elbo_estimate(tokens, o, generator=generator, prompt_len=plen) * r)
    return _answer_estimate(per, int(r.sum()))
