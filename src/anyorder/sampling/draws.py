"""Token draws: the sampling controls, float64 categorical draws, orders with a prompt first.

Design choices:

* Every random draw goes through an explicit :class:`torch.Generator`, so the same seed gives
  the same sample; a generator on another device than the logits is honoured.
* Categorical draws are made in float64: float32 noise lowers the effective temperature
  (Zheng et al. 2024, arXiv 2409.02908).
* A prompt is any set of known ``(position, token)`` pairs; known positions go first in the
  order (left to right among themselves), the rest follow in the requested order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor

from anyorder.errors import SamplingError
from anyorder.sampling.schedules import RevealPlan

StepHook = Callable[[Tensor, Tensor, int], None]
"""``on_step(positions, tokens, step)`` after every pass that draws tokens: (B, Q) positions
(padding = n) and tokens on the model's device, and the step recorded in ``step_of``."""


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
    """(B, n) the step that decided each position (-1 for prompt positions, -2 for positions
    never generated because their row ended at a generated EOS: they hold EOS, and their
    kept logits are zeros)."""
    extra: dict = field(default_factory=dict)
    logits: Tensor | None = None
    """(B, n, V) slot-aligned logits each token was drawn from (``keep_logits=True``)."""
    reveals: RevealPlan | None = None
    """Tokens revealed per non-empty reverse step (Lemma-1 and encoder samplers with steps)."""

    @property
    def counts(self) -> Tensor | None:
        """(steps, B) tokens revealed per reverse step, every step included (dense: it has
        ``steps`` rows, so ask for it only when ``steps`` is small; :attr:`reveals` holds the
        non-empty steps alone)."""
        return None if self.reveals is None else self.reveals.dense()


def check_controls(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise :class:`SamplingError` on out-of-range sampling controls."""
    if not temperature > 0:
        raise SamplingError(
            f"temperature={temperature} must be > 0 (use e.g. 0.01 for near-greedy)"
        )
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise SamplingError(f"top-p={top_p} must lie in (0, 1]; use e.g. 0.9, or 1 for no cut")
    if top_k is not None and top_k < 1:
        raise SamplingError(f"top-k={top_k} must be at least 1; leave it out to keep every token")


TOP_P_RULES = ("nucleus", "reference")
_TOP_P_RULE: ContextVar[str] = ContextVar("anyorder_top_p_rule", default="nucleus")


@contextlib.contextmanager
def top_p_rule(rule: str) -> Iterator[None]:
    """Which tokens top-p keeps, for the draws inside the block.

    ``nucleus`` (the default): the smallest set of top tokens whose mass reaches ``p``, the
    token that crosses ``p`` included (Holtzman et al.; what ``transformers`` does).
    ``reference``: the AO-GPT reference code's ``top_p_sampling_from_probs``, which drops
    every token whose cumulative mass exceeds ``p``, the crossing token too (the top token
    always stays); the generative-perplexity ``reference`` protocol samples this way.
    """
    if rule not in TOP_P_RULES:
        raise SamplingError(f"top-p rule {rule!r}: use one of {', '.join(TOP_P_RULES)}")
    token = _TOP_P_RULE.set(rule)
    try:
        yield
    finally:
        _TOP_P_RULE.reset(token)


def current_top_p_rule() -> str:
    """The top-p rule in force (:func:`top_p_rule`), read on the host: a sampler whose
    passes compile reads it once, outside them (a compiled pass cannot read the context)."""
    return _TOP_P_RULE.get()


def filter_logits(
    logits: Tensor, top_k: int | None = None, top_p: float | None = None, rule: str | None = None
) -> Tensor:
    """Set logits outside the top-k / nucleus (top-p) support to -inf. (..., V) -> (..., V).
    Top-p follows ``rule``, or (None) the rule in force (:func:`top_p_rule`)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass = probs.cumsum(dim=-1)
        if (rule or _TOP_P_RULE.get()) == "reference":
            drop = mass > top_p  # the crossing token goes too
            drop[..., 0] = False
        else:  # drop a token when the mass before it already reaches top_p
            drop = mass - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


DRAW_ELEMENTS = 1 << 22
"""Float64 elements drawn at once on the CPU (32 MB): rows of (..., V) logits are drawn in
chunks of this size, so a draw's memory is bounded whatever the batch and the queries (a
whole (32, 512, 50257) draw was 6.6 GB per float64 tensor, and top-p sorts two of them)."""
DRAW_ELEMENTS_GPU = 1 << 26
"""The same on a GPU (512 MB): a typical pass (batch 8, 64 queries, GPT-2's vocabulary) is
one chunk, so the draw adds no launches per pass; only huge requests are split."""
GPU_CHUNKS_ON_CPU = False
"""Chunk a CPU tensor as a GPU one (:data:`DRAW_ELEMENTS_GPU`): how the launch proxy
(``benchmarks/launch_overhead.py``) counts the GPU's kernels on a CPU."""


def draw_limit(device: torch.device) -> int:
    """The elements a draw (or a score) handles at once on ``device``."""
    cpu = device.type == "cpu" and not GPU_CHUNKS_ON_CPU
    return DRAW_ELEMENTS if cpu else DRAW_ELEMENTS_GPU


def sample_logits(
    logits: Tensor,
    generator: torch.Generator | None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """Draw one token per row from ``logits`` (..., V) in float64. Returns (...).

    The rows are drawn in chunks of :data:`DRAW_ELEMENTS` (:data:`DRAW_ELEMENTS_GPU` on a
    GPU) float64 values, in order, from the one generator; the chunks depend on the shape
    alone (no host sync)."""
    if top_k == 1:  # a point mass at any temperature: the argmax, without the float64
        return logits.argmax(dim=-1)  # draw over the vocabulary (the generator is unused)
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    rows = max(1, draw_limit(logits.device) // V)
    if flat.shape[0] <= rows:
        return _draw(flat, generator, temperature, top_k, top_p).view(logits.shape[:-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=logits.device)
    for start in range(0, flat.shape[0], rows):
        part = flat[start : start + rows]
        out[start : start + rows] = _draw(part, generator, temperature, top_k, top_p)
    return out.view(logits.shape[:-1])


def _draw(flat: Tensor, generator, temperature: float, top_k, top_p) -> Tensor:
    """One draw per row of (R, V) logits, in float64."""
    x = flat.double()
    if temperature != 1.0:  # a launch saved at the default (x / 1 is x); never in place
        x = x / temperature  # (float64 logits would be the caller's own)
    probs = filter_logits(x, top_k, top_p).softmax(dim=-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).view(-1).to(flat.device)


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
    # known positions: keys in [0, 1) by position (left to right); the rest: [2, 3)
    l2r_key = torch.arange(n, device=known.device, dtype=torch.float64).expand(B, n) / n
    return torch.where(known, l2r_key, key + 2).argsort(dim=-1)


def _gdev(generator: torch.Generator | None, like: Tensor) -> torch.device:
    return generator.device if generator is not None else like.device
