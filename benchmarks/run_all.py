"""Every benchmark, one after the other, then one table of the issue's targets.

    python benchmarks/run_all.py                          # the CPU sizes (what `make bench` runs)
    python benchmarks/run_all.py --quick                  # fewer sizes and rounds: a first look
    python benchmarks/run_all.py --paper --device cuda    # the papers' sizes on a GPU
    python benchmarks/run_all.py --paper --device cuda --dtype bf16 --graphs   # CUDA graphs

The CPU runs end with ``launch_overhead.py``: aten ops, kernel launches, sync points per
pass and attention shapes per generation of every sampler (the CPU proxy of a GPU's launch
overhead).

Each script writes its JSON under ``benchmarks/results/`` (``--out`` moves them) and prints
its own tables; this runner reads the ``targets`` of each JSON back and prints them together.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--paper", action="store_true", help="the papers' sizes (for a GPU)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--only", default="train_step,decode,decoder_vs_encoder,launch_overhead")
    ap.add_argument("--graphs", action="store_true", help="decoding with CUDA graphs")
    args = ap.parse_args()
    common = ["--device", args.device]
    size = ["--paper"] if args.paper else []
    dt = ["--dtype", args.dtype]
    graphs = ["--graphs"] if args.graphs else []
    runs = {  # output name: (script, arguments)
        "train_step": ("train_step", common + size + dt),
        "decode": ("decode", common + size + dt + graphs),
        "decoder_vs_encoder": ("decoder_vs_encoder", common + size + dt + graphs),
    }
    if not args.paper:  # a CPU proxy of GPU launch overhead (the paper runs are for a GPU)
        runs["launch_overhead"] = ("launch_overhead", [])
    if not args.paper:  # the curve is at the tiny size; the target row also at the small width
        runs["decoder_vs_encoder_4x768"] = (
            "decoder_vs_encoder",
            common + dt + ["--size", "4x768", "--lengths", "256", "--steps", "64,256"],
        )
    if args.quick:
        runs["train_step"][1].extend(["--repeats", "2", "--no-peak"])
        runs["decode"][1].extend(["--sizes", "tiny", "--repeats", "2"])
        runs["decoder_vs_encoder"][1].extend(["--lengths", "128,256", "--steps", "64,128,256"])
        runs.pop("decoder_vs_encoder_4x768", None)
        if "launch_overhead" in runs:
            runs["launch_overhead"][1].append("--no-train")
    summary = []
    for name, (script, arguments) in runs.items():
        if script not in args.only.split(","):
            continue
        out = args.out / f"{name}.json"
        extra = ["--json", str(out)]
        if script == "decoder_vs_encoder":
            extra += ["--plot", str(args.out / f"{name}.png")]
        cmd = [sys.executable, str(HERE / f"{script}.py"), *arguments, *extra]
        print(f"\n$ {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, check=True)
        print(f"({name}: {time.perf_counter() - start:.0f} s)", flush=True)
        for t in json.loads(out.read_text()).get("targets", []):
            summary.append((name, t))
    print("\nall targets")
    for name, t in summary:
        where = ", ".join(f"{k}={t[k]}" for k in ("size", "batch") if k in t)
        measured = t["measured"]
        measured = f"{measured:.3f}" if isinstance(measured, float) else str(measured)
        print(f"  {name:24s} {t['target']:62s} {where:20s} {measured:>6s}  {t['verdict']}")


if __name__ == "__main__":
    main()
