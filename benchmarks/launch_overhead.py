"""Launch-overhead proxies on the CPU: aten ops, sync points and attention shapes per pass.

On a GPU a decoding pass of a small model is bound by kernel launches and by whatever makes
the host wait for the device, not by arithmetic. Neither needs a GPU to be counted: every
aten op a sampler (or a training step) dispatches is seen by a ``TorchDispatchMode``. For
each sampler, at the ``tiny`` preset, batch 8, n = 256 by default, this prints

* ``ops/pass``: every aten op dispatched during one generation, over its forward passes;
* ``launch/pass``: the same without views and allocations (ops that launch no kernel on a
  GPU: ``view``, ``expand``, ``slice``, ``empty``, ...; see :func:`launches_kernel`), on the
  CPU's path (which packs the real entries of mostly padded passes: fewer matmul rows,
  more index ops) and on the GPU's path (``gpu launch``: no packing, as CUDA runs it, and
  what a CUDA graph captures; each RMSNorm counted as the one fused kernel CUDA runs, where
  the CPU runs six: :func:`fused_norms`);
* ``x gpt``: ``gpu launch`` over that of the left-to-right GPT's sequential decoding;
* ``syncs/pass`` and ``gpu syncs`` (per pass) inside the decode loop, on the CPU's path and
  on the GPU's: ops and calls that would make the host wait for the device (``item``,
  ``bool()``, ``nonzero``, ``equal``, ``unique``, ``tolist``, ``.cpu()``, ``.numpy()``;
  :data:`SYNC_OPS`, and the Python-level reads patched in :func:`host_reads`; reads of
  pinned host staging memory are not syncs). On the CPU reading a tensor waits for nothing,
  so the CPU's path may read where it saves work; the target is the GPU's path.
  The loop is the span from the first attention call to the last token draw; ``setup syncs``
  are the ones before and after it (checking the request, building the plan);
* the speculative rows (``*-spec-K*``) and the confidence-ordered ones (``*-confidence-*``)
  decide each pass after the last. The speculative sampler keeps its rows' counters on the
  device and reads them two passes late from pinned memory (not a sync: the host waits at
  most for the pass before last while the last is queued; once in eight passes, or when
  the read may end the decode: printed under the row); the confidence order reads the
  chosen positions once per pass (counted in ``syncs/pass``). Their ``passes`` are the
  model calls (random weights: nearly flat conditionals, so more drafts are accepted than
  with a trained model);
* ``shapes``: distinct attention ``(queries, keys)`` shapes per generation (each needs its own
  CUDA graph and its own plan in shape-specialised attention backends), on the CPU's path
  (which reads exactly the keys a pass needs: a CPU pays per key, not per shape) and on the
  GPU's (``gpu shapes``: key levels bucketed, at most eight);
* ``graph launch`` and ``graph kernels`` (per pass), for the samplers that capture their
  passes as CUDA graphs (``graphs="emulate"`` on the GPU's path: the replay's bookkeeping
  without a graph): the host's launches, a replay counted as the one launch it is on a GPU
  (the eager draws and the first pass of each graph, its warm-up, as they are), and the
  kernels the replays run (the graphs' nodes: device time, not host time), over all the
  passes and over the replays alone (``a replay``: a steady pass, what a long decode
  runs; its ``x gpt`` is over gpt's replay).

The training rows count one forward + backward of ``model.loss`` (per step).

    python benchmarks/launch_overhead.py                     # tiny, batch 8, n = 256
    python benchmarks/launch_overhead.py --samplers aogpt-seq,armd-lemma1
    python benchmarks/launch_overhead.py --no-train --json /tmp/ops.json
    python benchmarks/launch_overhead.py --no-train --dtype bf16    # as CUDA decodes by default
    python benchmarks/launch_overhead.py --no-train --preset small --seq-len 64  # paper size
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from anyorder import build_model, orders, preset
from anyorder.sample import sample

SYNC_OPS = (
    "_local_scalar_dense",  # item(), bool(), int(), float() of a tensor
    "is_nonzero",
    "nonzero",
    "equal",
    "allclose",
    "_unique",
    "unique_consecutive",
    "unique_dim",
    "masked_select",
)
"""aten ops whose result (or its shape) the host must read back from the device."""
NO_KERNEL = (
    "empty",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "empty_like",
    "lift_fresh",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "_unsafe_view",
)
"""aten ops that allocate or read metadata only: no kernel launch."""


def is_view(func) -> bool:
    """An op that returns an alias of an input without writing it (``view``, ``slice``...)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def launches_kernel(func) -> bool:
    """Whether an aten op launches a kernel on a GPU: not a view, not an allocation."""
    return not is_view(func) and func.overloadpacket.__name__ not in NO_KERNEL


class Counter(TorchDispatchMode):
    """Records every aten op: its name, whether it launches a kernel, attention shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []  # (kind, detail) in dispatch order
        self.ops = 0
        self.launches = 0
        self.in_replay = False  # inside an emulated CUDA graph replay (see replays_counted)
        self.replays = 0
        self.graph_kernels = 0  # kernels the replays ran: the graphs' nodes
        self.paused = False  # inside an op counted as the one kernel CUDA runs for it

    def fused(self, name: str) -> None:
        """Count one kernel-launching op that the CPU runs as several (:func:`fused_norms`)."""
        self.ops += 1
        if self.in_replay:
            self.graph_kernels += 1
        else:
            self.launches += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.ops += 1
        if launches_kernel(func):
            if self.in_replay:
                self.graph_kernels += 1
            else:
                self.launches += 1
        if "scaled_dot_product" in name or "flex_attention" in name:
            q, k = args[0], args[1]
            self.events.append(("attn", f"{q.shape[-2]}x{k.shape[-2]}"))
        elif name == "multinomial":
            self.events.append(("draw", ""))
        elif any(name == s or name.startswith(s) for s in SYNC_OPS) and not getattr(
            args[0],
            "_anyorder_host_staging",
            False,  # host memory: reading it waits for nothing
        ):
            self.events.append(("sync", name))
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_reads(counter: Counter):
    """Count the Python-level reads of tensor data (``tolist``, ``numpy``, ``cpu``...): on the
    CPU they dispatch no op, on a GPU each waits for the device."""
    saved = {}

    def wrap(name: str) -> Callable:
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, **k):
            if not getattr(self, "_anyorder_host_staging", False):  # pinned host memory
                counter.events.append(("sync", name))
            return orig(self, *a, **k)

        saved[name] = orig
        return counted

    for name in ("tolist", "numpy", "cpu", "__array__"):
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(torch.Tensor, name, orig)


@contextlib.contextmanager
def replays_counted(counter: Counter):
    """Count each replay of an emulated CUDA graph (``graphs="emulate"``) as the one launch
    it is on a GPU, and the kernels it runs as the graph's nodes. The first call of a
    runner is the eager warm-up (its launches count as launches)."""
    from anyorder.sampling import graphs

    saved = {}
    for cls in (graphs.PassRunner, getattr(graphs, "RoundRunner", None)):
        if cls is None:
            continue
        orig = saved[cls] = cls.__call__

        def call(self, *a, _orig=orig, **k):
            if self.graph is None:
                return _orig(self, *a, **k)
            counter.replays += 1
            counter.launches += 1
            counter.in_replay = True
            try:
                return _orig(self, *a, **k)
            finally:
                counter.in_replay = False

        cls.__call__ = call
    try:
        yield
    finally:
        for cls, orig in saved.items():
            cls.__call__ = orig


def measure(fn: Callable[[], int]) -> dict:
    """Run ``fn`` (returns its forward passes) under the counters."""
    counter = Counter()
    with counter, host_reads(counter), replays_counted(counter):
        passes = fn()
    ev = counter.events
    attn = [i for i, (kind, _) in enumerate(ev) if kind == "attn"]
    draws = [i for i, (kind, _) in enumerate(ev) if kind == "draw"]
    lo = attn[0] if attn else 0
    hi = max(draws[-1] if draws else 0, attn[-1] if attn else 0)
    syncs = [i for i, (kind, _) in enumerate(ev) if kind == "sync"]
    inside = [ev[i][1] for i in syncs if lo <= i <= hi]
    shapes = {detail for kind, detail in ev if kind == "attn"}
    return dict(
        passes=passes,
        ops=counter.ops,
        launches=counter.launches,
        ops_per_pass=counter.ops / passes,
        launches_per_pass=counter.launches / passes,
        loop_syncs=len(inside),
        loop_syncs_per_pass=len(inside) / passes,
        loop_sync_ops=sorted(set(inside)),
        setup_syncs=len(syncs) - len(inside),
        shapes=len(shapes),
        attention_calls=len(attn),
        replays=counter.replays,
        graph_kernels_per_pass=counter.graph_kernels / passes,
    )


def _counter() -> Counter | None:
    """The counting mode in force (unpaused), or None."""
    modes = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    counter = next((m for m in modes if isinstance(m, Counter)), None)
    return None if counter is None or counter.paused else counter


@contextlib.contextmanager
def cuda_attention_layout():
    """Return SDPA's output laid out as CUDA's kernels write it: flash, memory-efficient and
    cuDNN attention fill a (B, T, H, D) buffer and return it as its (B, H, T, D) transpose
    (``aten/src/ATen/native/transformers/cuda/attention.cu``: ``output.transpose(1, 2)``),
    so merging the heads (``y.transpose(1, 2).reshape(B, T, H * D)``) is a view there; the
    CPU's kernels return (B, H, T, D) contiguous, and the merge of a pass of several slots
    would count a copy CUDA never runs. The relayout is not counted; the values are the
    same."""
    real = F.scaled_dot_product_attention

    def laid_out(q, k, v, *args, **kwargs):
        y = real(q, k, v, *args, **kwargs)
        counter = None if torch.compiler.is_compiling() else _counter()
        if counter is None or y.dim() != 4:
            return y
        counter.paused = True
        try:
            return y.transpose(1, 2).contiguous().transpose(1, 2)
        finally:
            counter.paused = False

    F.scaled_dot_product_attention = laid_out
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


@contextlib.contextmanager
def fused_norms():
    """Count ``F.rms_norm`` as the one kernel CUDA runs for it (``aten._fused_rms_norm``,
    torch >= 2.8, fp32 or with the gain in the input's dtype, as ``RMSNorm`` passes it):
    the CPU has no fused kernel and runs six (pow, mean, add, rsqrt, mul, mul), which would
    count the 17 norms of a tiny pass as 102 launches instead of 17."""
    real = F.rms_norm

    def one(x, normalized_shape, weight=None, eps=None):
        if torch.compiler.is_compiling():  # a compiled pass makes its own kernels (and
            return real(x, normalized_shape, weight, eps)  # dynamo cannot trace the below)
        counter = _counter()
        if counter is None:
            return real(x, normalized_shape, weight, eps)
        counter.paused = True
        try:
            return real(x, normalized_shape, weight, eps)
        finally:
            counter.paused = False
            counter.fused("rms_norm")

    F.rms_norm = one
    try:
        yield
    finally:
        F.rms_norm = real


@contextlib.contextmanager
def gpu_path():
    """Decode as on a GPU: never pack, bucket the key levels (both live in the plan; before
    the sampling package, the packing threshold was in ``anyorder.sample``), no prepacked
    weights, draws and confidence scores in the GPU's chunks, the norms counted as CUDA's
    fused kernels (:func:`fused_norms`), attention's output in CUDA's layout
    (:func:`cuda_attention_layout`)."""
    try:
        import anyorder.sampling.plan as where
    except ImportError:
        import anyorder.sample as where
    saved = where._PACK_BELOW, getattr(where, "BUCKET_ON_CPU", None)
    where._PACK_BELOW, where.BUCKET_ON_CPU = -1.0, True
    try:  # the passes decided one at a time (speculative, confidence): fixed widths, levels
        import anyorder.sampling.rounds as rounds
    except ImportError:
        rounds = None
    if rounds is not None:
        rounds.STATIC_ON_CPU = True
    try:  # draws and scores chunked as on a GPU (a paper-size pass is one chunk there)
        import anyorder.sampling.draws as draws
    except ImportError:
        draws = None
    if draws is not None:
        draws.GPU_CHUNKS_ON_CPU = True
    try:  # a GPU never reads prepacked weights (the CPU's, layers/linear.py)
        from anyorder.layers.linear import use_prepacked
    except ImportError:
        use_prepacked = None
    try:
        prepacked = use_prepacked(False) if use_prepacked else contextlib.nullcontext()
        with prepacked, fused_norms(), cuda_attention_layout():
            yield
    finally:
        where._PACK_BELOW, where.BUCKET_ON_CPU = saved
        if rounds is not None:
            rounds.STATIC_ON_CPU = False
        if draws is not None:
            draws.GPU_CHUNKS_ON_CPU = False


def autocast(dtype: str, cache: bool = True) -> contextlib.AbstractContextManager:
    """The CPU's bf16 autocast for ``dtype`` bf16 (nothing for fp32). ``cache=False``: as a
    CUDA graph records under autocast, without its weight-cast cache (a captured pass casts
    whatever the decode has not cast before: ``layers/casts.py``)."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", torch.bfloat16, cache_enabled=cache)


def samplers(n: int) -> dict[str, tuple[str, dict]]:
    """name -> (model kind, keyword arguments of :func:`anyorder.sample.sample`)."""
    T = n // 4
    rows = {
        "gpt-seq": ("gpt", {}),
        "aogpt-seq": ("aogpt", {}),
        "armd-seq": ("armd", {}),
        f"aogpt-lemma1-T{T}": ("aogpt", dict(steps=T)),
        f"aogpt-lemma1-T{T}-shared": ("aogpt", dict(steps=T, shared_counts=True)),
        f"aogpt-lemma1-T{n}": ("aogpt", dict(steps=n)),
        f"armd-lemma1-T{T}": ("armd", dict(steps=T)),
        f"armd-lemma1-T{T}-shared": ("armd", dict(steps=T, shared_counts=True)),
        "armd-strided-S4": ("armd", dict(streams=4)),
        "aogpt-infill": ("aogpt", dict(prompt="infill")),
        "armd-infill": ("armd", dict(prompt="infill")),
        f"aogpt-infill-lemma1-T{T}": ("aogpt", dict(prompt="infill", steps=T)),
        "gpt-prompt": ("gpt", dict(prompt="prefix")),
        "gpt-seq-stop-at-eos": ("gpt", dict(stop_at_eos=256)),
    }
    for K in (2, 4, 8):  # any-order speculative sampling (issue 26)
        rows[f"aogpt-spec-K{K}"] = ("aogpt", dict(speculative=K))
    rows["armd-spec-K4"] = ("armd", dict(speculative=4))
    rows["aogpt-infill-spec-K4"] = ("aogpt", dict(prompt="infill", speculative=4))
    rows["aogpt-confidence-spec-K4"] = ("aogpt", dict(confidence=True, speculative=4))
    rows["armd-confidence-P4"] = ("armd", dict(confidence=True, per_pass=4))
    if "reveal" in inspect.signature(sample).parameters:  # the reference's counts (issue 15)
        rows[f"aogpt-lemma1-T{T}-reference"] = ("aogpt", dict(steps=T, reveal="reference"))
    return rows


def _sampler(kw: dict) -> Callable:
    """The sampling function of a row: :func:`sample`, or the speculative and
    confidence-ordered samplers (their options taken out of ``kw``)."""
    if kw.pop("confidence", False):
        from anyorder.sampling.confidence import confidence_sample

        return confidence_sample
    if "speculative" in kw:
        from anyorder.sampling.speculative import speculative_sample

        K = kw.pop("speculative")

        def speculative(model, n, **k):
            return speculative_sample(model, n, K, **k)

        return speculative
    return sample


def prompt_of(kind: str, n: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt shared by the batch: a prefix of n/8 tokens (``prefix``), or n/8 known
    tokens spread over the sequence, as an infilling template has (``infill``)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (n,), generator=g)
    known = torch.zeros(n, dtype=torch.bool)
    if kind == "prefix":
        known[: n // 8] = True
    else:
        known[torch.randperm(n, generator=g)[: n // 8]] = True
    return tokens, known


def _num(x: float | None, width: int = 12) -> str:
    return f"{x:{width}.1f}" if x is not None else f"{'-':>{width}s}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seq-len", type=int, default=256, help="n")
    ap.add_argument(
        "--preset",
        default="tiny",
        help="model size (small: the papers' 12 x 768, vocabulary 50,257, as the issue's GPU "
        "rows; the counts grow with the layers, not with the width)",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--samplers", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--no-train", action="store_true", help="leave out the training rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: under bf16 autocast, as anyorder sample and serve decode on CUDA (the "
        "captured rows without autocast's weight-cast cache, as a CUDA graph records)",
    )
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/launch_overhead.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, B = args.seq_len, args.batch
    models = {}
    for kind in ("gpt", "aogpt", "armd"):
        torch.manual_seed(0)
        models[kind] = build_model(preset(args.preset, kind=kind, seq_len=n)).eval()
    table = samplers(n)
    names = args.samplers.split(",") if args.samplers else list(table)
    rows = {}
    for name in names:
        kind, kw = table[name]
        kw = dict(kw)
        if "prompt" in kw:
            kw["prompt"], kw["known"] = prompt_of(kw["prompt"], n, B)
        model = models[kind]
        fn = _sampler(kw)

        last = {}

        def run(model=model, kw=kw, fn=fn, graphs=None, last=last) -> int:
            g = torch.Generator().manual_seed(0)
            extra = {} if graphs is None else dict(graphs=graphs)
            with torch.no_grad(), autocast(args.dtype, cache=graphs is None):
                out = last["out"] = fn(model, n, batch=B, generator=g, **kw, **extra)
            return out.forward_passes

        run()  # warm-up: lazy tables, allocator
        rows[name] = measure(run)
        with gpu_path():
            gpu = measure(run)
            if "count_reads" in last["out"].extra:  # pinned, two passes late: not syncs
                rows[name]["gpu_count_reads"] = last["out"].extra["count_reads"], gpu["passes"]
            captured = None
            if fn is sample or fn.__name__ in ("speculative", "confidence_sample"):  # capture
                captured = measure(partial(run, graphs="emulate"))
        if captured is not None:  # a replay is one launch; the rest are eager
            rows[name].update(
                graph_launches_per_pass=captured["launches_per_pass"],
                graph_kernels_per_pass=captured["graph_kernels_per_pass"],
                graph_replays=captured["replays"],
                graph_kernels_per_replay=captured["graph_kernels_per_pass"]
                * captured["passes"]
                / max(captured["replays"], 1),
                graph_loop_syncs=captured["loop_syncs"],
            )
        rows[name].update(
            gpu_launches_per_pass=gpu["launches_per_pass"],
            gpu_ops_per_pass=gpu["ops_per_pass"],
            gpu_shapes=gpu["shapes"],
            gpu_loop_syncs=gpu["loop_syncs"],
            gpu_loop_syncs_per_pass=gpu["loop_syncs_per_pass"],
            gpu_loop_sync_ops=gpu["loop_sync_ops"],
        )
    if not args.no_train:
        for kind in ("gpt", "aogpt", "armd"):
            model = models[kind].train()
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, 256, (B, n), generator=g)
            order = None if kind == "gpt" else orders.uniform(B, n, g).order

            def step(model=model, tokens=tokens, order=order) -> int:
                model.loss(tokens, order).backward()
                model.zero_grad(set_to_none=True)
                return 1

            step()
            rows[f"train-{kind}"] = measure(step)
            r = rows[f"train-{kind}"]
            r.update(
                gpu_launches_per_pass=r["launches"], gpu_shapes=r["shapes"], gpu_loop_syncs=0,
                gpu_loop_syncs_per_pass=0.0, gpu_loop_sync_ops=[],
            )  # fmt: skip
            model.eval()
    ref = rows.get("gpt-seq", {}).get("gpu_launches_per_pass")
    ref_replay = rows.get("gpt-seq", {}).get("graph_kernels_per_replay")
    what = f"{args.preset} preset, batch {B}, n = {n}, {args.dtype}"
    print(f"\n{what}: per forward pass (training: per step)")
    head = (
        f"{'sampler':30s} {'passes':>6s} {'ops/pass':>9s} {'launch/pass':>11s} "
        f"{'gpu launch':>10s} {'x gpt':>6s} {'syncs/pass':>10s} {'gpu syncs':>9s} "
        f"{'setup syncs':>11s} "
        f"{'shapes':>6s} {'gpu shapes':>10s} {'graph launch':>12s} {'graph kernels':>13s} "
        f"{'a replay':>8s} {'x gpt':>6s}"
    )
    print(head)
    print("-" * len(head))
    for name, r in rows.items():
        gpu = r["gpu_launches_per_pass"]
        ratio = f"{gpu / ref:6.2f}" if ref and "train" not in name else ""
        replay = r.get("graph_kernels_per_replay")
        replay_ratio = f"{replay / ref_replay:6.2f}" if replay and ref_replay else ""
        print(
            f"{name:30s} {r['passes']:6d} {r['ops_per_pass']:9.1f} {r['launches_per_pass']:11.1f} "
            f"{gpu:10.1f} {ratio:>6s} {r['loop_syncs_per_pass']:10.2f} "
            f"{r['gpu_loop_syncs_per_pass']:9.2f} {r['setup_syncs']:11d} "
            f"{r['shapes']:6d} {r['gpu_shapes']:10d} {_num(r.get('graph_launches_per_pass'))} "
            f"{_num(r.get('graph_kernels_per_pass'), 13)} {_num(replay, 8)} {replay_ratio:>6s}"
        )
        if "gpu_count_reads" in r:
            print(
                f"{'':30s} GPU path: the host read the rows' counts %d times in %d passes "
                "(pinned memory, two passes late)" % tuple(r["gpu_count_reads"])
            )
        for path, ops in (("CPU", r["loop_sync_ops"]), ("GPU", r["gpu_loop_sync_ops"])):
            if ops:
                print(f"{'':30s} syncs in the loop, {path} path: {', '.join(ops)}")
    decode = {k: v for k, v in rows.items() if not k.startswith("train")}
    checks = [
        dict(
            target="distinct attention shapes per generation, GPU path, <= 8 (every sampler)",
            measured=max(r["gpu_shapes"] for r in decode.values()),
            verdict="met" if all(r["gpu_shapes"] <= 8 for r in decode.values()) else "NOT met",
        ),
        dict(
            target="no sync point inside the decode loop, GPU path (every sampler)",
            measured=sum(r["gpu_loop_syncs"] for r in decode.values()),
            verdict="met" if all(r["gpu_loop_syncs"] == 0 for r in decode.values()) else "NOT met",
        ),
    ]
    captured = [r for r in decode.values() if "graph_loop_syncs" in r]
    if captured:
        checks.append(
            dict(
                target="no sync point inside the decode loop, captured path (every sampler)",
                measured=sum(r["graph_loop_syncs"] for r in captured),
                verdict="met" if all(r["graph_loop_syncs"] == 0 for r in captured) else "NOT met",
            )
        )
    if ref:
        worst = max(r["gpu_launches_per_pass"] / ref for r in decode.values())
        checks.append(
            dict(
                target="kernel-launching ops per pass, GPU path, <= 1.3 x gpt's (every sampler)",
                measured=worst,
                verdict="met" if worst <= 1.3 else "NOT met",
            )
        )
    print()
    for c in checks:
        print(f"  {c['target']:66s} {c['measured']!s:>8.8s}  {c['verdict']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(preset=args.preset, batch=B, n=n, dtype=args.dtype, torch=torch.__version__)
    args.json.write_text(json.dumps(dict(meta=meta, rows=rows, targets=checks), indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
