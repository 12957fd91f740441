"""A training step's memory and time with and without activation checkpointing
(``train.activation_checkpointing``), side by side.

Each (kind, checkpointing) pair runs in a process of its own: build the model, allocate its
gradients and AdamW's state (a step at lr 0), note the peak, then run ``--steps`` training
steps (loss, backward, AdamW). The figures are the growth of the peak resident set over the
step (``ru_maxrss``: activations and whatever backward allocates; the weights, gradients
and optimizer state are already counted in the base) and the best step's wall and CPU
time; with ``--device cuda`` also ``torch.cuda.max_memory_allocated`` over the same base.
The pairs alternate (plain, checkpointed, plain, ...) so that both see the same load.

    .venv/bin/python benchmarks/activation_memory.py                 # 12 x 512, n = 1024
    .venv/bin/python benchmarks/activation_memory.py --quick         # 4 x 128, n = 256
    .venv/bin/python benchmarks/activation_memory.py --device cuda --dtype bf16 --batch 8
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(args: argparse.Namespace) -> None:
    """One process: the model, its state, then the measured steps; prints one JSON line."""
    import torch

    from anyorder import build_model, preset
    from anyorder.memory import activation_bytes

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = preset("tiny", kind=args.kind, vocab_size=args.vocab, seq_len=args.seq_len,
                 n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model)  # fmt: skip
    model = build_model(cfg).to(device).train()
    model.checkpoint_blocks = args.ckpt
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():  # gradients and AdamW's moments exist before the base
        p.grad = torch.zeros_like(p)
    opt.step()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(device)
    order = None
    if args.kind != "gpt":
        order = torch.stack([torch.randperm(args.seq_len, generator=g) for _ in tokens])
        order = order.to(device)
    half = args.dtype == "bf16"
    cuda = device.type == "cuda"
    # before the base: the first checkpointed call imports torch._dynamo (tens of MB), and
    # the first step's one-off allocations, on 8 tokens
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
        warm = None if order is None else torch.randperm(8, generator=g)[None].to(device)
        model.loss(tokens[:1, :8], warm, generator=torch.Generator().manual_seed(1)).backward()
    opt.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    base = _peak_mb()
    walls, cpus = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=half):
            loss = model.loss(tokens, order, generator=torch.Generator().manual_seed(1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    out = {
        "kind": args.kind,
        "ckpt": args.ckpt,
        "params": sum(p.numel() for p in model.parameters()),
        "base_mb": base,
        "growth_mb": _peak_mb() - base,
        "wall_s": min(walls),
        "cpu_s": min(cpus),
        "loss": float(loss),
        "estimate_mb": activation_bytes(
            cfg, args.batch * args.seq_len, checkpointing=args.ckpt, half=half
        )
        / 2**20,
    }
    if cuda:
        out["cuda_growth_mb"] = (torch.cuda.max_memory_allocated() - cuda_base) / 2**20
    print(json.dumps(out))


def run(args: argparse.Namespace, kind: str, ckpt: bool) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind]
    for key in ("n_layer", "d_model", "n_head", "seq_len", "vocab", "batch", "steps",
                "threads", "device", "dtype"):  # fmt: skip
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    cmd += ["--ckpt"] if ckpt else []
    env = {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(SRC), "PATH": ""}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{kind} ckpt={ckpt} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kinds", default="gpt,armd", help="comma-separated model kinds")
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per process")
    ap.add_argument("--rounds", type=int, default=1, help="processes per (kind, setting)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--quick", action="store_true", help="4 x 128, n = 256")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.n_layer, args.d_model, args.n_head, args.seq_len = 4, 128, 4, 256
    if args.child:
        args.kind = args.child
        child(args)
        return
    print(
        f"one training step, {args.n_layer} x {args.d_model}, n = {args.seq_len}, batch "
        f"{args.batch}, vocab {args.vocab}, {args.dtype}, {args.device}, {args.threads} "
        f"thread(s); best of {args.steps} steps x {args.rounds} process(es)"
    )
    rows = []
    for kind in args.kinds.split(","):
        got: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.rounds):
            for ckpt in (False, True):  # alternate: both see the same load
                got[ckpt].append(run(args, kind, ckpt))
        best = {c: min(rs, key=lambda r: r["growth_mb"]) for c, rs in got.items()}
        for c in (False, True):
            best[c]["wall_s"] = min(r["wall_s"] for r in got[c])
            best[c]["cpu_s"] = min(r["cpu_s"] for r in got[c])
            rows.append(best[c])
        plain, ckpt = best[False], best[True]
        cuda = ""
        if "cuda_growth_mb" in plain:
            cuda = (f", CUDA {plain['cuda_growth_mb']:.0f} -> {ckpt['cuda_growth_mb']:.0f} MB "
                    f"({ckpt['cuda_growth_mb'] / plain['cuda_growth_mb']:.2f}x)")  # fmt: skip
        print(
            f"  {kind:5s} {plain['params'] / 1e6:.1f}M params: peak RSS growth "
            f"{plain['growth_mb']:.0f} -> {ckpt['growth_mb']:.0f} MB "
            f"({ckpt['growth_mb'] / plain['growth_mb']:.2f}x; lower bounds "
            f"{plain['estimate_mb']:.0f} -> {ckpt['estimate_mb']:.0f} MB), step "
            f"{plain['wall_s']:.2f} -> {ckpt['wall_s']:.2f} s wall "
            f"({ckpt['wall_s'] / plain['wall_s']:.2f}x), {plain['cpu_s']:.2f} -> "
            f"{ckpt['cpu_s']:.2f} s CPU ({ckpt['cpu_s'] / plain['cpu_s']:.2f}x){cuda}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
