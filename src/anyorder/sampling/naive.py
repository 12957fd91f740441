"""The naive any-order sampler: the oracle the fast samplers are tested against.

Design choices:

* One full forward pass per generated token and no cache: slow on purpose, and simple
  enough to be obviously right.
* It draws the order and the tokens from the generator exactly as the fast sequential
  sampler does, so the same seed gives the same sample on both.
* ``stop_at_eos`` is applied after the loop, in the order: a row's draws after its first
  generated EOS become EOS, never generated (step -2). It draws every token (a stopped row
  still consumes its draws, as the fast sampler's rows do until the whole batch stops).
"""

from __future__ import annotations

import torch
from torch import Tensor

from anyorder.errors import SamplingError
from anyorder.models.base import AnyOrderLM
from anyorder.models.mdm import MDM
from anyorder.sampling.draws import SampleResult, check_controls, prompt_order, sample_logits


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
    stop_at_eos: int | None = None,
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
        stop_at_eos: the EOS id: in each row, every slot of the order after the row's first
            generated EOS (a prompt's EOS does not count) is EOS with step -2. The fast
            samplers stop early only along a left-to-right order, where this is the text
            after its first generated EOS.

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
    if stop_at_eos is not None:
        drawn = order[:, k:]  # (B, n - k) the generated positions, in the order
        eos = tokens.gather(1, drawn) == stop_at_eos
        later = eos.long().cumsum(dim=1) - eos.long() > 0  # strictly after the first
        tokens = tokens.scatter(1, drawn, tokens.gather(1, drawn).masked_fill(later, stop_at_eos))
        step_of = step_of.scatter(1, drawn, step_of.gather(1, drawn).masked_fill(later, -2))
    return SampleResult(tokens, order, forward_passes=n - k, step_of=step_of)
