"""Decoding speed, side by side in one run: every fast decoder sampler against a cached GPT.

For each model size (the ``tiny`` preset, and 4 layers at the ``small`` width: d=768, 12
heads) and each batch size, with fresh random weights (speed does not depend on training),
the samplers are timed round-robin and the table reports the time per decoded token, its
ratio to the left-to-right GPT with the KV cache, the FLOP ratio counted from the
architecture (:func:`anyorder.flops.decode_flops_per_sequence`) and the forward passes:

* ``gpt``: left to right with the KV cache (the reference);
* ``aogpt seq`` / ``armd seq``: sequential any-order decoding, random order, KV cache;
* ``armd S=1`` / ``S=2`` / ``S=4``: ARMD's strided block-parallel decoding (S=1 is one token
  per pass, left to right); the SBP speed-up is ``S=1`` time over ``S=4`` time;
* with ``--lemma1``: ``aogpt/armd lemma1 T=n/4``, Lemma-1 sampling in n/4 steps;
* with ``--speculative 2,4,8``: ``aogpt/armd spec K=k``, any-order speculative sampling
  (exactly the sequential rows' law; ``passes`` is the most any row made), and ``aogpt conf
  spec K=k``, confidence order with speculative verification. With random weights the
  conditionals are nearly flat, so drafts are accepted far more often than with a trained
  model: read these rows for the cost of a pass, not for the passes a real model saves.

With ``--compile-passes [BACKEND]`` every row gets a twin ``<label> compiled`` decoded under
``anyorder.sampling.compiled_passes(BACKEND)`` (inductor by default: each pass and round
compiled whole, then captured with ``--graphs``), timed in the same rounds; the warm-up
round pays the compilation (each pass shape and key level compiles: minutes at paper size).
``--rows`` keeps only the rows named (their labels, comma-separated, the twins' included),
as ``gpu_check.sh`` does: ``--rows "aogpt seq,aogpt spec K=4,aogpt spec K=4 compiled"``.

With ``--compare-prepacked`` every row gets a twin with the CPU's prepacked weights turned
off (``<label> plain``: ``F.linear`` on the weights as built; ``layers/linear.py``), timed in
the same rounds, and a table of plain time over prepacked time per sampler.

The last table checks the issue's targets (aogpt/gpt <= 1.10 at batch 1 and 16, armd/gpt
<= 1.25 at batch 1, SBP S=4 over S=1 >= 3.6 at batch 1).

    python benchmarks/decode.py                          # tiny and 4x768, n=256, batch 1 and 16
    python benchmarks/decode.py --sizes tiny --batches 1 # the quick look

On a GPU (what ``benchmarks/gpu_check.sh`` runs; about a minute each on an H200): the
papers' small model (12 x 768, n = 1024) at batch 1 (the strided rows: ARMD's S = 1/2/4
per-sample targets) and batch 8 (sequential T = 1024 and Lemma 1 T = 256), bf16 autocast,
the wall clock, as many rounds as ``--budget`` allows (at least one after the warm-up)::

    python benchmarks/decode.py --paper --device cuda --dtype bf16 --graphs --budget 60
    python benchmarks/decode.py --paper --device cuda --dtype bf16 --budget 60   # eager

``--graphs`` captures each forward-pass shape once as a CUDA graph and replays it
(``graphs=True`` of the samplers); without it every pass is launched eagerly.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch

from _bench import (
    add_common,
    machine,
    print_table,
    round_robin,
    setup,
    summary,
    verdict,
    write_json,
)
from anyorder import build_model, preset, use_prepacked
from anyorder.flops import decode_flops_per_sequence
from anyorder.sample import lemma1_sample, sequential_sample, strided_sample
from anyorder.sampling import compiled_passes
from anyorder.sampling.confidence import confidence_sample
from anyorder.sampling.speculative import speculative_sample

SIZES = {
    "tiny": dict(),  # 4 layers x 256, 4 heads
    "4x768": dict(n_layer=4, d_model=768, n_head=12),  # the small width, fewer layers
    "small": dict(n_layer=12, d_model=768, n_head=12),  # the papers' small (--paper)
}
TARGETS = [  # (label, batch, numerator, denominator, bound, at_most)
    ("aogpt/gpt per token", 1, "aogpt seq", "gpt", 1.10, True),
    ("aogpt/gpt per token", 16, "aogpt seq", "gpt", 1.10, True),
    ("armd/gpt per token", 1, "armd seq", "gpt", 1.25, True),
    ("SBP S=1 time / S=4 time", 1, "armd S=1", "armd S=4", 3.6, False),
]
GPU_TARGETS = [  # (label, batch, sampler, seconds per batch at most): issue 14, small, n=1024
    ("aogpt sequential T=1024 s/batch", 8, "aogpt seq", 2.1),
    ("aogpt Lemma 1 T=256 s/batch", 8, "aogpt lemma1 T=256", 0.77),
    ("armd strided S=1 s/sample", 1, "armd S=1", 1.2),
    ("armd strided S=2 s/sample", 1, "armd S=2", 0.6),
    ("armd strided S=4 s/sample", 1, "armd S=4", 0.32),
]


def settings(
    n: int,
    batch: int,
    lemma1: bool,
    spec: tuple[int, ...] = (),
    plain: bool = False,
    only: set[str] | None = None,
    compile_backend: str | None = None,
) -> list[tuple]:
    """(label, model kind, sampler call) of every row for one batch size (``plain``: and
    each row's twin without prepacked weights; ``only``: the rows of these labels;
    ``compile_backend``: and each row's twin through compiled passes)."""
    rows = [
        ("gpt", "gpt", dict(fn=sequential_sample)),
        ("aogpt seq", "aogpt", dict(fn=sequential_sample)),
        ("armd seq", "armd", dict(fn=sequential_sample)),
    ]
    if batch == 1:  # the strided rows are the SBP target's (batch 1)
        rows += [(f"armd S={s}", "armd", dict(fn=strided_sample, streams=s)) for s in (1, 2, 4)]
    if lemma1:
        rows += [
            (f"{k} lemma1 T={n // 4}", k, dict(fn=lemma1_sample, steps=n // 4))
            for k in ("aogpt", "armd")
        ]
    for K in spec:
        rows += [
            (f"{k} spec K={K}", k, dict(fn=speculative_sample, K=K)) for k in ("aogpt", "armd")
        ]
        rows.append((f"aogpt conf spec K={K}", "aogpt", dict(fn=confidence_sample, K=K)))
    if compile_backend:
        rows += [
            (f"{label} compiled", kind, dict(spec, compiled=compile_backend))
            for label, kind, spec in rows
        ]
    if only is not None:  # a compiled twin by its own label ("aogpt spec K=4 compiled")
        rows = [r for r in rows if r[0] in only]
    if plain:
        rows += [(f"{label} plain", kind, dict(spec, plain=True)) for label, kind, spec in rows]
    return rows


def call(
    model, n: int, batch: int, spec: dict, seed: int, device: torch.device, graphs: bool = False
):
    """One batch of samples with the sampler of ``spec``."""
    spec = dict(spec)
    fn = spec.pop("fn")
    if spec.pop("plain", False):
        with use_prepacked(False):
            return call(model, n, batch, spec | {"fn": fn}, seed, device, graphs)
    backend = spec.pop("compiled", None)
    if backend:
        with compiled_passes(backend):
            return call(model, n, batch, spec | {"fn": fn}, seed, device, graphs)
    gen = torch.Generator(device).manual_seed(seed)
    kw = dict(batch=batch, generator=gen, graphs=graphs)
    if fn is strided_sample:
        return fn(model, n, spec["streams"], **kw)
    if fn is lemma1_sample:
        return fn(model, n, spec["steps"], **kw)
    if fn is speculative_sample:  # captured rounds, one graph per key level
        return fn(model, n, spec["K"], **kw)
    if fn is confidence_sample:
        return fn(model, n, speculative=spec["K"], **kw)
    return fn(model, n, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, default=256, help="n, tokens per sample")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    ap.add_argument("--sizes", default="tiny,4x768", help=f"comma-separated: {', '.join(SIZES)}")
    ap.add_argument("--repeats", type=int, default=4, help="timed rounds (see --stat)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--lemma1", action="store_true", help="add Lemma-1 rows (T = n/4)")
    ap.add_argument(
        "--speculative", default="", help="comma-separated K: speculative rows (e.g. 2,4,8)"
    )
    ap.add_argument(
        "--paper",
        action="store_true",
        help="the small preset (12x768) at n=1024, batches 1 and 8, Lemma-1 rows, 2 rounds",
    )
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (see above)")
    ap.add_argument(
        "--compare-prepacked", action="store_true", help="each row again without prepacking"
    )
    ap.add_argument(
        "--compile-passes",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="each row again through compiled passes (torch.compile backend; inductor)",
    )
    ap.add_argument("--rows", default=None, help="only these rows (labels, comma-separated)")
    ap.add_argument(
        "--budget", type=float, default=None, help="seconds per batch size: fewer rounds to fit"
    )
    add_common(ap, "benchmarks/results/decode.json")
    args = ap.parse_args()
    if args.paper:
        args.sizes, args.seq_len, args.batches, args.lemma1 = "small", 1024, "1,8", True
        args.repeats = min(args.repeats, 2)
    device = setup(args)
    n = args.seq_len
    ctx = (
        torch.autocast(device.type, torch.bfloat16)
        if args.dtype == "bf16"
        else contextlib.nullcontext()
    )
    results, checks = [], []
    for size in args.sizes.split(","):
        models, cfgs = {}, {}
        for kind in ("gpt", "aogpt", "armd"):
            torch.manual_seed(0)
            cfgs[kind] = preset("tiny", kind=kind, seq_len=n, **SIZES[size])
            models[kind] = build_model(cfgs[kind]).to(device).eval()
        flops = {k: decode_flops_per_sequence(c, n) for k, c in cfgs.items()}
        for batch in (int(b) for b in args.batches.split(",")):
            ks = tuple(int(k) for k in args.speculative.split(",") if k)
            only = set(args.rows.split(",")) if args.rows else None
            rows = settings(
                n, batch, args.lemma1, ks, args.compare_prepacked, only, args.compile_passes
            )
            if not rows:
                raise SystemExit(f"--rows {args.rows!r}: no such row (labels as printed)")
            fns = {
                label: functools.partial(call, models[kind], n, batch, spec, 0, device, args.graphs)
                for label, kind, spec in rows
            }
            with ctx, torch.no_grad():
                times, last = round_robin(fns, args.repeats, device, args.budget)
            first = "gpt" if "gpt" in times else rows[0][0]  # the time ratios' reference
            ref = summary(times[first], args.clock, args.stat)
            table = []
            by_label = {}
            for label, kind, _ in rows:
                sec = summary(times[label], args.clock, args.stat)
                row = dict(
                    size=size,
                    batch=batch,
                    sampler=label,
                    kind=kind,
                    n=n,
                    ms_per_token=1000 * sec / n,
                    seconds_per_batch=sec,
                    time_ratio=sec / ref,
                    flop_ratio=flops[kind] / flops["gpt"],
                    forward_passes=last[label].forward_passes,
                    tokens_per_s=batch * n / sec,
                    seconds_wall=times[label]["wall"],
                    seconds_cpu=times[label]["cpu"],
                )
                by_label[label] = row
                results.append(row)
                table.append(
                    [
                        label,
                        row["seconds_per_batch"],
                        row["ms_per_token"],
                        row["time_ratio"],
                        row["flop_ratio"],
                        row["forward_passes"],
                        row["tokens_per_s"],
                    ]
                )
            print_table(
                f"{size}: n={n}, batch {batch}, {args.dtype}, {device.type}"
                f"{', CUDA graphs' if args.graphs else ''}, {args.clock} clock, {args.stat} of "
                f"{len(times[first][args.clock])}",
                [
                    "sampler",
                    "s/batch",
                    "ms/token",
                    f"time x {first}",
                    "FLOP x gpt",
                    "passes",
                    "tokens/s",
                ],
                table,
            )
            twins = [
                [label, by_label[label + " plain"]["seconds_per_batch"] / row["seconds_per_batch"]]
                for label, row in by_label.items()
                if label + " plain" in by_label
            ]
            if twins:
                title = f"{size}, batch {batch}: plain time / prepacked time"
                print_table(title, ["sampler", "x"], twins)
            for label, b, name, bound in GPU_TARGETS if device.type == "cuda" else []:
                if b == batch and name in by_label and size == "small":
                    value = by_label[name]["seconds_per_batch"]
                    checks.append(
                        dict(
                            target=label,
                            size=size,
                            batch=batch,
                            measured=value,
                            flop_or_pass_ratio=float("nan"),
                            bound=bound,
                            verdict=verdict(value, bound, True),
                        )
                    )
            for label, b, num, den, bound, at_most in TARGETS:
                if b == batch and num in by_label and den in by_label:
                    value = by_label[num]["ms_per_token"] / by_label[den]["ms_per_token"]
                    flop = by_label[num]["flop_ratio"] / by_label[den]["flop_ratio"]
                    if label.startswith("SBP"):
                        flop = by_label[num]["forward_passes"] / by_label[den]["forward_passes"]
                    checks.append(
                        dict(
                            target=label,
                            size=size,
                            batch=batch,
                            measured=value,
                            flop_or_pass_ratio=flop,
                            bound=bound,
                            verdict=verdict(value, bound, at_most),
                        )
                    )
    print_table(
        "targets (SBP: the ideal is the ratio of forward passes)",
        ["target", "size", "batch", "measured", "FLOP/pass x", "bound", "verdict"],
        [
            [
                c["target"],
                c["size"],
                c["batch"],
                c["measured"],
                c["flop_or_pass_ratio"],
                ("<= " if "SBP" not in c["target"] else ">= ") + f"{c['bound']:.2f}",
                c["verdict"],
            ]
            for c in checks
        ],
    )
    meta = dict(
        machine(), device=str(device), dtype=args.dtype, clock=args.clock, stat=args.stat, n=n
    )
    meta.update(repeats=args.repeats, graphs=args.graphs, budget=args.budget)
    meta.update(compile_passes=args.compile_passes)
    write_json(args.json, dict(meta=meta, rows=results, targets=checks))


if __name__ == "__main__":
    main()
