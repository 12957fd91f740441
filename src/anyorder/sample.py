"""Sampling: token draws and the naive any-order sampler (the oracle for the fast ones).

Design choices:

* Samplers are functions of ``(model, ..., generator)``; every random draw goes through the
  explicit :class:`torch.Generator`, so the same seed gives the same sample.
* Categorical draws are made in float64: float32 noise lowers the effective temperature
  (Zheng et al. 2024, arXiv 2409.02908).
* A prompt is any set of known ``(position, token)`` pairs, given as a ``(B, n)`` token
  tensor and a ``(B, n)`` boolean mask. Known positions go first in the order (left to
  right among themselves), the rest follow in the requested order.
* :func:`naive_sample` runs one full forward pass per generated token and no cache. It is
  slow on purpose: it is the reference the fast samplers are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from anyorder.errors import SamplingError
from anyorder.models.base import AnyOrderLM
from anyorder.models.mdm import MDM


@dataclass
class SampleResult:
    """What a sampler returns."""

    tokens: Tensor
    """(B, n) the finished sequences, in original positions."""
    order: Tensor
    """(B, n) the order the positions were decided in."""
    forward_passes: int = 0
    """Number of model calls made."""
    step_of: Tensor | None = None
    """(B, n) the step that decided each position (-1 for prompt positions)."""
    extra: dict = field(default_factory=dict)


def check_controls(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise :class:`SamplingError` on out-of-range sampling controls."""
    if not temperature > 0:
        raise SamplingError(
            f"temperature={temperature} must be > 0 (use e.g. 0.01 for near-greedy)"
        )
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise SamplingError(f"top-p={top_p} must lie in (0, 1]")
    if top_k is not None and top_k < 1:
        raise SamplingError(f"top-k={top_k} must be at least 1")


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set logits outside the top-k / nucleus (top-p) support to -inf. (..., V) -> (..., V)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


def sample_logits(
    logits: Tensor,
    generator: torch.Generator | None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """Draw one token per row from ``logits`` (..., V) in float64. Returns (...)."""
    logits = filter_logits(logits.double() / temperature, top_k, top_p)
    probs = logits.softmax(dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:
        flat = flat.to(generator.device)
    draw = torch.multinomial(flat, 1, generator=generator).to(logits.device)
    return draw.view(probs.shape[:-1])


def prompt_order(
    known: Tensor, generator: torch.Generator | None = None, mode: str = "random"
) -> Tensor:
    """An order with the known positions first (left to right) and the rest after.

    Args:
        known: (B, n) boolean, True at prompt positions.
        generator: draws the random part of the order.
        mode: ``random`` (uniform over the unknown positions) or ``l2r``.
    """
    B, n = known.shape
    if mode == "l2r":
        key = torch.arange(n, device=known.device, dtype=torch.float64).expand(B, n) / n
    elif mode == "random":
        key = torch.rand(
            B, n, generator=generator, dtype=torch.float64, device=_gdev(generator, known)
        )
        key = key.to(known.device)
    else:
        raise SamplingError(f"order mode {mode!r}: use random or l2r")
    return (key + (~known).double() * 2).argsort(dim=-1)


def _gdev(generator: torch.Generator | None, like: Tensor) -> torch.device:
    return generator.device if generator is not None else like.device


def slot_logits(model: AnyOrderLM, tokens: Tensor, order: Tensor, t: int) -> Tensor:
    """Logits (B, V) predicting slot ``t`` from slots ``< t``, by one full uncached pass."""
    if isinstance(model, MDM):
        visible = torch.zeros_like(tokens, dtype=torch.bool).scatter(1, order[:, :t], True)
        x_t = torch.where(visible, tokens, model.mask_id)
        logits = model.denoise(x_t)
        return logits.gather(1, order[:, t, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
    return model(tokens, order)[:, t]


@torch.no_grad()
def naive_sample(
    model: AnyOrderLM,
    n: int,
    *,
    batch: int = 1,
    order: Tensor | None = None,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> SampleResult:
    """Generate ``n`` tokens one at a time, a full forward pass per token, no cache.

    Args:
        model: any of the four models (``gpt`` needs the left-to-right order).
        n: sequence length.
        batch: number of sequences (ignored when ``prompt`` is given).
        order: (B, n) order to follow; default: known positions first, then random (``l2r``
            for ``gpt``). A given order must list the known positions first.
        prompt: (B, n) tokens at the known positions (anything elsewhere).
        known: (B, n) boolean mask of the known positions.
        temperature, top_k, top_p: sampling controls.
        generator: the source of randomness.

    Returns:
        A :class:`SampleResult`; ``forward_passes`` is the number of generated tokens.
    """
    check_controls(temperature, top_k, top_p)
    device = model.device
    if n > model.cfg.seq_len:
        raise SamplingError(f"n={n} is longer than the model's context ({model.cfg.seq_len})")
    if prompt is None:
        prompt = torch.zeros(batch, n, dtype=torch.long, device=device)
        known = torch.zeros(batch, n, dtype=torch.bool, device=device)
    elif known is None:
        raise SamplingError("a prompt needs its known-position mask")
    prompt, known = prompt.to(device), known.to(device)
    if order is None:
        order = prompt_order(known, generator, "l2r" if model.kind == "gpt" else "random")
    order = order.to(device)
    num_known = known.sum(dim=1)
    if not bool((num_known == num_known[0]).all()):
        raise SamplingError("every row of a batch needs the same number of known positions")
    k = int(num_known[0])
    if not bool(known.gather(1, order[:, :k]).all()):
        raise SamplingError("the order must list the known positions first")
    tokens = torch.where(known, prompt, 0)
    step_of = torch.full_like(tokens, -1)
    for t in range(k, n):
        logits = slot_logits(model, tokens, order, t)
        new = sample_logits(logits, generator, temperature, top_k, top_p)
        tokens = tokens.scatter(1, order[:, t, None], new[:, None])
        step_of = step_of.scatter(1, order[:, t, None], t - k)
    return SampleResult(tokens, order, forward_passes=n - k, step_of=step_of)
