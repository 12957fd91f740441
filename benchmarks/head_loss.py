"""The head's cross-entropy: the plain path (full logits, ``F.cross_entropy``) against
``layers/head_loss.py`` (chunks, gradients taken in forward), side by side in one run.

For each shape: which path the models' loss takes there by default (plain up to
``PLAIN_UP_TO`` logits), the loss and its backward timed round-robin, and what autograd
keeps between them (bytes saved for backward, measured with ``saved_tensors_hooks``; on
CUDA also the peak memory of the call beyond its inputs).

    PYTHONPATH=src python benchmarks/head_loss.py                 # the CPU shapes
    PYTHONPATH=src python benchmarks/head_loss.py --device cuda --paper --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from _bench import add_common, machine, print_table, setup, summary, timed, write_json
from anyorder.layers import head_loss
from anyorder.layers.head_loss import head_cross_entropy


def plain(h, w, b, y, wt):
    """What the loss computed before: the full logits, upcast, cross-entropy."""
    logits = F.linear(h, w, b).float()
    return (F.cross_entropy(logits, y, reduction="none") * wt).sum()


def chunked(h, w, b, y, wt):
    """``head_cross_entropy`` in chunks whatever the size (its own default takes the plain
    path up to ``PLAIN_UP_TO`` logits)."""
    keep, head_loss.PLAIN_UP_TO = head_loss.PLAIN_UP_TO, 0
    try:
        return head_cross_entropy(h, w, b, y, wt)
    finally:
        head_loss.PLAIN_UP_TO = keep


def saved_bytes(fn, *args) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    skip = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return sum(v for k, v in seen.items() if k not in skip)


def measure(shape: tuple[int, int, int], device: torch.device, ctx, args) -> dict:
    """Both paths at one (rows, d, V): times, bytes kept for backward, CUDA peaks."""
    N, d, V = shape
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, d, generator=g).to(device).requires_grad_()
    w = (0.02 * torch.randn(V, d, generator=g)).to(device).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g).to(device)
    wt = torch.full((N,), 1.0 / N, device=device)
    fns = {"plain": plain, "chunked": chunked}

    def step(fn) -> None:
        with ctx:
            loss = fn(h, w, None, y, wt)
        loss.backward()
        h.grad = w.grad = None

    times = {k: {"wall": [], "cpu": []} for k in fns}
    for fn in fns.values():
        step(fn)  # warm-up
    for _ in range(args.repeats):
        for k, fn in fns.items():
            wall, cpu, _ = timed(lambda fn=fn: step(fn), device)
            times[k]["wall"].append(wall)
            times[k]["cpu"].append(cpu)
    sec = {k: summary(times[k], args.clock, args.stat) for k in fns}
    with ctx:
        kept = {k: saved_bytes(fn, h, w, None, y, wt) for k, fn in fns.items()}
    peak = {}
    if device.type == "cuda":
        for k, fn in fns.items():
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(fn)
            torch.cuda.synchronize()
            peak[k] = torch.cuda.max_memory_allocated() - base
    default = "plain" if N * V <= head_loss.PLAIN_UP_TO else "chunked"
    ms = {k: 1e3 * v for k, v in sec.items()}
    return dict(N=N, d=d, V=V, default=default, ms=ms, saved_bytes=kept,
                peak_bytes=peak or None, time_ratio=sec["chunked"] / sec["plain"])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paper", action="store_true", help="8 x 1024 rows, d 768, 50,257 ids")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="autocast")
    ap.add_argument("--repeats", type=int, default=10)
    add_common(ap, "benchmarks/results/head_loss.json")
    args = ap.parse_args()
    device = setup(args)
    shapes = (
        [(8 * 1024, 768, 50257)]
        if args.paper  # else the demo's head (16 x 128 rows, 257 ids), GPT-2's vocabulary
        else [(2048, 128, 257), (512, 128, 50257)]
    )
    ctx = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.dtype == "bf16"
        else contextlib.nullcontext()
    )
    out = [measure(shape, device, ctx, args) for shape in shapes]
    rows = []
    for r in out:
        kept, peak = r["saved_bytes"], r["peak_bytes"]
        rows.append(
            [f"{r['N']} x {r['d']} -> {r['V']}", r["default"], r["ms"]["plain"], r["ms"]["chunked"]]
            + [r["time_ratio"], kept["plain"] / 2**20, kept["chunked"] / 2**20]
            + ([peak["plain"] / 2**20, peak["chunked"] / 2**20] if peak else ["-", "-"])
        )
    print_table(
        f"head cross-entropy + backward, {args.dtype}, {device} ({args.clock} clock, "
        f"{args.stat} of {args.repeats})",
        [
            "rows x d -> V",
            "the loss takes",
            "plain ms",
            "chunked ms",
            "time x",
            "plain kept MB",
            "chunked kept MB",
        ]
        + ["plain peak MB", "chunked peak MB"],
        rows,
    )
    write_json(args.json, {"machine": machine(), "dtype": args.dtype, "rows": out})


if __name__ == "__main__":
    main()
