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
    python benchmarks/train_step.py --dtype bf16      # bf16 autocast (a win on this CPU)
    python benchmarks/train_step.py --compile         # torch.compile every model (warm-up first)
    python benchmarks/train_step.py --paper --device cuda   # 12 layers, n=1024, GPT-2 vocab
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import resource
import sys
import warnings
from pathlib import Path

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
from anyorder import build_model, orders, preset
from anyorder.flops import train_flops_per_token


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


def variants(L: int) -> dict[str, dict]:
    return {
        "gpt": dict(kind="gpt"),
        "aogpt": dict(kind="aogpt"),
        f"armd L2s={max(1, L // 2)}": dict(kind="armd", l2s=max(1, L // 2)),
        f"armd L2s={max(1, L // 4)}": dict(kind="armd", l2s=max(1, L // 4)),
    }


def make(shape: dict, kw: dict, device: torch.device, compile_: bool):
    torch.manual_seed(0)
    cfg = preset("tiny", **shape, **kw)
    model = build_model(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if compile_:
        model.compile()  # in place: model(...) inside model.loss runs the compiled forward
    return cfg, model, model, opt


def train_step(model, opt, tokens, order, autocast) -> None:
    with autocast:
        loss = model.loss(tokens, order)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _peak_child(queue, shape, kw, n, batch, vocab, bf16) -> None:
    """In a fresh process: RSS high-water mark growth of one training step (KiB).

    Parameters, gradients and AdamW state are allocated first (AdamW stepped once on zero
    gradients), so the growth is what the step itself needs: activations and temporaries.
    """
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    cfg, model, _, _ = make(shape, kw, torch.device("cpu"), False)
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
        cfg, model, _, opt = make(shape, kw, device, False)
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


def main() -> None:
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
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile every model")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--paper", action="store_true", help="12 layers, n=1024, GPT-2 vocabulary")
    add_common(ap, "benchmarks/results/train_step.json")
    args = ap.parse_args()
    if args.paper:
        args.layers, args.seq_len, args.vocab, args.batch = 12, 1024, 50257, 8
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
    built = {name: make(shape, kw, device, args.compile) for name, kw in variants(L).items()}
    fns = {
        name: functools.partial(
            train_step, run, opt, tokens, None if cfg.kind == "gpt" else order, autocast
        )
        for name, (cfg, _, run, opt) in built.items()
    }
    if args.compile:  # compile outside the timed rounds (the round-robin warms up once more)
        for fn in fns.values():
            fn()
    times, _ = round_robin(fns, args.repeats, device)
    act = {}
    for name, (cfg, model, _, _) in built.items():
        with autocast:
            act[name] = saved_bytes(model, tokens, None if cfg.kind == "gpt" else order, None)
    peak = {}
    if not args.no_peak:
        del fns
        for name, kw in variants(L).items():
            peak[name] = peak_memory(
                name, shape, kw, n, B, args.vocab, device, bf16, (tokens, order)
            )
    base_t = summary(times["gpt"], args.clock, args.stat)
    base_f = train_flops_per_token(built["gpt"][0], n)
    rows, table = [], []
    for name, (cfg, _, _, _) in built.items():
        t = summary(times[name], args.clock, args.stat)
        f = train_flops_per_token(cfg, n) / base_f
        row = dict(
            model=name,
            ms_per_step=1000 * t,
            time_ratio=t / base_t,
            flop_ratio=f,
            time_over_flop=(t / base_t) / f,
            activation_mb=act[name] / 2**20,
            activation_ratio=act[name] / act["gpt"],
            peak_mb=peak[name] / 2**20 if peak else None,
            peak_ratio=peak[name] / peak["gpt"] if peak else None,
            tokens_per_s=B * n / t,
            seconds_wall=times[name]["wall"],
            seconds_cpu=times[name]["cpu"],
        )
        if cfg.kind == "armd":
            row["stored_activation_model"] = (L + cfg.two_stream_layers) / L
        rows.append(row)
        table.append(
            [
                name,
                row["ms_per_step"],
                row["time_ratio"],
                f,
                row["time_over_flop"],
                row["activation_mb"],
                row["activation_ratio"],
                row["peak_ratio"] if peak else "-",
            ]
        )
    print_table(
        f"train step: {L} layers, d={args.d_model}, n={n}, batch {B}, {args.dtype}, "
        f"{device.type}{', compiled' if args.compile else ''}, {args.clock} clock, "
        f"{args.stat} of {args.repeats}",
        ["model", "ms/step", "time x", "FLOP x", "t/F", "act MB", "act x", "peak x"],
        table,
    )
    checks = []
    for row in rows[1:]:
        checks.append(
            dict(
                target=f"{row['model']}: time x <= 1.05 FLOP x",
                measured=row["time_over_flop"],
                bound=1.05,
                verdict=verdict(row["time_over_flop"], 1.05),
            )
        )
    half = rows[2]  # armd L2s = L/2
    if peak:
        bound = 1.05 * half["stored_activation_model"]
        checks.append(
            dict(
                target=f"{half['model']}: peak x <= 1.05 x {half['stored_activation_model']}",
                measured=half["peak_ratio"],
                bound=bound,
                verdict=verdict(half["peak_ratio"], bound),
            )
        )
    print_table(
        "targets (t/F = time ratio over FLOP ratio)",
        ["target", "measured", "bound", "verdict"],
        [[c["target"], c["measured"], c["bound"], c["verdict"]] for c in checks],
    )
    meta = dict(machine(), device=str(device), dtype=args.dtype, clock=args.clock, stat=args.stat)
    meta.update(compile=args.compile, repeats=args.repeats, argv=sys.argv[1:])
    meta["shape"] = dict(shape, batch=B)
    write_json(args.json, dict(meta=meta, rows=rows, targets=checks))


if __name__ == "__main__":
    main()
