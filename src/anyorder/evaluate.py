"""Likelihoods: exact left-to-right and per-order NLL, Monte-Carlo any-order NLL, the
encoder's ELBO, and the exact enumerations that settle Eq. 5 for tiny ``n``.

Design choices:

* Everything is in nats and per sequence (B,) or per token; callers convert to perplexity
  or bits per byte with :func:`bits_per_byte`.
* A Monte-Carlo estimate's standard error is over the *orders* (the corpus is fixed):
  the mean NLL of the batch under each random order is one sample.
* The enumerations are exact and exponential (``n!`` orders, ``2^n`` mask sets): they exist
  to test the method's identities, for ``n`` up to about 7.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from anyorder import orders as orders_mod
from anyorder.models.base import AnyOrderLM
from anyorder.models.mdm import MDM


@dataclass
class Estimate:
    """A Monte-Carlo estimate in nats per token, with its standard error."""

    mean: float
    stderr: float
    samples: int

    def ci95(self) -> tuple[float, float]:
        return self.mean - 1.96 * self.stderr, self.mean + 1.96 * self.stderr


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """Convert nats/token to bits per UTF-8 byte of text."""
    return nats_per_token / math.log(2) / bytes_per_token


@torch.no_grad()
def sequence_nll(
    model: AnyOrderLM, tokens: Tensor, order: Tensor | None = None, blocks: Tensor | None = None
) -> Tensor:
    """Exact NLL (B,) in nats of each sequence generated in ``order`` with ``blocks``."""
    return model.token_nll(tokens, order, blocks).sum(dim=1)


@torch.no_grad()
def left_to_right_nll(model: AnyOrderLM, tokens: Tensor) -> Tensor:
    """Exact left-to-right NLL (B,) in nats (for ``mdm``: its suffix-masked conditionals)."""
    return sequence_nll(model, tokens, None, None)


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
