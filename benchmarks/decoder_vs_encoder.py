"""Decoder (Lemma 1, KV cache) against encoder MDM sampling: time vs steps T and vs length n.

The AO-GPT paper's Figure 4 in one run: for every length ``n`` and number of reverse steps
``T``, the same batch of samples is drawn

* by a decoder (``aogpt`` by default) with :func:`anyorder.sample.lemma1_sample`: one random
  order, per step the reveal counts of the reverse process, all of a step's tokens predicted
  in one pass with the parallel prediction mask, an empty step skipped: at most ``T`` passes
  of ``O(n/T)`` new slots each over the KV cache;
* by the encoder-only MDM with :func:`anyorder.sample.encoder_sample`: a full bidirectional
  pass over all ``n`` positions per non-empty step.

The decoder is timed in full. The encoder's passes all cost the same (every pass reads the
whole sequence; drawing the revealed tokens is negligible beside it), so by default its time
is measured over a few passes of its real sampler (``--encoder-passes``) and multiplied by
the number of non-empty steps of the ``T``-step schedule; ``--full-encoder`` times whole runs
instead (minutes at n=1024). The table prints both times, their ratio, the FLOP ratio
counted from the architecture (:mod:`anyorder.flops`), and checks that the decoder made
exactly as many passes as there were non-empty steps. A PNG plot and a JSON file are
written beside each other.

    python benchmarks/decoder_vs_encoder.py                  # tiny, batch 16, n=128..1024
    python benchmarks/decoder_vs_encoder.py --lengths 256 --full-encoder   # timed in full

On a GPU (what ``benchmarks/gpu_check.sh`` runs; about a minute on an H200): the papers'
small model (12 x 768), batch 32, n = 256 and 1024, T = 64, 256, n, bf16 autocast, one
timed run per point, points in order until ``--budget`` seconds are spent (the rest are
reported as skipped)::

    python benchmarks/decoder_vs_encoder.py --paper --device cuda --dtype bf16 --graphs --budget 60

``--graphs`` runs the decoder with CUDA graphs (``graphs=True`` of ``lemma1_sample``); the
encoder's passes all have one shape and run eagerly.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from functools import partial
from pathlib import Path

import torch

from _bench import add_common, machine, print_table, setup, timed, verdict, write_json
from anyorder import build_model, preset
from anyorder.flops import decode_flops_per_sequence, decode_flops_per_token
from anyorder.sample import encoder_sample, lemma1_sample

SIZES = {
    "tiny": dict(),  # 4 layers x 256, 4 heads
    "4x768": dict(n_layer=4, d_model=768, n_head=12),
    "small": dict(n_layer=12, d_model=768, n_head=12),
}


def step_grid(n: int, steps: list[int]) -> list[int]:
    """The T values run at length n: those of ``steps`` up to n, and n itself."""
    return sorted({t for t in steps if t <= n} | {n})


@torch.no_grad()
def floor_pass(model, B: int, n: int, k: int, device, ctx, pick, rounds: int = 3) -> float:
    """Seconds of one KV-cache pass of ``k`` new slots per row over ``n // 2`` cached slots
    (the mean cache length of a decode): what a Lemma-1 pass costs at least when it carries
    ``k`` real slots per row, with no padding, no mask and nothing drawn."""
    L, reps = n // 2, 10
    cache = model.new_cache(B, L + k)
    pos = torch.arange(L, device=device).expand(B, L)
    x = torch.zeros(B, k, dtype=torch.long, device=device)
    p = torch.full((B, k), L, dtype=torch.long, device=device)
    target = (p + torch.arange(k, device=device)).clamp(max=n - 1)
    with ctx:
        model.decode(cache, pos % model.cfg.vocab_size, pos, pos, None)
        cache.advance(L)

        def run() -> None:  # writes at the same scratch slots every time
            for _ in range(reps):
                model.decode(cache, x, p, target, None, queries=k)

        run()
        times = [pick(*timed(run, device)[:2]) for _ in range(rounds)]
    return min(times) / reps


def _stat(xs: list[float], stat: str) -> float:
    return min(xs) if stat == "min" else sorted(xs)[len(xs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="tiny", choices=list(SIZES))
    ap.add_argument("--decoder", default="aogpt", choices=["aogpt", "armd"])
    ap.add_argument("--lengths", default="128,256,512,1024", help="comma-separated n")
    ap.add_argument("--steps", default="64,128,256,512,1024", help="comma-separated T (<= n)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per point (--stat)")
    ap.add_argument("--encoder-passes", type=int, default=3, help="encoder passes timed")
    ap.add_argument("--full-encoder", action="store_true", help="time whole encoder runs")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument(
        "--paper",
        action="store_true",
        help="small (12x768), batch 32, n = 256 and 1024, T = 64, 256, n",
    )
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs for the decoder")
    ap.add_argument(
        "--budget", type=float, default=None, help="seconds: later (n, T) points are skipped"
    )
    ap.add_argument("--plot", type=Path, default=Path("benchmarks/results/decoder_vs_encoder.png"))
    add_common(ap, "benchmarks/results/decoder_vs_encoder.json")
    args = ap.parse_args()
    if args.paper:
        args.size, args.batch = "small", 32
        if args.lengths == ap.get_default("lengths"):
            args.lengths, args.steps = "256,1024", "64,256,1024"
    device = setup(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    B, clock = args.batch, args.clock
    ctx = (
        torch.autocast(device.type, torch.bfloat16)
        if args.dtype == "bf16"
        else contextlib.nullcontext()
    )
    models, cfgs = {}, {}
    for kind in (args.decoder, "mdm"):
        torch.manual_seed(0)
        cfgs[kind] = preset("tiny", kind=kind, seq_len=max(lengths), **SIZES[args.size])
        models[kind] = build_model(cfgs[kind]).to(device).eval()
    model, enc = models[args.decoder], models["mdm"]

    def pick(w: float, c: float) -> float:
        return c if clock == "cpu" else w

    started = time.perf_counter()
    skipped = []
    with ctx:  # warm-up: lazy inits, allocator; CUDA graphs that fail fall back to eager
        try:
            lemma1_sample(
                model, 32, 8, batch=B, generator=torch.Generator(device).manual_seed(0),
                graphs=args.graphs,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - report, then measure eagerly
            print(f"CUDA graphs failed ({type(e).__name__}: {e}); the decoder runs eagerly")
            args.graphs = False
        encoder_sample(enc, 32, steps=2, batch=B, generator=torch.Generator(device).manual_seed(0))
    rows, floors = [], {}
    for n in lengths:
        enc_pass = None
        if not args.full_encoder:  # seconds per encoder pass at this n
            with ctx:  # one pass first: buffers of this size, caches
                encoder_sample(enc, n, steps=1, batch=B, generator=torch.Generator(device))
            samples = []
            for r in range(max(1, args.repeats)):
                gen = torch.Generator(device).manual_seed(r)
                k = args.encoder_passes
                with ctx:
                    w, c, out = timed(
                        partial(encoder_sample, enc, n, steps=k, batch=B, generator=gen),
                        device,
                    )
                samples.append(pick(w, c) / out.forward_passes)
            enc_pass = _stat(samples, args.stat)
            if args.decoder == "aogpt":  # the floor of a decoder pass (ARMD's differs)
                floors[n] = {
                    k: floor_pass(model, B, n, k, device, ctx, pick) for k in (1, 2, 4)
                } | {"encoder_pass": enc_pass}
        for T in step_grid(n, steps):
            if args.budget is not None and time.perf_counter() - started > args.budget:
                skipped.append((n, T))
                continue
            point = dict(n=n, steps=T, batch=B)
            ok = True
            for mode in ("per-row", "shared"):
                dec_t, enc_t = [], []
                for r in range(args.repeats):
                    kw = dict(batch=B, shared_counts=mode == "shared")
                    gen = torch.Generator(device).manual_seed(r)
                    with ctx:
                        w, c, out = timed(
                            partial(
                                lemma1_sample, model, n, T, generator=gen, graphs=args.graphs, **kw
                            ),
                            device,
                        )
                    dec_t.append(pick(w, c))
                    # both samplers draw the order, then the counts, from the same seed: the
                    # encoder makes one pass per step in which some row reveals a token
                    nonempty = len(out.reveals.step)  # steps where some row reveals
                    ok &= out.forward_passes == nonempty
                    if args.full_encoder:
                        gen = torch.Generator(device).manual_seed(r)
                        with ctx:
                            w, c, eout = timed(
                                partial(encoder_sample, enc, n, steps=T, generator=gen, **kw),
                                device,
                            )
                        assert eout.forward_passes == nonempty
                        enc_t.append(pick(w, c))
                    else:
                        enc_t.append(enc_pass * nonempty)
                key = "" if mode == "per-row" else "_shared"
                dec_s, enc_s = _stat(dec_t, args.stat), _stat(enc_t, args.stat)
                flop_enc = nonempty * decode_flops_per_token(cfgs["mdm"], n)
                point.update(
                    {
                        f"decoder{key}_s": dec_s,
                        f"encoder{key}_s": enc_s,
                        f"speedup{key}": enc_s / dec_s,
                        f"flop_ratio{key}": flop_enc
                        / decode_flops_per_sequence(cfgs[args.decoder], n),
                        f"passes{key}": out.forward_passes,
                        f"nonempty_steps{key}": nonempty,
                        f"decoder{key}_seconds": dec_t,
                        f"encoder{key}_seconds": enc_t,
                    }
                )
            point["passes_equal_nonempty"] = ok
            point["encoder_timed"] = "full" if args.full_encoder else "per-pass x passes"
            rows.append(point)
    print_table(
        f"{args.decoder} (Lemma 1, KV cache) vs mdm encoder: {args.size}, batch {B}, "
        f"{args.dtype}, {device.type}, {clock} clock"
        + ("" if args.full_encoder else f"; encoder: {args.encoder_passes} passes timed x steps"),
        [
            "n",
            "T",
            "decoder s",
            "encoder s",
            "speed-up",
            "FLOP x",
            "passes",
            "| shared:",
            "encoder s",
            "speed-up",
            "passes",
            "= steps",
        ],
        [
            [
                r["n"],
                r["steps"],
                r["decoder_s"],
                r["encoder_s"],
                r["speedup"],
                r["flop_ratio"],
                r["passes"],
                f"| {r['decoder_shared_s']:.3f}",
                r["encoder_shared_s"],
                r["speedup_shared"],
                r["passes_shared"],
                "yes" if r["passes_equal_nonempty"] else "NO",
            ]
            for r in rows
        ],
    )
    if floors:
        print_table(
            "floor: one pass of k real slots per row over n/2 cached slots (no padding, no "
            "mask); ceiling = encoder pass / 2-slot pass (a Lemma-1 pass at T = n carries 2 "
            "real slots per row on average: every token is written once and predicted once)",
            ["n", "encoder pass ms", "1 slot ms", "2 slots ms", "4 slots ms", "ceiling"],
            [
                [n, *(1e3 * f[key] for key in ("encoder_pass", 1, 2, 4)), f["encoder_pass"] / f[2]]
                for n, f in floors.items()
            ],
        )
    checks = [
        dict(
            target="Lemma 1 passes == non-empty steps (every point)",
            measured=all(r["passes_equal_nonempty"] for r in rows),
            verdict="met" if all(r["passes_equal_nonempty"] for r in rows) else "NOT met",
        )
    ]
    for r in rows:
        if r["steps"] == r["n"] and r["n"] == 256:
            for key, what in (("speedup", "per-row counts"), ("speedup_shared", "shared counts")):
                checks.append(
                    dict(
                        target=f"encoder/decoder, T=n=256, batch {B}, {args.size}, {what}: >= 64",
                        measured=r[key],
                        verdict=verdict(r[key], r["n"] / 4, at_most=False),
                    )
                )
    if skipped:
        print(f"skipped for --budget {args.budget:g} s: (n, T) = {skipped}")
    print_table("targets", ["target", "measured", "verdict"], [list(c.values()) for c in checks])
    meta = dict(machine(), device=str(device), dtype=args.dtype, clock=clock, size=args.size)
    meta.update(decoder=args.decoder, batch=B, full_encoder=args.full_encoder)
    meta.update(graphs=args.graphs, budget=args.budget, skipped=skipped)
    floor_rows = [{"n": n, **{str(k): v for k, v in f.items()}} for n, f in floors.items()]
    write_json(args.json, dict(meta=meta, rows=rows, floors=floor_rows, targets=checks))
    plot(rows, args, meta)


def _ticks(ax, values: list[int]) -> None:
    """Plain tick labels at the measured values of a log axis."""
    from matplotlib.ticker import NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(values, [str(v) for v in values])


def plot(rows: list[dict], args, meta: dict) -> None:
    """Two panels: time vs T at the largest n, and time vs n at T = n (log-log)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in sorted({r["n"] for r in rows}):
        pts = [r for r in rows if r["n"] == n]
        T = [r["steps"] for r in pts]
        (line,) = a.plot(T, [r["encoder_s"] for r in pts], "s--", label=f"mdm encoder, n={n}")
        color = line.get_color()
        a.plot(T, [r["decoder_s"] for r in pts], "o-", color=color, label=f"{args.decoder}, n={n}")
        a.plot(T, [r["decoder_shared_s"] for r in pts], "^:", color=color)
        a.plot(T, [r["encoder_shared_s"] for r in pts], "s:", color=color, alpha=0.5)
    a.set(xscale="log", yscale="log", xlabel="steps T", ylabel="seconds per batch")
    _ticks(a, sorted({r["steps"] for r in rows}))
    a.set_title(f"time vs steps, batch {args.batch} (dotted: shared reveal counts)", fontsize=9)
    a.legend(fontsize=7)
    diag = [r for r in rows if r["steps"] == r["n"]]
    ns = [r["n"] for r in diag]
    b.plot(ns, [r["encoder_s"] for r in diag], "s--", label="mdm encoder")
    b.plot(
        ns, [r["decoder_s"] for r in diag], "o-", label=f"{args.decoder} Lemma 1, per-row counts"
    )
    b.plot(ns, [r["encoder_shared_s"] for r in diag], "s:", label="mdm encoder, shared counts")
    b.plot(ns, [r["decoder_shared_s"] for r in diag], "^:", label=f"{args.decoder}, shared counts")
    for r in diag:
        b.annotate(
            f"{r['speedup']:.0f}x / {r['speedup_shared']:.0f}x",
            (r["n"], r["decoder_s"]),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=7,
        )
    b.set(xscale="log", yscale="log", xlabel="length n", ylabel="seconds per batch")
    _ticks(b, ns)
    b.set_title("time vs length, T = n (encoder/decoder time marked)", fontsize=9)
    b.legend(fontsize=8)
    fig.suptitle(
        f"{meta['size']}, {meta['device']}, {meta['dtype']}, {meta['clock']} clock"
        + ("" if meta["full_encoder"] else " (encoder: per-pass time x non-empty steps)"),
        fontsize=9,
    )
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
