"""Memory and step time of LoRA (``train.lora``) against full fine-tuning, same model.

Each side runs in a process of its own (so each peak resident set is its own): it builds
the model, adds peft's adapters for ``lora``, builds the run's optimizer
(:func:`anyorder.training.setup.make_optimizer`: AdamW on what trains), then takes
``--warmup`` untimed and ``--steps`` timed optimizer steps (forward, backward, step) on
random tokens and random orders. It reports:

* ``model MB``: what building the model (and its adapters) added to the
  peak resident set, over the libraries (torch, anyorder and peft, imported on both sides);
* ``peak MB``: the peak resident set over the whole run, ``growth MB`` the difference: the
  gradients, the optimizer's state and the activations;
* ``ms/step`` on the chosen clock (``_bench.py``; CPU time by default, one thread).

The sides alternate, ``--rounds`` processes each (full, lora, full, lora, ...) so a burst of
load hits both alike; the best round of each is reported (``--stat``), every round is kept
in the JSON, with the machine's load average and CPU model.

    .venv/bin/python benchmarks/lora.py                     # 6 x 512, vocab 8192, n = 128
    .venv/bin/python benchmarks/lora.py --quick             # 2 x 128: a look in seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("full", "lora")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(args: argparse.Namespace) -> None:
    """One side: build, note the peak, train ``--steps`` timed steps, print JSON."""
    import peft.tuners.lora  # noqa: F401  (both sides: the libraries are not what is compared)
    import torch

    from anyorder.config import load_config
    from anyorder.models import build_model
    from anyorder.models.lora import add_adapters
    from anyorder.training.setup import make_optimizer

    gc.collect()
    libs = _peak_mb()
    torch.set_num_threads(args.threads)
    over = [
        f"model.kind={args.kind}",
        f"model.n_layer={args.n_layer}",
        f"model.d_model={args.d_model}",
        f"model.n_head={args.n_head}",
        f"model.vocab_size={args.vocab}",
        f"model.seq_len={args.seq_len}",
        f"train.lora.r={args.r if args.child == 'lora' else 0}",
        f"train.lora.targets=[{args.targets}]",
    ]
    cfg = load_config(None, over)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    if args.child == "lora":
        add_adapters(model, cfg.train.lora)
    model.train()
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(1)
    B, n = args.batch, args.seq_len
    x = torch.randint(0, args.vocab, (B, n), generator=g)
    order = torch.stack([torch.randperm(n, generator=g) for _ in range(B)])
    order = None if args.kind == "gpt" else order
    gc.collect()
    weights = _peak_mb()
    times = {"wall": [], "cpu": []}
    for i in range(args.warmup + args.steps):
        w0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        model.loss(x, order, None, generator=g).backward()
        opt.step()
        if i >= args.warmup:
            times["wall"].append(time.perf_counter() - w0)
            times["cpu"].append(time.process_time() - c0)
    peak = _peak_mb()
    print(json.dumps({"mode": args.child, "params": sum(p.numel() for p in model.parameters()),
                      "trained": trained, "libs_mb": libs, "weights_mb": weights, "peak_mb": peak,
                      "growth_mb": peak - weights, "times": times}))  # fmt: skip


def run_side(mode: str, args: argparse.Namespace, passthrough: list[str]) -> dict:
    src = Path(__file__).resolve().parents[1] / "src"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, *passthrough]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(src)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def parse() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="aogpt", choices=("gpt", "aogpt", "armd", "mdm"))
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--r", type=int, default=8, help="the adapters' rank")
    ap.add_argument("--targets", default="attn,mlp", help="train.lora.targets")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per process")
    ap.add_argument("--rounds", type=int, default=2, help="processes per side, alternating")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="see _bench.py")
    ap.add_argument("--stat", choices=["min", "median"], default="min", help="see _bench.py")
    ap.add_argument("--quick", action="store_true", help="2 x 128, vocab 256, n = 64")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/lora.json"))
    args = ap.parse_args()
    if args.quick:
        args.n_layer, args.d_model, args.n_head, args.vocab, args.seq_len = 2, 128, 4, 256, 64
    keys = ("kind", "n_layer", "d_model", "n_head", "vocab", "seq_len", "batch", "r",
            "targets", "warmup", "steps", "threads")  # fmt: skip
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    return args, passthrough


def main() -> None:
    import statistics

    from _bench import print_table, write_json

    args, passthrough = parse()
    if args.child:
        child(args)
        return
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    runs = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run_side(mode, args, passthrough))
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    pick = min if args.stat == "min" else statistics.median
    rows, best = [], {}
    for mode in MODES:
        rs = runs[mode]
        ms = pick(t for r in rs for t in r["times"][args.clock]) * 1000
        peak, growth = min(r["peak_mb"] for r in rs), min(r["growth_mb"] for r in rs)
        best[mode] = {"ms_per_step": ms, "peak_mb": peak, "growth_mb": growth}
        model = min(r["weights_mb"] - r["libs_mb"] for r in rs)
        best[mode]["model_mb"] = model
        rows.append([mode, f"{rs[0]['trained']:,}", model, peak, growth, ms])
    ratio = {k: best["lora"][k] / best["full"][k] for k in ("ms_per_step", "peak_mb", "growth_mb")}
    rows.append(["lora / full", "", "", ratio["peak_mb"], ratio["growth_mb"], ratio["ms_per_step"]])
    title = (
        f"{args.kind} {args.n_layer} x {args.d_model}, vocab {args.vocab}, n = {args.seq_len}, "
        f"batch {args.batch}, fp32, {args.threads} thread(s), LoRA r={args.r} on {args.targets}; "
        f"{cpu_model()}; load {' '.join(load_before)} -> {' '.join(load_after)}"
    )
    header = ["mode", "trained", "model MB", "peak MB", "growth MB", f"ms/step ({args.clock})"]
    print_table(title, header, rows)
    write_json(
        args.json,
        {
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
            "cpu": cpu_model(),
            "load_before": load_before,
            "load_after": load_after,
            "best": best,
            "lora_over_full": ratio,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
