"""Muon for the hidden matrices, AdamW for everything else, in one optimizer.

Muon (Jordan et al., 2024) keeps a momentum of each matrix's gradient and steps along its
nearest semi-orthogonal matrix, found by a few Newton-Schulz iterations. It is used for the
2-D weights of linear layers inside the network; token and position tables, the head, norms
and biases keep AdamW, as Muon's authors recommend.

Design choices:

* One :class:`torch.optim.Optimizer` with two kinds of parameter group (``"muon": True`` or
  not), so the learning-rate schedule (which sets ``group["lr"]``), checkpoints
  (``state_dict``) and exact resume work as they do for AdamW.
* The step of a ``m x n`` matrix is scaled by ``0.2 * sqrt(max(m, n))``, which gives it the
  root-mean-square of a typical AdamW step (Liu et al., 2025, "Muon is scalable"), so
  ``train.lr`` means about the same thing for both optimizers and one schedule serves both.
* Decoupled weight decay on the matrices, as AdamW's.
* The iteration runs in bf16, on the CPU too: half the time of fp32 there (0.16 s against
  0.34 s per step for the tiny preset's 18 matrices, one thread), and the result is
  approximate by design.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients of Muon's reference implementation (a published
constant): they push every singular value into roughly [0.7, 1.2] in 5 steps."""
NS_STEPS = 5


def orthogonalize(g: Tensor, steps: int = NS_STEPS) -> Tensor:
    """The semi-orthogonal matrix nearest ``g`` (its ``U V^T``), approximately; ``g`` is one
    matrix (m, n) or a stack of them (k, m, n), each taken on its own."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16)
    wide = x.size(-2) <= x.size(-1)
    if not wide:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    if not wide:
        x = x.mT
    return x.to(g.dtype)


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights Muon takes: those of ``nn.Linear`` layers, except the output head (whose
    rows are tokens, like the embedding's): a :class:`~anyorder.layers.blocks.Head`, or the
    model's ``head`` attribute (the encoder's plain ``Linear``)."""
    from anyorder.layers.blocks import Head

    head = getattr(model, "head", None)
    out: list[nn.Parameter] = []
    for m in model.modules():
        if not isinstance(m, nn.Linear) or isinstance(m, Head) or m is head:
            continue
        if m.weight.requires_grad:
            out.append(m.weight)
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked ``muon=True``, AdamW on the others."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.95,
        eps: float = 1e-8,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "momentum": momentum,
            "eps": eps,
            "muon": False,
            "weight_decay": 0.0,
        }
        super().__init__(list(groups), defaults)
        for g in self.param_groups:
            if g["muon"] and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon takes matrices only (2-D parameters)")

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102 (torch's signature)
        assert closure is None, "MuonAdamW takes no closure"
        for g in self.param_groups:
            if g["muon"]:
                self._muon(g)
            else:
                self._adamw(g)

    def _muon(self, g: dict[str, Any]) -> None:
        """Nesterov momentum, then one batched Newton-Schulz per shape (the layers of a
        model share a few shapes: a handful of iterations for all of its matrices)."""
        lr, mu, wd = g["lr"], g["momentum"], g["weight_decay"]
        params = [p for p in g["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        grads = [p.grad for p in params]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        nesterov = torch._foreach_add(grads, bufs, alpha=mu)
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(params):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        for shape, idx in by_shape.items():
            steps = orthogonalize(torch.stack([nesterov[i] for i in idx])).unbind(0)
            scale = lr * 0.2 * math.sqrt(max(shape))  # AdamW's RMS (see the module notes)
            torch._foreach_add_([params[i] for i in idx], list(steps), alpha=-scale)

    def _adamw(self, g: dict[str, Any]) -> None:
        """AdamW over the group with ``torch._foreach`` ops (a few kernels for all of it)."""
        lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
        params = [p for p in g["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)  # on the CPU: no sync
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            st["step"] += 1
        t = float(self.state[params[0]]["step"])
        grads = [p.grad for p in params]
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - b2**t))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, value=-lr / (1 - b1**t))
