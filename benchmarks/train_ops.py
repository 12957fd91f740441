"""Kernel launches per training step: the CPU proxy of a launch-bound GPU step.

On a GPU a small model's training step is bound by how many kernels it launches, not by its
FLOPs, when the kernels are small; on the CPU the same count is a property of the code. This
script runs one forward + backward of each model under a ``TorchDispatchMode`` and counts
every aten op that reaches a kernel, split into:

* ``launch``: ops that compute or copy (what would be a kernel launch on a GPU);
* ``view``: ops that only make a view (``view``, ``transpose``, ``slice``, ...; no kernel);
* ``alloc``: ``empty``-like allocations (no kernel);
* ``sync``: reads of a value back to the host (``item``, ``nonzero``, ...).

``launch`` is the figure to cut. The optimizer step is left out (fused AdamW is one kernel
per parameter group on CUDA whatever the model).

    python benchmarks/train_ops.py                       # tiny preset, batch 8, n = 256
    python benchmarks/train_ops.py --dtype bf16 --top 15 # the most launched ops of each model
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from anyorder import build_model, orders, preset

ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
SYNC = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item", "masked_select"}


def kind_of(func) -> str:
    """``launch``, ``view``, ``alloc`` or ``sync`` for an aten overload."""
    name = func.overloadpacket.__name__
    if name in SYNC:
        return "sync"
    if name in ALLOC:
        return "alloc"
    if getattr(func, "is_view", False) or name in ("detach", "alias", "lift_fresh"):
        return "view"
    return "launch"


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name and by :func:`kind_of` while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = kind_of(func)
        self.kinds[kind] += 1
        if kind == "launch":
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_step(model, tokens, order, blocks=None, dtype: str = "fp32") -> OpCounter:
    """Ops of one forward + backward of ``model.loss`` (gradients are reset after)."""
    ctx = torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16")
    counter = OpCounter()
    with counter:
        with ctx:
            loss = model.loss(tokens, order, blocks)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter


def models(n_layer: int | None = None) -> dict[str, dict]:
    """The variants counted: gpt, aogpt, armd at L2s = L/2 (the preset's), and with blocks."""
    extra = {} if n_layer is None else {"n_layer": n_layer}
    return {
        "gpt": dict(kind="gpt", **extra),
        "aogpt": dict(kind="aogpt", **extra),
        "armd": dict(kind="armd", **extra),
        "armd S=4 blocks": dict(kind="armd", blocks=4, **extra),
    }


def count_all(
    batch: int = 8, n: int = 256, dtype: str = "fp32", n_layer: int | None = None
) -> dict[str, OpCounter]:
    """:func:`count_step` of every variant of :func:`models` at the tiny preset."""
    out = {}
    g = torch.Generator().manual_seed(0)
    for name, kw in models(n_layer).items():
        kw = dict(kw)
        streams = kw.pop("blocks", None)
        torch.manual_seed(0)
        cfg = preset("tiny", seq_len=n, **kw)
        model = build_model(cfg).train()
        tokens = torch.randint(0, cfg.vocab_size, (batch, n), generator=g)
        order = blocks = None
        if cfg.kind != "gpt":
            if streams:
                o = orders.strided(batch, n, streams)
                order, blocks = o.order, o.model_blocks
            else:
                order = orders.uniform(batch, n, g).order
        out[name] = count_step(model, tokens, order, blocks, dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=None, help="default: the tiny preset's")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--top", type=int, default=0, help="also list each model's top ops")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    counts = count_all(args.batch, args.seq_len, args.dtype, args.layers)
    base = counts["gpt"].kinds["launch"]
    print(
        f"aten ops per training step (forward + backward), tiny, batch {args.batch}, "
        f"n = {args.seq_len}, {args.dtype}"
    )
    print(f"  {'model':18s} {'launch':>7s} {'x gpt':>6s} {'view':>6s} {'alloc':>6s} {'sync':>5s}")
    rows = []
    for name, c in counts.items():
        k = c.kinds
        rows.append(
            dict(model=name, **{key: k[key] for key in ("launch", "view", "alloc", "sync")})
        )
        print(
            f"  {name:18s} {k['launch']:7d} {k['launch'] / base:6.2f} {k['view']:6d} "
            f"{k['alloc']:6d} {k['sync']:5d}"
        )
    if args.top:
        for name, c in counts.items():
            top = ", ".join(f"{op} {m}" for op, m in c.ops.most_common(args.top))
            print(f"\n{name}: {top}")
    if args.json:
        import json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(batch=args.batch, seq_len=args.seq_len, dtype=args.dtype, argv=sys.argv[1:])
        args.json.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
