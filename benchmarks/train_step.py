"""Training-step time, stored activations and FLOPs: aogpt and armd against gpt, one run.

Every model is built at the same width and depth and timed round-robin (gpt, aogpt, armd,
gpt, ...) so that machine noise hits all sides alike; the table reports the median step
time, its ratio to gpt, the FLOP ratio counted from the architecture
(:mod:`anyorder.flops`), and the ratio of bytes saved for backward (measured with
``saved_tensors_hooks``: the activation memory a training step stores).

    python benchmarks/train_step.py                  # small width, 4 layers, n=256, batch 4
    python benchmarks/train_step.py --dtype bf16     # bf16 autocast (a win on this CPU)
    python benchmarks/train_step.py --paper --device cuda   # 12 layers, n=1024, batch 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from anyorder import build_model, orders, preset
from anyorder.flops import train_flops_per_token


def saved_bytes(model, tokens, order, blocks) -> int:
    """Bytes of tensors autograd saves for backward in one forward pass (deduplicated)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(tokens, order, blocks)
    return sum(v for k, v in seen.items() if k not in params)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--paper", action="store_true", help="12 layers, n=1024, GPT-2 vocabulary")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/train_step.json"))
    args = ap.parse_args()
    if args.paper:
        args.layers, args.seq_len, args.vocab, args.batch = 12, 1024, 50257, 8
    device = torch.device(args.device)
    L = args.layers
    variants = {
        "gpt": dict(kind="gpt"),
        "aogpt": dict(kind="aogpt"),
        f"armd L2s={L // 2}": dict(kind="armd", l2s=max(1, L // 2)),
        f"armd L2s={max(1, L // 4)}": dict(kind="armd", l2s=max(1, L // 4)),
    }
    shape = dict(
        n_layer=L,
        d_model=args.d_model,
        n_head=args.heads,
        seq_len=args.seq_len,
        vocab_size=args.vocab,
    )
    g = torch.Generator().manual_seed(0)
    n, B = args.seq_len, args.batch
    tokens = torch.randint(0, args.vocab, (B, n), generator=g).to(device)
    order = orders.uniform(B, n, g).order.to(device)
    models, opts, cfgs = {}, {}, {}
    for name, kw in variants.items():
        torch.manual_seed(0)
        cfgs[name] = preset("tiny", **shape, **kw)
        models[name] = build_model(cfgs[name]).to(device).train()
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def step(name: str) -> float:
        model, opt = models[name], opts[name]
        o = None if cfgs[name].kind == "gpt" else order
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            loss = model.loss(tokens, o)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for name in variants:  # warm-up
        step(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name in variants:
            times[name].append(step(name))
    mem = {}
    for name in variants:
        with autocast:
            mem[name] = saved_bytes(
                models[name], tokens, None if cfgs[name].kind == "gpt" else order, None
            )
    base_t = statistics.median(times["gpt"])
    base_f = train_flops_per_token(cfgs["gpt"], n)
    rows = []
    print(
        f"train step: {L} layers, d={args.d_model}, n={n}, batch {B}, {args.dtype}, {device.type}, "
        f"median of {args.repeats}"
    )
    print(
        f"{'model':16s} {'ms/step':>9s} {'time x':>7s} {'FLOP x':>7s} {'t/F':>6s} "
        f"{'act MB':>8s} {'act x':>6s}"
    )
    for name in variants:
        t = statistics.median(times[name])
        f = train_flops_per_token(cfgs[name], n) / base_f
        row = dict(
            model=name,
            ms_per_step=1000 * t,
            time_ratio=t / base_t,
            flop_ratio=f,
            time_over_flop=(t / base_t) / f,
            activation_mb=mem[name] / 2**20,
            activation_ratio=mem[name] / mem["gpt"],
            tokens_per_s=B * n / t,
        )
        rows.append(row)
        print(
            f"{name:16s} {row['ms_per_step']:9.1f} {row['time_ratio']:7.3f} {f:7.3f} "
            f"{row['time_over_flop']:6.3f} {row['activation_mb']:8.1f} "
            f"{row['activation_ratio']:6.3f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, rows=rows), indent=2)
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
