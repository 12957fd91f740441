"""Likelihood of a corpus, block by block: left to right, any order, the encoder's ELBO and
context-order ensembles (AO-GPT Eq. 7), each as per-block values.

A corpus is a stack of token blocks ``(N, n)`` (a Tensor or a memmap from
:mod:`anyorder.data`). Each ``corpus_*`` path returns its per-block values in nats per token;
:func:`anyorder.evaluation.suite.likelihood_suite` runs the ones that apply to a model and
turns them into estimates with error bars.

Design choices:

* Per-block randomness: the orders, ensemble keys, target slots and mask levels of block
  ``b`` come from a generator seeded by ``(seed, b, stream, replicate)``. Results do not
  depend on the batch size, and the ensemble at size 1 is exactly the plain any-order
  estimate of the same seed.
* Memory: every path runs the trunk on at most ``max_tokens`` positions per call (blocks
  per call: ``max_tokens // n``, at most ``batch_size``) and the head on the scored slots
  only, :func:`anyorder.models.base.head_rows` at a time.
* Long work reports progress through :func:`anyorder.progress.progress` (a bar on a
  terminal, lines in a log).
* An ensemble applies to the decoders only: a ``gpt`` has no any-order likelihood, and an
  encoder's conditionals depend on the context set only (:func:`corpus_ensemble` refuses
  both).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from anyorder import orders as orders_mod
from anyorder.errors import ConfigError
from anyorder.evaluation.estimators import (
    combine_members,
    ensemble_cost,
    left_to_right_nll,
    member_logprobs,
    sequence_nll,
)
from anyorder.models.base import DEFAULT_MAX_TOKENS, AnyOrderLM
from anyorder.models.mdm import MDM
from anyorder.progress import progress as progress_bar

Blocks = Tensor | np.ndarray


def block_generator(seed: int, block: int, stream: int, k: int = 0) -> torch.Generator:
    """A CPU generator for one block's draws: orders (stream 0), ensemble keys (1), target
    slots (2) and mask levels (3) of replicate ``k``; the harness's sampled requests use
    stream 4 (block: the request's index)."""
    state = np.random.SeedSequence([seed & (2**63 - 1), block, stream, k]).generate_state(2)
    return torch.Generator().manual_seed(int(state[0]) << 31 ^ int(state[1]))


def _block_orders(seed: int, first: int, count: int, n: int, k: int) -> Tensor:
    return torch.cat(
        [
            orders_mod.uniform(1, n, block_generator(seed, first + b, 0, k)).order
            for b in range(count)
        ]
    )


def rows_per_call(n: int, batch_size: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> int:
    """Blocks per trunk call: at most ``batch_size`` and ``max_tokens`` positions (>= 1)."""
    return max(1, min(batch_size, max_tokens // max(1, n)))


def _batches(blocks: Blocks, rows: int, bar: Any) -> Iterator[tuple[int, Tensor]]:
    """``(first block index, (rows, n) int64 tensor)``, updating ``bar`` by blocks done."""
    for start in range(0, len(blocks), rows):
        chunk = blocks[start : start + rows]
        if isinstance(chunk, Tensor):
            x = chunk.long()
        else:
            x = torch.from_numpy(np.asarray(chunk, dtype=np.int64))
        yield start, x
        bar.update(len(x))


def _bar(total: int, desc: str, enabled: bool, unit: str = "blocks") -> Any:
    return progress_bar(total=total, desc=desc, unit=unit, enabled=enabled, leave=False)


@torch.no_grad()
def corpus_left_to_right(
    model: AnyOrderLM,
    blocks: Blocks,
    *,
    batch_size: int = 8,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: bool = True,
) -> Tensor:
    """Exact left-to-right NLL per block (N,), nats/token (mdm: n encoder passes a block)."""
    n = int(blocks.shape[1])
    rows = 1 if isinstance(model, MDM) else rows_per_call(n, batch_size, max_tokens)
    out = []
    with _bar(len(blocks), "left to right", progress) as bar:
        for _, x in _batches(blocks, rows, bar):
            x = x.to(model.device)
            nll = left_to_right_nll(model, x, max_tokens=max_tokens)
            out.append(nll.double().cpu() / n)
    return torch.cat(out)


@torch.no_grad()
def corpus_any_order(
    model: AnyOrderLM,
    blocks: Blocks,
    num_orders: int,
    *,
    seed: int = 0,
    batch_size: int = 8,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: bool = True,
) -> Tensor:
    """Any-order NLL per block under ``num_orders`` uniform orders each: (N, K), nats/token."""
    n = int(blocks.shape[1])
    out = []
    with _bar(len(blocks), f"any order (K={num_orders})", progress) as bar:
        for start, x in _batches(blocks, rows_per_call(n, batch_size, max_tokens), bar):
            x = x.to(model.device)
            cols = []
            for k in range(num_orders):
                o = _block_orders(seed, start, len(x), n, k).to(x.device)
                cols.append(sequence_nll(model, x, o, max_tokens=max_tokens).double().cpu() / n)
            out.append(torch.stack(cols, dim=1))
    return torch.cat(out)


@torch.no_grad()
def corpus_mdm_elbo(
    model: MDM,
    blocks: Blocks,
    num_samples: int,
    *,
    seed: int = 0,
    batch_size: int = 8,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: bool = True,
) -> Tensor:
    """The encoder's ELBO per block, ``num_samples`` mask draws each: (N, K), nats/token.

    The same one-sample estimate as :meth:`MDM.elbo_estimate` (mask the last ``m`` slots of
    a uniform order, ``m ~ U{1..n}``, score ``(1/m) sum NLL``), drawn per block; the head
    reads the masked positions only.
    """
    n = int(blocks.shape[1])
    out = []
    with _bar(len(blocks), f"ELBO (K={num_samples})", progress) as bar:
        for start, x in _batches(blocks, rows_per_call(n, batch_size, max_tokens), bar):
            x = x.to(model.device)
            B = len(x)
            cols = []
            for k in range(num_samples):
                o = _block_orders(seed, start, B, n, k).to(x.device)
                gens = [block_generator(seed, start + b, 3, k) for b in range(B)]
                m = torch.cat([torch.randint(1, n + 1, (1,), generator=g) for g in gens])
                m = m.to(x.device)
                masked = orders_mod.inverse(o) >= (n - m)[:, None]  # (B, n) by position
                h = model.denoise_features(torch.where(masked, model.mask_id, x))  # (B, n, d)
                nll = torch.zeros(B, n, dtype=torch.float32, device=x.device)
                nll[masked] = model.head_nll(h[masked], x[masked], max_tokens)
                cols.append((nll.sum(dim=1) / m).double().cpu())
            out.append(torch.stack(cols, dim=1))
    return torch.cat(out)


@dataclass
class EnsembleRun:
    """Per-block ensemble NLL for several ensemble sizes, and what it cost."""

    values: Tensor
    """(N, K, len(sizes)) nats/token: block, order replicate, ensemble size."""
    sizes: list[int]
    """Ensemble sizes (prefixes of the members; 1 = the plain any-order NLL)."""
    members: int
    slot_evals: int
    """Slot evaluations run (padding and identity passes included)."""
    passes_per_block: float
    """``slot_evals / (N K n)``: measured forward passes of n tokens per block and order."""
    expected_passes: float = 0.0
    """:func:`ensemble_cost`: the formula, for comparison."""


def default_sizes(members: int) -> list[int]:
    """1, 2, 4, ... up to ``members``, and ``members`` itself."""
    sizes = [1 << p for p in range(max(1, members).bit_length()) if 1 << p <= members]
    return sorted(set(sizes + [members]))


@torch.no_grad()
def corpus_ensemble(
    model: AnyOrderLM,
    blocks: Blocks,
    num_orders: int,
    members: int,
    *,
    sizes: Sequence[int] | None = None,
    targets: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: bool = True,
) -> EnsembleRun:
    """Context-order ensemble NLL per block (Eq. 7) for each ensemble size in ``sizes``.

    The orders are those of :func:`corpus_any_order` with the same seed, so size 1 equals
    it. ``targets`` scores a uniform random subset of that many target slots per block and
    order (an unbiased estimate of the per-token mean, much cheaper); None scores all.

    Raises:
        ConfigError: a model whose ensembles are undefined (gpt) or a no-op (mdm), or sizes
            outside ``1..members``.
    """
    if model.kind == "gpt" or isinstance(model, MDM):
        raise ConfigError(
            f"context-order ensembles do not apply to {model.kind} (gpt is left-to-right only; "
            "an encoder's conditionals depend on the context set only); use aogpt or armd"
        )
    sizes = list(sizes) if sizes is not None else default_sizes(members)
    if members < 1 or not all(1 <= s <= members for s in sizes):
        raise ConfigError(f"ensemble sizes {sizes} must lie in 1..{members} (the members)")
    n = int(blocks.shape[1])
    total = round(len(blocks) * num_orders * ensemble_cost(n, members, targets))
    bar = _bar(total, f"ensemble x{members}", progress, f"passes of {n} tokens")
    done = [0, 0]  # slot evaluations so far, passes reported

    def advance(slot_evals: int) -> None:  # whole passes of n tokens to the bar
        done[0] += slot_evals
        passes = min(total - 1, done[0] // n)  # padding can run past the formula's count
        bar.update(passes - done[1])
        done[1] = passes

    out, evaluated = [], 0
    for start, x in _batches(blocks, rows_per_call(n, batch_size, max_tokens), _bar(0, "", False)):
        x = x.to(model.device)
        B = len(x)
        per_k = []
        for k in range(num_orders):
            o = _block_orders(seed, start, B, n, k).to(x.device)
            gens = [block_generator(seed, start + b, 1, k) for b in range(B)]
            keys = torch.stack([torch.rand(members - 1, n, generator=g, dtype=torch.float64)
                                for g in gens])  # fmt: skip
            slots = None
            if targets is not None and targets < n:
                gens = [block_generator(seed, start + b, 2, k) for b in range(B)]
                slots = torch.stack([torch.randperm(n, generator=g)[:targets].sort().values
                                     for g in gens]).to(x.device)  # fmt: skip
            logp, ev = member_logprobs(
                model, x, o, keys, slots, max_tokens=max_tokens, on_chunk=advance
            )
            evaluated += ev
            nll = torch.stack([-combine_members(logp, m).mean(dim=1) for m in sizes], dim=-1)
            per_k.append(nll.cpu())  # (B, len(sizes))
        out.append(torch.stack(per_k, dim=1))
    bar.update(total - done[1])  # the formula's count, padding aside: close at 100%
    bar.close()
    values = torch.cat(out)
    return EnsembleRun(
        values,
        sizes,
        members,
        evaluated,
        evaluated / max(1, values.shape[0] * num_orders * n),
        ensemble_cost(n, members, targets),
    )
