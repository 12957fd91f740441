"""The AO-GPT authors' own training recipe on builtin:synthetic, at the tiny configs' size:
does their code learn uniform orders where ours (``model.variant=aogpt-ref``) does not?

Needs their repository (scxue/AO-GPT-MDM) unpacked in an ignored folder (default ``.ref/``);
nothing of it is copied here. Run from the repository root, one thread:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/aogpt_reference_recipe.py \\
        --steps 300 --out runs/aogpt-reference-recipe

Their side, as their ``train_AOGPT_CL.py`` trains: their ``AOGPT`` (bias False, as their
trainer's default), the loss of ``model(X, mode='Random_CL', random_ratio=0.9)`` (a uniform
order for each row with probability 0.9, else left to right, drawn by their own code), their
``configure_optimizers`` (AdamW, betas (0.9, 0.95), weight decay 0.1 on >= 2-D tensors),
clipping at 1, their linear warm-up from 0 and cosine to lr/10 over the run (``get_lr``, with
``lr_decay_iters`` = the run's steps), their seed 1337. Our side supplies only the data: the
tiny configs' blocks of builtin:synthetic (bytes, n = 256) drawn by our block sampler, and
the yardsticks (the chain's entropy floor, the unigram baseline). Every ``--eval-every``
steps it scores the first ``--eval-blocks`` validation blocks with their model: left to
right (``mode='AR'``) and in uniform orders (``mode='Random'``, ``--eval-orders`` draws),
in bits per byte, and writes one JSON line per evaluation to ``OUT/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def their_lr(it: int, lr: float, warmup: int, steps: int) -> float:
    """Their ``get_lr`` with ``min_lr = lr / 10`` and ``lr_decay_iters = steps``."""
    low = lr / 10
    if it < warmup:
        return lr * it / warmup
    if it > steps:
        return low
    ratio = (it - warmup) / max(1, steps - warmup)
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - low)


@torch.no_grad()
def evaluate(model, val: torch.Tensor, orders: int, to_bpb: float) -> dict[str, float]:
    """Their model's mean cross-entropy, left to right and over uniform orders, in bits/byte."""
    model.eval()
    ar = float(model(val, mode="AR")[1])
    rnd = sum(float(model(val, mode="Random")[1]) for _ in range(orders)) / orders
    model.train()
    return {"l2r_bpb": ar * to_bpb, "any_order_bpb": rnd * to_bpb}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ref", default=str(REPO / ".ref"), help="their repository, unpacked")
    p.add_argument("--out", default="runs/aogpt-reference-recipe")
    p.add_argument("--cache-dir", default="data_cache")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--eval-orders", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(args.ref).resolve()))
    from model_AOGPT_AdaLN6_NoRep_cond_128_trunc_qknorm import AOGPT, AOGPTConfig

    from anyorder.config import DataConfig
    from anyorder.data import BlockSampler, prepare, unigram_bits_per_byte
    from anyorder.data.synthetic import floor_bits_per_byte

    data_cfg = DataConfig(source="builtin:synthetic", tokenizer="bytes", cache_dir=args.cache_dir)
    data = prepare(data_cfg, args.seq_len, progress=False)
    to_bpb = 1.0 / (math.log(2) * data.bytes_per_token("val"))
    val = torch.from_numpy(data.split("val")[: args.eval_blocks].astype("int64"))
    sampler = BlockSampler(data.num_blocks("train"), args.batch_size, seed=0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = {"floor_bpb": floor_bits_per_byte(), "unigram_bpb": unigram_bits_per_byte(data),
            "args": vars(args), "threads": torch.get_num_threads()}  # fmt: skip
    print(json.dumps(head), flush=True)

    torch.manual_seed(1337)  # their trainer's seed; their Random_CL draws from python's random
    random.seed(1337)
    shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = AOGPT(AOGPTConfig(**shape, block_size=args.seq_len, vocab_size=257, bias=False))
    opt = model.configure_optimizers(0.1, args.lr, (0.9, 0.95), "cpu")
    t0 = time.time()
    with open(out / "metrics.jsonl", "w") as log:
        log.write(json.dumps(head) + "\n")
        for it in range(args.steps + 1):
            if it % args.eval_every == 0 or it == args.steps:
                row = {"step": it, **evaluate(model, val, args.eval_orders, to_bpb),
                       "elapsed_s": round(time.time() - t0, 1)}  # fmt: skip
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(json.dumps(row), flush=True)
            if it == args.steps:
                break
            for group in opt.param_groups:
                group["lr"] = their_lr(it, args.lr, args.warmup, args.steps)
            x = data.batch("train", sampler.next_indices()).long()
            _, loss = model(x, mode="Random_CL", random_ratio=0.9)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if it % 10 == 0:
                log.write(json.dumps({"step": it + 1, "loss": loss.item()}) + "\n")


if __name__ == "__main__":
    main()
