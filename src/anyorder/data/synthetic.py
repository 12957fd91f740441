"""``builtin:synthetic``: text from a random sparse Markov chain whose entropy is known exactly.

A corpus to tune recipes against: every model's validation bits per byte can be read as a
distance from the floor no model can beat, which a natural corpus cannot give.

Design choices:

* The source is a Markov chain of order :data:`ORDER` over the :data:`ALPHABET` (ASCII, one
  byte per symbol). Each context of ``ORDER`` symbols has :data:`SUCCESSORS` possible next
  symbols, drawn at random, with probabilities from a flat Dirichlet: sparse and skewed like
  text, but far simpler. Everything is drawn from one seeded ``numpy`` generator
  (:data:`SEED`), so the corpus is the same on every machine.
* Every document is :data:`DOC_BYTES` = 63 symbols long, its first ``ORDER`` symbols drawn
  from the chain's stationary distribution. With the EOS the packer appends, a document is
  64 tokens, so for any ``model.seq_len`` that is a multiple of 64 the blocks start at
  document starts and hold whole documents. The entropy of a block is then exact: per
  document, the entropy of its first ``ORDER`` symbols plus ``DOC_BYTES - ORDER`` times the
  chain's entropy rate, the EOS (always at the same place) costing nothing.
  :func:`floor_bits_per_byte` divides that by the document's bytes: the validation bits per
  byte of a perfect model, left to right *and* in any order (the joint entropy does not
  depend on the order it is factorised in).
* The floor assumes a model that knows where the documents start: every model here has
  absolute positions (learned, or ARMD's and the RoPE-target AO-GPT's target embeddings).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.;'-"
"""The symbols (32 ASCII characters, one byte each)."""
ORDER = 1
"""Symbols of context the next symbol depends on. (An order-2 chain over these symbols, 4,096
transitions to memorise, kept a tiny gpt 45% above its floor after 500 steps: too slow a
target for the tiny configs' 300 steps; with order 1 the floor is reachable left to right,
and any order must still infer a symbol from neighbours at any distance.)"""
SUCCESSORS = 4
"""Possible next symbols per context."""
DOC_BYTES = 63
"""Symbols per document (64 tokens with its EOS)."""
DOCUMENTS = 32768
"""Documents in the corpus (about 2.1M bytes; 5% held out for validation by the packer)."""
SEED = 0
"""Seed of the chain and of the documents."""
VERSION = 2
"""Part of the data cache key: a change to the generator above must change it."""


@dataclass(frozen=True)
class Chain:
    """The Markov chain: ``next_symbols[s]`` (SUCCESSORS,) with ``probs[s]`` for context
    state ``s`` (a base-K number of the last ORDER symbols), and its stationary law."""

    next_symbols: np.ndarray  # (S, SUCCESSORS) int64
    probs: np.ndarray  # (S, SUCCESSORS) float64
    stationary: np.ndarray  # (S,) float64

    @property
    def states(self) -> int:
        return self.probs.shape[0]

    def next_state(self, state: np.ndarray, symbol: np.ndarray) -> np.ndarray:
        """The context state after ``symbol`` follows ``state`` (both arrays)."""
        return (state * len(ALPHABET) + symbol) % self.states


@functools.cache
def chain() -> Chain:
    """The chain of :data:`SEED` (built once; about 10 ms)."""
    K = len(ALPHABET)
    S = K**ORDER
    rng = np.random.default_rng(SEED)
    nxt = np.stack([rng.choice(K, SUCCESSORS, replace=False) for _ in range(S)])
    probs = rng.dirichlet(np.ones(SUCCESSORS), size=S)
    # Stationary law of the context state: iterate from uniform until it stops moving.
    pi = np.full(S, 1.0 / S)
    dest = (np.arange(S)[:, None] * K + nxt) % S  # (S, SUCCESSORS) next states
    for _ in range(10_000):
        new = np.bincount(dest.ravel(), weights=(pi[:, None] * probs).ravel(), minlength=S)
        if np.abs(new - pi).sum() < 1e-13:
            pi = new
            break
        pi = new
    else:  # pragma: no cover - the seeded chain converges (tested)
        raise RuntimeError("the synthetic chain did not reach its stationary law")
    return Chain(nxt, probs, pi)


def entropy_rate_bits() -> float:
    """Entropy of the next symbol given the past, in bits per symbol (the chain's rate)."""
    c = chain()
    h = -(c.probs * np.log2(c.probs)).sum(axis=1)  # (S,) per context
    return float((c.stationary * h).sum())


def start_entropy_bits() -> float:
    """Entropy in bits of a document's first ORDER symbols (the stationary context law)."""
    pi = chain().stationary
    p = pi[pi > 0]
    return float(-(p * np.log2(p)).sum())


def floor_bits_per_byte() -> float:
    """The validation bits per byte of a perfect model on this corpus (see the module doc)."""
    return (start_entropy_bits() + (DOC_BYTES - ORDER) * entropy_rate_bits()) / DOC_BYTES


def unigram_bits() -> float:
    """Entropy in bits of one symbol drawn from the stationary law (the unigram baseline)."""
    c = chain()
    K = len(ALPHABET)
    last = np.bincount(np.arange(c.states) % K, weights=c.stationary, minlength=K)
    p = last[last > 0]
    return float(-(p * np.log2(p)).sum())


def documents(count: int = DOCUMENTS) -> Iterator[str]:
    """The corpus: ``count`` documents of :data:`DOC_BYTES` symbols, deterministic (the
    first documents are the same whatever ``count``)."""
    c = chain()
    K = len(ALPHABET)
    rng = np.random.default_rng([SEED, 1])
    letters = np.frombuffer(ALPHABET.encode("ascii"), dtype=np.uint8)
    cum = np.cumsum(c.probs, axis=1)
    cum[:, -1] = 1.0  # no rounding gap above the last successor
    n = 4096  # documents drawn per round: the corpus's prefix does not depend on ``count``
    for start in range(0, count, n):
        out = np.empty((n, DOC_BYTES), dtype=np.int64)
        state = np.searchsorted(np.cumsum(c.stationary), rng.random(n) * c.stationary.sum())
        state = np.minimum(state, c.states - 1)
        for j in range(ORDER):  # the context state spells the first ORDER symbols
            out[:, j] = state // K ** (ORDER - 1 - j) % K
        for j in range(ORDER, DOC_BYTES):
            u = rng.random(n)
            pick = (u[:, None] > cum[state]).sum(axis=1)  # (n,) successor index
            sym = c.next_symbols[state, pick]
            out[:, j] = sym
            state = c.next_state(state, sym)
        for row in letters[out[: count - start]]:
            yield row.tobytes().decode("ascii")


def describe() -> str:
    """One line for reports: the chain and its exact floor."""
    return (
        f"order-{ORDER} Markov chain over {len(ALPHABET)} symbols, {SUCCESSORS} successors per "
        f"context (seed {SEED}); {DOCUMENTS:,} documents of {DOC_BYTES} bytes; entropy rate "
        f"{entropy_rate_bits():.4f} bits/symbol, floor {floor_bits_per_byte():.4f} bits/byte, "
        f"unigram {unigram_bits():.4f} bits/byte"
    )
