"""CUDA graphs of the decoding passes: each group's pass captured once, then replayed.

On by default on CUDA (``graphs="auto"``: every sampler, ``anyorder sample``,
``anyorder.load(...).generate``, the server, ``transformers``' ``generate``, the harness);
``graphs=False`` / ``--no-cuda-graphs`` decodes eagerly. On a CPU, ``auto`` is eager.

Design choices:

* ``torch.cuda.CUDAGraph`` directly, not ``torch.compile(mode="reduce-overhead")``: a pass
  is already a fixed sequence of eager kernels over static buffers (the plan fixes every
  shape), so capturing it is all that is needed. Direct capture costs one eager pass per
  group (no compilation: minutes at paper size, and again for every new shape or guard),
  replays exactly the kernels the eager path runs (the same logits, so the equivalence tests
  of the eager path carry over), and keeps the sampling (an explicit ``torch.Generator``, a
  data-dependent top-p) outside the graph, where it stays eager and bit-reproducible.
* Inside the graph nothing comes from the host: a pass reads its row of the group's table by
  an ``index_select`` at a device counter that the graph itself increments, so a replay
  takes no arguments. The caches, the tokens and the tables are static tensors.
* Capture: the group's first pass runs eagerly on a side stream (it warms up cuBLAS and
  allocates the adaLN and RoPE tables), then the same callable is recorded (recording
  runs nothing). Each graph has its own memory pool (groups replay interleaved; a pass's
  intermediates are a few MB). Under autocast the weight-cast cache is off while recording
  (a cached cast would be freed under the graph): the passes read the weights their decode
  cast once instead (``layers/casts.py``), so a replay casts none.
* ``mode="emulate"`` runs the same bookkeeping on any device without a graph: the first
  call records, a replay re-runs the callable through the device counter and copies into
  the static output. This is how the CPU tests cover the replay logic.
* Rounds (:class:`RoundRunner`): the speculative sampler decides each pass after the last,
  so a pass's table is built on the device from the rows' counters. Its whole round (the
  table, the pass, the ratio tests, the next drafts, the counters) reads and writes static
  tensors and draws no random number (they are drawn ahead, eagerly:
  :class:`~anyorder.sampling.verify.AheadRandoms`), so it is captured as one graph per key
  level (at most seven) and replayed: a pass is one replay and three eager draws.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

_COMPILE: ContextVar[str | None] = ContextVar("anyorder_compile_passes", default=None)
RECOMPILE_LIMIT = 256
"""Compiled variants of one pass function kept while :func:`compiled_passes` is on (one per
pass shape and key level, per request shape): past it, dynamo runs the pass eagerly."""


@contextlib.contextmanager
def compiled_passes(backend: str = "inductor") -> Iterator[None]:
    """Compile every decoding pass of the block with ``torch.compile(fullgraph=True)``
    before it is captured (on CUDA) or replayed (elsewhere): the planned samplers' passes,
    and the speculative and confidence-ordered rounds (their ratio tests and drafts
    included). Each pass shape (and key level) compiles once, at its runner's first call
    (seconds to minutes at paper size; never again for the same request shape, and never
    while a CUDA graph records: tested); the tokens are those of the eager decode (tested
    at random sizes). ``backend``: :func:`torch.compile`'s (``aot_eager`` traces
    without generating kernels: the tests' quick check)."""
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        from anyorder.errors import SamplingError, preview

        raise SamplingError(
            f"compiled passes: backend {preview(backend)} is not one of torch.compile's "
            f"({', '.join(known)}); use inductor (the default) or aot_eager"
        )
    token = _COMPILE.set(backend)
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            yield
    finally:
        _COMPILE.reset(token)


def compiling() -> str | None:
    """The backend :func:`compiled_passes` set (None: passes run as they are)."""
    return _COMPILE.get()


def capture_report(mode: str, runners) -> dict | None:
    """What capturing (and compiling) the runners' passes cost, for the callers to report
    (``SampleResult.extra["graphs"]``; None: no runner)."""
    runners = list(runners)
    if not runners:
        return None
    return {
        "mode": mode,
        "shapes": len(runners),
        "capture_s": sum(r.capture_s for r in runners),
        "compiled": compiling(),
    }


def _compiled(fn: Callable) -> Callable:
    backend = _COMPILE.get()
    if backend is None:
        return fn
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)


GRAPH_MODES = ("off", "cuda", "emulate", "auto")
"""``auto`` (every sampler's default): ``cuda`` on a CUDA device, ``off`` elsewhere."""


class PassRunner:
    """Runs the passes of one group in order, captured once as a CUDA graph and replayed.

    Args:
        fn: one pass, ``fn(table_row) -> logits``; it may only read and write static tensors.
        table: (P, rows, F, width) the group's table on the device.
        mode: ``cuda`` (capture and replay) or ``emulate`` (the same logic, no graph).
    """

    def __init__(self, fn: Callable[[Tensor], Tensor], table: Tensor, mode: str) -> None:
        self.fn, self.table, self.mode = _compiled(fn), table, mode
        self.counter = torch.zeros(1, dtype=torch.long, device=table.device)
        self.graph = None
        self.out: Tensor | None = None
        self.capture_s = 0.0
        """Host seconds the capture took (its warm-up pass launched, the pass recorded)."""

    def _select(self) -> Tensor:
        """This pass's table row, by the device counter; the counter moves on."""
        row = self.table.index_select(0, self.counter)[0]
        self.counter.add_(1)
        return row

    def __call__(self) -> Tensor:
        """Logits of the group's next pass. A replay's output is the same tensor each time:
        read it before the next call."""
        if self.graph is None:
            start = time.perf_counter()
            out = self._record()
            self.capture_s = time.perf_counter() - start
            return out
        if self.mode == "cuda":
            self.graph.replay()
            return self.out
        return self.out.copy_(self.fn(self._select()))

    def _record(self) -> Tensor:
        if self.mode == "emulate":
            out = self.fn(self._select())
            self.out, self.graph = out.clone(), "recorded"
            return out
        self.graph, out, self.out = capture(lambda: self.fn(self._select()))
        return out


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object, object]:
    """Run ``fn`` once eagerly on a side stream (the warm-up: a real call), then record it
    as a CUDA graph (recording runs nothing). Returns the graph, the warm-up's result, and
    the recorded call's (static tensors, rewritten by each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # the warm-up under the recording's autocast (no cast cache): a compiled pass guards on
    # it, and a compile while recording fails
    with torch.cuda.stream(side), _no_cast_cache():
        out = fn()  # the real call, eagerly (warm-up)
    torch.cuda.current_stream().wait_stream(side)
    for t in _tensors(out):
        t.record_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    # thread_local: a server's other threads may use CUDA while this one records
    with _no_cast_cache(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
        recorded = fn()  # recorded only: runs at each replay
    return graph, out, recorded


def _tensors(out: object) -> list[Tensor]:
    """The tensors of a call's result: a tensor, a dict of tensors, or None."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        return [v for v in out.values() if isinstance(v, Tensor)]
    return []


class RoundRunner:
    """One round of a sampler that decides each pass after the last (speculative decoding),
    captured once as a CUDA graph and replayed.

    ``fn()`` takes no argument: it reads and updates static tensors in place (the rows'
    counters, the tokens, the caches, the randoms drawn ahead), and returns None or a dict
    of tensors that a replay rewrites (read it before the next call). ``static()`` lists the
    tensors ``fn`` must keep (the same storage at every call): ``emulate`` checks that no
    call rebinds one, the mistake a graph would hide (it keeps reading the old storage).
    """

    def __init__(
        self, fn: Callable[[], dict | None], mode: str, static: Callable[[], list[Tensor]]
    ) -> None:
        self.fn, self.mode, self.static = _compiled(fn), mode, static
        self.graph = None
        self.out: dict | None = None
        self.capture_s = 0.0
        self.storage: list[int] = []

    def __call__(self) -> dict | None:
        if self.graph is None:
            start = time.perf_counter()
            if self.mode == "emulate":
                self.storage = [t.data_ptr() for t in self.static()]
                out = self.fn()
                self.out, self.graph = out, "recorded"
                self._check()
            else:
                self.graph, out, self.out = capture(self.fn)
            self.capture_s = time.perf_counter() - start
            return out
        if self.mode == "cuda":
            self.graph.replay()
            return self.out
        out = self.fn()
        self._check()
        for name, t in (out or {}).items():  # the replay's outputs, in the recorded storage
            self.out[name].copy_(t)
        return self.out

    def _check(self) -> None:
        now = [t.data_ptr() for t in self.static()]
        if now != self.storage:
            raise RuntimeError(
                "a captured round rebound a static tensor (a replay would read the old one)"
            )


def _no_cast_cache():
    """Autocast as it is, without its weight-cast cache (not allowed under capture)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", torch.get_autocast_dtype("cuda"), cache_enabled=False)


def resolve_mode(graphs: bool | str, device: torch.device) -> str:
    """``graphs`` as given to a sampler (False/True or a mode name) to a mode: ``auto``, the
    default, captures on CUDA and runs eagerly elsewhere."""
    from anyorder.errors import SamplingError

    mode = {False: "off", True: "cuda"}.get(graphs, graphs) if isinstance(graphs, bool) else graphs
    if mode not in GRAPH_MODES:
        raise SamplingError(f"graphs={graphs!r}: use True, False, or one of {GRAPH_MODES}")
    if mode == "auto":
        mode = "cuda" if device.type == "cuda" else "off"
    if mode == "off" and compiling() is not None:  # compiled passes go through the runners
        return "emulate"
    if mode == "cuda" and device.type != "cuda":
        raise SamplingError(
            f"CUDA graphs need a CUDA device; the model is on {device.type} (leave graphs off)"
        )
    return mode
