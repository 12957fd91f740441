"""A model's likelihoods on a corpus, with error bars: :func:`likelihood_suite` runs every
path of :mod:`anyorder.evaluation.corpus` that applies to the model (the exact left-to-right
NLL, the any-order NLL over random orders, the context-order ensemble, the encoder's ELBO)
and summarizes the per-block values.

Design choices:

* Error bars mean what a reader thinks (:func:`block_estimate`): the headline ``±`` is the
  standard error over *blocks*, the corpus being a sample of text: the standard deviation
  of the per-block values (a block's mean over its ``K`` orders) over ``sqrt(N)``; it
  includes the order draw. Beside it, where orders are drawn, the order draw's part alone:
  the pooled within-block variance, ``sqrt(sum_b s_b^2 / K) / N`` (:func:`pooled_estimate`;
  nan for ``K = 1``). Left to right is exact per block and gets the block-level one. The
  per-block values are in the result (``per_block``), so any other summary can be made.
* Long work says what it costs: :func:`likelihood_suite` prints an estimate first (the
  forward passes it will run x the measured time of one, :func:`suite_passes` and
  :func:`pass_seconds`); the CLI prints it even without progress bars.
* What does not apply is reported as such, not computed: a ``gpt`` has no any-order
  likelihood; an encoder's ensemble is its plain estimate (its conditionals depend on the
  context set only); its "any-order" figure is the ELBO, equal in expectation (Eq. 5).
* One unit per report (:func:`anyorder.evaluation.report.format_likelihood`): bits per
  byte where the bytes per token are known, else nats per token. The JSON keeps nats,
  perplexity and bits per byte.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from anyorder.errors import ConfigError
from anyorder.evaluation.corpus import (
    Blocks,
    EnsembleRun,
    _block_orders,
    corpus_any_order,
    corpus_ensemble,
    corpus_left_to_right,
    corpus_mdm_elbo,
    rows_per_call,
)
from anyorder.evaluation.estimators import Estimate, bits_per_byte, ensemble_cost
from anyorder.models.base import DEFAULT_MAX_TOKENS, AnyOrderLM
from anyorder.models.mdm import MDM
from anyorder.progress import estimate as print_estimate


def pooled_estimate(values: Tensor) -> Estimate:
    """The order draw's standard error: mean and pooled within-block standard error.

    ``values`` is (N,) for an exact quantity (standard error 0) or (N, K) for ``K``
    replicates per block (``sqrt(sum_b s_b^2 / K) / N``; nan when ``K = 1``).
    """
    v = values.double()
    if v.dim() == 1:
        return Estimate(float(v.mean()), 0.0, 1)
    N, K = v.shape
    if K < 2:
        return Estimate(float(v.mean()), float("nan"), K)
    se = float(v.var(dim=1, unbiased=True).sum().sqrt()) / (math.sqrt(K) * N)
    return Estimate(float(v.mean()), se, K)


def block_estimate(values: Tensor) -> Estimate:
    """Mean and standard error over blocks (the corpus sample), the order part beside it.

    ``values`` is (N,) (exact per block: ``stderr_orders`` None) or (N, K). ``stderr`` is
    the standard deviation of the per-block means over ``sqrt(N)`` (nan for one block);
    ``stderr_orders`` is :func:`pooled_estimate`'s.
    """
    v = values.double()
    means = v if v.dim() == 1 else v.mean(dim=1)
    N = len(means)
    se = float(means.std(unbiased=True)) / math.sqrt(N) if N > 1 else float("nan")
    orders = None if v.dim() == 1 else pooled_estimate(v).stderr
    K = 1 if v.dim() == 1 else v.shape[1]
    return Estimate(float(v.mean()), se, K, orders, N)


def metric(est: Estimate, bytes_per_token: float | None) -> dict[str, Any]:
    """An estimate as nats/token, perplexity (95% interval from ``stderr``) and bits per byte,
    each with its standard error (``stderr``: over blocks; ``stderr_orders``: the order draw's
    part, None where no order is drawn)."""
    lo, hi = est.ci95() if math.isfinite(est.stderr) else (est.mean, est.mean)
    so = est.stderr_orders
    out: dict[str, Any] = {
        "nats_per_token": est.mean,
        "stderr": est.stderr,
        "stderr_orders": so,
        "blocks": est.blocks,
        "replicates": est.samples,
        "ppl": math.exp(est.mean),
        "ppl_ci95": [math.exp(lo), math.exp(hi)],
        "bits_per_byte": None,
        "bpb_stderr": None,
        "bpb_stderr_orders": None,
    }
    if bytes_per_token:
        out["bits_per_byte"] = bits_per_byte(est.mean, bytes_per_token)
        out["bpb_stderr"] = bits_per_byte(est.stderr, bytes_per_token)
        out["bpb_stderr_orders"] = None if so is None else bits_per_byte(so, bytes_per_token)
    return out


def _per_block(values: Tensor) -> list:
    """Per-block values for the JSON: (N,) -> N numbers, (N, K) -> N lists of K."""
    return [round(float(v), 6) if v.dim() == 0 else [round(float(u), 6) for u in v]
            for v in values.double()]  # fmt: skip


def suite_passes(
    model: AnyOrderLM, N: int, n: int, orders: int, ensemble: int, targets: int | None, l2r: bool
) -> float:
    """Forward passes of ``n`` tokens that :func:`likelihood_suite` will run (the estimate)."""
    passes = 0.0
    if l2r:
        passes += N * (n if isinstance(model, MDM) else 1)
    if model.kind == "gpt":
        return passes
    passes += N * orders  # the plain any-order pass (the ELBO for mdm)
    if ensemble > 1 and not isinstance(model, MDM):
        passes += N * orders * (ensemble_cost(n, ensemble, targets) - 1)
    return passes


def pass_seconds(model: AnyOrderLM, blocks: Blocks, batch_size: int, max_tokens: int) -> float:
    """Measured seconds of one forward pass of a block (its head included), from a call of
    as many blocks as the suite batches (the second of two: the first warms up)."""
    import time

    n = int(blocks.shape[1])
    rows = min(len(blocks), rows_per_call(n, batch_size, max_tokens))
    x = torch.from_numpy(np.array(blocks[:rows], dtype=np.int64)).to(model.device)
    o = _block_orders(0, 0, rows, n, 0).to(x.device) if model.kind != "gpt" else None
    seconds = float("inf")
    with torch.no_grad():
        for _ in range(2):
            t0 = time.perf_counter()
            if isinstance(model, MDM):
                model.head_nll(model.denoise_features(x), x, max_tokens)
            else:
                model.token_nll(x, o, max_tokens=max_tokens)
            seconds = min(seconds, time.perf_counter() - t0)
    return seconds / rows


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
    max_tokens: int = DEFAULT_MAX_TOKENS,
    left_to_right: bool = True,
    progress: bool = True,
    estimate: bool | None = None,
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
        batch_size: blocks per forward pass (at most ``max_tokens // n``).
        max_tokens: the memory bound: token positions per trunk call, and as many logits
            elements as ``max_tokens x d_model`` per head call.
        left_to_right: also compute the exact left-to-right NLL (n encoder passes per
            block for mdm).
        progress: progress bars (lines when not on a terminal).
        estimate: print what the suite will cost before it starts (None: when ``progress``;
            the CLI prints it always, so no long evaluation runs silent).

    Returns:
        A JSON-ready dict: ``l2r``, ``any_order`` and ``ensemble`` (each a :func:`metric`
        dict, or None where it does not apply, see ``notes``), ``per_block`` (the values
        behind them, nats/token), the corpus size and the ensemble's cost in passes.
    """
    if len(blocks) == 0:
        raise ConfigError("the corpus has no blocks to evaluate; give more text or a shorter n")
    N, n = len(blocks), int(blocks.shape[1])
    targets = None if targets is not None and targets >= n else targets  # every slot
    kw = dict(seed=seed, batch_size=batch_size, max_tokens=max_tokens, progress=progress)
    res: dict[str, Any] = {
        "model": model.kind,
        "blocks": N,
        "seq_len": n,
        "tokens": N * n,
        "bytes_per_token": bytes_per_token,
        "orders": orders,
        "seed": seed,
        "error_bars": "stderr: over blocks (the text sample; includes the order draw); "
        "stderr_orders: the order draw's part alone",
        "l2r": None,
        "any_order": None,
        "ensemble": None,
        "per_block": {},
        "notes": [],
    }
    notes, per_block = res["notes"], res["per_block"]
    if progress if estimate is None else estimate:
        passes = suite_passes(model, N, n, orders, ensemble, targets, left_to_right)
        sec = pass_seconds(model, blocks, batch_size, max_tokens)
        what = f"{model.kind} likelihoods of {N:,} blocks"
        if isinstance(model, MDM) and left_to_right:  # by far the largest part: say so
            what += f" (left to right: {n} encoder passes a block, the ELBO {orders})"
        print_estimate(what, round(passes), sec, f"passes of {n} tokens")
    if left_to_right:
        l2r = corpus_left_to_right(model, blocks, **{k: kw[k] for k in kw if k != "seed"})
        res["l2r"] = metric(block_estimate(l2r), bytes_per_token)
        per_block["l2r"] = _per_block(l2r)
    if model.kind == "gpt":
        notes.append("gpt is a left-to-right model: no any-order likelihood or ensemble")
        return res
    if isinstance(model, MDM):
        _add_elbo(res, model, blocks, ensemble, kw)
    else:
        _add_any_order(res, model, blocks, ensemble, targets, kw)
    return res


def _add_elbo(res: dict[str, Any], model: MDM, blocks: Blocks, ensemble: int, kw: dict) -> None:
    """The encoder's part of :func:`likelihood_suite`'s ``res``: its ELBO as the any-order
    figure, and its ensemble as the same estimate (a no-op)."""
    notes, per_block, bytes_per_token = res["notes"], res["per_block"], res["bytes_per_token"]
    elbo = corpus_mdm_elbo(model, blocks, res["orders"], **kw)
    res["any_order"] = metric(block_estimate(elbo), bytes_per_token) | {"kind": "elbo"}
    per_block["any_order"] = _per_block(elbo)
    notes.append("mdm: the any-order figure is the ELBO (equal in expectation, Eq. 5)")
    if ensemble > 1:
        res["ensemble"] = res["any_order"] | {"members": ensemble, "noop": True}
        notes.append(
            "mdm: ensembles are a no-op (conditionals depend on the context set only); "
            "the plain estimate is reported"
        )


def _add_any_order(
    res: dict[str, Any],
    model: AnyOrderLM,
    blocks: Blocks,
    ensemble: int,
    targets: int | None,
    kw: dict,
) -> None:
    """A decoder's part of :func:`likelihood_suite`'s ``res``: the any-order NLL and, with
    ``ensemble > 1`` members, the ensemble beside its baseline."""
    notes, per_block, bytes_per_token = res["notes"], res["per_block"], res["bytes_per_token"]
    orders = res["orders"]
    if ensemble <= 1:
        plain = corpus_any_order(model, blocks, orders, **kw)
        res["any_order"] = metric(block_estimate(plain), bytes_per_token)
        per_block["any_order"] = _per_block(plain)
        return
    run = corpus_ensemble(model, blocks, orders, ensemble, targets=targets, **kw)
    # the size-1 column covers the sampled targets only: the plain figure runs all of them
    plain = run.values[..., 0] if targets is None else corpus_any_order(model, blocks, orders, **kw)
    res["any_order"] = metric(block_estimate(plain), bytes_per_token)
    per_block["any_order"] = _per_block(plain)
    res["ensemble"] = _ensemble_result(run, targets, bytes_per_token)
    per_block["ensemble"] = {m: _per_block(run.values[..., i]) for i, m in enumerate(run.sizes)}
    if model.kind == "armd":
        notes.append(
            "armd: token-level orders, so its conditionals depend on the context order across "
            "blocks (with the whole context in one block an ensemble would change nothing)"
        )


def _ensemble_result(run: EnsembleRun, targets: int | None, bpt: float | None) -> dict:
    """The ensemble part of the result: every size on the same targets (size 1 is the
    baseline the gains are paired against), the gains, the cost."""
    by_size = {m: metric(block_estimate(run.values[..., i]), bpt) for i, m in enumerate(run.sizes)}
    gains = {}  # paired over the same blocks, orders and targets: M = 1 minus M = m
    for i, m in enumerate(run.sizes):
        g = metric(block_estimate(run.values[..., 0] - run.values[..., i]), bpt)
        gains[m] = {"nats": g["nats_per_token"], "stderr": g["stderr"],
                    "stderr_orders": g["stderr_orders"], "bits_per_byte": g["bits_per_byte"],
                    "bpb_stderr": g["bpb_stderr"]}  # fmt: skip
    M = run.sizes[-1]
    return by_size[M] | {
        "members": run.members,
        "targets": targets,
        "baseline": by_size[1],
        "by_size": by_size,
        "gain_by_size": gains,
        "gain_nats": gains[M]["nats"],
        "gain_stderr": gains[M]["stderr"],
        "gain_bpb": gains[M]["bits_per_byte"],
        "passes_per_block": run.passes_per_block,
        "passes_formula": run.expected_passes,
    }
