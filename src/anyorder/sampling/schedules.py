"""Masking schedules and reveal counts: how many tokens each reverse step of Lemma 1 reveals.

Design choices:

* Time runs from ``t = 1`` (every token masked) to ``t = 0`` (none); a ``T``-step reverse
  process visits ``t_i = (T - i) / T``. ``m(t)`` is the probability that a token is masked
  at time ``t``: ``linear`` ``m(t) = t``, ``cosine`` ``m(t) = cos((1 - t) pi / 2)`` (the
  cosine schedule of MaskGIT, MD4 and the AO-GPT reference code: few tokens early, many
  late; docs/method.md says why it is not the mirror image ``1 - cos(pi t / 2)``).
* ``binomial`` counts (ours, the default): the exact reverse process. A step ``t -> s``
  reveals each still-masked token with probability ``1 - m(s)/m(t)``; equivalently every
  masked token has its own unmasking time ``u`` with ``P(u <= t) = m(t)``, independent of
  the others. We draw those ``u`` by inverse CDF in closed form, one per token, and count
  them per step: the cost is O(tokens), whatever ``T`` is (a request for 10^8 steps costs
  what ``T = n`` costs), and only the non-empty steps are kept (:class:`RevealPlan`).
* ``reference`` counts: the AO-GPT reference code's deterministic schedule. By the end of
  step ``i`` (0-based) ``R_i = max(floor(m_tot * (1 - m(t_{i+1}))), R_{i-1} + 1)`` tokens
  are revealed in total (``m_tot`` masked at the start), so no step is empty until all are
  revealed, and the last step reveals the rest. Computed as the reference computes it: in
  float32, the times by ``torch.linspace`` and the cosine by ``torch.cos`` (float64 gave
  other counts, and left a position undecided when cos(pi/2) came out as 6e-17).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from anyorder.errors import SamplingError

SCHEDULES = ("linear", "cosine")
REFERENCE_MAX_STEPS = 1 << 22
"""Most steps of the reference counts (a float32 table of ``steps + 1`` times, 16 MB)."""
REVEALS = ("binomial", "reference")


def masked_fraction(t: float, schedule: str = "linear") -> float:
    """Probability ``m(t)`` that a token is masked at time ``t`` in [0, 1] (``m(1) = 1``).

    ``linear``: ``m(t) = t``; ``cosine``: ``m(t) = cos((1 - t) pi / 2)``.
    """
    if schedule == "linear":
        return t
    if schedule == "cosine":
        return math.cos((1.0 - t) * math.pi / 2)
    raise SamplingError(f"schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")


def _unmask_time(v: np.ndarray, schedule: str) -> np.ndarray:
    """The inverse of ``m``: the time ``t`` with ``m(t) = v`` (element-wise, float64)."""
    if schedule == "linear":
        return v
    return np.arcsin(np.clip(v, 0.0, 1.0)) * (2.0 / math.pi)  # cos((1-t)pi/2) = sin(pi t/2)


def reveal_probabilities(steps: int, schedule: str = "linear") -> list[float]:
    """Per reverse step ``t -> s`` (``t = (T-i)/T``, ``s = (T-i-1)/T``), the probability that a
    still-masked token is revealed: ``1 - m(s)/m(t)`` (it stays masked with ``m(s)/m(t)``,
    since a token masked at ``s`` is masked at ``t``). The last step reveals the rest."""
    out = []
    for i in range(steps):
        t, s = (steps - i) / steps, (steps - i - 1) / steps
        out.append(1.0 - masked_fraction(s, schedule) / masked_fraction(t, schedule))
    return out


@dataclass
class RevealPlan:
    """Tokens revealed per reverse step, the non-empty steps only (O(tokens), never O(T))."""

    steps: int
    """``T``, the number of reverse steps asked for."""
    step: np.ndarray
    """(P,) int64, the steps in which some row reveals a token, increasing."""
    counts: np.ndarray
    """(P, B) int64, tokens each row reveals in those steps."""

    def expand(self, batch: int) -> RevealPlan:
        """One row's counts for every one of ``batch`` rows (shared counts)."""
        return RevealPlan(self.steps, self.step, np.repeat(self.counts, batch, axis=1))

    def dense(self) -> Tensor:
        """(steps, B) int64 CPU tensor of every step's counts, zeros included."""
        out = torch.zeros(self.steps, self.counts.shape[1], dtype=torch.long)
        out[torch.from_numpy(self.step)] = torch.from_numpy(self.counts)
        return out


def check_reveal(steps: int, schedule: str, reveal: str) -> None:
    """Raise :class:`SamplingError` on a bad step count, schedule or count mode."""
    if steps < 1:
        raise SamplingError(f"steps={steps} must be at least 1")
    masked_fraction(1.0, schedule)  # validates the name
    if reveal not in REVEALS:
        raise SamplingError(f"reveal {reveal!r} is unknown; use one of {', '.join(REVEALS)}")


def draw_reveals(
    masked: int,
    steps: int,
    batch: int,
    schedule: str = "linear",
    reveal: str = "binomial",
    generator: torch.Generator | None = None,
) -> RevealPlan:
    """How many of ``masked`` tokens each of ``batch`` rows reveals per reverse step.

    ``binomial``: the exact reverse process, independently per row (see the module notes);
    uniforms are drawn on the generator's device in float64 and read back once, before
    decoding starts. ``reference``: the AO-GPT reference schedule, the same for every row.
    """
    check_reveal(steps, schedule, reveal)
    if reveal == "reference":
        return reference_reveals(masked, steps, schedule).expand(batch)
    if masked == 0:
        return RevealPlan(steps, np.zeros(0, np.int64), np.zeros((0, batch), np.int64))
    dev = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(batch, masked, dtype=torch.float64, device=dev, generator=generator)
    t = _unmask_time(1.0 - u.cpu().numpy(), schedule)  # in (0, 1]: the token's unmasking time
    # step i reveals the tokens with s_i < t <= t_i, i.e. ceil(T t) = T - i
    step = np.clip(steps - np.ceil(steps * t), 0, steps - 1).astype(np.int64)
    uniq, inv = np.unique(step, return_inverse=True)
    counts = np.zeros((len(uniq), batch), dtype=np.int64)
    np.add.at(counts, (inv.reshape(batch, masked), np.arange(batch)[:, None]), 1)
    return RevealPlan(steps, uniq.astype(np.int64), counts)


def reference_reveals(masked: int, steps: int, schedule: str = "linear") -> RevealPlan:
    """The AO-GPT reference code's counts (one row): never an empty step until every token
    is revealed; ``min(steps, masked)`` non-empty steps; the last step reveals the rest.

    Computed as the reference computes them, in float32 with torch's ``linspace`` and
    ``cos`` on the CPU, so the sequence is bit-identical to its ``generate`` (float64 gave
    another count at some steps, and cos(pi/2) = 6e-17 left one position undecided).
    ``R_i = max(int(m (1 - m(t_{i+1}))), R_{i-1} + 1)`` is a running maximum:
    ``R_i - i = max(1, max_{j <= i} (int(...)_j - j))``, O(steps) with no Python loop.
    """
    check_reveal(steps, schedule, "reference")
    if steps > REFERENCE_MAX_STEPS:  # its float32 times are a table of steps + 1 values
        raise SamplingError(
            f"reveal='reference' computes the reference's schedule over all {steps:,} steps "
            f"(at most {REFERENCE_MAX_STEPS:,}); use the binomial reveal, which costs what "
            "the tokens cost whatever the steps, or fewer steps"
        )
    if masked == 0:
        return RevealPlan(steps, np.zeros(0, np.int64), np.zeros((0, 1), np.int64))
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
    m = t if schedule == "linear" else torch.cos((1 - t) * math.pi * 0.5)
    base = (masked * (1 - m[1:])).long().numpy()  # int() truncates, as the reference's
    i = np.arange(steps)
    total = np.minimum(i + np.maximum.accumulate(np.maximum(base - i, 1)), masked)
    total[-1] = masked  # the last step reveals what is left, whatever the rounding
    counts = np.diff(total, prepend=0)
    step = np.flatnonzero(counts)
    return RevealPlan(steps, step.astype(np.int64), counts[step].astype(np.int64)[:, None])


def reveal_counts(
    masked: int,
    steps: int,
    batch: int,
    schedule: str = "linear",
    generator: torch.Generator | None = None,
    reveal: str = "binomial",
) -> Tensor:
    """How many tokens each row reveals at each of ``steps`` reverse steps (Lemma 1), as a
    dense (steps, batch) int64 CPU tensor whose rows add up to ``masked`` (see
    :func:`draw_reveals`; the count of a step is ``Binomial(#still masked, 1 - m(s)/m(t))``)."""
    return draw_reveals(masked, steps, batch, schedule, reveal, generator).dense()


def check_counts(counts: np.ndarray, steps: np.ndarray, batch: int, left: int) -> None:
    """Reveal counts as a plan takes them: (P, B), non-negative, each row adding up to
    the positions left, in increasing steps. A violation is a bug upstream (an undecided
    position keeps token 0, or mdm's mask id): an error now, not a wrong sample later."""
    if counts.shape != (len(steps), batch) or (counts < 0).any():
        raise AssertionError(f"plan: counts of shape {counts.shape} for {batch} rows")
    if not (counts.sum(axis=0) == left).all():
        raise AssertionError(
            f"plan: rows reveal {sorted(set(counts.sum(axis=0).tolist()))} tokens, not the "
            f"{left} left"
        )
    if (np.diff(steps) <= 0).any():
        raise AssertionError("plan: steps are not increasing")
