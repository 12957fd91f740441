"""Training speed beside the AO-GPT authors' trainer: their model and loss, compiled as their
``train_AOGPT_CL.py`` compiles it, and our aogpt as ``anyorder train`` runs it, timed
round-robin on one device at one shape; tokens per second of both.

Needs their repository (scxue/AO-GPT-MDM) unpacked in an ignored folder (default ``.ref/``,
``--ref``); nothing of it is copied into the project. On a GPU machine without a network,
carry that folder with the working tree.

    PYTHONPATH=src python benchmarks/vs_reference_trainer.py --paper --device cuda
    PYTHONPATH=src python benchmarks/vs_reference_trainer.py        # tiny, on the CPU

One training step on each side, as each trainer takes it (one micro-batch; their loop's
``gradient_accumulation_steps`` only repeats the first half):

* theirs: ``AOGPT`` (their 124M config: ``bias=True``, dropout 0), ``torch.compile(model)``
  where ``--compile`` says so (their trainer's ``compile`` flag), bf16 autocast on CUDA as
  their ``ctx``, ``model(X, mode='Random_CL', random_ratio=0.9)`` (their own order draws,
  on the device), backward, clipping at 1, their ``configure_optimizers`` (fused AdamW on
  CUDA), their EMA update, ``zero_grad``;
* ours: ``model.variant=aogpt-ref`` at the same shape (the same architecture and FLOPs),
  the loss module compiled as ``train.compile=true`` compiles it (``fullgraph`` in one
  process), orders drawn on the host by the run's order sampler (``order.kind=mix``,
  ``p_l2r=0.1``), backward, clipping at 1, ``make_optimizer`` (fused AdamW on CUDA), our EMA
  update, ``zero_grad``.

``--compile both`` times each side eager and compiled in the same rounds. The table: ms per
step, tokens/s, and ours over theirs (tokens/s, > 1: ours is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import torch

from _bench import add_common, machine, print_table, setup, summary, timed, write_json

REPO = Path(__file__).resolve().parents[1]
REF_MODEL = "model_AOGPT_AdaLN6_NoRep_cond_128_trunc_qknorm"


def their_side(ref: Path, shape: dict, device: torch.device, compiled: bool):
    """A step of their trainer: ``fn()`` runs it on the batch given to ``fn.feed``."""
    sys.path.insert(0, str(ref.resolve()))
    try:
        from ema import ExponentialMovingAverage

        mod = __import__(REF_MODEL)
    finally:
        sys.path.pop(0)
    torch.manual_seed(1337)  # their trainer's seed
    conf = mod.AOGPTConfig(
        n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["d_model"],
        block_size=shape["seq_len"], bias=True, vocab_size=shape["vocab_size"], dropout=0.0,
    )  # fmt: skip
    model = mod.AOGPT(conf).to(device).train()
    opt = model.configure_optimizers(0.05, 6e-4, (0.9, 0.95), device.type)
    ema = ExponentialMovingAverage(model.parameters(), decay=1 - 1e-4)
    run = torch.compile(model) if compiled else model
    ctx = autocast(device)
    box = {}

    def step() -> None:
        with ctx:
            _, loss = run(box["x"], mode="Random_CL", random_ratio=0.9)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema.update(model.parameters())
        opt.zero_grad(set_to_none=True)

    return step, box


def our_side(shape: dict, device: torch.device, compiled: bool):
    """A step of ``anyorder train`` at the same shape (see the module docstring)."""
    from anyorder import build_model, preset
    from anyorder.config import load_config
    from anyorder.orders import OrderSampler
    from anyorder.training import setup as train_setup
    from anyorder.training.state import EMA

    torch.manual_seed(0)
    cfg = load_config(None, ["order.kind=mix", "order.p_l2r=0.1", "train.weight_decay=0.05"])
    mcfg = preset("tiny", variant="aogpt-ref", **shape)
    cfg = dataclasses.replace(cfg, model=mcfg)
    model = build_model(mcfg).to(device).train()
    run = train_setup.LossModule(model)
    if compiled:
        train_setup.compile_modules(model, run, fullgraph=True)
    opt = train_setup.make_optimizer(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    ema = EMA(params, 1 - 1e-4, False)
    orders, gen = OrderSampler(cfg.order, 1000), torch.Generator().manual_seed(0)
    ctx = autocast(device)
    box = {"step": 0}

    def step() -> None:
        x = box["x"]
        B, n = x.shape
        order = orders(B, n, box["step"], gen).order.to(device, non_blocking=True)
        box["step"] += 1
        with ctx:
            loss = run(x, order, None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        ema.update(box["step"])
        opt.zero_grad(set_to_none=True)

    return step, box


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (both trainers' default there), fp32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", type=Path, default=REPO / ".ref", help="their repository")
    ap.add_argument("--paper", action="store_true", help="12 x 768, n = 1024, vocab 50304")
    ap.add_argument("--batch", type=int, default=None, help="rows per step (paper: 8)")
    ap.add_argument("--compile", choices=["eager", "compiled", "both"], default="compiled")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (after a warm-up)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timed rounds")
    add_common(ap, "benchmarks/results/vs_reference_trainer.json")
    args = ap.parse_args()
    device = setup(args)
    if not (args.ref / f"{REF_MODEL}.py").is_file():
        raise SystemExit(
            f"--ref {args.ref}: no {REF_MODEL}.py there; unpack scxue/AO-GPT-MDM into it "
            "(an ignored folder, never committed)"
        )
    if args.paper:
        shape = dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304)
        batch = args.batch or 8
    else:
        shape = dict(n_layer=2, n_head=2, d_model=64, seq_len=64, vocab_size=257)
        batch = args.batch or 4
    modes = {"eager": [False], "compiled": [True], "both": [False, True]}[args.compile]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, shape["vocab_size"], (batch, shape["seq_len"]), generator=g).to(device)
    fns, first = {}, {}
    for compiled in modes:
        tag = "compiled" if compiled else "eager"
        for side, make in (("theirs", lambda c: their_side(args.ref, shape, device, c)),
                           ("ours", lambda c: our_side(shape, device, c))):  # fmt: skip
            step, box = make(compiled)
            box["x"] = x
            w, _, _ = timed(step, device)  # the first step pays for compilation
            first[f"{side} {tag}"] = w
            fns[f"{side} {tag}"] = step
    times = {name: {"wall": [], "cpu": []} for name in fns}
    start = time.perf_counter()
    for r in range(args.repeats):
        if r and args.budget is not None and time.perf_counter() - start > args.budget:
            break
        for name, fn in fns.items():
            w, c, _ = timed(fn, device)
            times[name]["wall"].append(w)
            times[name]["cpu"].append(c)
    tokens = batch * shape["seq_len"]
    rows, results = [], {}
    for tag in ("eager", "compiled"):
        if f"ours {tag}" not in fns:
            continue
        t_ours = summary(times[f"ours {tag}"], args.clock, args.stat)
        t_theirs = summary(times[f"theirs {tag}"], args.clock, args.stat)
        results[tag] = {
            "ours_ms": 1e3 * t_ours, "theirs_ms": 1e3 * t_theirs,
            "ours_tokens_s": tokens / t_ours, "theirs_tokens_s": tokens / t_theirs,
            "ours_over_theirs": t_theirs / t_ours,
            "first_step_s": {"ours": first[f"ours {tag}"], "theirs": first[f"theirs {tag}"]},
        }  # fmt: skip
        r = results[tag]
        first = r["first_step_s"]
        rows.append(
            [tag, r["theirs_ms"], r["ours_ms"], r["theirs_tokens_s"], r["ours_tokens_s"]]
            + [r["ours_over_theirs"], first["theirs"], first["ours"]]
        )
    rounds = len(times[next(iter(fns))]["wall"])
    print_table(
        f"one training step, aogpt {shape['n_layer']} x {shape['d_model']}, "
        f"n = {shape['seq_len']}, batch {batch}, on {device} "
        f"({args.clock} clock, {args.stat} of {rounds} rounds)",
        ["", "theirs ms", "ours ms", "theirs tok/s", "ours tok/s", "ours x theirs"]
        + ["theirs 1st s", "ours 1st s"],
        rows,
    )
    write_json(
        args.json, {"machine": machine(), "shape": shape, "batch": batch, "results": results}
    )


if __name__ == "__main__":
    main()
