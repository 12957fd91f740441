"""Where the time goes: torch.profiler over a training step or a decode, grouped by kind of op.

Every aten op's self CPU time is put in one bucket (matmul, attention, norm, elementwise,
indexing/copies, sampling, other) and the table prints each bucket's share, the number of
ops launched per step, and the top ops. For the Python side, run the same workload under
py-spy (``pip install py-spy``)::

    python benchmarks/profile_ops.py train --kind armd            # one training step, 4x768, n=256
    python benchmarks/profile_ops.py decode --kind gpt --size tiny --batch 1
    python benchmarks/profile_ops.py decode --kind armd --streams 4          # SBP, S=4
    py-spy record -r 500 -o decode.svg -- python benchmarks/profile_ops.py decode --kind aogpt
"""

from __future__ import annotations

import argparse
import warnings
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from anyorder import build_model, orders, preset
from anyorder.sample import sequential_sample, strided_sample

BUCKETS = [
    ("matmul", ("mm", "addmm", "bmm", "linear", "matmul")),
    ("attention", ("scaled_dot_product", "flash_attention", "flex_attention")),
    ("norm", ("rms_norm", "layer_norm", "rsqrt", "pow", "mean")),
    ("sampling", ("multinomial", "softmax", "exponential", "topk", "sort", "cumsum")),
    ("indexing/copies", ("index", "gather", "scatter", "embedding", "cat", "copy", "clone")),
    ("elementwise", ("add", "mul", "sub", "div", "gelu", "silu", "where", "fill", "masked")),
]
SIZES = {"tiny": dict(), "4x768": dict(n_layer=4, d_model=768, n_head=12)}


def bucket(name: str) -> str:
    op = name.removeprefix("aten::")
    for label, keys in BUCKETS:
        if any(k in op for k in keys):
            return label
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=["train", "decode"])
    ap.add_argument("--kind", default="armd", choices=["gpt", "aogpt", "armd"])
    ap.add_argument(
        "--size", default=None, help="tiny or 4x768 (default: train 4x768, decode tiny)"
    )
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=None, help="default: train 4, decode 1")
    ap.add_argument("--streams", type=int, default=None, help="decode: armd strided S")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    train = args.what == "train"
    size = args.size or ("4x768" if train else "tiny")
    B = args.batch or (4 if train else 1)
    n = args.seq_len
    torch.manual_seed(0)
    cfg = preset("tiny", kind=args.kind, seq_len=n, **SIZES[size])
    model = build_model(cfg).train(train)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, n), generator=g)
    order = None if args.kind == "gpt" else orders.uniform(B, n, g).order

    def run():
        if train:
            model.loss(tokens, order).backward()
            model.zero_grad(set_to_none=True)
            return 1
        gen = torch.Generator().manual_seed(0)
        if args.streams:
            return strided_sample(model, n, args.streams, batch=B, generator=gen).forward_passes
        return sequential_sample(model, n, batch=B, generator=gen).forward_passes

    amp = torch.autocast("cpu", torch.bfloat16, enabled=args.dtype == "bf16")
    with amp:
        run()  # warm-up
    with amp, profile(activities=[ProfilerActivity.CPU]) as prof:
        steps = run()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    by = defaultdict(lambda: [0.0, 0])
    for e in events:
        b = by[bucket(e.key)]
        b[0] += e.self_cpu_time_total
        b[1] += e.count
    what = f"{args.what} {args.kind} {size} n={n} batch {B} {args.dtype}"
    if args.streams:
        what += f" S={args.streams}"
    unit = "step" if train else "pass"
    print(f"\n{what}: {total / 1e3:.0f} ms of aten self time, {steps} {unit}(s)")
    print(f"{'bucket':18s} {'share':>7s} {'ms/' + unit:>10s} {'ops/' + unit:>9s}")
    for label, (t, c) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"{label:18s} {100 * t / total:6.1f}% {t / 1e3 / steps:10.3f} {c / steps:9.1f}")
    print(f"\ntop {args.top} ops by self time")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        share = 100 * e.self_cpu_time_total / total
        print(f"  {e.key:52s} {share:6.1f}%  {e.count / steps:7.1f}/{unit}")


if __name__ == "__main__":
    main()
