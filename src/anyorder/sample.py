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

The fast samplers (:func:`sample` picks one):

* :func:`sequential_sample`: one token per pass along an order with the KV cache of
  :mod:`anyorder.cache`, O(1) model cost per token (gpt, aogpt, armd).
* :func:`lemma1_sample`: ``T``-step masked-diffusion sampling by Lemma 1 on a decoder: one
  random order; per step a Binomial number of tokens, all predicted in one pass with the
  parallel prediction mask; an empty step costs nothing. Reveal counts are drawn **per
  row** (rows are independent samples of the reverse process); a pass is padded to the row
  revealing most, and padding slots are masked out and never kept.
* :func:`strided_sample`: ARMD's strided block-parallel order, ``S`` tokens per pass.
* :func:`encoder_sample`: the encoder MDM's ancestral sampler, a full pass per step.
* All four draw reveal counts and orders before the loop, so the loop needs no host-device
  sync; a prompt shared by the whole batch is prefilled once and the cache forked.
* Known slots of a prompt come first in the order, left to right among themselves.
* Text: :func:`parse_template` (holes ``[MASK:n]``), :func:`infill`, :func:`decode_text`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from anyorder.cache import ARMDCache, KVCache
from anyorder.errors import ConfigError, SamplingError
from anyorder.layers import Packing, StreamPacking
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.models.gpt import BOS, GPT
from anyorder.models.mdm import MDM
from anyorder.orders import is_permutation, strided

if TYPE_CHECKING:
    from anyorder.data import Tokenizer

StepHook = Callable[[Tensor, Tensor, int], None]
"""``on_step(positions, tokens, step)`` after every pass that draws tokens: (B, Q) positions
(padding = n) and tokens on the model's device, and the step recorded in ``step_of``."""
_COMPACT_MIN = 16  # cache gaps (slots) below which a compaction is not worth a pass
_PACK_BELOW = 0.75  # pack a pass's real slots when at most this fraction of its slots is real
_EOS_EVERY = 8  # passes between the early-stop checks (each is a host-device sync)


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
    never generated because decoding stopped at EOS)."""
    extra: dict = field(default_factory=dict)
    logits: Tensor | None = None
    """(B, n, V) slot-aligned logits each token was drawn from (``keep_logits=True``)."""
    counts: Tensor | None = None
    """(steps, B) tokens revealed per reverse step (Lemma-1 and encoder samplers)."""


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
    # known positions: keys in [0, 1) by position (left to right); the rest: [2, 3)
    l2r_key = torch.arange(n, device=known.device, dtype=torch.float64).expand(B, n) / n
    return torch.where(known, l2r_key, key + 2).argsort(dim=-1)


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


# ============================================================================= fast samplers
#
# Every decoder sampler below is the same engine run on a different *plan*: a list of forward
# passes worked out on the host before the loop, from the reveal counts alone (they never
# depend on the sampled tokens). Slot ``t`` of the order is "decided" once its token is drawn.
# A pass
#
# * writes the slots that became ready since the last pass ("writes": AO-GPT slot inputs
#   whose token is now known; ARMD content tokens and query-stream catch-up slots), causal
#   among themselves, kept in the cache;
# * and asks ``Q`` queries: the next ``Q`` slots of the order, each seeing the cache and the
#   writes but not the other queries (the parallel prediction mask), or, in block mode
#   (ARMD's strided order), seeing the other queries of its block as the training forward
#   with blocks does. Query 0 is the true next slot and is kept; the others are scratch and
#   are written properly by the next pass, once their tokens are known.
#
# Rows of a batch reveal different counts: each pass is padded to the largest row, padding
# slots are invisible and never kept (``KVCache.valid``). Index arrays and masks of every
# pass are shipped to the device in one copy per kind before the loop, so the loop makes no
# host-device sync (except the optional early stop at EOS, every few steps).

SCHEDULES = ("linear", "cosine")


def masked_fraction(t: float, schedule: str = "linear") -> float:
    """Probability ``m(t)`` that a token is masked at time ``t`` in [0, 1] (``m(1) = 1``).

    ``linear``: ``m(t) = t``; ``cosine``: ``m(t) = 1 - cos(pi t / 2)``.
    """
    if schedule == "linear":
        return t
    if schedule == "cosine":
        return 1.0 - math.cos(math.pi * t / 2)
    raise SamplingError(f"schedule {schedule!r} is unknown; use one of {', '.join(SCHEDULES)}")


def reveal_probabilities(steps: int, schedule: str = "linear") -> list[float]:
    """Per reverse step ``t -> s`` (``t = (T-i)/T``, ``s = (T-i-1)/T``), the probability that a
    still-masked token is revealed: ``1 - m(s)/m(t)`` (it stays masked with ``m(s)/m(t)``,
    since a token masked at ``s`` is masked at ``t``). The last step reveals the rest."""
    out = []
    for i in range(steps):
        t, s = (steps - i) / steps, (steps - i - 1) / steps
        out.append(1.0 - masked_fraction(s, schedule) / masked_fraction(t, schedule))
    return out


def reveal_counts(
    masked: int,
    steps: int,
    batch: int,
    schedule: str = "linear",
    generator: torch.Generator | None = None,
) -> Tensor:
    """How many tokens each row reveals at each of ``steps`` reverse steps (Lemma 1).

    The count of a step is ``Binomial(#still masked, 1 - m(s)/m(t))``, drawn independently per
    row; the counts of a row add up to ``masked``. Drawn on the generator's device in float64,
    returned as a (steps, batch) int64 CPU tensor (one sync, before decoding starts).
    """
    if steps < 1:
        raise SamplingError(f"steps={steps} must be at least 1")
    dev = generator.device if generator is not None else torch.device("cpu")
    left = torch.full((batch,), float(masked), dtype=torch.float64, device=dev)
    rows = []
    for p in reveal_probabilities(steps, schedule):
        prob = torch.full_like(left, min(max(p, 0.0), 1.0))
        c = torch.binomial(left, prob, generator=generator)
        rows.append(c)
        left = left - c
    return torch.stack(rows).round().long().cpu()


# ----------------------------------------------------------------------------- plans


class _Bank:
    """Host arrays (leading dim B) of every pass, shipped in one device copy per dtype."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.parts: dict[str, list[np.ndarray]] = {"i": [], "b": [], "f": []}
        self.size = {"i": 0, "b": 0, "f": 0}
        self.dev: dict[str, Tensor] = {}

    def add(self, a: np.ndarray) -> tuple[str, int, tuple[int, ...]]:
        kind = "b" if a.dtype == np.bool_ else "i"
        flat = a.reshape(self.batch, -1)
        start = self.size[kind]
        self.parts[kind].append(flat)
        self.size[kind] += flat.shape[1]
        return kind, start, a.shape

    def add_flat(self, a: np.ndarray) -> tuple[str, int, tuple[int, ...]]:
        """A 1-D integer array of any length (not one entry per row)."""
        start = self.size["f"]
        self.parts["f"].append(a.astype(np.int64))
        self.size["f"] += a.shape[0]
        return "f", start, a.shape

    def ship(self, device: torch.device) -> None:
        for kind, dtype in (("i", np.int64), ("b", np.bool_)):
            parts = self.parts[kind]
            arr = np.concatenate(parts, axis=1) if parts else np.zeros((self.batch, 0), dtype)
            self.dev[kind] = torch.from_numpy(arr.astype(dtype)).to(device)
        flat = self.parts["f"]
        arr = np.concatenate(flat) if flat else np.zeros(0, np.int64)
        self.dev["f"] = torch.from_numpy(arr).to(device)

    def get(self, handle: tuple[str, int, tuple[int, ...]] | None) -> Tensor | None:
        if handle is None:
            return None
        kind, start, shape = handle
        if kind == "f":
            return self.dev["f"][start : start + shape[0]]
        width = math.prod(shape[1:])  # not np.prod: this runs every pass
        return self.dev[kind][:, start : start + width].view(shape)


def _rows(start: np.ndarray, count: np.ndarray, width: int, pad: int) -> tuple[np.ndarray, ...]:
    """(B, width) slots ``start + j`` for ``j < count`` per row, ``pad`` after; and the mask."""
    j = np.arange(width)
    real = j[None, :] < count[:, None]
    return np.where(real, start[:, None] + j[None, :], pad), real


def _see(rank_q: np.ndarray, rank_k: np.ndarray, real_k: np.ndarray, same: bool) -> np.ndarray:
    """(B, Tq, Tk): key visible iff real and of a lower rank (or the same rank when ``same``)."""
    rq, rk = rank_q[:, :, None], rank_k[:, None, :]
    vis = (rk < rq) | ((rk == rq) & same)
    return vis & real_k[:, None, :]


def _worth_packing(real: np.ndarray, prefill: bool) -> bool:
    """Whether a pass with these real slots (B, T) runs packed: mostly padding, and not a
    prefill (which runs on one row, unpadded)."""
    return not prefill and not real.all() and real.sum() <= _PACK_BELOW * real.size


def _with_self(m: np.ndarray) -> np.ndarray:
    """Add the diagonal: every slot sees itself (no empty rows, padding included)."""
    return m | np.eye(m.shape[1], m.shape[2], dtype=bool)[None]


@dataclass
class _Pass:
    step: int  # reverse step (or slot) whose tokens this pass draws; -1 for a prefill
    prefill: bool
    n_write: int  # entries before the queries
    n_query: int
    keep: int  # entries kept in the cache (AO-GPT) / query-stream entries kept (ARMD)
    h: dict = field(default_factory=dict)  # bank handles
    compact: dict = field(default_factory=dict)  # run before the pass: key -> (index, real, dense)


class _Plan:
    """The forward passes of one decode, worked out on the host from the reveal counts.

    Args:
        armd: plan for ARMD's two streams (else the GPT/AO-GPT slot layout).
        batch, n, k: rows, sequence length, known (prompt) slots per row.
        counts: (steps, B) tokens revealed per step; steps where no row reveals are skipped.
        block_of: (n,) block id per slot for block mode (ARMD's strided order); None: token
            level with the parallel prediction mask.
        prefill: put the prompt in a pass of its own (run on one row, then forked).
    """

    def __init__(
        self,
        armd: bool,
        batch: int,
        n: int,
        k: int,
        counts: np.ndarray,
        block_of: np.ndarray | None = None,
        prefill: bool = False,
    ) -> None:
        self.armd, self.batch, self.n = armd, batch, n
        self.block_mode = block_of is not None
        self.rank_of = np.append(block_of if block_of is not None else np.arange(n), -1)
        self.bank = _Bank(batch)
        self.passes: list[_Pass] = []
        self.d = np.full(batch, k)  # decided slots
        self.w = np.zeros(batch, dtype=np.int64)  # slots kept (AO-GPT) / query stream (ARMD)
        self.cc = np.zeros(batch, dtype=np.int64)  # ARMD: content tokens kept
        self.len = {"w": 0, "c": 0}
        self.cap = 1
        self.dense = {"w": True, "c": True}
        self.valid = {key: np.zeros((batch, 0), dtype=bool) for key in ("w", "c")}
        if prefill and k > 0:
            self._add(np.zeros(batch, dtype=np.int64), -1, prefill=True)
        for step, c in enumerate(counts):
            if c.max() > 0:
                self._add(c.astype(np.int64), step)

    def _grow(self, key: str, keep: int, written: int, real: np.ndarray) -> None:
        self.cap = max(self.cap, self.len[key] + written)
        self.len[key] += keep
        self.valid[key] = np.concatenate([self.valid[key], real], axis=1)
        if not real.all():
            self.dense[key] = False

    def _compact(self) -> dict:
        """Compactions worth doing before the next pass: a cache whose rows kept different
        numbers of slots has gaps that every later pass would attend over."""
        out = {}
        for key in ("w", "c") if self.armd else ("w",):
            valid = self.valid[key]
            length, count = valid.shape[1], valid.sum(axis=1)
            M = int(count.max()) if length else 0
            if M == 0 or length - M < max(_COMPACT_MIN, length // 4):
                continue
            index = np.argsort(~valid, axis=1, kind="stable")[:, :M]  # kept slots, in order
            real = np.arange(M)[None, :] < count[:, None]
            self.valid[key], self.len[key], self.dense[key] = real, M, bool(real.all())
            out[key] = (self.bank.add(np.where(real, index, 0)), self.bank.add(real), real.all())
        return out

    def _add(self, c: np.ndarray, step: int, prefill: bool = False) -> None:
        compact = self._compact()
        if self.armd:
            self._add_armd(c, step, prefill)
        else:
            self._add_gpt(c, step, prefill)
        self.passes[-1].compact = compact
        self.d = self.d + c

    def _add_gpt(self, c: np.ndarray, step: int, prefill: bool) -> None:
        n, d, w = self.n, self.d, self.w
        W, Q = int((d - w).max()), int(c.max())
        ws, wr = _rows(w, d - w, W, n)
        qs, qr = _rows(d, c, Q, n)
        real = np.concatenate([wr, qr], axis=1)
        in_slot = np.concatenate([np.where(wr, ws - 1, n), np.where(qr, d[:, None] - 1, n)], 1)
        rank = np.concatenate([np.where(wr, ws, -1), np.where(qr, d[:, None], -1)], 1)
        new = _with_self(_see(rank, rank, real, same=False))
        keep = W + min(Q, 1)
        p = _Pass(step, prefill, W, Q, keep)
        b = self.bank
        p.h["in_slot"] = b.add(in_slot)
        p.h["tgt_slot"] = b.add(np.concatenate([ws, qs], axis=1))
        p.h["mask"] = None if self.dense["w"] and new.all() else b.add(new)
        p.h["keep"] = None if real[:, :keep].all() else b.add(real[:, :keep])
        if _worth_packing(real, prefill):
            # run the real slots only
            p.h["pack"] = b.add_flat(np.flatnonzero(real))
        self._grow("w", keep, W + Q, real[:, :keep])
        self.w = np.where(c > 0, d + 1, d)
        self.passes.append(p)

    def _add_armd(self, c: np.ndarray, step: int, prefill: bool) -> None:
        n, d, w, cc, rank_of = self.n, self.d, self.w, self.cc, self.rank_of
        C, Wg, Q = int((d - cc).max()), int((d - w).max()), int(c.max())
        cs, cr = _rows(cc, d - cc, C, n)
        gs, gr = _rows(w, d - w, Wg, n)
        qs, qr = _rows(d, c, Q, n)
        crank = np.where(cr, rank_of[cs], -1)
        qrank = rank_of[qs] if self.block_mode else np.broadcast_to(d[:, None], qs.shape)
        grank = np.concatenate([np.where(gr, rank_of[gs], -1), np.where(qr, qrank, -1)], 1)
        greal = np.concatenate([gr, qr], axis=1)
        c_new = _with_self(cr[:, None, :] & (crank[:, None, :] <= crank[:, :, None]))
        qc_new = _see(grank, crank, cr, same=False)
        qq_new = _with_self(_see(grank, grank, greal, same=self.block_mode))
        keep = Wg + (Q if self.block_mode else min(Q, 1))
        p = _Pass(step, prefill, Wg, Q, keep)
        b = self.bank
        p.h["c_slot"] = b.add(cs)
        p.h["g_slot"] = b.add(np.concatenate([gs, qs], axis=1))
        p.h["c_keep"] = None if cr.all() else b.add(cr)
        dense_c = self.dense["c"]
        p.h["c_mask"] = None if C == 0 or (dense_c and c_new.all()) else b.add(c_new)
        p.h["qc_mask"] = None if dense_c and qc_new.all() else b.add(qc_new)
        p.h["qq_mask"] = None if self.dense["w"] and qq_new.all() else b.add(qq_new)
        p.h["keep"] = None if greal[:, :keep].all() else b.add(greal[:, :keep])
        real = np.concatenate([cr, greal], axis=1)  # the two-stream layers' rows
        if _worth_packing(real, prefill):
            # mostly padding: the real content rows first, then the real query rows
            G, (bc, jc), (bg, jg) = Wg + Q, np.nonzero(cr), np.nonzero(greal)
            both = np.concatenate([bc * (C + G) + jc, bg * (C + G) + C + jg])
            p.h["pack"] = (
                b.add_flat(both),
                b.add_flat(bc * C + jc),
                b.add_flat(bg * G + jg),
                len(bc),
            )
        self._grow("c", C, C, cr)
        self._grow("w", keep, Wg + Q, greal[:, :keep])
        self.cc = d.copy()
        self.w = np.where(c > 0, d + (c if self.block_mode else 1), d)
        self.passes.append(p)


# ----------------------------------------------------------------------------- the engine


@dataclass
class _Controls:
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None


def _gpt_pass(
    model: GPT, cache: KVCache, p: _Pass, bank: _Bank, tokens: Tensor, order: Tensor, n: int
) -> Tensor:
    rows = tokens.shape[0]
    in_slot, tgt_slot = bank.get(p.h["in_slot"])[:rows], bank.get(p.h["tgt_slot"])[:rows]
    is_bos = in_slot < 0
    pos_in = order.gather(1, in_slot.clamp(min=0))
    x_in = tokens.gather(1, pos_in).masked_fill(is_bos, BOS)
    pos_in = pos_in.masked_fill(is_bos, 0).clamp(max=n - 1)
    target = order.gather(1, tgt_slot).clamp(max=n - 1)
    new = bank.get(p.h["mask"])
    mask = None if new is None else cache.mask(new[:rows])
    pack = p.h.get("pack")
    packing = None if pack is None else Packing(bank.get(pack), rows, in_slot.shape[1])
    logits = model.decode(cache, x_in, pos_in, target, mask, queries=p.n_query, packing=packing)
    keep = bank.get(p.h["keep"])
    cache.advance(p.keep, None if keep is None else keep[:rows], pos_in)
    return logits


def _armd_pass(
    model: ARMD, cache: ARMDCache, p: _Pass, bank: _Bank, tokens: Tensor, order: Tensor, n: int
) -> Tensor:
    rows = tokens.shape[0]

    def get(name: str) -> Tensor | None:
        t = bank.get(p.h[name])
        return None if t is None else t[:rows]

    c_pos = order.gather(1, get("c_slot"))
    content = tokens.gather(1, c_pos)
    c_pos = c_pos.clamp(max=n - 1)
    target = order.gather(1, get("g_slot")).clamp(max=n - 1)
    c_new, qc_new, qq_new = get("c_mask"), get("qc_mask"), get("qq_mask")
    packing = None
    if p.h.get("pack") is not None:
        both, cont, query, n_content = p.h["pack"]
        C, G = content.shape[1], target.shape[1]
        packing = StreamPacking(
            Packing(bank.get(both), rows, C + G),
            Packing(bank.get(cont), rows, C),
            Packing(bank.get(query), rows, G),
            n_content,
        )
    logits = model.decode(
        cache,
        content,
        c_pos,
        target,
        content_mask=None if c_new is None else cache.content.mask(c_new),
        query_content_mask=None if qc_new is None else cache.content.mask(qc_new),
        query_mask=None if qq_new is None else cache.query.mask(qq_new),
        keep_content=get("c_keep"),
        packing=packing,
    )
    cache.query.advance(p.keep, get("keep"), target)
    return logits[:, p.n_write :]


def _run_plan(
    model: AnyOrderLM,
    tokens: Tensor,
    order: Tensor,
    k: int,
    plan: _Plan,
    ctl: _Controls,
    generator: torch.Generator | None,
    *,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
    stop_at_eos: int | None = None,
) -> SampleResult:
    """Run a plan on a decoder: the loop every fast decoder sampler shares."""
    B, n = tokens.shape
    device = tokens.device
    pad = torch.full((B, 1), n, dtype=torch.long, device=device)
    tok = torch.cat([tokens, torch.zeros_like(pad)], dim=1)  # column n absorbs padding
    order_ext = torch.cat([order, pad], dim=1)  # slot n -> position n
    step_of = torch.full((B, n + 1), -2, dtype=torch.long, device=device)
    step_of.scatter_(1, order[:, :k], -1)
    V = model.cfg.vocab_size
    logits_buf = torch.zeros(B, n + 1, V, device=device) if keep_logits else None
    plan.bank.ship(device)
    armd = isinstance(model, ARMD)
    cache = model.new_cache(1 if plan.passes and plan.passes[0].prefill else B, plan.cap)
    step_fn = _armd_pass if armd else _gpt_pass
    done = torch.zeros(B, dtype=torch.bool, device=device) if stop_at_eos is not None else None
    passes = 0
    for i, p in enumerate(plan.passes):
        rows = 1 if p.prefill else B
        for key, (index, real, dense) in p.compact.items():
            kv = (cache.content if key == "c" else cache.query) if armd else cache
            kv.compact(plan.bank.get(index)[:rows], plan.bank.get(real)[:rows], dense)
        logits = step_fn(model, cache, p, plan.bank, tok[:rows], order_ext[:rows], n)
        passes += 1
        if p.prefill:
            cache = cache.fork(B)
            continue
        q_slot = plan.bank.get(p.h["g_slot" if armd else "tgt_slot"])[:, p.n_write :]
        q_pos = order_ext.gather(1, q_slot)  # (B, Q); padding -> column n
        new = sample_logits(logits, generator, ctl.temperature, ctl.top_k, ctl.top_p)
        tok.scatter_(1, q_pos, new)
        step_of.scatter_(1, q_pos, p.step)
        if logits_buf is not None:
            logits_buf.scatter_(1, q_slot[..., None].expand(-1, -1, V), logits.float())
        if on_step is not None:
            on_step(q_pos, new, p.step)
        if done is not None:
            done |= (new == stop_at_eos).any(dim=1)
            if i % _EOS_EVERY == _EOS_EVERY - 1 and bool(done.all()):  # the only sync
                break
    tokens = tok[:, :n]
    if stop_at_eos is not None:  # left to right: everything after the first EOS is EOS
        tokens = tokens.masked_fill((tokens == stop_at_eos).cumsum(dim=1) > 0, stop_at_eos)
    return SampleResult(
        tokens,
        order,
        forward_passes=passes,
        step_of=step_of[:, :n],
        logits=None if logits_buf is None else logits_buf[:, :n],
    )


# ----------------------------------------------------------------------------- public samplers


def _prepare(
    model: AnyOrderLM,
    n: int,
    batch: int,
    prompt: Tensor | None,
    known: Tensor | None,
    order: str | Tensor | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Check the request; return ``(tokens, known, order, k)`` on the model's device."""
    device = model.device
    if not 1 <= n <= model.cfg.seq_len:
        raise SamplingError(
            f"length n={n} must lie in 1..{model.cfg.seq_len} (the model's context)"
        )
    if batch < 1:
        raise SamplingError(f"batch={batch} must be at least 1")
    if isinstance(order, Tensor) and order.dim() == 2 and (prompt is None or prompt.dim() == 1):
        batch = order.shape[0]  # a batch of orders sets the batch
    if prompt is None:
        tokens = torch.zeros(batch, n, dtype=torch.long, device=device)
        known = torch.zeros(batch, n, dtype=torch.bool, device=device)
    else:
        if known is None:
            raise SamplingError("a prompt needs its known-position mask")
        prompt, known = prompt.to(device).long(), known.to(device).bool()
        if prompt.dim() == 1 or prompt.shape[0] == 1:  # one prompt for the whole batch
            prompt, known = prompt.expand(batch, -1), known.expand(batch, -1)
        if prompt.shape != known.shape or prompt.shape[1] != n:
            raise SamplingError(
                f"prompt {tuple(prompt.shape)} and known {tuple(known.shape)} must both be "
                f"(batch, n={n})"
            )
        tokens = torch.where(known, prompt, 0)
        if bool(((tokens < 0) | (tokens >= model.cfg.vocab_size)).any()):
            raise SamplingError(
                f"prompt token ids must lie in 0..{model.cfg.vocab_size - 1} (the model's "
                "vocabulary); was it encoded with the model's tokenizer?"
            )
    num_known = known.sum(dim=1)
    if not bool((num_known == num_known[0]).all()):
        raise SamplingError("every row of a batch needs the same number of known positions")
    k = int(num_known[0])
    if order is None:
        order = "l2r" if model.kind == "gpt" else "random"
    if isinstance(order, str):
        order = prompt_order(known, generator, order)
        # known slots left to right, the same in every row: a shared prompt is prefilled once
        order = torch.cat([order[:, :k].sort(dim=1).values, order[:, k:]], dim=1)
    else:
        order = order.to(device).long()
        if order.dim() == 1:
            order = order.expand(tokens.shape[0], -1)
        if order.shape != tokens.shape or not is_permutation(order):
            raise SamplingError(f"order must be (batch, n={n}) permutations of 0..{n - 1}")
        if not bool(known.gather(1, order[:, :k]).all()):
            raise SamplingError("the order must list the known positions first")
    if model.kind == "gpt" and not torch.equal(
        order, torch.arange(n, device=device).expand_as(order)
    ):
        raise SamplingError(
            "gpt generates left to right: give order l2r and a prefix prompt (the unknown "
            "positions last); use aogpt, armd or mdm to fill holes"
        )
    return tokens, known, order.contiguous(), k


def _shared_prompt(tokens: Tensor, order: Tensor, k: int) -> bool:
    """Whether every row has the same prompt in the same slots (prefill once, then fork)."""
    B = tokens.shape[0]
    return (
        B > 1
        and k > 0
        and bool((tokens == tokens[:1]).all())
        and bool((order[:, :k] == order[:1, :k]).all())
    )


def _decoder_only(model: AnyOrderLM, what: str) -> None:
    if isinstance(model, MDM):
        raise SamplingError(f"{what} needs a decoder (gpt, aogpt, armd); mdm uses encoder_sample")


@torch.no_grad()
def sequential_sample(
    model: AnyOrderLM,
    n: int,
    *,
    batch: int = 1,
    order: str | Tensor | None = None,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_at_eos: int | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
) -> SampleResult:
    """One token per step along an order, with a KV cache: O(1) model cost per token.

    Args:
        model: ``gpt`` (left to right only), ``aogpt`` or ``armd``.
        n: sequence length.
        batch: rows (taken from ``prompt`` when it is 2-D).
        order: ``random`` (default; ``l2r`` for gpt), ``l2r``, or a (B, n) tensor listing
            the known positions first.
        prompt, known: (B, n) or (n,) tokens and the mask of the known positions; they are
            prefilled in one pass (once for the whole batch when every row shares them).
        temperature, top_k, top_p: sampling controls (float64 draws).
        generator: every random draw; the same seed gives the same sample.
        stop_at_eos: with a left-to-right order, the EOS id: stop once every row has drawn
            it (checked every few steps) and set every later position to EOS.
        keep_logits: return the logits each token was drawn from (slot-aligned).
        on_step: called after each pass with the decided positions and tokens, (B, Q) each
            (padding positions are ``n``), and their step (:data:`StepHook`).

    Returns:
        A :class:`SampleResult`; ``forward_passes`` is the number of model calls.
    """
    check_controls(temperature, top_k, top_p)
    _decoder_only(model, "sequential sampling")
    tokens, _, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    B = tokens.shape[0]
    if stop_at_eos is not None and not torch.equal(
        order, torch.arange(n, device=order.device).expand_as(order)
    ):
        raise SamplingError(
            "stop at EOS needs a left-to-right order with a prefix prompt; truncate the "
            "text at EOS instead"
        )
    counts = np.ones((n - k, B), dtype=np.int64)
    plan = _Plan(isinstance(model, ARMD), B, n, k, counts, None, _shared_prompt(tokens, order, k))
    ctl = _Controls(temperature, top_k, top_p)
    return _run_plan(
        model,
        tokens,
        order,
        k,
        plan,
        ctl,
        generator,
        keep_logits=keep_logits,
        on_step=on_step,
        stop_at_eos=stop_at_eos,
    )


@torch.no_grad()
def lemma1_sample(
    model: AnyOrderLM,
    n: int,
    steps: int,
    *,
    schedule: str = "linear",
    shared_counts: bool = False,
    batch: int = 1,
    order: str | Tensor | None = None,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
) -> SampleResult:
    """``steps``-step masked-diffusion sampling by Lemma 1, on a decoder with a KV cache.

    Follows one order (random by default); at each reverse step ``t -> s`` a row reveals
    ``Binomial(#masked, 1 - m(s)/m(t))`` tokens (:func:`reveal_counts`, per row), the next
    ones in its order, all predicted in ONE forward pass with the parallel prediction mask
    (each query sees the cache, not the other queries: AO-GPT repeats the last decided token
    with the different targets; ARMD uses as many query-stream slots). A step that reveals
    nothing costs no pass. Rows revealing different counts share a pass, padded.

    Args:
        model: ``aogpt`` or ``armd``.
        steps: ``T``, the number of reverse steps.
        schedule: masking probability ``m(t)``: ``linear`` or ``cosine``.
        shared_counts: draw one reveal count per step for the whole batch instead of one
            per row. Each row is still an exact sample of the reverse process, but the rows
            share their count trajectory (not independent); no padding, so faster.
        Others: as :func:`sequential_sample`.

    Returns:
        A :class:`SampleResult` with ``counts`` (steps, B); ``forward_passes`` is the number
        of steps in which some row revealed a token (plus one prefill for a shared prompt).
    """
    check_controls(temperature, top_k, top_p)
    _decoder_only(model, "Lemma-1 sampling")
    if model.kind == "gpt":
        raise SamplingError(
            "gpt cannot predict several positions per pass (it has no target position); "
            "use sequential sampling, or aogpt/armd for --steps"
        )
    masked_fraction(1.0, schedule)  # validates the name
    tokens, _, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    B = tokens.shape[0]
    counts = reveal_counts(n - k, steps, 1 if shared_counts else B, schedule, generator)
    counts = counts.expand(steps, B).contiguous()
    plan = _Plan(
        isinstance(model, ARMD), B, n, k, counts.numpy(), None, _shared_prompt(tokens, order, k)
    )
    ctl = _Controls(temperature, top_k, top_p)
    out = _run_plan(
        model, tokens, order, k, plan, ctl, generator, keep_logits=keep_logits, on_step=on_step
    )
    out.counts = counts
    return out


@torch.no_grad()
def strided_sample(
    model: ARMD,
    n: int,
    streams: int,
    *,
    batch: int = 1,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
) -> SampleResult:
    """ARMD's strided block-parallel decoding: the ``S`` stream heads one at a time, then
    ``S`` tokens per forward pass (``S + m/S - 1`` passes for ``m`` unknown tokens), with the
    training forward's block semantics (:func:`anyorder.orders.strided`).

    A prompt must be a prefix (``known`` True at positions ``0..k-1``, the same ``k`` in
    every row): it is read one token per block, left to right, and the ``m = n - k``
    positions after it are cut into the ``S`` streams.
    """
    check_controls(temperature, top_k, top_p)
    if not isinstance(model, ARMD):
        raise SamplingError(
            f"strided block-parallel decoding is ARMD's; {model.kind} was not trained on "
            "blocks (use --steps for parallel decoding)"
        )
    k = 0
    if known is not None:
        known = known.bool().expand(batch if known.dim() == 1 else known.shape[0], -1)
        k = int(known[0].sum())
        prefix = torch.arange(known.shape[1], device=known.device) < k
        if not bool((known == prefix).all()):
            raise SamplingError(
                "strided decoding takes a prefix prompt (the same known positions 0..k-1 in "
                "every row); use --steps or a random order to fill holes"
            )
        batch = known.shape[0]
    try:
        ordering = strided(batch, n - k, streams, model.device)
    except ConfigError as e:
        after = f"n={n - k} (the unknown tokens after the prompt)" if k else f"n={n}"
        raise SamplingError(str(e).replace(f"n={n - k}", after)) from None
    head = torch.arange(k, device=model.device)
    order = torch.cat([head.expand(batch, k), ordering.order + k], dim=1)
    tokens, _, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    block_of = torch.cat([head, ordering.blocks[0] + k]).cpu().numpy()
    counts = np.bincount(block_of[k:] - k)[:, None].repeat(batch, axis=1)
    plan = _Plan(True, batch, n, k, counts, block_of, _shared_prompt(tokens, order, k))
    ctl = _Controls(temperature, top_k, top_p)
    return _run_plan(
        model, tokens, order, k, plan, ctl, generator, keep_logits=keep_logits, on_step=on_step
    )


@torch.no_grad()
def encoder_sample(
    model: MDM,
    n: int,
    *,
    steps: int | None = None,
    schedule: str = "linear",
    shared_counts: bool = False,
    batch: int = 1,
    order: str | Tensor | None = None,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
) -> SampleResult:
    """Ancestral sampling of the encoder-only MDM: a full bidirectional pass per step.

    With ``steps=T`` the reveal counts are those of the reverse process (as in
    :func:`lemma1_sample`: the revealed set of a step is a uniform subset of the masked
    positions, here the next ones of a random order); a step revealing nothing makes no
    pass. ``steps=None`` reveals one token per pass (``n - k`` passes). No cache: every pass
    re-reads the whole sequence (the O(n^2) the decoders avoid). ``shared_counts``: as in
    :func:`lemma1_sample`.
    """
    check_controls(temperature, top_k, top_p)
    if not isinstance(model, MDM):
        raise SamplingError(f"encoder_sample runs the mdm encoder; {model.kind} is a decoder")
    masked_fraction(1.0, schedule)
    tokens, known, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    B = tokens.shape[0]
    if steps is None:
        counts = torch.ones(n - k, B, dtype=torch.long)
    else:
        counts = reveal_counts(n - k, steps, 1 if shared_counts else B, schedule, generator)
        counts = counts.expand(steps, B).contiguous()
    bank, plan = _Bank(B), []
    d = np.full(B, k)
    for step, c in enumerate(counts.numpy()):
        if c.max() > 0:
            slots, _ = _rows(d, c, int(c.max()), n)
            plan.append((step, bank.add(slots)))
            d = d + c
    device = tokens.device
    bank.ship(device)
    pad = torch.full((B, 1), n, dtype=torch.long, device=device)
    x = torch.cat([torch.where(known, tokens, model.mask_id), pad], dim=1)  # column n: padding
    order_ext = torch.cat([order, pad], dim=1)
    step_of = torch.full((B, n + 1), -2, dtype=torch.long, device=device)
    step_of.scatter_(1, order[:, :k], -1)
    V = model.cfg.vocab_size
    logits_buf = torch.zeros(B, n + 1, V, device=device) if keep_logits else None
    for step, h in plan:
        q_slot = bank.get(h)
        q_pos = order_ext.gather(1, q_slot)  # (B, Q)
        logits = model.denoise(x[:, :n])
        logits = logits.gather(1, q_pos.clamp(max=n - 1)[..., None].expand(-1, -1, V))
        new = sample_logits(logits, generator, temperature, top_k, top_p)
        x.scatter_(1, q_pos, new)
        step_of.scatter_(1, q_pos, step)
        if logits_buf is not None:
            logits_buf.scatter_(1, q_slot[..., None].expand(-1, -1, V), logits.float())
        if on_step is not None:
            on_step(q_pos, new, step)
    return SampleResult(
        x[:, :n],
        order,
        forward_passes=len(plan),
        step_of=step_of[:, :n],
        logits=None if logits_buf is None else logits_buf[:, :n],
        counts=counts if steps is not None else None,
    )


def sample(
    model: AnyOrderLM,
    n: int,
    *,
    order: str | Tensor | None = None,
    streams: int | None = None,
    steps: int | None = None,
    schedule: str = "linear",
    shared_counts: bool = False,
    batch: int = 1,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_at_eos: int | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
) -> SampleResult:
    """The fast sampler that fits the model and the request.

    * ``mdm``: :func:`encoder_sample` (``steps`` reverse steps; default one token per pass);
    * ``streams=S`` (``armd``): :func:`strided_sample`;
    * ``steps=T`` (``aogpt``, ``armd``): :func:`lemma1_sample`;
    * otherwise :func:`sequential_sample` (``gpt``: left to right).

    ``stop_at_eos`` applies to sequential left-to-right decoding only.
    """
    common = dict(
        batch=batch,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        keep_logits=keep_logits,
        on_step=on_step,
    )
    diffusion = dict(
        schedule=schedule, shared_counts=shared_counts, order=order, prompt=prompt, known=known
    )
    if streams is not None and steps is not None:
        raise SamplingError("give steps (Lemma-1 sampling) or streams (strided), not both")
    if isinstance(model, MDM):
        if streams is not None:
            raise SamplingError("strided decoding is ARMD's; mdm takes --steps")
        return encoder_sample(model, n, steps=steps, **diffusion, **common)
    if streams is not None:
        if prompt is not None and bool(known.any()):
            raise SamplingError(
                "strided decoding takes no prompt; use a random or l2r order to condition"
            )
        if isinstance(order, Tensor) or order not in (None, "strided"):
            raise SamplingError("streams fix the order (strided); leave the order out")
        return strided_sample(model, n, streams, **common)
    if order == "strided":
        raise SamplingError("the strided order needs a number of streams S (--streams)")
    if steps is not None:
        return lemma1_sample(model, n, steps, **diffusion, **common)
    return sequential_sample(
        model, n, order=order, prompt=prompt, known=known, stop_at_eos=stop_at_eos, **common
    )


# ----------------------------------------------------------------------------- text

HOLE_GRAMMAR = (
    "a template is literal text with holes; a hole is [MASK:n] with n a whole number >= 1 "
    "(n tokens to fill); the text '[MASK' always opens a hole"
)
_HOLE = re.compile(r"\[MASK:(\d+)\]")


def parse_template(
    text: str, tokenizer: Tokenizer, max_len: int | None = None
) -> tuple[Tensor, Tensor]:
    """Tokens and known mask of an infilling template such as ``"The [MASK:20] of Python"``.

    Grammar: the template is literal text and holes; a hole is ``[MASK:n]`` with ``n`` a
    decimal integer >= 1 and stands for ``n`` unknown tokens; every other character is
    literal. Each literal run is encoded on its own (so a subword tokenizer never merges
    across a hole); the text ``[MASK`` cannot appear literally.

    Args:
        text: the template.
        tokenizer: encodes the literal runs.
        max_len: longest allowed result (the model's context).

    Returns:
        ``(tokens, known)``: (n,) int64 ids (0 in the holes) and (n,) bool.

    Raises:
        SamplingError: an unterminated or malformed hole, a template without holes, or one
            longer than ``max_len``.
    """
    ids: list[int] = []
    known: list[bool] = []
    holes = 0
    i = 0
    while True:
        j = text.find("[MASK", i)
        literal = text[i:] if j < 0 else text[i:j]
        if literal:
            piece = tokenizer.encode(literal)
            ids += piece
            known += [True] * len(piece)
        if j < 0:
            break
        m = _HOLE.match(text, j)
        digits = m.group(1).lstrip("0") if m else ""  # "" for no hole or [MASK:0]
        if not digits:
            close = text.find("]", j)
            if close < 0:
                raise SamplingError(
                    f"unterminated hole at character {j} of the template; close it as [MASK:n]"
                )
            if 0 <= text.find("[MASK", j + 1) < close:
                raise SamplingError(
                    f"holes overlap at character {j} of the template ({text[j : close + 1]!r}); "
                    "put them side by side, e.g. [MASK:3][MASK:2]"
                )
            raise SamplingError(
                f"bad hole {text[j : close + 1]!r} at character {j}; write [MASK:n] with a "
                "whole number n >= 1"
            )
        # int() refuses thousands of digits: judge a long number by its length first
        if max_len is not None and (len(digits) > 18 or int(digits) > max_len):
            shown = digits if len(digits) <= 12 else f"{digits[:6]}... ({len(digits)} digits)"
            raise SamplingError(
                f"hole [MASK:{shown}] is longer than the model's context ({max_len} tokens)"
            )
        size = int(digits)
        ids += [0] * size
        known += [False] * size
        holes += 1
        i = m.end()
    if holes == 0:
        raise SamplingError("the template has no hole; mark the text to fill with [MASK:n]")
    if max_len is not None and len(ids) > max_len:
        raise SamplingError(
            f"the template is {len(ids)} tokens, longer than the model's context ({max_len}); "
            "shorten the text or the holes"
        )
    return torch.tensor(ids, dtype=torch.long), torch.tensor(known, dtype=torch.bool)


def decode_text(tokenizer: Tokenizer, tokens: Tensor, eos_id: int | None = None) -> str:
    """Text of one sequence (n,), cut at the first ``eos_id`` when given."""
    ids = tokens.tolist()
    if eos_id is not None and eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    return tokenizer.decode(ids)


def infill(
    model: AnyOrderLM,
    tokenizer: Tokenizer,
    template: str,
    *,
    num_samples: int = 1,
    order: str = "random",
    steps: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> list[str]:
    """Fill the holes of ``template`` (:func:`parse_template`); one text per sample.

    The known tokens are prefilled first (one pass, shared by the samples); the holes are
    generated in ``order`` (``random`` or ``l2r``), one token per pass, or by Lemma 1 in
    ``steps`` steps. A ``gpt`` fills only a hole at the end.
    """
    tokens, known = parse_template(template, tokenizer, model.cfg.seq_len)
    if int(tokens.max()) >= model.cfg.vocab_size:
        raise SamplingError(
            f"the tokenizer gives ids up to {int(tokens.max())} but the model reads "
            f"{model.cfg.vocab_size}; use the model's own tokenizer"
        )
    if model.kind == "gpt":
        order = "l2r"
    result = sample(
        model,
        len(tokens),
        order=order,
        steps=steps,
        batch=num_samples,
        prompt=tokens,
        known=known,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    return [decode_text(tokenizer, row) for row in result.tokens]
