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
per parameter group on CUDA whatever the model). The CPU runs ``F.rms_norm`` as about 18
small ops (forward and backward); CUDA runs it as one fused kernel each way when the input
and the gain share a dtype, so the ``cuda-like`` column counts every RMSNorm as two launches
(the rest as measured): the closer proxy of a GPU step.

    python benchmarks/train_ops.py                       # tiny preset, batch 8, n = 256
    python benchmarks/train_ops.py --dtype bf16 --top 15 # the most launched ops of each model
"""

from __future__ import annotations

import argparse
import collections
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from anyorder import build_model, orders, preset
from anyorder.layers import RMSNorm

ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
SYNC = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item", "masked_select"}


def kind_of(func) -> str:
    """``launch``, ``view``, ``alloc`` or ``sync`` for an aten overload."""
    name = func.overloadpacket.__name__
    if name in SYNC:
        return "sync"
    if name in ALLOC:
        return "alloc"
    if getattr(func, "is_view", False) or name in ("detach", "alias", "lift_fresh", "_unsafe_view"):
        return "view"
    return "launch"


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name and by :func:`kind_of` while active (and not ``paused``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.kinds: collections.Counter[str] = collections.Counter()
        self.paused = False

    def add(self, name: str) -> None:
        self.kinds["launch"] += 1
        self.ops[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            kind = kind_of(func)
            self.kinds[kind] += 1
            if kind == "launch":
                self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _FusedNorm(torch.autograd.Function):
    """``F.rms_norm`` counted as CUDA's fused kernel: one launch forward, one backward."""

    @staticmethod
    def forward(ctx, x, weight, eps, counter):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.counter = eps, counter
        counter.paused = True
        try:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        finally:
            counter.paused = False
            counter.add("rms_norm (fused)")

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        ctx.counter.paused = True
        try:
            with torch.enable_grad():
                x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
                y = F.rms_norm(x, (x.shape[-1],), weight, ctx.eps)
                gx, gw = torch.autograd.grad(y, (x, weight), gy)
        finally:
            ctx.counter.paused = False
            ctx.counter.add("rms_norm_backward (fused)")
        return gx, gw, None, None


def count_step(
    model, tokens, order, blocks=None, dtype: str = "fp32", fused_norms: bool = False
) -> OpCounter:
    """Ops of one forward + backward of ``model.loss`` (gradients are reset after)."""
    ctx = torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16")
    counter = OpCounter()

    def fused(norm, x):
        return _FusedNorm.apply(x, norm.weight.to(x.dtype), norm.eps, counter)

    patch = mock.patch.object(RMSNorm, "forward", fused) if fused_norms else nullcontext()
    with patch, counter:
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
        out[name].cuda_like = count_step(model, tokens, order, blocks, dtype, True).kinds["launch"]
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
    base_cuda = counts["gpt"].cuda_like
    print(
        f"aten ops per training step (forward + backward), tiny, batch {args.batch}, "
        f"n = {args.seq_len}, {args.dtype}"
    )
    head = ["model", "launch", "x gpt", "cuda-like", "x gpt", "view", "alloc", "sync"]
    print(f"  {head[0]:18s} " + " ".join(f"{h:>9s}" for h in head[1:]))
    rows = []
    for name, c in counts.items():
        k = c.kinds
        keys = ("launch", "view", "alloc", "sync")
        rows.append(dict(model=name, cuda_like=c.cuda_like, **{key: k[key] for key in keys}))
        print(
            f"  {name:18s} {k['launch']:9d} {k['launch'] / base:9.2f} {c.cuda_like:9d} "
            f"{c.cuda_like / base_cuda:9.2f} {k['view']:9d} {k['alloc']:9d} {k['sync']:9d}"
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
