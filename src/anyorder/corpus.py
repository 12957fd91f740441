"""Likelihood of a corpus: per-block estimates, error bars, ensembles, the report.

A corpus is a stack of token blocks ``(N, n)`` (a Tensor or a memmap from
:mod:`anyorder.data`). :func:`likelihood_suite` measures a model on it: the exact
left-to-right NLL, the any-order NLL over random orders (Monte Carlo, with a standard
error), the context-order ensemble (AO-GPT Eq. 7) and, for the encoder, its ELBO — each as
nats/token, perplexity and bits per byte.

Design choices:

* Per-block randomness: the orders, ensemble keys, target slots and mask levels of block
  ``b`` come from a generator seeded by ``(seed, b, stream, replicate)``. Results do not
  depend on the batch size, and the ensemble at size 1 is exactly the plain any-order
  estimate of the same seed.
* Error bars are over the random orders only (the corpus is fixed): ``K`` replicates per
  block, and the standard error pools the within-block variance,
  ``se = sqrt(sum_b s_b^2 / K) / N`` (``N (K - 1)`` degrees of freedom; nan for ``K = 1``).
* What does not apply is reported as such, not computed: a ``gpt`` has no any-order
  likelihood; an encoder's ensemble is its plain estimate (its conditionals depend on the
  context set only); its "any-order" figure is the ELBO, equal in expectation (Eq. 5).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from anyorder import orders as orders_mod
from anyorder.errors import ConfigError
from anyorder.evaluate import (
    Estimate,
    bits_per_byte,
    combine_members,
    ensemble_cost,
    left_to_right_nll,
    member_logprobs,
    sequence_nll,
)
from anyorder.models.base import AnyOrderLM
from anyorder.models.mdm import MDM

Blocks = Tensor | np.ndarray


def block_generator(seed: int, block: int, stream: int, k: int = 0) -> torch.Generator:
    """A CPU generator for one block's draws: orders (stream 0), ensemble keys (1), target
    slots (2) and mask levels (3) of replicate ``k``."""
    state = np.random.SeedSequence([seed & (2**63 - 1), block, stream, k]).generate_state(2)
    return torch.Generator().manual_seed(int(state[0]) << 31 ^ int(state[1]))


def _block_orders(seed: int, first: int, count: int, n: int, k: int) -> Tensor:
    return torch.cat(
        [
            orders_mod.uniform(1, n, block_generator(seed, first + b, 0, k)).order
            for b in range(count)
        ]
    )


def _batches(
    blocks: Blocks, batch_size: int, desc: str, progress: bool
) -> Iterator[tuple[int, Tensor]]:
    from tqdm.auto import tqdm

    N = len(blocks)
    starts = range(0, N, batch_size)
    for start in tqdm(starts, desc=desc, disable=None if progress else True, leave=False):
        chunk = blocks[start : start + batch_size]
        if isinstance(chunk, Tensor):
            yield start, chunk.long()
        else:
            yield start, torch.from_numpy(np.asarray(chunk, dtype=np.int64))


@torch.no_grad()
def corpus_left_to_right(
    model: AnyOrderLM, blocks: Blocks, *, batch_size: int = 8, progress: bool = True
) -> Tensor:
    """Exact left-to-right NLL per block (N,), nats/token."""
    out = []
    for _, x in _batches(blocks, batch_size, "l2r", progress):
        x = x.to(model.device)
        out.append(left_to_right_nll(model, x).double().cpu() / x.shape[1])
    return torch.cat(out)


@torch.no_grad()
def corpus_any_order(
    model: AnyOrderLM,
    blocks: Blocks,
    num_orders: int,
    *,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = True,
) -> Tensor:
    """Any-order NLL per block under ``num_orders`` uniform orders each: (N, K), nats/token."""
    out = []
    for start, x in _batches(blocks, batch_size, "any-order", progress):
        x = x.to(model.device)
        B, n = x.shape
        cols = []
        for k in range(num_orders):
            o = _block_orders(seed, start, B, n, k).to(x.device)
            cols.append(sequence_nll(model, x, o).double().cpu() / n)
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
    progress: bool = True,
) -> Tensor:
    """The encoder's ELBO per block, ``num_samples`` mask draws each: (N, K), nats/token.

    The same one-sample estimate as :meth:`MDM.elbo_estimate` (mask the last ``m`` slots of
    a uniform order, ``m ~ U{1..n}``, score ``(1/m) sum NLL``), drawn per block.
    """
    out = []
    for start, x in _batches(blocks, batch_size, "elbo", progress):
        x = x.to(model.device)
        B, n = x.shape
        cols = []
        for k in range(num_samples):
            o = _block_orders(seed, start, B, n, k).to(x.device)
            m = torch.cat(
                [
                    torch.randint(1, n + 1, (1,), generator=block_generator(seed, start + b, 3, k))
                    for b in range(B)
                ]
            ).to(x.device)
            masked = orders_mod.inverse(o) >= (n - m)[:, None]
            logits = model.denoise(torch.where(masked, model.mask_id, x)).float()
            nll = F.cross_entropy(logits.transpose(1, 2), x, reduction="none")
            cols.append(((nll * masked).sum(dim=1) / m).double().cpu())
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
    max_tokens: int = 1 << 15,
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
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(blocks) * num_orders,
        desc=f"ensemble x{members} (blocks x orders)",
        disable=None if progress else True,
        leave=False,
    )
    out, evaluated, n = [], 0, 1
    for start, x in _batches(blocks, batch_size, "", False):
        x = x.to(model.device)
        B, n = x.shape
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
            logp, ev = member_logprobs(model, x, o, keys, slots, max_tokens=max_tokens)
            evaluated += ev
            nll = torch.stack([-combine_members(logp, m).mean(dim=1) for m in sizes], dim=-1)
            per_k.append(nll.cpu())  # (B, len(sizes))
            bar.update(B)
        out.append(torch.stack(per_k, dim=1))
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


# ----------------------------------------------------------------------------- the report


def pooled_estimate(values: Tensor) -> Estimate:
    """Mean and standard error of per-block values in nats/token.

    ``values`` is (N,) for an exact quantity (standard error 0) or (N, K) for ``K``
    replicates per block (pooled within-block variance; nan when ``K = 1``).
    """
    v = values.double()
    if v.dim() == 1:
        return Estimate(float(v.mean()), 0.0, 1)
    N, K = v.shape
    if K < 2:
        return Estimate(float(v.mean()), float("nan"), K)
    se = float(v.var(dim=1, unbiased=True).sum().sqrt()) / (math.sqrt(K) * N)
    return Estimate(float(v.mean()), se, K)


def metric(est: Estimate, bytes_per_token: float | None) -> dict[str, Any]:
    """An estimate as nats/token, perplexity (with its 95% interval) and bits per byte."""
    lo, hi = est.ci95() if math.isfinite(est.stderr) else (est.mean, est.mean)
    out: dict[str, Any] = {
        "nats_per_token": est.mean,
        "stderr": est.stderr,
        "replicates": est.samples,
        "ppl": math.exp(est.mean),
        "ppl_ci95": [math.exp(lo), math.exp(hi)],
        "bits_per_byte": None,
        "bpb_stderr": None,
    }
    if bytes_per_token:
        out["bits_per_byte"] = bits_per_byte(est.mean, bytes_per_token)
        out["bpb_stderr"] = bits_per_byte(est.stderr, bytes_per_token)
    return out


def likelihood_suite(
    model: AnyOrderLM,
    blocks: Blocks,
    *,
    bytes_per_token: float | None = None,
    orders: int = 4,
    ensemble: int = 1,
    targets: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    max_tokens: int = 1 << 15,
    left_to_right: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Every likelihood of ``model`` on a corpus that applies to its kind.

    Args:
        model: any of the four models, in eval mode.
        blocks: (N, n) token blocks.
        bytes_per_token: UTF-8 bytes per token of the text, for bits per byte.
        orders: random orders (mask draws for mdm) per block.
        ensemble: context-order ensemble members ``M`` (1: none).
        targets: score the ensemble on this many random target slots per block (None: all).
        seed: seed of every random draw.
        batch_size: blocks per forward pass.
        max_tokens: slot evaluations per forward call in the ensemble.
        left_to_right: also compute the exact left-to-right NLL (n encoder passes per
            block for mdm).
        progress: tqdm bars.

    Returns:
        A JSON-ready dict: ``l2r``, ``any_order`` and ``ensemble`` (each a :func:`metric`
        dict, or None where it does not apply, see ``notes``), the corpus size and the
        ensemble's cost in forward passes.
    """
    if len(blocks) == 0:
        raise ConfigError("the corpus has no blocks to evaluate; give more text or a shorter n")
    n = int(blocks.shape[1])
    kw = dict(seed=seed, batch_size=batch_size, progress=progress)
    res: dict[str, Any] = {
        "model": model.kind,
        "blocks": len(blocks),
        "seq_len": n,
        "tokens": len(blocks) * n,
        "bytes_per_token": bytes_per_token,
        "orders": orders,
        "seed": seed,
        "l2r": None,
        "any_order": None,
        "ensemble": None,
        "notes": [],
    }
    notes = res["notes"]
    if left_to_right:
        l2r = corpus_left_to_right(model, blocks, batch_size=batch_size, progress=progress)
        res["l2r"] = metric(pooled_estimate(l2r), bytes_per_token)
    if model.kind == "gpt":
        notes.append("gpt is a left-to-right model: no any-order likelihood or ensemble")
        return res
    if isinstance(model, MDM):
        elbo = corpus_mdm_elbo(model, blocks, orders, **kw)
        res["any_order"] = metric(pooled_estimate(elbo), bytes_per_token) | {"kind": "elbo"}
        notes.append("mdm: the any-order figure is the ELBO (equal in expectation, Eq. 5)")
        if ensemble > 1:
            res["ensemble"] = res["any_order"] | {"members": ensemble, "noop": True}
            notes.append(
                "mdm: ensembles are a no-op (conditionals depend on the context set only); "
                "the plain estimate is reported"
            )
        return res
    if ensemble <= 1:
        res["any_order"] = metric(
            pooled_estimate(corpus_any_order(model, blocks, orders, **kw)), bytes_per_token
        )
        return res
    run = corpus_ensemble(
        model, blocks, orders, ensemble, targets=targets, max_tokens=max_tokens, **kw
    )
    plain = run.values[..., 0] if targets is None else None
    if plain is None:  # the size-1 column covers the sampled targets only: run all of them
        plain = corpus_any_order(model, blocks, orders, **kw)
    res["any_order"] = metric(pooled_estimate(plain), bytes_per_token)
    by_size = {
        m: metric(pooled_estimate(run.values[..., i]), bytes_per_token)
        for i, m in enumerate(run.sizes)
    }
    gains = {}  # paired over the same blocks, orders and targets: M = 1 minus M = m
    for i, m in enumerate(run.sizes):
        g = pooled_estimate(run.values[..., 0] - run.values[..., i])
        gains[m] = {"nats": g.mean, "stderr": g.stderr}
    gain = gains[run.sizes[-1]]
    res["ensemble"] = by_size[run.sizes[-1]] | {
        "members": ensemble,
        "targets": targets,
        "by_size": by_size,
        "gain_by_size": gains,
        "gain_nats": gain["nats"],
        "gain_stderr": gain["stderr"],
        "passes_per_block": run.passes_per_block,
        "passes_formula": run.expected_passes,
    }
    if model.kind == "armd":
        notes.append(
            "armd: token-level orders, so its conditionals depend on the context order across "
            "blocks (with the whole context in one block an ensemble would change nothing)"
        )
    return res


def _fmt_metric(name: str, m: dict[str, Any] | None) -> str:
    if m is None:
        return f"  {name:22s} n/a"
    err = m["stderr"]
    pm = f" ± {err:.4f}" if err and math.isfinite(err) else ""
    line = f"  {name:22s} {m['nats_per_token']:.4f}{pm} nats/token   ppl {m['ppl']:.3f}"
    if m["bits_per_byte"] is not None:
        bpm = f" ± {m['bpb_stderr']:.4f}" if pm else ""
        line += f"   {m['bits_per_byte']:.4f}{bpm} bits/byte"
    return line


def format_likelihood(res: dict[str, Any]) -> str:
    """A :func:`likelihood_suite` result as a few aligned lines of text."""
    bpt = res["bytes_per_token"]
    head = (
        f"{res['model']}: {res['blocks']} blocks x {res['seq_len']} tokens "
        f"({res['tokens']:,} tokens)" + (f", {bpt:.3f} bytes/token" if bpt else "")
    )
    lines = [head, _fmt_metric("left-to-right (exact)", res["l2r"])]
    kind = "ELBO" if (res["any_order"] or {}).get("kind") == "elbo" else "any-order"
    lines.append(_fmt_metric(f"{kind} (K={res['orders']})", res["any_order"]))
    ens = res["ensemble"]
    if ens is not None:
        M = ens["members"]
        lines.append(_fmt_metric(f"+ ensemble x{M}", ens))
        if not ens.get("noop"):
            for m, val in ens["by_size"].items():
                if m not in (1, M):
                    lines.append(_fmt_metric(f"  ensemble x{m}", val))
            n = res["seq_len"]
            t = ens["targets"]
            scope = "all targets" if t is None else f"{t} random targets per block"
            lines.append(
                f"  ensemble gain {ens['gain_nats']:.4f} ± {ens['gain_stderr']:.4f} nats/token; "
                f"cost per block and order ({scope}): 1 + {M - 1}*(n+1)/2"
                + ("" if t is None else f"*{t}/n")
                + f" = {ens['passes_formula']:.1f} forward passes of n={n} tokens "
                f"(measured {ens['passes_per_block']:.1f})"
            )
    lines += [f"  note: {note}" for note in res["notes"]]
    return "\n".join(lines)
