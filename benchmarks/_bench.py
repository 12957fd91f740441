"""What every benchmark script shares: threads, clocks, round-robin timing, tables, JSON.

Design choices:

* Ratios, not absolute times: every side of a ratio is timed in the same run, round-robin
  (A, B, C, A, B, C, ...), and the median of the rounds is reported, so that a burst of load
  on a shared machine hits every side alike.
* Two clocks. ``wall`` is what a user waits; ``cpu`` is the CPU time of this process
  (``time.process_time``). With one thread the CPU time is the work done, and it does not
  count the time the process waits for a core that another program holds, so on a loaded
  machine it is the better estimate of the quiet-machine wall time. The scripts report
  ratios on the ``cpu`` clock by default on the CPU (``--clock wall`` switches) and on the
  ``wall`` clock on CUDA (the host's CPU time says nothing about the GPU's).
* One thread by default on the CPU (``--threads``): ratios are then free of the thread
  pool's scaling, and the numbers are reproducible on a machine shared with others.
* The best round by default (``--stat min``), as ``timeit`` does: other programs only ever
  add time (CPU time too, through the caches and memory bandwidth they share), so the
  fastest round of each side is the closest to its time on a quiet machine; ``--stat
  median`` reports the typical round instead. Every round is kept in the JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def add_common(ap, default_json: str) -> None:
    """The flags every benchmark script takes."""
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None, help="see _bench.py")
    ap.add_argument("--stat", choices=["min", "median"], default="min", help="see _bench.py")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=Path(default_json))


def setup(args) -> torch.device:
    """Apply ``--threads``; resolve ``--clock``; return the device."""
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.clock is None:
        args.clock = "cpu" if device.type == "cpu" else "wall"
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float, object]:
    """``(wall seconds, cpu seconds, result)`` of one call."""
    sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    sync(device)
    return time.perf_counter() - w0, time.process_time() - c0, out


def round_robin(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    budget: float | None = None,
) -> tuple[dict[str, dict[str, list[float]]], dict[str, object]]:
    """Time every function once per round, ``repeats`` rounds (after one warm-up round).

    ``budget``: seconds for the whole call: after the warm-up round (which also captures
    CUDA graphs, so it is the slowest) as many rounds as fit, at least one, at most
    ``repeats``.

    Returns ``({name: {"wall": [...], "cpu": [...]}}, {name: last result})``.
    """
    out = {name: {"wall": [], "cpu": []} for name in fns}
    last = {}
    start = time.perf_counter()
    for name, fn in fns.items():  # warm-up: allocator, caches, lazy inits
        last[name] = fn()
    sync(device)
    if budget is not None:
        per_round = time.perf_counter() - start
        repeats = max(1, min(repeats, int((budget - per_round) / max(per_round, 1e-9))))
    for _ in range(repeats):
        for name, fn in fns.items():
            w, c, last[name] = timed(fn, device)
            out[name]["wall"].append(w)
            out[name]["cpu"].append(c)
    return out, last


def summary(times: dict[str, list[float]], clock: str, stat: str = "median") -> float:
    """The ``stat`` (min or median) of the rounds on ``clock``."""
    return min(times[clock]) if stat == "min" else statistics.median(times[clock])


def machine() -> dict:
    """What the run ran on (the load average says how quiet the machine was)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    info = dict(
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        cpus=os.cpu_count(),
        load_avg_1_5_15=[round(x, 2) for x in load],
    )
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def verdict(value: float, bound: float, at_most: bool = True) -> str:
    """``met`` / ``NOT met`` for a target ``value <= bound`` (or ``>=``)."""
    ok = value <= bound if at_most else value >= bound
    return "met" if ok else "NOT met"


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """A fixed-width table: strings left, numbers right (3 decimals for floats)."""

    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    print(f"\n{title}")
    print(
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))
        )
    )
    for r in cells:
        print(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))
            )
        )


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)  # never a half-written file
    print(f"wrote {path}")
