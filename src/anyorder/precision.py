"""bf16 or fp32: the one rule behind ``train.dtype=auto``, the demo and Muon's iteration.

bf16 autocast is fast only where the processor computes in bf16: a GPU, or a CPU with
avx512_bf16 or AMX. A CPU without them (most laptops: AVX2 only) converts every operand
and runs bf16 matrix products 7-13x slower than fp32 (docs/performance.md). What a CPU
does is measured, not guessed from its name.

Design choices:

* :func:`use_bf16` is the decision: ``bf16``/``fp32`` as asked; ``auto`` is bf16 on CUDA,
  and on the CPU bf16 only where :func:`bf16_cost` finds bf16 clearly faster (at most
  :data:`FAST` of fp32's time). :func:`bf16_is_fast` is the same question without a
  setting (Muon's Newton-Schulz iteration asks it).
* :func:`bf16_cost` times the products of a linear layer at the model's width (forward,
  and the two products of its backward) in fp32 and under bf16 autocast, interleaved, the
  fastest of a few repeats each: well under a second, once per CPU. The ratio is kept in
  ``<cache home>/precision.json`` under the CPU's identity (:func:`cpu_identity`: model
  name, flags, torch version, the ``ONEDNN_MAX_CPU_ISA``/``ATEN_CPU_CAPABILITY``
  variables that limit the kernels) and the width. It runs on one thread: on a shared
  machine two threads beside other jobs time the scheduler, not the kernels (the ratio
  came out 2.4 on one thread's 0.5 under a load of 1.6 on 2 cores), and a ratio of
  one core's speeds is what tells a CPU with bf16 units from one without.
* ``ANYORDER_CPU_BF16=1`` (or ``0``) answers without measuring, for a CPU the probe
  misjudges and for the test suite (which must run alike on every CPU).
* The cache is a hint and never trusted: a file that is not a small regular file (a
  symlink, a folder, a huge file), does not parse, or holds anything but a finite ratio
  in [:data:`RATIO_RANGE`] for this very identity is ignored, measured again and
  replaced; a cache that cannot be written is left alone (the answer is used anyway).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import stat
import time
from pathlib import Path

import torch

from anyorder.atomic import write_text
from anyorder.config.run import cache_home
from anyorder.errors import AnyorderError, ConfigError

FAST = 0.9
"""bf16 is used on the CPU where its products take at most this fraction of fp32's time."""
RATIO_RANGE = (1e-3, 1e3)
"""The bf16/fp32 time ratios a cache entry may hold; anything else is measured again."""
CACHE_NAME = "precision.json"
MAX_CACHE_BYTES = 64 * 1024
"""A larger cache file is not read (and is replaced)."""
MAX_ENTRIES = 64
"""The cache keeps the latest entries only (CPUs x widths x settings)."""
OVERRIDE = "ANYORDER_CPU_BF16"
"""``1`` or ``0``: the answer for this CPU without measuring (the test suite sets ``0``, so
that it runs alike on every CPU)."""
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""Environment variables that limit the CPU kernels' instruction set, so change the answer."""
_TOKENS = 65536
"""Rows x width of the probe's input (256 rows at width 256, at least 256 rows): large
enough for the kernels' regime, small enough that the slow case stays under a second."""
_REPEATS = 3
_MAX_WIDTH = 256
"""Wider models are probed at this width (the answer is the CPU's; this bounds the time)."""
_BUDGET_S = 0.5
"""Stop repeating once the probe has run this long (one timed round always runs)."""


def use_bf16(dtype: str, device: torch.device, width: int) -> bool:
    """Whether a run asking for ``dtype`` (``auto``, ``bf16`` or ``fp32``) on ``device``
    autocasts to bf16; ``width`` is the model's ``d_model`` (what ``auto`` measures at)."""
    if dtype == "auto":
        return bf16_is_fast(device, width)
    return dtype == "bf16"


def bf16_is_fast(device: torch.device, width: int) -> bool:
    """True on CUDA, and on a CPU whose bf16 products are clearly faster than fp32's."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    forced = os.environ.get(OVERRIDE)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ConfigError(
                f"{OVERRIDE}={forced!r}: use 1 (bf16 autocast on this CPU) or 0 (fp32), or "
                "unset it to measure"
            )
        return forced == "1"
    return bf16_cost(width) <= FAST


def bf16_cost(width: int) -> float:
    """bf16 autocast's time over fp32's for a linear layer of ``width`` on this CPU (below 1:
    bf16 is faster), measured once and cached (see the module notes)."""
    width = min(int(width), _MAX_WIDTH)
    key = cache_key(width)
    path = cache_path()
    entries = read_entries(path)
    ratio = entries.get(key)
    if ratio is None:
        ratio = measure(width)
        entries.pop(key, None)
        entries[key] = ratio
        write_entries(path, dict(list(entries.items())[-MAX_ENTRIES:]))
    return ratio


def slower_note(key: str, width: int) -> str | None:
    """One line for a setting that names bf16 on a CPU where bf16 is slower (None where it is
    not, or where :data:`OVERRIDE` answers instead): what it costs, measured, and the fix."""
    if os.environ.get(OVERRIDE) is not None:
        return None
    ratio = bf16_cost(width)
    if ratio <= 1.0:
        return None
    return (
        f"{key}=bf16: bf16 autocast is {ratio:.1f}x slower than fp32 on this CPU (its matrix "
        f"products at width {width}, measured); {key}=auto would use fp32"
    )


def cpu_identity() -> dict[str, str]:
    """What the probe's answer depends on: the CPU, its flags, torch and the ISA limits."""
    name, flags = "", ""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "model name" and not name:
                name = v.strip()
            elif k.strip() in ("flags", "Features") and not flags:  # x86, Arm
                flags = " ".join(sorted(v.split()))
    name = name or platform.processor() or platform.machine()
    ident = {
        "cpu": name,
        "flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
    }
    ident.update({v: os.environ.get(v, "") for v in ISA_VARIABLES})
    return ident


def cache_key(width: int) -> str:
    """The cache entry's name: a digest of :func:`cpu_identity` and ``width``."""
    text = json.dumps({**cpu_identity(), "width": int(width)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_path() -> Path:
    """``precision.json`` in the cache home (``$ANYORDER_CACHE``, ...)."""
    return cache_home() / CACHE_NAME


def read_entries(path: Path) -> dict[str, float]:
    """The cache's valid entries; nothing at all from a file that is not a small regular
    file of the expected shape (it is replaced on the next write)."""
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CACHE_BYTES:
            return {}
        with open(path, "rb") as f:
            doc = json.loads(f.read(MAX_CACHE_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError):  # absent, unreadable, not UTF-8, not JSON
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items() if _valid(k, v)}


def _valid(key: object, ratio: object) -> bool:
    if not isinstance(key, str) or len(key) != 32 or type(ratio) is not float:
        return False
    return math.isfinite(ratio) and RATIO_RANGE[0] <= ratio <= RATIO_RANGE[1]


def write_entries(path: Path, entries: dict[str, float]) -> None:
    """Replace the cache atomically (a symlink in its place is replaced, never followed); a
    cache that cannot be written is skipped: the answer only costs a measurement."""
    with contextlib.suppress(OSError, AnyorderError):
        write_text(path, json.dumps({"entries": entries}, indent=1) + "\n")


def measure(width: int) -> float:
    """bf16 autocast's time over fp32's for ``x @ W`` (forward) and the backward's two
    products, ``x: (rows, width)``, ``W: (width, 4 width)``; the fastest of a few interleaved
    repeats each, after a warm-up."""
    rows = max(256, _TOKENS // width)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=gen)
    w = torch.randn(4 * width, width, generator=gen) / width**0.5
    g = torch.randn(rows, 4 * width, generator=gen)

    def products() -> None:
        torch.nn.functional.linear(x, w)  # forward: (rows, 4 width)
        g @ w  # the input's gradient: (rows, width)
        g.T @ x  # the weight's gradient: (4 width, width)

    def bf16() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            products()

    best = {products: math.inf, bf16: math.inf}
    threads = torch.get_num_threads()
    start = time.perf_counter()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            for i in range(_REPEATS + 1):
                for fn in best:
                    t = time.process_time()  # CPU time: what other programs' load adds is
                    fn()  # the time this one waits for a core, which it does not count
                    if i:  # the first round warms the kernels up
                        best[fn] = min(best[fn], time.process_time() - t)
                if i and time.perf_counter() - start > _BUDGET_S:
                    break
    finally:
        torch.set_num_threads(threads)
    ratio = best[bf16] / max(best[products], 1e-9)
    return float(min(max(ratio, RATIO_RANGE[0]), RATIO_RANGE[1]))
