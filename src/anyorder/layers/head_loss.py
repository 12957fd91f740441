"""The cross-entropy of a linear head over a large vocabulary, in chunks of rows, without
keeping the (N, V) logits for backward.

Design choices:

* A plain ``F.cross_entropy(head(h).float(), y)`` keeps the fp32 logits (and, under bf16
  autocast, the bf16 ones too) until backward: 3.3 GB at 8 x 1024 tokens of GPT-2's 50,257
  ids, the largest activation of a 124M-parameter step. Here each chunk's logits live only
  while that chunk is computed.
* The gradients are computed in the forward pass, chunk by chunk (the logits' gradient is
  ``softmax - onehot``, known as soon as the logits are), and kept: ``dL/dh`` (N, d) and
  ``dL/dW`` (V, d), smaller than the logits and computed once. Backward scales them by the
  incoming gradient (a scalar: the loss is a sum). No matmul runs twice.
* Under autocast the products take autocast's dtype, as ``F.linear`` would, and the logits
  and their softmax are fp32, as the plain path's ``.float()`` makes them: the same loss and
  gradients within rounding (fp32: within 1e-5; tested against the plain path).
* Without gradients (validation, ``no_grad``) only the loss is computed, in the same chunks.
* Small heads (:data:`PLAIN_UP_TO` logits) take the plain path: little to keep, and its
  fused kernels are faster there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_ELEMENTS = 1 << 25
"""Logits per chunk (rows x vocabulary): 128 MB in fp32, 2,048 rows of a 16k vocabulary,
667 of GPT-2's."""
PLAIN_UP_TO = 1 << 22
"""Logits (rows x vocabulary) up to which the plain ``F.cross_entropy`` runs instead: 16 MB
in fp32 at most kept, and its fused kernels are faster on small heads (the demo's 2,048 x
257: 1.14x less time on this CPU, ``benchmarks/head_loss.py``)."""


def weighted_nll(logits: Tensor, targets: Tensor, weights: Tensor | None = None) -> Tensor:
    """The plain path: the mean NLL (fp32) of ``targets`` (...) under ``logits`` (..., V), or
    ``sum(weights * NLL)`` with ``weights`` (...)."""
    logits = logits.flatten(0, -2).float()
    if weights is None:
        return F.cross_entropy(logits, targets.flatten())
    return (F.cross_entropy(logits, targets.flatten(), reduction="none") * weights.flatten()).sum()


def _log_probs(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Log-probabilities (rows, V) in fp32 of ``F.linear(h, weight, bias)`` (one dtype)."""
    return F.log_softmax(F.linear(h, weight, bias).float(), dim=-1)


def _chunk_nll(logp: Tensor, targets: Tensor, weights: Tensor) -> Tensor:
    """``sum(weights * NLL)`` of one chunk's targets from its log-probabilities."""
    return -(weights * logp.gather(1, targets[:, None]).squeeze(1)).sum()


class _HeadCrossEntropy(torch.autograd.Function):
    """``sum_i w_i * CE(h_i W^T + b, y_i)``; its gradients computed in forward."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, weights, rows, dtype):  # noqa: ANN001, ANN205
        cd = dtype or h.dtype  # the products' dtype, as F.linear computes them
        w_c, b_c = weight.to(cd), None if bias is None else bias.to(cd)
        grad_hs, grad_w, grad_b = [], None, None
        with torch.autocast(h.device.type, enabled=False):  # the casts are explicit here
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for i in range(0, h.shape[0], rows):
                h_c, y_c, wt = h[i : i + rows].to(cd), targets[i : i + rows], weights[i : i + rows]
                logp = _log_probs(h_c, w_c, b_c)  # (rows, V) fp32, a fresh tensor
                total = total + _chunk_nll(logp, y_c, wt)
                g = logp.exp_().mul_(wt[:, None])  # dL/dlogits = w (softmax - onehot), in place
                g = g.scatter_add_(1, y_c[:, None], -wt[:, None]).to(cd)
                gh, gw = (g @ w_c).to(h.dtype), (g.t() @ h_c).float()
                gb = None if bias is None else g.sum(0).float()
                grad_hs.append(gh)
                if grad_w is None:  # the first chunk: nothing to sum yet
                    grad_w, grad_b = gw, gb
                else:  # the chunks' sums in fp32
                    grad_w += gw
                    if gb is not None:
                        grad_b += gb
            grad_h = grad_hs[0] if len(grad_hs) == 1 else torch.cat(grad_hs)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        return (
            grad_h * grad_out.to(grad_h.dtype),
            (grad_w * grad_out).to(w_dtype),
            None if grad_b is None else (grad_b * grad_out).to(b_dtype),
            None,
            None,
            None,
            None,
        )


def head_cross_entropy(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    weights: Tensor | None = None,
) -> Tensor:
    """``sum_i weights_i * CE(F.linear(h_i, weight, bias), targets_i)`` in fp32: ``h``
    (..., d), ``targets`` and ``weights`` (...) alike (``None``: the mean over every row);
    the logits computed :data:`CHUNK_ELEMENTS` at a time and never kept (see the module
    docstring)."""
    d, V = h.shape[-1], weight.shape[0]
    h, targets = h.reshape(-1, d), targets.reshape(-1)
    if h.shape[0] * V <= PLAIN_UP_TO:  # small: the plain path (see PLAIN_UP_TO)
        return weighted_nll(F.linear(h, weight, bias), targets, weights)
    if weights is None:
        weights = torch.full(targets.shape, 1 / targets.numel(), device=h.device)
    weights = weights.reshape(-1).float()
    rows = max(1, CHUNK_ELEMENTS // V)
    on = torch.is_autocast_enabled(h.device.type)
    dtype = torch.get_autocast_dtype(h.device.type) if on else None
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias)
    )
    if grads:
        return _HeadCrossEntropy.apply(h, weight, bias, targets, weights, rows, dtype)
    cd = dtype or h.dtype
    w_c, b_c = weight.to(cd), None if bias is None else bias.to(cd)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, h.shape[0], rows):
        logp = _log_probs(h[i : i + rows].to(cd), w_c, b_c)
        total = total + _chunk_nll(logp, targets[i : i + rows], weights[i : i + rows])
    return total
