"""Training speed with and without bf16 units: fp32, bf16 and ``auto`` for every shipped tiny
config and configs/demo.yaml, on this CPU and on this CPU limited to AVX2, side by side.

Most laptops have no bf16 units (no avx512_bf16, no AMX): bf16 autocast there converts every
operand and runs 7-13x slower than fp32. Such a CPU is emulated on one that has them by
limiting the kernels' instruction set, ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``
(read when torch starts, so every CPU kind runs in a child process of its own; the first
table also shows the probe's bf16/fp32 ratio, which says whether the limit took effect).

For each config the training step runs as ``anyorder train`` runs it (the config's model,
``LossModule``, ``make_optimizer``, its order schedule at step ``--at`` of the run, gradient
clipping) in three arms timed round-robin in one process: ``train.dtype`` fp32, bf16 and
auto (:func:`anyorder.precision.use_bf16` deciding, its cache in a temporary folder so the
probe really runs). Batches are random tokens (the speed does not depend on them). The
``fp32, bf16 Muon`` arm of a Muon config is the step before that choice (fp32 with torch's
bf16 Newton-Schulz iteration, what a CPU without bf16 units ran). The second table times
tiny-armd's optimizer step alone (Muon on the layers' matrices, AdamW on
the rest): Newton-Schulz in bf16 (torch's, the only one before) against fp32.

    python benchmarks/cpu_dtype.py                       # both CPU kinds, all configs
    python benchmarks/cpu_dtype.py --kinds avx2 --configs tiny-armd --rounds 2

Ratios are measured side by side; ``cat /proc/loadavg`` is printed beside each CPU kind's
rows (the machine may be shared). One thread and the CPU clock by default (see _bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from _bench import add_common, machine, print_table, round_robin, setup, summary, write_json

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ["tiny-gpt", "tiny-aogpt", "tiny-armd", "tiny-mdm", "demo"]
KINDS = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
ROUNDS = {"demo": 8}
"""Rounds per arm in multiples of --rounds: the demo's step is ~20x cheaper than a tiny one's."""


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


def bf16_flags() -> str:
    text = Path("/proc/cpuinfo").read_text()
    flags = sorted({f for f in text.split() if f in ("avx512_bf16", "amx_bf16", "amx_tile")})
    return " ".join(flags) or "none"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ----------------------------------------------------------------------------- the child


def arm(cfg, device, at: int, muon_ns: torch.dtype | None = None):
    """One training step of ``cfg`` as the trainer runs it: a closure and the dtype it ran.
    ``muon_ns`` overrides the dtype of Muon's Newton-Schulz iteration (the trainer's choice
    by default)."""
    from anyorder.models import build_model
    from anyorder.orders import OrderSampler
    from anyorder.training.setup import LossModule, autocast_context, make_optimizer

    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).train()
    run, opt = LossModule(model), make_optimizer(model, cfg, device)
    if muon_ns is not None:
        opt.ns_dtype = muon_ns
    ctx = autocast_context(cfg, device)
    B, n, V = cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, n), generator=gen)
    order = blocks = None
    if cfg.model.kind != "gpt":
        o = OrderSampler(cfg.order, cfg.train.steps)(B, n, at * cfg.train.steps // 100, gen)
        order, blocks = o.order, o.model_blocks
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        with ctx:
            loss = run(x, order, blocks, gen)
        loss.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, "bf16" if isinstance(ctx, torch.autocast) else "fp32"


def load(name: str, dtype: str | None = None):
    """The shipped config, on the CPU, with ``train.dtype`` overridden unless None."""
    from anyorder.config import load_config

    over = ["train.device=cpu"] + ([f"train.dtype={dtype}"] if dtype else [])
    return load_config(REPO / "configs" / f"{name}.yaml", over)


def child(args, device) -> dict:
    from anyorder import precision

    out = {
        "kind": args.child,
        "env": {k: os.environ.get(k, "") for k in precision.ISA_VARIABLES},
        "capability": torch.backends.cpu.get_cpu_capability(),
        "configs": {},
    }
    for name in args.configs.split(","):
        before = loadavg()
        width = load(name, "auto").model.d_model
        probe = precision.bf16_cost(width)  # a fresh cache: measured here
        fns, picked = {}, {}
        for dtype in args.arms.split(","):
            cfg = load(name, dtype)
            fns[dtype], picked[dtype] = arm(cfg, device, args.at)
        if cfg.train.optimizer == "muon":  # before issue 31: fp32 with torch's bf16 iteration
            fns["fp32, bf16 Muon"], _ = arm(load(name, "fp32"), device, args.at, torch.bfloat16)
        times, _ = round_robin(fns, ROUNDS.get(name, 1) * args.rounds, device)
        tokens = cfg.train.batch_size * cfg.model.seq_len
        tps = {d: tokens / summary(times[d], args.clock, args.stat) for d in fns}
        out["configs"][name] = {
            "shipped": load(name).train.dtype,
            "width": width,
            "probe_bf16_over_fp32": probe,
            "auto_picks": picked["auto"],
            "tokens_per_s": tps,
            "rounds": times,
            "load_before": before,
            "load_after": loadavg(),
        }
        print(f"  {args.child} {name}: {json.dumps({k: round(v) for k, v in tps.items()})}",
              file=sys.stderr, flush=True)  # fmt: skip
    if "tiny-armd" in args.configs.split(","):
        out["muon"] = muon_steps(args, device)
    return out


def muon_steps(args, device) -> dict:
    """tiny-armd's optimizer step alone, Newton-Schulz in bf16 (torch's) and in fp32."""
    from anyorder.models import build_model
    from anyorder.training.muon import MuonAdamW
    from anyorder.training.setup import make_optimizer

    cfg = load("tiny-armd", "fp32")
    fns = {}
    before = loadavg()
    for ns in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        model = build_model(cfg.model).to(device)
        opt = make_optimizer(model, cfg, device)
        assert isinstance(opt, MuonAdamW)
        opt.ns_dtype = ns
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        fns[str(ns).removeprefix("torch.")] = opt.step
    times, _ = round_robin(fns, args.rounds * 2, device)
    return {
        "ms": {k: 1e3 * summary(times[k], args.clock, args.stat) for k in fns},
        "rounds": times,
        "load_before": before,
        "load_after": loadavg(),
    }


# ----------------------------------------------------------------------------- the parent


def parent(args) -> None:
    results = {"machine": {**machine(), "cpu": cpu_name(), "bf16_flags": bf16_flags()}}
    results["kinds"] = {}
    for kind in args.kinds.split(","):
        cache = tempfile.TemporaryDirectory()  # a fresh probe cache: the probe runs
        env = {**os.environ, **KINDS[kind], "ANYORDER_CACHE": cache.name}
        env.pop("ANYORDER_CPU_BF16", None)
        for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
            if k not in KINDS[kind]:
                env.pop(k, None)
        cmd = [sys.executable, __file__, "--child", kind, "--configs", args.configs,
               "--rounds", str(args.rounds), "--arms", args.arms, "--at", str(args.at), "--threads",
               str(args.threads), "--clock", args.clock or "cpu", "--stat", args.stat]  # fmt: skip
        print(f"{kind}: load {loadavg()}", file=sys.stderr, flush=True)
        with cache:
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        results["kinds"][kind] = json.loads(done.stdout)
    report(results)
    write_json(args.json, results)


def describe(kind: str, res: dict) -> str:
    if kind == "native":
        return f"this CPU ({res['capability']})"
    return "limited to AVX2 (" + " ".join(f"{k}={v}" for k, v in res["env"].items()) + ")"


def report(results: dict) -> None:
    nan = float("nan")
    m = results["machine"]
    print(f"CPU: {m['cpu']}; bf16 flags: {m['bf16_flags']}; torch {m['torch']}; "
          f"{m['threads']} thread(s)")  # fmt: skip
    rows, muon = [], []
    for kind, res in results["kinds"].items():
        for name, r in res["configs"].items():
            tps = {"fp32": nan, "bf16": nan, "auto": nan, **r["tokens_per_s"]}
            best = max(tps["fp32"], tps["bf16"] if tps["bf16"] == tps["bf16"] else 0.0)
            shipped = r.get("shipped") or load(name).train.dtype
            rows.append([name, describe(kind, res), tps["fp32"], tps["bf16"],
                         tps["bf16"] / tps["fp32"], r["probe_bf16_over_fp32"], r["auto_picks"],
                         tps["auto"], tps["auto"] / best, shipped, tps[shipped] / best,
                         tps.get("fp32, bf16 Muon", "-"),
                         f"{r['load_before']} / {r['load_after']}"])  # fmt: skip
        if "muon" in res:
            ms = res["muon"]["ms"]
            avg = f"{res['muon']['load_before']} / {res['muon']['load_after']}"
            muon.append([describe(kind, res), ms["bfloat16"], ms["float32"],
                         ms["bfloat16"] / ms["float32"], avg])  # fmt: skip
    print_table(
        "training tokens/s by train.dtype (auto / faster, shipped / faster: target >= 0.9)",
        ["config", "CPU", "fp32", "bf16", "bf16/fp32", "probe", "auto", "auto tok/s",
         "auto/faster", "shipped", "shipped/faster", "fp32, bf16 Muon",
         "loadavg before / after"],
        rows,
    )  # fmt: skip
    if muon:
        print_table(
            "tiny-armd optimizer step (ms): Newton-Schulz in bf16 (torch's) vs fp32",
            ["CPU", "bf16 NS", "fp32 NS", "bf16/fp32", "loadavg before / after"],
            muon,
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common(ap, "benchmarks/results/cpu_dtype.json")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--kinds", default=",".join(KINDS), help="native, avx2")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per arm (demo: 8x)")
    ap.add_argument("--at", type=int, default=80, help="the step timed, in %% of the run")
    ap.add_argument("--arms", default="fp32,bf16,auto", help="train.dtype arms (fp32 first)")
    ap.add_argument("--report", type=Path, default=None, help="print the tables of a JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = setup(args)
    if args.report:
        report(json.loads(args.report.read_text()))
    elif args.child:
        print(json.dumps(child(args, device)))
    else:
        parent(args)


if __name__ == "__main__":
    main()
