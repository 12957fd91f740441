"""Kernels a compiled decoding pass launches: issue 41's "cheaper pass", counted on the CPU.

``anyorder.sampling.compiled_passes()`` (``anyorder sample --compile-passes``) hands every
steady pass of a decode, the speculative and confidence-ordered rounds included (their
ratio tests, drafts and counters), to ``torch.compile(fullgraph=True)`` before it is
captured. How many kernels one such pass runs needs no GPU to count: inductor writes each
compiled graph as a straight-line ``call()`` of its kernels, so this script decodes each
sampler under ``compiled_passes("inductor")`` on the GPU's path (fixed widths, key levels,
``graphs="emulate"``), collects the generated code (``run_and_get_code``) and counts the
kernel calls of each graph: fused kernels (``cpp_fused_*`` here, ``triton_*`` on a GPU),
``extern_kernels.*`` (matmuls) and aten fallbacks (attention, sort, cumprod).

Beside them, ``launch_overhead.py``'s count of the same pass uncompiled (``graph
kernels``): what the CUDA graph of an eager pass holds.

Caveat: inductor's CPU backend may fuse more into one kernel than its GPU backend does (a
C++ kernel can hold several loop nests; a Triton kernel is one). Run on a GPU, the same
script counts the Triton kernels (``--device cuda``).

    python benchmarks/compiled_kernels.py              # tiny, batch 8, n = 32: ~4 minutes
    python benchmarks/compiled_kernels.py --samplers gpt-seq,aogpt-spec-K4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

from anyorder import build_model, preset
from anyorder.sampling import compiled_passes
from launch_overhead import _sampler, gpu_path, prompt_of, samplers

ROWS = (
    "gpt-seq", "aogpt-seq", "armd-seq", "aogpt-spec-K4", "armd-spec-K4",
    "aogpt-confidence-spec-K4", "armd-confidence-P4",
)  # fmt: skip
"""The rows by default: the sequential baselines and issue 41's parallel samplers."""
KERNEL_CALL = re.compile(
    r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.aten\.\w+)",
    re.M,
)
"""A kernel call in the ``call()`` of inductor's generated code (CPU or CUDA)."""


def kernel_calls(code: str) -> list[str]:
    """The kernels the ``call()`` of one compiled graph's generated code launches, in order
    (fused kernels by their family: ``cpp_fused`` or ``triton``)."""
    if "def call(" not in code:
        return []
    body = code.split("def call(", 1)[1].split("\ndef ", 1)[0]
    calls = KERNEL_CALL.findall(body)
    return [re.sub(r"^(cpp_fused|triton)_\w+", r"\1", c) for c in calls]


def count(name: str, n: int, batch: int, device: str, dtype: str = "fp32") -> dict:
    """Decode row ``name`` with compiled passes; the kernels of its compiled graphs
    (``dtype`` bf16: under bf16 autocast, without its weight-cast cache, as a CUDA graph
    records)."""
    kind, kw = samplers(n)[name]
    kw = dict(kw)
    if "prompt" in kw:  # a prefix or infilling template, as launch_overhead.py's
        kw["prompt"], kw["known"] = (t.to(device) for t in prompt_of(kw["prompt"], n, batch))
    torch.manual_seed(0)
    model = build_model(preset("tiny", kind=kind, seq_len=n)).to(device).eval()
    fn = _sampler(kw)
    graphs = "emulate" if device == "cpu" else True

    def run():
        g = torch.Generator(device).manual_seed(0)
        cast = contextlib.nullcontext()
        if dtype == "bf16":
            cast = torch.autocast(torch.device(device).type, torch.bfloat16, cache_enabled=False)
        with torch.no_grad(), gpu_path(), compiled_passes("inductor"), cast:
            return fn(model, n, batch=batch, generator=g, graphs=graphs, **kw)

    t = time.perf_counter()
    out, codes = run_and_get_code(run)
    graphs_kernels = [kernel_calls(code) for code in codes]
    per_graph = sorted({len(k) for k in graphs_kernels if k})
    return dict(
        passes=out.forward_passes,
        graphs=len(graphs_kernels),
        kernels=max(per_graph) if per_graph else None,  # the steady pass (every level alike)
        per_graph=per_graph,
        seconds=time.perf_counter() - t,
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, default=32, help="n (the kernels do not grow with it)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--samplers", default=",".join(ROWS), help="comma-separated names")
    ap.add_argument("--device", default="cpu")
    bf16 = "bf16: under bf16 autocast, as anyorder sample decodes on CUDA"
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help=bf16)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/compiled_kernels.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.samplers.split(",")
    unknown = sorted(set(names) - set(samplers(args.seq_len)))
    if unknown:
        known = ", ".join(samplers(args.seq_len))
        raise SystemExit(f"--samplers: no row {', '.join(unknown)}; the rows: {known}")
    rows = {}
    for name in names:
        rows[name] = r = count(name, args.seq_len, args.batch, args.device, args.dtype)
        print(
            f"{name:28s} {r['kernels']!s:>8s} kernels a compiled pass "
            f"({r['graphs']} graphs, {r['passes']} passes, {r['seconds']:.0f} s)",
            flush=True,
        )
    ref = rows.get("gpt-seq", {}).get("kernels")
    print(
        f"\ntiny preset, batch {args.batch}, n = {args.seq_len}, {args.device}, {args.dtype}, "
        "inductor"
    )
    print(f"{'sampler':28s} {'kernels':>8s} {'x gpt':>6s}")
    for name, r in rows.items():
        ratio = r["kernels"] / ref if ref and r["kernels"] else None
        r["x_gpt"] = ratio
        print(f"{name:28s} {r['kernels']!s:>8s} {'' if ratio is None else f'{ratio:6.2f}'}")
    parallel = [r["x_gpt"] for k, r in rows.items() if ("spec" in k or "confidence" in k)]
    checks = []
    if ref and parallel and None not in parallel:
        worst = max(parallel)
        checks.append(
            dict(
                target="compiled pass kernels, speculative and confidence, <= 1.5 x gpt's",
                measured=worst,
                verdict="met" if worst <= 1.5 else "NOT met",
            )
        )
    for c in checks:
        print(f"\n  {c['target']:66s} {c['measured']:8.2f}  {c['verdict']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(preset="tiny", batch=args.batch, n=args.seq_len, device=args.device,
                dtype=args.dtype, torch=torch.__version__)  # fmt: skip
    args.json.write_text(json.dumps(dict(meta=meta, rows=rows, targets=checks), indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
