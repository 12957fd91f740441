"""Generation orders, shared by training and sampling.

An :class:`Ordering` is a permutation ``order`` (B, n) — slot ``t`` generates the token at
original position ``order[:, t]`` — and block ids ``blocks`` (B, n), non-decreasing along
the slots: the prediction at slot ``t`` may condition on the tokens of blocks
``< blocks[:, t]`` only. Token-level orders (every token its own block) set
``token_level`` so that models can take the plain causal fast path.

Design choices:

* Every random order takes an explicit :class:`torch.Generator`; nothing reads the global
  RNG, so training and sampling are reproducible from a seed.
* ``progressive`` follows METHOD.md section 3 (our reading of ARMD): ``k`` tokens are taken
  out of the left-to-right order and put back at uniformly random places; the remaining
  ``n - k`` keep their relative order. ``k`` is 0 before ``i_ar``, then rises linearly from
  1 to ``rho`` at ``i_perm``. Both may be given as a share of the run (``"10%"`` of
  ``train.steps``), so a schedule keeps its shape when a run is made shorter or longer.
* ``order.condition=prompt`` (prompt/response data): the prompt's positions come first, left
  to right, in every order, and the answer's follow in the configured distribution
  (:func:`prompt_first`, :func:`displace_answer`). The prompt lengths are the global
  batch's, so the orders a row gets do not depend on the number of processes.
* ``strided(S)`` is ARMD's SBP order: the ``S`` stream heads are generated one at a time,
  then each group of same-offset tokens is one block of ``S``.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from anyorder.bounds import shown
from anyorder.config import OrderConfig
from anyorder.errors import ConfigError, preview

ORDER_KINDS = ("l2r", "uniform", "mix", "fixed", "progressive", "strided", "sbp")
CONDITIONS = ("none", "prompt")
"""The values of ``order.condition``."""


class Ordering(NamedTuple):
    """A batch of orders and their block structure."""

    order: Tensor
    """(B, n) permutation of positions: slot t generates position order[:, t]."""
    blocks: Tensor
    """(B, n) block id of each slot, non-decreasing along the slots."""
    token_level: bool = True
    """True when every slot is its own block (blocks == arange)."""

    @property
    def model_blocks(self) -> Tensor | None:
        """The blocks to pass to a model: None for token-level orders (plain causal path)."""
        return None if self.token_level else self.blocks


def _arange_blocks(batch: int, n: int, device: torch.device | str | None) -> Tensor:
    return torch.arange(n, device=device).expand(batch, n)


def l2r(batch: int, n: int, device: torch.device | str | None = None) -> Ordering:
    """The left-to-right order."""
    o = _arange_blocks(batch, n, device)
    return Ordering(o.clone(), o.clone())


def uniform(
    batch: int, n: int, generator: torch.Generator, device: torch.device | str | None = None
) -> Ordering:
    """A fresh uniformly random permutation per sequence."""
    order = torch.rand(batch, n, generator=generator, device=generator.device).argsort(dim=-1)
    return Ordering(order.to(device), _arange_blocks(batch, n, device).clone())


def mix(
    batch: int,
    n: int,
    p_l2r: float,
    generator: torch.Generator,
    device: torch.device | str | None = None,
) -> Ordering:
    """Left-to-right with probability ``p_l2r`` per sequence, else uniform (AO-GPT: 0.1)."""
    if not 0.0 <= p_l2r <= 1.0:
        raise ConfigError(f"order.p_l2r={p_l2r} must lie in [0, 1]")
    rand = uniform(batch, n, generator, device).order
    pick = torch.rand(batch, generator=generator, device=generator.device).to(rand.device) < p_l2r
    order = torch.where(pick[:, None], torch.arange(n, device=rand.device), rand)
    return Ordering(order, _arange_blocks(batch, n, device).clone())


def fixed(batch: int, n: int, seed: int, device: torch.device | str | None = None) -> Ordering:
    """One permutation, drawn from ``seed``, for every sequence and every step."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=g).to(device).expand(batch, n).clone()
    return Ordering(order, _arange_blocks(batch, n, device).clone())


def progressive_k(step: int, i_ar: int, i_perm: int, rho: int) -> int:
    """Number of displaced tokens at a training step: 0 before ``i_ar``, 1..rho linearly up to
    ``i_perm``, ``rho`` after."""
    if step < i_ar:
        return 0
    span = max(1, i_perm - i_ar)
    frac = min(1.0, (step - i_ar) / span)
    return 1 + int(round((rho - 1) * frac))


def displace(batch: int, n: int, k: int, generator: torch.Generator, device=None) -> Tensor:
    """Left-to-right order with ``k`` random tokens moved to uniformly random places.

    The ``n - k`` tokens left in place keep their order and get integer keys ``0..n-k-1``;
    each moved token gets a key uniform in ``(-1, n-k)``, i.e. a uniformly random gap among
    the ``n - k + 1`` places. Sorting the keys gives the order. Vectorised over the batch.
    """
    k = min(k, n)
    if k == 0:
        return l2r(batch, n, device).order
    gd = generator.device
    chosen = torch.rand(batch, n, generator=generator, device=gd).argsort(dim=-1)[:, :k]
    moved = torch.zeros(batch, n, dtype=torch.bool, device=gd).scatter_(1, chosen, True)
    rank = (~moved).cumsum(dim=-1).float() - 1
    spot = (
        torch.rand(batch, n, generator=generator, device=gd, dtype=torch.float64) * (n - k + 1) - 1
    )
    keys = torch.where(moved, spot, rank.double())
    return keys.argsort(dim=-1).to(device)


def prompt_first(order: Tensor, prompt_len: Tensor) -> Tensor:
    """``order`` with the prompt's positions (``< prompt_len``, per row) moved to the front,
    left to right, and the answer's kept in the order ``order`` gives them.

    The answer's part of a uniform order is uniform over the answer's orders (and of the
    left-to-right order left to right), so uniform, mix, l2r and fixed orders keep their
    meaning over the answer.

    Args:
        order: (B, n) permutations.
        prompt_len: (B,) prompt lengths.
    """
    B, n = order.shape
    pos = torch.arange(n, device=order.device).expand(B, n)
    slot = inverse(order)
    # prompt positions: keys -n..-1 by position; answer positions: their slots 0..n-1
    key = torch.where(pos < prompt_len.to(order.device)[:, None], pos - n, slot)
    return key.argsort(dim=-1)


def displace_answer(
    prompt_len: Tensor, n: int, k: int, generator: torch.Generator, device=None
) -> Tensor:
    """The prompt left to right, then the answer left to right with ``min(k, answer length)``
    of its tokens moved to uniformly random places among the answer's (:func:`displace` on
    the answer alone; with no prompt and ``k >= 1``, the same order from the same draws)."""
    B, gd = len(prompt_len), generator.device
    plen = prompt_len.to(gd)
    pos = torch.arange(n, device=gd).expand(B, n)
    answer = pos >= plen[:, None]
    r = (n - plen).clamp(min=0)
    kk = r.clamp(max=k)[:, None]  # (B, 1) tokens moved per row
    u = torch.rand(B, n, generator=generator, device=gd)
    pick = torch.where(answer, u, 2.0).argsort(dim=-1).argsort(dim=-1)  # answer positions first
    moved = answer & (pick < kk)
    rank = (answer & ~moved).cumsum(dim=-1).double() - 1
    spot = torch.rand(B, n, generator=generator, device=gd, dtype=torch.float64)
    spot = spot * (r[:, None] - kk + 1) - 1
    keys = torch.where(moved, spot, rank)
    keys = torch.where(answer, keys, (pos - n - 2).double())  # the prompt before every spot
    return keys.argsort(dim=-1).to(device)


def progressive(
    batch: int,
    n: int,
    step: int,
    i_ar: int,
    i_perm: int,
    rho: int,
    generator: torch.Generator,
    device: torch.device | str | None = None,
) -> Ordering:
    """ARMD's progressive permutation schedule as a function of the training step."""
    k = progressive_k(step, i_ar, i_perm, rho)
    return Ordering(
        displace(batch, n, k, generator, device), _arange_blocks(batch, n, device).clone()
    )


def strided(batch: int, n: int, streams: int, device: torch.device | str | None = None) -> Ordering:
    """ARMD's strided block-parallel order with ``S = streams``.

    The sequence is cut into ``S`` streams of length ``n/S``; the order interleaves them
    (``n=8, S=2``: positions ``[0,4 | 1,5 | 2,6 | 3,7]``). The ``S`` heads are generated one
    at a time (blocks ``0..S-1``); after that each group of ``S`` is one block.
    """
    if isinstance(streams, bool) or not isinstance(streams, numbers.Integral):
        raise ConfigError(
            f"streams S={shown(streams)} must be a whole number, at least 1 (S tokens per pass "
            f"after the S stream heads); pick S among the divisors of {n}"
        )
    if streams < 1:
        raise ConfigError(
            f"streams S={shown(streams)} must be at least 1 (S tokens per pass after the S "
            f"stream heads); pick S among the divisors of {n}"
        )
    if n % streams:
        raise ConfigError(
            f"streams S={shown(streams)} does not divide the sequence length n={n}; "
            f"pick S among the divisors of {n}"
        )
    length = n // streams
    j = torch.arange(length, device=device)
    s = torch.arange(streams, device=device)
    order = (s[None, :] * length + j[:, None]).reshape(-1)  # group j: s*L + j for every s
    group = j[:, None].expand(length, streams).reshape(-1)
    blocks = torch.where(group == 0, torch.arange(n, device=device), group + streams - 1)
    return Ordering(
        order.expand(batch, n).clone(), blocks.expand(batch, n).clone(), token_level=streams == 1
    )


def sbp(
    batch: int,
    n: int,
    generator: torch.Generator,
    streams: Sequence[int] = (1, 2, 4),
    device: torch.device | str | None = None,
) -> Ordering:
    """SBP fine-tuning: one ``S`` drawn uniformly from ``streams`` per call (per step)."""
    i = int(torch.randint(len(streams), (1,), generator=generator, device=generator.device))
    return strided(batch, n, int(streams[i]), device)


_STEP = re.compile(r"[0-9]+", re.ASCII)
_SHARE = re.compile(r"([0-9]+(?:\.[0-9]*)?)%", re.ASCII)


def schedule_step(value: int | str, total_steps: int | None, key: str) -> int:
    """A progressive-schedule step: an integer as it is, ``"P%"`` as ``round(P/100 x
    total_steps)``.

    Raises:
        ConfigError: neither form, a share over 100%, or a share with no run length.
    """
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"order.{key}={value} must be a step >= 0 or a share like '10%'")
        return value
    text = str(value).strip()
    if _STEP.fullmatch(text):
        return int(text)
    m = _SHARE.fullmatch(text)
    if m is None or float(m.group(1)) > 100:
        raise ConfigError(
            f"order.{key}={preview(value)} must be a training step (an integer) or a share of "
            "train.steps from '0%' to '100%', such as '10%'"
        )
    if total_steps is None:
        raise ConfigError(
            f"order.{key}={preview(value)} is a share of train.steps; give train.steps"
        )
    return round(float(m.group(1)) / 100 * total_steps)


class OrderSampler:
    """The training order distribution named by an :class:`OrderConfig`.

    ``sampler(batch, n, step, generator)`` returns an :class:`Ordering`. ``total_steps``
    (``train.steps``) resolves a progressive schedule given as shares of the run.
    """

    def __init__(self, cfg: OrderConfig, total_steps: int | None = None) -> None:
        if cfg.kind not in ORDER_KINDS:
            raise ConfigError(
                f"order.kind={preview(cfg.kind)} is unknown; use one of {', '.join(ORDER_KINDS)}"
            )
        self.i_ar = self.i_perm = 0
        if cfg.kind == "progressive":
            self.i_ar = schedule_step(cfg.i_ar, total_steps, "i_ar")
            self.i_perm = schedule_step(cfg.i_perm, total_steps, "i_perm")
            if cfg.rho < 1 or self.i_perm < self.i_ar:
                raise ConfigError(
                    f"order.progressive needs rho >= 1 and i_perm >= i_ar (here rho={cfg.rho}, "
                    f"i_ar={self.i_ar}, i_perm={self.i_perm})"
                )
        if cfg.condition not in CONDITIONS:
            raise ConfigError(
                f"order.condition={preview(cfg.condition)} is unknown; use none or prompt"
            )
        if cfg.condition == "prompt" and (cfg.kind == "sbp" or cfg.kind == "strided"):
            raise ConfigError(
                f"order.condition=prompt takes token-level orders; order.kind={cfg.kind} "
                "trains on blocks (use uniform, mix, progressive, l2r or fixed)"
            )
        if cfg.kind == "sbp" and not cfg.sbp_streams:
            raise ConfigError("order.sbp_streams must list at least one stream count")
        self.cfg = cfg

    def describe(self) -> str:
        """The distribution in words, with a progressive schedule's steps resolved."""
        c = self.cfg
        if c.kind == "progressive":
            text = (
                f"progressive (left to right until step {self.i_ar}, {c.rho} displaced "
                f"from step {self.i_perm})"
            )
        elif c.kind == "mix":
            text = f"mix ({c.p_l2r:.0%} left to right)"
        else:
            text = c.kind
        return text + (" over the answer, the prompt first" if c.condition == "prompt" else "")

    @property
    def is_left_to_right_only(self) -> bool:
        return self.cfg.kind == "l2r" or (self.cfg.kind == "mix" and self.cfg.p_l2r >= 1.0)

    def __call__(
        self,
        batch: int,
        n: int,
        step: int,
        generator: torch.Generator,
        device: torch.device | str | None = None,
        prompt_len: Tensor | None = None,
    ) -> Ordering:
        """Orders for ``batch`` rows of ``n`` positions; with ``prompt_len`` (B,) the prompt
        of each row first (``order.condition=prompt``)."""
        if prompt_len is None:
            return self._draw(batch, n, step, generator, device)
        c = self.cfg
        if c.kind == "progressive":
            k = progressive_k(step, self.i_ar, self.i_perm, c.rho)
            order = displace_answer(prompt_len, n, k, generator, device)
        else:
            order = prompt_first(self._draw(batch, n, step, generator, device).order, prompt_len)
        return Ordering(order, _arange_blocks(batch, n, device).clone())

    def _draw(
        self,
        batch: int,
        n: int,
        step: int,
        generator: torch.Generator,
        device: torch.device | str | None = None,
    ) -> Ordering:
        c = self.cfg
        if c.kind == "l2r":
            return l2r(batch, n, device)
        if c.kind == "uniform":
            return uniform(batch, n, generator, device)
        if c.kind == "mix":
            return mix(batch, n, c.p_l2r, generator, device)
        if c.kind == "fixed":
            return fixed(batch, n, c.seed, device)
        if c.kind == "progressive":
            return progressive(batch, n, step, self.i_ar, self.i_perm, c.rho, generator, device)
        if c.kind == "strided":
            return strided(batch, n, c.streams, device)
        return sbp(batch, n, generator, c.sbp_streams, device)


def inverse(order: Tensor) -> Tensor:
    """Slot of each position: ``inverse(order)[b, order[b, t]] == t``."""
    return torch.argsort(order, dim=-1)


def is_permutation(order: Tensor) -> bool:
    """Whether every row of ``order`` is a permutation of ``0..n-1``."""
    n = order.shape[-1]
    return bool((order.sort(dim=-1).values == torch.arange(n, device=order.device)).all())
