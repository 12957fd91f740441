"""One optimizer step over the global batch: the learning rate, the rows, their orders, the
micro-steps, the update.

Design choices:

* The learning rate is set from the step (:func:`~anyorder.training.state.lr_at`) before
  every step, so a resumed run needs no scheduler state.
* The orders are drawn for the global batch from the shared order generator and each rank
  takes its rows ``rank::world``, the rows :class:`~anyorder.data.BlockSampler` gave it.
  With ``order.condition=prompt`` they are drawn with the global batch's prompt lengths
  (every rank reads them), and each row's prompt length goes to the loss.
* Gradients are synchronised on the last micro-step only (DDP's ``no_sync``, FSDP2's
  ``set_requires_gradient_sync``).
* The step's objective is the mean over the global batch's loss tokens, however the batch
  is split over ranks and micro-steps. Pre-training scores every slot, so every micro-batch
  weighs the same (``1 / grad_accum``). Under ``order.condition=prompt`` only the answers'
  tokens count and a micro-batch's loss is the mean over its own: each is weighted by its
  share of the global batch's answer tokens (:func:`micro_weights`; the counts come from the
  global batch's prompt lengths, which every rank reads, so no collective is needed), times
  the world size that the gradients' average over ranks divides out again.
* The loss is averaged over ranks before the update, so every rank skips a non-finite step
  alike; such a step leaves the weights (and EMA) as they were.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import Tensor

from anyorder.training.distributed import DistEnv
from anyorder.training.state import RunParts, lr_at


def train_step(parts: RunParts, step: int, rows: int | None = None) -> float:
    """One optimizer step (0-based ``step``); returns the mean loss over the global batch.

    ``rows`` caps the rows this rank takes (the dry run's one small micro-batch). A loss
    that is not finite is returned without an update.
    """
    cfg, env, opt = parts.cfg, parts.env, parts.opt
    device, micro = env.device, parts.micro
    lr = lr_at(step, cfg)
    for group in opt.param_groups:
        group["lr"] = lr
    idx = parts.sampler.next_indices()
    if rows is not None:
        idx = idx[:rows]
    x = parts.data.batch("train", idx).to(device, non_blocking=True)  # (local, n)
    plen = plen_all = None
    if cfg.order.condition == "prompt":  # the global batch's prompts: its orders depend on them
        plen_all = parts.data.prompt_lengths("train", parts.sampler.last_batch)
        plen = plen_all[env.rank :: env.world_size][: len(idx)].to(device)
    if cfg.model.kind == "gpt":
        order = blocks = None
    else:
        B, n = cfg.train.batch_size, cfg.model.seq_len
        # the global batch's orders
        ordering = parts.order_sampler(B, n, step, parts.order_gen, prompt_len=plen_all)
        order = ordering.order[env.rank :: env.world_size][: len(idx)].to(device)
        mb = ordering.model_blocks
        blocks = None if mb is None else mb[env.rank :: env.world_size][: len(idx)].to(device)
    accum = max(1, math.ceil(len(idx) / micro))
    weights = micro_weights(cfg.model.seq_len, micro, accum, len(idx), env, plen_all)
    total = torch.zeros((), device=device)  # the mean loss, checked before the update
    for a in range(accum):
        sl = slice(a * micro, (a + 1) * micro)
        last = a == accum - 1
        if parts.fsdp:
            parts.model.set_requires_gradient_sync(last)
            sync: contextlib.AbstractContextManager = contextlib.nullcontext()
        elif env.distributed and not last:
            sync = parts.train_module.no_sync()
        else:
            sync = contextlib.nullcontext()
        with sync:
            p = None if plen is None else plen[sl]
            # the loss's random inputs drawn here, eagerly: a compiled forward reads tensors
            draws = parts.model.loss_draws(x[sl], parts.loss_gen, p)
            with parts.autocast:  # inside the (compiled) forward
                loss = parts.train_module(
                    x[sl],
                    None if order is None else order[sl],
                    None if blocks is None else blocks[sl],
                    None,
                    p,
                    draws,
                )
            # pre-training divides as it always has (bit for bit); prompts weigh by tokens
            part = loss / accum if weights is None else loss * weights[a]
            part.backward()
        total += part.detach()
    if env.distributed:  # every rank sees the same mean, so all skip a bad update alike
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    value = float(total)
    if not math.isfinite(value):  # no update: the weights stay the last good ones
        opt.zero_grad(set_to_none=True)
        return value
    if cfg.train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(parts.params, cfg.train.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if parts.ema is not None:
        parts.ema.update(step)
    return value


def micro_weights(
    n: int, micro: int, accum: int, rows: int, env: DistEnv, plen_all: Tensor | None
) -> list[float] | None:
    """The weight of each micro-step's loss (a mean over that micro-batch's loss tokens), so
    that the weighted sum, averaged over the ranks, is the mean over the global batch's.

    Without prompts (None) every slot counts and the micro-batches are of one size: each
    weighs ``1 / accum``. With ``plen_all`` (the global batch's prompt lengths) a row has
    ``n - plen`` loss tokens (the answer's slots, as the models' losses count them), and a
    micro-batch weighs ``world * its tokens / the global batch's``; ``rows`` is this rank's
    row count (every rank takes as many).
    """
    if plen_all is None:
        return None
    world = env.world_size
    # the ranks take rows r, r + world, ...: together the global batch's first world * rows
    total = float((n - plen_all[: world * rows]).clamp(min=0).sum().clamp(min=1))
    mine = (n - plen_all[env.rank :: world][:rows]).clamp(min=0).double()
    return [world * float(mine[a * micro : (a + 1) * micro].sum()) / total for a in range(accum)]
