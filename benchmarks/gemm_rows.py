"""What a linear layer costs for M = 1..8 rows: the floor of batch-1 decoding on this CPU.

Decoding at batch 1 multiplies a handful of rows by every weight matrix: one row per token
for a GPT, two for ARMD's content and query streams, ``2S`` for strided decoding with S
streams. Where one pass is bound by reading the weights, M rows cost about what one row
costs; where the BLAS loops over rows, they cost M times as much. This prints the time of
``F.linear`` on the trunk's weight shapes (several matrices in turn, so that they come from
memory as in a model) for M = 1, 2, 3, 4, 8, relative to M = 1, and beside it the same
product from a prepacked copy of each weight (oneDNN's layout for one row or for several,
what the decoders read on the CPU: ``layers/linear.py``), over ``F.linear``'s time at that
M (every weight copied, whatever its size: the decoders leave out those of at most
``MIN_WEIGHT`` elements).

    python benchmarks/gemm_rows.py                 # d = 256 (tiny) and 768 (small width)
    python benchmarks/gemm_rows.py --widths 2048 --rows 1,2,4,8,16,64   # Llama-3.2-1B
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from anyorder.layers.linear import every_copy


def cost(x: torch.Tensor, weights: list[torch.Tensor], reps: int, op=F.linear) -> float:
    """Best of 3 of the mean CPU seconds of one ``op(x, w)`` over ``weights``."""
    best = float("inf")
    for _ in range(3):
        for w in weights:
            op(x, w)
        start = time.process_time()
        for _ in range(reps):
            for w in weights:
                op(x, w)
        best = min(best, (time.process_time() - start) / reps / len(weights))
    return best


def prepacked_op(weights: list[torch.Tensor]):
    """``op(x, w)`` reading each weight's prepacked copy (made at its first call, which
    ``cost`` leaves out of the timing)."""
    from anyorder.layers.linear import Linear, prepacked, prepacked_for

    layers = {}
    for w in weights:
        layer = Linear(w.shape[1], w.shape[0], bias=False)
        layer.weight.data = w
        layers[id(w)] = (layer, prepacked_for(layer))

    def op(x, w):
        layer, packs = layers[id(w)]
        with torch.no_grad(), prepacked(packs):
            return layer(x)

    return op


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--widths", default="256,768")
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-prepacked", dest="prepacked", action="store_false")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    print(f"F.linear, fp32, {args.threads} thread(s): microseconds (x the cost of one row)")
    for d in (int(w) for w in args.widths.split(",")):
        for name, (out, inp) in {
            "qkv": (3 * d, d),
            "mlp up": (4 * d, d),
            "mlp down": (d, 4 * d),
        }.items():
            weights = [torch.randn(out, inp) for _ in range(6)]
            reps = max(3, int(2e8 / (out * inp * 6)))
            t = {m: cost(torch.randn(m, inp), weights, reps) for m in rows}
            cells = "  ".join(f"M={m}: {1e6 * t[m]:6.0f} ({t[m] / t[rows[0]]:.2f}x)" for m in rows)
            print(f"d={d:4d} {name:8s} {cells}")
            if args.prepacked:
                op = prepacked_op(weights)
                with every_copy():  # whatever the weight's size, unraced
                    p = {m: cost(torch.randn(m, inp), weights, reps, op) for m in rows}
                cells = "  ".join(
                    f"M={m}: {1e6 * p[m]:6.0f} ({p[m] / t[m]:.2f}x F.linear)" for m in p
                )
                print(f"{'':6s} {'prepacked':9s}{cells}")


if __name__ == "__main__":
    main()
