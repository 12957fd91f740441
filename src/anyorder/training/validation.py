"""Validation during training: exact left-to-right and Monte-Carlo any-order NLL.

Design choices:

* Validation runs on every rank over the same blocks (simple, and FSDP needs every rank in
  every forward); only rank 0 writes.
* The any-order figure is the mean over :data:`VAL_ORDERS` uniform orders per batch, drawn
  from a generator seeded with :data:`VAL_SEED`, so every evaluation scores the same orders.
* The encoder's left-to-right figure costs one encoder pass per token, so it is measured on
  at most :data:`MDM_L2R_ROWS` sequences.
* With EMA on, validation reports the EMA weights (swapped in for the duration).
* ``order.condition=prompt``: the figures are of the answers given their prompts
  (:mod:`anyorder.evaluation.answers`), per answer token, in bits per token
  (``val/l2r_bpt``, ``val/ao_bpt``) beside nats and bits per byte of the answers' text.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from anyorder.config import RunConfig
from anyorder.training.state import RunParts

MDM_L2R_ROWS = 4
"""Sequences the encoder's (costly: one pass per token) left-to-right NLL is measured on."""
VAL_ORDERS = 2
"""Random orders per validation batch for the Monte-Carlo any-order NLL."""
VAL_SEED = 1234
"""Seed of the validation orders: the same orders at every evaluation."""


@torch.no_grad()
def validate(
    model: nn.Module,
    data: Any,
    cfg: RunConfig,
    device: torch.device,
    *,
    batches: int,
    batch_size: int,
    num_orders: int = VAL_ORDERS,
    autocast: contextlib.AbstractContextManager | None = None,
    mdm_l2r_rows: int = MDM_L2R_ROWS,
) -> dict[str, float]:
    """Validation NLL in nats/token and bits/byte: exact left-to-right, Monte-Carlo any-order.

    The any-order figure is the mean over ``num_orders`` uniform orders per batch (the
    encoder's: its ELBO), with a standard error over the orders; the orders come from a
    generator seeded with :data:`VAL_SEED`, so every evaluation scores the same orders.

    Returns:
        ``val/l2r_nll``, ``val/l2r_bpb`` and, except for ``gpt``, ``val/ao_nll``,
        ``val/ao_bpb``, ``val/ao_bpb_se``; plus ``val/blocks``.
    """
    from anyorder.data import iter_eval_blocks
    from anyorder.evaluation.estimators import (
        any_order_nll,
        bits_per_byte,
        left_to_right_nll,
        mdm_elbo,
    )

    if cfg.order.condition == "prompt":
        return validate_answers(
            model, data, cfg, device, batches=batches, batch_size=batch_size,
            num_orders=num_orders, autocast=autocast, mdm_l2r_rows=mdm_l2r_rows,
        )  # fmt: skip
    kind = cfg.model.kind
    bpt = data.bytes_per_token("val")
    gen = torch.Generator().manual_seed(VAL_SEED)
    was_training = model.training
    model.eval()
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    l2r_sum, l2r_count = 0.0, 0
    ao_means: list[float] = []
    ao_vars: list[float] = []
    blocks = 0
    n = data.seq_len
    max_blocks = max(1, batches) * batch_size
    try:
        for x in iter_eval_blocks(data, "val", max_blocks, batch_size=batch_size):
            x = x.to(device)
            blocks += x.shape[0]
            rows = x if kind != "mdm" else x[: max(0, mdm_l2r_rows - l2r_count)]
            if len(rows):
                with ctx:
                    l2r_sum += float(left_to_right_nll(model, rows).double().sum())
                l2r_count += len(rows)
            if kind == "gpt":
                continue
            with ctx:
                if kind == "mdm":
                    est = mdm_elbo(model, x, num_orders, gen)
                else:
                    est = any_order_nll(model, x, num_orders, gen)
            ao_means.append(est.mean)
            ao_vars.append(est.stderr**2 if num_orders > 1 else 0.0)
    finally:
        model.train(was_training)
    out: dict[str, float] = {"val/blocks": float(blocks)}
    nll = l2r_sum / max(1, l2r_count * n)
    out["val/l2r_nll"] = nll
    out["val/l2r_bpb"] = bits_per_byte(nll, bpt)
    if ao_means:
        k = len(ao_means)
        mean = sum(ao_means) / k
        se = math.sqrt(sum(ao_vars)) / k
        out["val/ao_nll"] = mean
        out["val/ao_bpb"] = bits_per_byte(mean, bpt)
        out["val/ao_bpb_se"] = bits_per_byte(se, bpt)
    return out


@torch.no_grad()
def validate_answers(
    model: nn.Module,
    data: Any,
    cfg: RunConfig,
    device: torch.device,
    *,
    batches: int,
    batch_size: int,
    num_orders: int = VAL_ORDERS,
    autocast: contextlib.AbstractContextManager | None = None,
    mdm_l2r_rows: int = MDM_L2R_ROWS,
) -> dict[str, float]:
    """:func:`validate` of prompt/response data: the answers' NLL given their prompts, left to
    right (exact) and any order (the prompt first, the answer in ``num_orders`` uniform
    orders; the encoder's: its ELBO with the prompt unmasked).

    Returns:
        ``val/l2r_nll`` (nats per answer token), ``val/l2r_bpt``, ``val/l2r_bpb`` and,
        except for ``gpt``, ``val/ao_nll``, ``val/ao_bpt``, ``val/ao_bpt_se``,
        ``val/ao_bpb``, ``val/ao_bpb_se``; plus ``val/blocks`` and ``val/answer_tokens``.
    """
    from anyorder.evaluation.answers import answer_any_order_nll, answer_mdm_elbo, answer_nll
    from anyorder.evaluation.estimators import bits_per_byte

    kind, n = cfg.model.kind, data.seq_len
    gen = torch.Generator().manual_seed(VAL_SEED)
    was_training = model.training
    model.eval()
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    l2r_sum, l2r_tokens, l2r_rows, answer_tokens = 0.0, 0, 0, 0
    ao_sums: list[float] = []  # per batch: nats over its answer tokens, and their variance
    ao_vars: list[float] = []
    total = min(data.num_blocks("val"), max(1, batches) * batch_size)
    try:
        for start in range(0, total, batch_size):
            idx = list(range(start, min(total, start + batch_size)))
            x = data.batch("val", idx).to(device)
            plen = data.prompt_lengths("val", idx).to(device)
            tokens = int((n - plen).sum())
            answer_tokens += tokens
            # the encoder's left to right costs a pass a token: on mdm_l2r_rows rows only
            rows = len(idx) if kind != "mdm" else min(len(idx), max(0, mdm_l2r_rows - l2r_rows))
            l2r_rows += rows
            if rows:
                with ctx:
                    l2r_sum += float(answer_nll(model, x[:rows], plen[:rows]).double().sum())
                l2r_tokens += int((n - plen[:rows]).sum())
            if kind == "gpt":
                continue
            with ctx:
                if kind == "mdm":
                    est = answer_mdm_elbo(model, x, plen, num_orders, gen)
                else:
                    est = answer_any_order_nll(model, x, plen, num_orders, gen)
            ao_sums.append(est.mean * tokens)
            ao_vars.append((est.stderr * tokens) ** 2 if num_orders > 1 else 0.0)
    finally:
        model.train(was_training)
    bpt = data.bytes_per_token("val")
    nll = l2r_sum / max(1, l2r_tokens)
    out = {"val/blocks": float(total), "val/answer_tokens": float(answer_tokens)}
    out |= {"val/l2r_nll": nll, "val/l2r_bpt": nll / math.log(2)}
    out["val/l2r_bpb"] = bits_per_byte(nll, bpt)
    if ao_sums:
        mean, se = sum(ao_sums) / answer_tokens, math.sqrt(sum(ao_vars)) / answer_tokens
        out |= {"val/ao_nll": mean, "val/ao_bpt": mean / math.log(2)}
        out["val/ao_bpt_se"] = se / math.log(2)
        out["val/ao_bpb"] = bits_per_byte(mean, bpt)
        out["val/ao_bpb_se"] = bits_per_byte(se, bpt)
    return out


def evaluate_run(
    parts: RunParts,
    batches: int,
    batch_size: int,
    orders: int = VAL_ORDERS,
    mdm_rows: int = MDM_L2R_ROWS,
) -> dict[str, float]:
    """:func:`validate` the run's model (its EMA weights when it keeps them)."""
    ema = parts.ema
    with ema.swapped() if ema is not None else contextlib.nullcontext():
        return validate(
            parts.model,
            parts.data,
            parts.cfg,
            parts.env.device,
            batches=batches,
            batch_size=batch_size,
            num_orders=orders,
            autocast=parts.autocast,
            mdm_l2r_rows=mdm_rows,
        )


def format_val(val: dict[str, float], unigram: float | None = None) -> str:
    """The validation figures in bits/byte, as the training log prints them."""
    if not val:
        return "no validation"
    if "val/l2r_bpt" in val:  # answers given their prompts: bits per answer token
        parts = [f"validation of the answers: left to right {val['val/l2r_bpt']:.4f}"]
        if "val/ao_bpt" in val:
            parts.append(f"any order {val['val/ao_bpt']:.4f} ± {val['val/ao_bpt_se']:.4f}")
        return ", ".join(parts) + " bits/token"
    parts = [f"validation left to right {val['val/l2r_bpb']:.4f}"]
    if "val/ao_bpb" in val:
        parts.append(f"any order {val['val/ao_bpb']:.4f} ± {val['val/ao_bpb_se']:.4f}")
    if unigram is not None:
        parts.append(f"unigram baseline {unigram:.4f}")
    return ", ".join(parts) + " bits/byte"


def count_evaluations(step: int, end: int, every: int) -> int:
    """Validations a run from ``step`` to ``end`` makes (every ``every`` steps and at the end)."""
    count = (end // every - step // every) if every else 0
    return count + (0 if every and end % every == 0 else 1)
