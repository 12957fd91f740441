"""Recipe sweep: train short runs that differ in one setting, report bits/byte and CPU time.

    python benchmarks/recipe_sweep.py --out runs/sweep NAME -- key=value ...   # one recipe
    python benchmarks/recipe_sweep.py --out runs/sweep --table                 # the results

Each recipe is one ``anyorder train`` process (one thread unless ``--threads``) started
fresh in ``OUT/NAME``; what it reached (the last validation of its ``summary.json``) and
what it cost (the child's user + system CPU seconds, which load on a shared machine
inflates far less than wall clock) are appended to ``OUT/results.jsonl``. Compare recipes
at equal steps and tokens, or at equal CPU seconds when their shapes differ; the recipe
section of docs/results.md was made this way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

BASE = [
    "train.device=cpu",
    "train.dtype=bf16",
    "train.ema=0",
    "train.ckpt_every=1000000",
    "train.keep_last=1",
    "train.log_every=25",
]


def run(
    out: Path, name: str, overrides: list[str], threads: int, config: str | None, exe: list[str]
) -> dict:
    run_dir = out / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    if config is None:
        config = str(out / "empty.yaml")
        Path(config).write_text("{}\n")
    cmd = [*exe, "train", config]
    cmd += [*BASE, *overrides, f"train.out_dir={run_dir}", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    t = summary["config"]["train"]
    row = {
        "name": name,
        "overrides": overrides,
        "env": {k: v for k, v in os.environ.items() if k == "PATCH"},
        "steps": summary["step"],
        "tokens": summary["step"] * t["batch_size"] * summary["config"]["model"]["seq_len"],
        "params": summary["params"],
        "cpu_s": cpu,
        "wall_s": wall,
        "threads": threads,
        "l2r_bpb": summary["val"].get("val/l2r_bpb"),
        "ao_bpb": summary["val"].get("val/ao_bpb"),
        "ao_se": summary["val"].get("val/ao_bpb_se"),
        "unigram_bpb": summary["unigram_bpb"],
    }
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def table(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    print("| recipe | steps | tokens | params | CPU s | l2r bits/byte | any-order bits/byte |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ao = "n/a" if r["ao_bpb"] is None else f"{r['ao_bpb']:.3f} ± {r['ao_se']:.3f}"
        print(
            f"| {r['name']} | {r['steps']} | {r['tokens']:,} | {r['params'] / 1e6:.2f}M | "
            f"{r['cpu_s']:.0f} | {r['l2r_bpb']:.3f} | {ao} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("name", nargs="?", help="recipe name (its run folder under --out)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    ap.add_argument("--out", type=Path, default=Path("runs/sweep"))
    ap.add_argument("--config", default=None, help="a YAML config to start from")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", action="store_true", help="print the results table")
    ap.add_argument(
        "--exe",
        default=str(Path(sys.executable).parent / "anyorder"),
        help="the command that takes `train CONFIG overrides` (a patched entry point, say)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.name:
        exe = args.exe.split()
        row = run(args.out, args.name, args.overrides, args.threads, args.config, exe)
        print(json.dumps(row))
    if args.table:
        table(args.out)


if __name__ == "__main__":
    main()
