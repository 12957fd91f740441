"""Make tests/fixtures/aogpt-train/: the AO-GPT authors' own code trained for a few steps on
the batches and orders our trainer draws, for tests/test_train_parity.py.

Needs the authors' repository (scxue/AO-GPT-MDM) unpacked in an ignored folder, by default
``.ref/`` at the repository root; nothing of it is copied into the project. Run from the
repository root, one thread:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/aogpt_train_parity.py [--ref .ref]

What it does, in order:

1. builds their ``AOGPT`` (``model_AOGPT_AdaLN6_NoRep_cond_128_trunc_qknorm.py``) at a tiny
   size under their seed and saves its initial state the way their trainer saves a checkpoint
   (``init.pt``): that is what both sides start from (ours through our converter);
2. draws the batches and orders our trainer draws for :data:`OVERRIDES` (our data pipeline,
   block sampler and order sampler, in the order ``training/step.py`` draws them);
3. trains their model the way their ``train_AOGPT_CL.py`` loop does one step (grad
   accumulation 1, fp32, so its GradScaler is a no-op): their ``configure_optimizers``
   (AdamW, decay on >= 2-D tensors, betas), their warm-up and cosine ``get_lr`` (written
   out below: the script cannot be imported, it runs at import), the loss of
   ``model(X, mode='Random_CL', random_ratio=0.9)`` with ``sample_random_orders_CL`` set to
   return our orders for the step's duration, clipping at 1.0, ``optimizer.step()``, then
   their ``ExponentialMovingAverage.update``;
4. saves the per-step losses, the learning rates, the batches and orders, and the final
   weights and EMA as a checkpoint in their format (``final.pt``).

Sizes: ``init.pt`` and ``final.pt`` are about 0.25 MB each (2 layers x 32, vocabulary 257).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "aogpt-train"
MODEL_ARGS = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, bias=True, vocab_size=257,
                  dropout=0.0)  # fmt: skip
STEPS = 24
LR, MIN_LR, WARMUP, DECAY_ITERS = 2e-3, 2e-4, 8, STEPS
BETAS, WEIGHT_DECAY, GRAD_CLIP, EMA_RATE = (0.9, 0.95), 0.1, 1.0, 0.9999
RANDOM_RATIO = 0.9
OVERRIDES = [
    "data.source=builtin:synthetic", "data.tokenizer=bytes", "data.max_documents=200",
    "order.kind=mix", f"order.p_l2r={1 - RANDOM_RATIO:g}",
    f"train.steps={STEPS}", "train.batch_size=8", f"train.lr={LR:g}",
    f"train.min_lr_ratio={MIN_LR / LR:g}", f"train.warmup_steps={WARMUP}",
    "train.optimizer=adamw", f"train.beta1={BETAS[0]}", f"train.beta2={BETAS[1]}",
    f"train.weight_decay={WEIGHT_DECAY}", f"train.grad_clip={GRAD_CLIP}",
    f"train.ema={EMA_RATE}", "train.ema_warmup=true", "train.dtype=fp32", "train.device=cpu",
    "train.compile=false", "train.eval_every=0", "train.eval_batches=1", "train.log_every=1",
    f"train.ckpt_every={STEPS}", "train.seed=0",
]  # fmt: skip
"""Our side: ``anyorder train`` with these and ``train.init_from`` = the converted init."""


def reference_lr(it: int) -> float:
    """Their ``get_lr``: linear warm-up from 0 (``lr * it / warmup``), then cosine from ``lr``
    to ``min_lr`` over ``lr_decay_iters``, then ``min_lr``. (Ours warms up from ``lr /
    warmup`` at step 0: a difference on purpose, so the test runs ours on this one.)"""
    if it < WARMUP:
        return LR * it / WARMUP
    if it > DECAY_ITERS:
        return MIN_LR
    ratio = (it - WARMUP) / (DECAY_ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def our_draws(init_dir: Path, work: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The (STEPS, B, n) batches and orders our trainer draws, as ``training/step.py`` does."""
    from anyorder.config import load_config
    from anyorder.interop.hub import init_model_config
    from anyorder.training.distributed import setup_distributed
    from anyorder.training.setup import build_parts, prepare_data, resolve_vocab

    where = [f"train.init_from={init_dir}", f"train.out_dir={work / 'draws'}",
             f"data.cache_dir={work / 'cache'}"]  # fmt: skip
    cfg = load_config(None, [*OVERRIDES, *where])
    env = setup_distributed(cfg.train.device)
    cfg = init_model_config(cfg)  # as train() sets up a run, phase by phase
    data = prepare_data(cfg, env, False, False, None)
    cfg = resolve_vocab(cfg, data.tokenizer.vocab_size)
    parts = build_parts(cfg, env, data, None)
    xs, orders = [], []
    B, n = cfg.train.batch_size, cfg.model.seq_len
    for step in range(STEPS):
        idx = parts.sampler.next_indices()
        xs.append(parts.data.batch("train", idx))
        orders.append(parts.order_sampler(B, n, step, parts.order_gen).order)
    return torch.stack(xs).long(), torch.stack(orders).long()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", default=str(REPO / ".ref"), help="their repository, unpacked")
    args = p.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(args.ref).resolve()))
    from ema import ExponentialMovingAverage
    from model_AOGPT_AdaLN6_NoRep_cond_128_trunc_qknorm import AOGPT, AOGPTConfig

    from anyorder.interop.reference import convert_ref

    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1337)  # their trainer's seed
    model = AOGPT(AOGPTConfig(**MODEL_ARGS))
    ckpt = {"model": model.state_dict(), "model_args": dict(MODEL_ARGS), "iter_num": 0,
            "config": {"note": "initial state for the training-parity fixture"}}  # fmt: skip
    torch.save(ckpt, OUT / "init.pt")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        convert_ref(OUT / "init.pt", work / "init", "aogpt-ref", weights="raw", tokenizer="bytes")
        tokens, orders = our_draws(work / "init", work)

    optimizer = model.configure_optimizers(WEIGHT_DECAY, LR, BETAS, "cpu")
    ema = ExponentialMovingAverage(model.parameters(), decay=EMA_RATE)
    losses, lrs = [], []
    model.train()
    for it in range(STEPS):
        lr = reference_lr(it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # their order sampling, set to our orders for this step
        model.sample_random_orders_CL = lambda x, ratio, o=orders[it]: o.to(x.device)
        _, loss = model(tokens[it], mode="Random_CL", random_ratio=RANDOM_RATIO)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        ema.update(model.parameters())
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        lrs.append(lr)
        print(f"step {it}: lr {lr:.3g} loss {loss.item():.6f}")
    del model.sample_random_orders_CL  # back to theirs
    final = {"model": model.state_dict(), "ema_model": ema.state_dict(), "ema_rate": EMA_RATE,
             "model_args": dict(MODEL_ARGS), "iter_num": STEPS,
             "config": {"note": "after the training-parity steps"}}  # fmt: skip
    torch.save(final, OUT / "final.pt")
    torch.save({"losses": torch.tensor(losses, dtype=torch.float64),
                "lrs": torch.tensor(lrs, dtype=torch.float64), "tokens": tokens,
                "orders": orders, "overrides": OVERRIDES}, OUT / "expected.pt")  # fmt: skip
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
