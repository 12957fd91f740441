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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_ELEMENTS = 1 << 25
"""Logits per chunk (rows x vocabulary): 128 MB in fp32, 2,048 rows of a 16k vocabulary,
667 of GPT-2's."""


def _chunk(
    h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Logits (rows, V) in fp32 from products in ``dtype``, and each row's NLL of its target."""
    b = None if bias is None else bias.to(dtype)
    logits = F.linear(h.to(dtype), weight.to(dtype), b).float()
    lse = torch.logsumexp(logits, dim=-1)
    return logits, lse - logits.gather(1, targets[:, None]).squeeze(1)


class _HeadCrossEntropy(torch.autograd.Function):
    """``sum_i w_i * CE(h_i W^T + b, y_i)``; its gradients computed in forward."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, weights, rows, dtype):  # noqa: ANN001, ANN205
        cd = dtype or h.dtype  # the products' dtype, as F.linear computes them
        with torch.autocast(h.device.type, enabled=False):  # the casts are explicit here
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            grad_b = None if bias is None else torch.zeros(bias.shape, device=bias.device)
            w_c = weight.to(cd)
            for i in range(0, h.shape[0], rows):
                h_c, y_c, wt = h[i : i + rows], targets[i : i + rows], weights[i : i + rows]
                logits, nll = _chunk(h_c, weight, bias, y_c, cd)
                total = total + (wt * nll).sum()
                g = torch.softmax(logits, dim=-1)
                g.scatter_add_(1, y_c[:, None], torch.full_like(wt[:, None], -1.0))
                g = (g * wt[:, None]).to(cd)  # dL/dlogits, computed in fp32
                grad_h[i : i + rows] = (g @ w_c).to(h.dtype)
                grad_w += (g.t() @ h_c.to(cd)).float()
                if grad_b is not None:
                    grad_b += g.sum(0).float()
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
    h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, weights: Tensor
) -> Tensor:
    """``sum_i weights_i * CE(F.linear(h_i, weight, bias), targets_i)`` in fp32: ``h``
    (..., d), ``targets`` and ``weights`` (...) alike; the logits computed
    :data:`CHUNK_ELEMENTS` at a time and never kept (see the module docstring)."""
    d, V = h.shape[-1], weight.shape[0]
    h, targets = h.reshape(-1, d), targets.reshape(-1)
    weights = weights.reshape(-1).float()
    rows = max(1, CHUNK_ELEMENTS // V)
    on = torch.is_autocast_enabled(h.device.type)
    dtype = torch.get_autocast_dtype(h.device.type) if on else None
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (h, weight, bias)
    )
    if grads:
        return _HeadCrossEntropy.apply(h, weight, bias, targets, weights, rows, dtype)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for i in range(0, h.shape[0], rows):
        _, nll = _chunk(h[i : i + rows], weight, bias, targets[i : i + rows], dtype or h.dtype)
        total = total + (weights[i : i + rows] * nll).sum()
    return total
