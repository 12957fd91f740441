"""Training-step time, memory and FLOPs: aogpt and armd against gpt, side by side in one run.

Every model is built at the same width and depth and timed round-robin (gpt, aogpt, armd,
gpt, ...) so that machine noise hits all sides alike; the table reports the step time
(forward, backward, AdamW; the best round, see ``--stat``), its ratio to gpt, the FLOP
ratio counted from the architecture (:mod:`anyorder.flops`, as ARMD App. B.2 counts), and
two memory ratios:

* ``act x``: bytes autograd saves for backward (measured with ``saved_tensors_hooks``,
  deduplicated by storage): the stored activations;
* ``peak x``: the peak memory of a training step beyond the parameters, gradients and AdamW
  state: ``torch.cuda.max_memory_allocated`` on CUDA; on the CPU the growth of the peak
  resident set of a fresh process (each model in its own, see :func:`_peak_child`).

The ``targets`` table checks the issue's rows: time ratio <= 1.05 x the FLOP ratio for
every model, and for armd at L2s = L/2 a peak-memory ratio <= 1.05 x the architecture's
ratio of stored activations, ``(L + L2s) / L`` (two streams in L2s of L layers).

    python benchmarks/train_step.py                   # d=768, 12 heads, 4 layers, n=256, batch 4
    python benchmarks/train_step.py --dtype bf16      # bf16 autocast (wins only with bf16 units)
    python benchmarks/train_step.py --compile         # torch.compile every model (warm-up first)
    python benchmarks/train_step.py --compile both    # eager and compiled side by side
    python benchmarks/train_step.py --paper --device cuda   # 12 layers, n=1024, GPT-2 vocab

``--compile`` compiles what ``train.compile=true`` compiles: the loss module (the model and
the cross-entropy over the vocabulary, :func:`anyorder.training.setup.compile_modules`); with
``both``, every model is timed eager and compiled in the same rounds, and the compiled rows
get an ``x eager`` column (the input ``train.compile=auto`` is to be decided on).
``--models`` picks variants (gpt, aogpt, armd_half, armd_quarter), ``--budget`` caps the
seconds spent in timed rounds (at least one round). ``TFLOP/s`` counts the architecture's
training FLOPs (:func:`anyorder.flops.train_flops_per_token`: 6 x parameters + attention).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

from _bench import (
    add_common,
    machine,
    print_table,
    setup,
    summary,
    timed,
    verdict,
    write_json,
)
from anyorder import build_model, orders, preset
from anyorder.flops import train_flops_per_token
from anyorder.training.setup import LossModule


def saved_bytes(model, tokens, order, blocks) -> int:
    """Bytes of tensors autograd saves for backward in one forward pass (deduplicated)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.loss(tokens, order, blocks)
    return sum(v for k, v in seen.items() if k not in params)


def variants(L: int, keys: str = "gpt,aogpt,armd_half,armd_quarter") -> dict[str, dict]:
    """The models timed, by label: gpt, aogpt and armd at L2s = L/2 and L/4 (``keys``)."""
    half, quarter = max(1, L // 2), max(1, L // 4)
    every = {
        "gpt": ("gpt", dict(kind="gpt")),
        "aogpt": ("aogpt", dict(kind="aogpt")),
        "armd_half": (f"armd L2s={half}", dict(kind="armd", l2s=half)),
        "armd_quarter": (f"armd L2s={quarter}", dict(kind="armd", l2s=quarter)),
    }
    unknown = set(keys.split(",")) - set(every)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; use {', '.join(every)}")
    return dict(every[k] for k in every if k in keys.split(","))


def make(shape: dict, kw: dict, device: torch.device, backend: str | None):
    """``(cfg, model, loss module, optimizer)``; the loss module compiled with ``backend``
    (None: eager), as a run with ``train.compile=true`` compiles it."""
    torch.manual_seed(0)
    cfg = preset("tiny", **shape, **kw)
    model = build_model(cfg).to(device).train()
    # fused AdamW on CUDA, as training's make_optimizer takes it
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, fused=True if device.type == "cuda" else None
    )
    run = LossModule(model)
    if backend is not None:  # as compile_modules compiles a one-process run's loss
        run.compile(backend=backend, fullgraph=True)
    return cfg, model, run, opt


def train_step(run, opt, tokens, order, autocast) -> None:
    with autocast:
        loss = run(tokens, order, None)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def rounds(fns: dict, repeats: int, budget: float | None, device: torch.device) -> dict:
    """Round-robin timing after one warm-up round (compilation happens there): ``repeats``
    rounds, fewer when ``budget`` seconds of timed rounds run out (at least one)."""
    out = {name: {"wall": [], "cpu": [], "first": 0.0} for name in fns}
    for name, fn in fns.items():  # the first step pays for compilation: timed apart
        out[name]["first"] = timed(fn, device)[0]
    start = time.perf_counter()
    for r in range(repeats):
        if r and budget is not None and time.perf_counter() - start > budget * r / (r + 1):
            break  # another round would overrun the budget (rounds cost about the same)
        for name, fn in fns.items():
            w, c, _ = timed(fn, device)
            out[name]["wall"].append(w)
            out[name]["cpu"].append(c)
    return out


def _peak_child(queue, shape, kw, n, batch, vocab, bf16) -> None:
    """In a fresh process: RSS high-water mark growth of one training step (KiB).

    Parameters, gradients and AdamW state are allocated first (AdamW stepped once on zero
    gradients), so the growth is what the step itself needs: activations and temporaries.
    """
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    cfg, model, _, _ = make(shape, kw, torch.device("cpu"), None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # no big temporaries
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, n), generator=g)
    order = None if cfg.kind == "gpt" else orders.uniform(batch, n, g).order
    before = _reset_peak_rss()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = model.loss(tokens, order)
    loss.backward()
    queue.put(_peak_rss_kib() - before)


def _peak_rss_kib() -> int:
    """The process's peak resident set (KiB): VmHWM, else ``ru_maxrss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak_rss() -> int:
    """Reset the peak resident set to the current one where Linux allows it (a spawned child
    otherwise inherits its parent's peak through fork), and return it (KiB)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return _peak_rss_kib()


def peak_memory(name, shape, kw, n, B, vocab, device, bf16, data) -> int:
    """Peak bytes of one training step beyond parameters, gradients and optimizer state."""
    if device.type == "cuda":
        cfg, model, _, opt = make(shape, kw, device, None)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        tokens, order = data
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
            loss = model.loss(tokens, None if cfg.kind == "gpt" else order)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del model, opt, loss
        torch.cuda.empty_cache()
        return peak
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(queue, shape, kw, n, B, vocab, bf16))
    proc.start()
    kib = queue.get()
    proc.join()
    return 1024 * kib


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=None, help="seconds of timed rounds, at most")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument(
        "--compile",
        nargs="?",
        const="on",
        default="off",
        choices=["off", "on", "both"],
        help="torch.compile the loss modules (both: eager and compiled side by side)",
    )
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--models", default="gpt,aogpt,armd_half,armd_quarter")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--paper", action="store_true", help="12 layers, n=1024, GPT-2 vocabulary")
    add_common(ap, "benchmarks/results/train_step.json")
    args = ap.parse_args()
    if args.paper:
        args.layers, args.seq_len, args.vocab, args.batch = 12, 1024, 50257, 8
    return args


def main() -> None:
    args = parse_args()
    device = setup(args)
    L, n, B = args.layers, args.seq_len, args.batch
    shape = dict(
        n_layer=L, d_model=args.d_model, n_head=args.heads, seq_len=n, vocab_size=args.vocab
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (B, n), generator=g).to(device)
    order = orders.uniform(B, n, g).order.to(device)
    bf16 = args.dtype == "bf16"
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    )
    models = variants(L, args.models)
    modes = {"off": [None], "on": ["compiled"], "both": [None, "compiled"]}[args.compile]
    built = {}  # label: (name, mode, cfg, model, run, opt)
    for mode in modes:
        backend = args.compile_backend if mode else None
        for name, kw in models.items():
            label = f"{name} {mode}" if mode and args.compile == "both" else name
            built[label] = (name, mode, *make(shape, kw, device, backend))
    fns = {
        label: functools.partial(
            train_step, run, opt, tokens, None if cfg.kind == "gpt" else order, autocast
        )
        for label, (_, _, cfg, _, run, opt) in built.items()
    }
    times = rounds(fns, args.repeats, args.budget, device)
    act = {}
    for label, (_, mode, cfg, model, _, _) in built.items():
        if mode is None:  # autograd's saved tensors of the eager step
            with autocast:
                act[label] = saved_bytes(model, tokens, None if cfg.kind == "gpt" else order, None)
    peak = {}
    if not args.no_peak and None in modes:
        del fns
        for name, kw in models.items():
            peak[name] = peak_memory(
                name, shape, kw, n, B, args.vocab, device, bf16, (tokens, order)
            )
    rows = report(args, built, times, act, peak, n, B)
    checks = targets(rows, peak)
    meta = dict(machine(), device=str(device), dtype=args.dtype, clock=args.clock, stat=args.stat)
    meta.update(compile=args.compile, repeats=args.repeats, argv=sys.argv[1:])
    meta.update(rounds=len(next(iter(times.values()))["wall"]), budget=args.budget)
    meta["shape"] = dict(shape, batch=B)
    write_json(args.json, dict(meta=meta, rows=rows, targets=checks))


def report(args, built: dict, times: dict, act: dict, peak: dict, n: int, B: int) -> list[dict]:
    """One row per timed model (ratios to gpt of the same mode) and the printed table."""
    sec = {label: summary(times[label], args.clock, args.stat) for label in built}
    gpt_of = {mode: label for label, (name, mode, *_) in built.items() if name == "gpt"}
    eager_of = {name: label for label, (name, mode, *_) in built.items() if mode is None}
    base_f = train_flops_per_token(preset("tiny", kind="gpt", **built_shape(built)), n)
    rows, table = [], []
    for label, (name, mode, cfg, _, _, _) in built.items():
        t, ref = sec[label], sec.get(gpt_of.get(mode), float("nan"))
        flops = train_flops_per_token(cfg, n)
        f = flops / base_f
        eager = sec.get(eager_of.get(name)) if mode else None
        row = dict(
            model=name,
            compiled=bool(mode),
            ms_per_step=1000 * t,
            time_ratio=t / ref,
            flop_ratio=f,
            time_over_flop=(t / ref) / f,
            vs_eager=t / eager if eager else None,
            first_step_s=times[label]["first"],  # compiled rows: the compile's cost
            tflops=flops * B * n / t / 1e12,
            activation_mb=act[label] / 2**20 if label in act else None,
            activation_ratio=act[label] / act[gpt_of[None]] if label in act else None,
            peak_mb=peak[name] / 2**20 if peak and not mode else None,
            peak_ratio=peak[name] / peak["gpt"] if peak and not mode and "gpt" in peak else None,
            tokens_per_s=B * n / t,
            seconds_wall=times[label]["wall"],
            seconds_cpu=times[label]["cpu"],
        )
        if cfg.kind == "armd":
            row["stored_activation_model"] = (cfg.n_layer + cfg.two_stream_layers) / cfg.n_layer
        rows.append(row)
        table.append(
            [label, row["ms_per_step"], row["time_ratio"], f, row["time_over_flop"]]
            + [row["tflops"], _or_dash(row["vs_eager"])]
            + [_or_dash(row["activation_ratio"]), _or_dash(row["peak_ratio"])]
            + [row["first_step_s"]]
        )
    print_table(
        f"train step: {args.layers} layers, d={args.d_model}, n={n}, batch {B}, {args.dtype}, "
        f"{args.device}, compile {args.compile}, {args.clock} clock, "
        f"{args.stat} of {len(next(iter(times.values()))['wall'])}",
        ["model", "ms/step", "time x", "FLOP x", "t/F", "TFLOP/s", "x eager", "act x", "peak x"]
        + ["1st s"],
        table,
    )
    return rows


def built_shape(built: dict) -> dict:
    """The shape every model shares (read back from the first one's config)."""
    cfg = next(iter(built.values()))[2]
    keys = ("n_layer", "d_model", "n_head", "seq_len", "vocab_size")
    return {k: getattr(cfg, k) for k in keys}


def _or_dash(v):
    return "-" if v is None else v


def targets(rows: list[dict], peak: dict) -> list[dict]:
    """This CPU's targets: time x <= 1.05 FLOP x for every model against gpt (each mode),
    and armd at L2s = L/2: peak x <= 1.05 x the architecture's ratio of stored activations."""
    checks = []
    for row in rows:
        if row["model"] == "gpt":
            continue
        mode = " (compiled)" if row["compiled"] else ""
        checks.append(
            dict(
                target=f"{row['model']}{mode}: time x <= 1.05 FLOP x",
                measured=row["time_over_flop"],
                bound=1.05,
                verdict=verdict(row["time_over_flop"], 1.05),
            )
        )
    half = [r for r in rows if r["model"].startswith("armd") and r["peak_ratio"] is not None]
    if peak and half:
        row = max(half, key=lambda r: r["stored_activation_model"])  # armd L2s = L/2
        bound = 1.05 * row["stored_activation_model"]
        checks.append(
            dict(
                target=f"{row['model']}: peak x <= 1.05 x {row['stored_activation_model']}",
                measured=row["peak_ratio"],
                bound=bound,
                verdict=verdict(row["peak_ratio"], bound),
            )
        )
    print_table(
        "targets (t/F = time ratio over FLOP ratio)",
        ["target", "measured", "bound", "verdict"],
        [[c["target"], c["measured"], c["bound"], c["verdict"]] for c in checks],
    )
    return checks


if __name__ == "__main__":
    main()
