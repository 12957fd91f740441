"""Decoding throughput of every fast sampler, side by side in one run.

For each model size (the ``tiny`` preset and a larger one) at sequence length ``n``, with
fresh random weights (throughput does not depend on training), the samplers are timed
round-robin (every setting once, then again, ...) so that machine noise hits all alike; the
table reports the median tokens/s, the ratio to a cached left-to-right GPT, and the number
of forward passes per batch:

* ``gpt cached``: left to right with the KV cache (the speed reference);
* ``aogpt seq`` / ``armd seq``: sequential any-order decoding, random order, KV cache;
* ``armd S=2`` / ``armd S=4``: strided block-parallel decoding;
* ``aogpt/armd lemma1 T``: Lemma-1 sampling in ``T = n/4`` and ``T = n`` steps, reveal
  counts drawn per row (independent samples; passes padded to the row revealing most), and
  ``shared``: one count per step shared by the batch (no padding);
* ``mdm T=n``: the encoder's ancestral sampler, a full bidirectional pass per step.

    python benchmarks/decode.py                       # tiny + 6x384, n=256, batch 8
    python benchmarks/decode.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from anyorder import build_model, preset
from anyorder.sample import encoder_sample, lemma1_sample, sequential_sample, strided_sample

SIZES = {
    "tiny": dict(),  # 4 layers x 256, 4 heads
    "6x384": dict(n_layer=6, d_model=384, n_head=6),
}


def settings(n: int, mdm_batch: int) -> list[tuple[str, str, dict]]:
    """(label, model kind, sampler call) for every row of the table."""
    return [
        ("gpt cached", "gpt", dict(fn=sequential_sample)),
        ("aogpt seq", "aogpt", dict(fn=sequential_sample)),
        ("armd seq", "armd", dict(fn=sequential_sample)),
        ("armd S=2", "armd", dict(fn=strided_sample, streams=2)),
        ("armd S=4", "armd", dict(fn=strided_sample, streams=4)),
        (f"aogpt lemma1 T={n // 4}", "aogpt", dict(fn=lemma1_sample, steps=n // 4)),
        (f"armd lemma1 T={n // 4}", "armd", dict(fn=lemma1_sample, steps=n // 4)),
        (f"aogpt lemma1 T={n // 4} shared", "aogpt", dict(fn=lemma1_sample, steps=n // 4, sh=True)),
        (f"armd lemma1 T={n // 4} shared", "armd", dict(fn=lemma1_sample, steps=n // 4, sh=True)),
        (f"aogpt lemma1 T={n}", "aogpt", dict(fn=lemma1_sample, steps=n)),
        (f"armd lemma1 T={n}", "armd", dict(fn=lemma1_sample, steps=n)),
        (f"mdm T={n}", "mdm", dict(fn=encoder_sample, steps=n, batch=mdm_batch)),
    ]


def run_once(model, n: int, batch: int, call: dict, seed: int, device) -> tuple[float, int]:
    """Seconds and forward passes of one batch of samples."""
    call = dict(call)
    fn = call.pop("fn")
    batch = call.pop("batch", batch)
    steps, streams = call.pop("steps", None), call.pop("streams", None)
    gen = torch.Generator(device).manual_seed(seed)
    kw = dict(batch=batch, generator=gen)
    if call.pop("sh", False):
        kw["shared_counts"] = True
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    if fn is strided_sample:
        out = fn(model, n, streams, **kw)
    elif fn is lemma1_sample:
        out = fn(model, n, steps, **kw)
    elif fn is encoder_sample:
        out = fn(model, n, steps=steps, **kw)
    else:
        out = fn(model, n, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out.forward_passes


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, default=256, help="n, tokens per sample")
    ap.add_argument("--batch", type=int, default=8, help="samples per sampler call")
    ap.add_argument("--mdm-batch", type=int, default=None, help="batch of the mdm row")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: tiny,6x384")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/decode.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    n, batch = args.seq_len, args.batch
    mdm_batch = args.mdm_batch or batch
    ctx = (
        torch.autocast(device.type, torch.bfloat16)
        if args.dtype == "bf16"
        else contextlib.nullcontext()
    )
    results = []
    for size in args.sizes.split(","):
        rows = settings(n, mdm_batch)
        models = {}
        for kind in ("gpt", "aogpt", "armd", "mdm"):
            torch.manual_seed(0)
            cfg = preset("tiny", kind=kind, seq_len=n, **SIZES[size])
            models[kind] = build_model(cfg).to(device).eval()
        times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
        passes: dict[str, int] = {}
        with ctx:
            for _, kind, call in rows:  # warm-up on a short sequence
                run_once(models[kind], 16, 2, {**call, **_short(call)}, 0, device)
            for r in range(args.repeats):
                for label, kind, call in rows:
                    dt, p = run_once(models[kind], n, batch, call, r, device)
                    times[label].append(dt)
                    passes[label] = p
        params = {k: m.num_params() for k, m in models.items()}
        ref = None
        print(f"\n{size}: n={n}, batch {batch} (mdm {mdm_batch}), {args.dtype}, {device}")
        print(f"{'sampler':26s} {'tok/s':>9s} {'x gpt':>7s} {'passes':>7s} {'s/batch':>8s}")
        for label, kind, call in rows:
            b = call.get("batch", batch)
            sec = statistics.median(times[label])
            tps = b * n / sec
            ref = tps if ref is None else ref
            print(f"{label:26s} {tps:9.0f} {tps / ref:7.2f} {passes[label]:7d} {sec:8.2f}")
            results.append(
                dict(
                    size=size,
                    sampler=label,
                    kind=kind,
                    params=params[kind],
                    n=n,
                    batch=b,
                    tokens_per_s=round(tps, 1),
                    ratio_to_gpt=round(tps / ref, 3),
                    forward_passes=passes[label],
                    seconds=[round(t, 4) for t in times[label]],
                )
            )
    meta = dict(
        device=str(device),
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        repeats=args.repeats,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(meta=meta, rows=results), indent=2) + "\n")
    print(f"\nwrote {args.json}")


def _short(call: dict) -> dict:
    """The warm-up version of a setting: n=16, steps and streams scaled down."""
    out = {}
    if "steps" in call:
        out["steps"] = 4
    if "batch" in call:
        out["batch"] = 2
    return out


if __name__ == "__main__":
    main()
