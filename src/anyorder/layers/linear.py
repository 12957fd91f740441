"""Linear layers: the weight and bias a layer applies, and prepacked weights for decoding on
the CPU.

Some paths read a layer's weight instead of calling it (ARMD's query-only and key/value-only
projections slice the fused ``qkv`` weight; AO-GPT joins every adaLN linear into one
matmul). Under peft's LoRA (``train.lora``) the layer is a wrapper whose ``weight`` is the
frozen base alone, so those paths would skip the adapters silently. :func:`weight_and_bias`
adds each active, unmerged adapter's delta (peft's own ``get_delta_weight``, which keeps
the gradient to the adapters); a plain ``nn.Linear`` returns its own tensors, untouched.
peft is never imported here: the wrapper is recognised by its ``base_layer``.

**Prepacked weights.** On the CPU, ``F.linear`` of a few rows (decoding) runs well below
what the same product costs from a copy of the weight laid out in advance for oneDNN's
kernels (``torch.ops.mkldnn._reorder_linear_weight``), the same product to round-off:
measured on an AMD EPYC, one thread, a 2048 -> 8192 product of 16 rows took 13-20 ms
through ``F.linear`` and 6 ms from such a copy, and of one row 8.5 ms against 7.7 (the
Llama-3.2-1B head: 300 -> 99 ms and 73 -> 54 ms; docs/performance.md, "Prepacked weights").
The layout depends on the row count: one for one row (:data:`ONE_ROW`), one for more
(:data:`MANY_ROWS`); a product of several rows reads the one-row copy where it has no other
and may make none (still faster than ``F.linear``), a product of one row never reads the
many-row copy (slower there than ``F.linear``).

The decoding engines (``sampling/passes.py``) run their passes inside :func:`prepacked`,
which says which layouts may be made (``sampling.passes`` decides what a decode earns back:
many-row copies for decodes of at least 8 multi-row passes, one-row copies once the model
has decoded 64 one-row passes, this decode's included). Every product by one of the model's
own CPU weights (fp32, or bf16 where oneDNN has bf16 kernels) then reads a copy, made at
its first use and kept with the model for later decodes, where a race on this CPU found the
copy faster (:data:`RACE`). Copies stop being made once they would take more than half the
memory available when the decode began.

**A copy is never stale.** Many writes change a weight without its version counter:
fused optimizers (``AdamW(fused=True)``), anything through ``.data`` (peft's LoRA merge,
hand edits), numpy views, the storage. So a copy is checked against its weight's bytes
(:func:`_fingerprint`: exact integer sums of its 64-bit words along each row and each
column, weighted by secret random keys) the first time each decode reads it
(:func:`prepacked_for` starts a decode), and against the version counter at every read;
one that differs is dropped and made again from the weight as it is. A copy of a weight
the model no longer holds (``p.data = new``, ``load_state_dict(assign=True)``,
``.to(dtype)``) is dropped at the next decode. The check reads each weight it copied twice
per decode, once per row print and once per column print: decodes too short to earn that
back read the weights themselves (:data:`READ_PASSES`).

Products with a gradient, under autocast, on other devices, by small weights
(:data:`MIN_WEIGHT`), or by tensors made during the forward (the adaLN join) run
``F.linear`` as before. ``ANYORDER_PREPACK=0`` or ``with
use_prepacked(False):`` turns it off (the uncached oracle never uses it).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.layers import casts
from anyorder.memory import available_memory

MIN_WEIGHT = 1 << 18
"""Elements a weight must exceed to be copied: oneDNN's call costs some 25 us more than
``F.linear``'s, measured a loss at 768 x 256 and 1024 x 256 (out x in; one row and two),
level at 1152 x 384, a gain from 1536 x 512 on (``gemm_rows.py``)."""
MIN_ONE_ROW_WEIGHT = 1 << 22
"""Elements a weight must exceed for a one-row copy: one row by a 768-wide model's weights
(2.4M elements at most) ran 4-12% slower from copies in the decoders (``decode.py
--compare-prepacked``), where the Llama-3.2-1B shape's (4.2M-263M) ran faster, its head
(73 -> 54 ms) most: at one row a product costs little more than the call's own overhead."""
ONE_ROW, MANY_ROWS = 1, 16  # the row counts oneDNN lays a copy out for (2-128 measured alike)
RACE = True
"""Whether a copy's product is first timed against ``F.linear``'s, once per weight shape,
dtype, layout and row count (in powers of two) in a process, and read only where it won:
which is faster depends on the CPU (measured: with AVX-512 the copies win from 1536 x 512
(out x in) on at 2-16 rows; limited to AVX2, 16 rows by a 512 x 2048 weight took 1.5x as
long from the copy). Tests turn it off to read every copy."""
READ_PASSES = (8, 32)
"""A decode reads copies (each checked against its weight at its first read) only where it
has at least this many passes of two rows or more, or of one row (:func:`worth_reading`):
the check reads every copied weight twice, about what 3-4 one-row passes cost (measured on
a 2048-wide model, one thread), which a one-row copy's 15-25% earns back in some 20 passes
and a many-row copy's 25-60% in fewer. :func:`every_copy` reads them in every decode."""
_faster: dict[tuple, bool] = {}  # the races' verdicts (this process, this CPU)
_DTYPES = (torch.float32, torch.bfloat16)


def worth_reading(many_row_passes: int, one_row_passes: int) -> bool:
    """Whether a decode of that many passes (the prompt's left out) reads prepacked copies:
    long enough to earn back their check (:data:`READ_PASSES`)."""
    many, one = READ_PASSES
    return many_row_passes >= many or one_row_passes >= one


def weight_and_bias(linear: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W, b)`` with ``linear(x) == F.linear(x, W, b)`` (up to the adapters' dropout)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight, linear.bias
    weight = base.weight
    if not (linear.disable_adapters or linear.merged):
        for name in linear.active_adapters:
            if name in linear.lora_A:
                weight = weight + linear.get_delta_weight(name)
    return weight, base.bias


class Linear(nn.Linear):
    """``nn.Linear`` whose product goes through :func:`linear` (same parameters, names and
    initialisation; peft wraps it as any ``nn.Linear``)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, from a prepacked copy of ``weight`` where one applies,
    or from the decode's cast of it under autocast (``layers/casts.py``)."""
    packs = _here.packs
    if packs is not None:
        out = packs.apply(x, weight, bias, _here.make)
        if out is not None:
            return out
    cast = casts.current()
    if cast is not None:
        weight, bias = cast.of(weight), cast.of(bias)
    return F.linear(x, weight, bias)


class Prepacked:
    """oneDNN-laid-out copies of one model's CPU weights, keyed by the weight's view (decodes
    of the model in several threads share them: a lock guards their making and dropping)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[tuple, tuple[Tensor, int, Tensor]] = {}  # key -> weight, version, copy
        self.prints: dict[tuple, tuple[Tensor, ...]] = {}  # view -> its weight's fingerprint
        self.checked: set[tuple] = set()  # views checked since the decode began (refresh)
        self.refused: set[tuple] = set()  # layouts oneDNN does not take here (bf16 on AVX2)
        self.storages: set[int] = set()
        self.bytes = 0
        self.budget = 0
        self.one_row_passes = 0  # decoded so far (``sampling.passes`` counts them)

    def refresh(self, model: nn.Module) -> None:
        """Take ``model``'s current parameters: copies of weights it no longer holds are
        dropped, and the budget is half of the memory available now (beyond the copies)."""
        storages = {
            p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type == "cpu"
        }
        with self.lock:
            self.storages = storages
            self.checked.clear()  # a new decode: every copy is checked again at its first read
            for key, (weight, _, _) in list(self.entries.items()):
                if weight.untyped_storage().data_ptr() not in storages:
                    self._drop(key[:-1])
            self.budget = self.bytes + available_memory() // 2

    def apply(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, make: frozenset[int] = frozenset()
    ) -> Tensor | None:
        """``F.linear(x, weight, bias)`` from the copy, or None where none applies (a missing
        copy is made where its layout is in ``make``)."""
        if (
            x.device.type != "cpu"
            or x.dtype not in _DTYPES
            or weight.dtype != x.dtype
            or x.dim() < 2
            or weight.dim() != 2
            or weight.numel() <= MIN_WEIGHT
            or not weight.is_contiguous()
            or (bias is not None and (bias.dtype != x.dtype or bias.dim() != 1))
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            or torch.is_autocast_enabled("cpu")  # F.linear casts there; the copy would not
        ):
            return None
        view = (weight.data_ptr(), tuple(weight.shape), weight.dtype)
        rows = x.numel() // x.shape[-1]
        bucket = 1 << (rows - 1).bit_length()
        layout = ONE_ROW if rows == 1 else MANY_ROWS
        race = (view[1], weight.dtype, layout, bucket)
        faster = _faster.get(race) if RACE else True  # a copy that lost its race is not read
        with self.lock:
            key = (*view, layout)
            entry = self._current(key, faster is not False) or self._pack(key, weight, make)
            if entry is None and layout == MANY_ROWS:
                layout = ONE_ROW
                race = (view[1], weight.dtype, layout, bucket)
                faster = _faster.get(race) if RACE else True
                entry = self._current((*view, ONE_ROW), faster is not False)
        if entry is None:
            return None
        bias = None if bias is None else bias.detach()
        if faster is None:
            faster, out = _race(x, weight, bias, entry[2])
            _faster[race] = faster
            return out
        return _product(x, entry[2], bias) if faster else None

    def _current(self, key: tuple, read: bool = True) -> tuple[Tensor, int, Tensor] | None:
        """The copy under ``key`` if its weight has not changed since it was made: the
        version counter at every read, the fingerprint at the first read of each decode
        (a stale copy is dropped, in every layout). ``read=False``: the copy will not be
        read (it lost its race), its fingerprint is not computed."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        view = key[:-1]
        if entry[0]._version != entry[1]:
            self._drop(view)
            return None
        if read and view not in self.checked:
            if not _same(_fingerprint(entry[0]), self.prints[view]):
                self._drop(view)
                return None
            self.checked.add(view)
        return entry

    def _drop(self, view: tuple) -> None:
        """Drop the copies of the weight under ``view`` (every layout)."""
        for layout in (ONE_ROW, MANY_ROWS):
            if (entry := self.entries.pop((*view, layout), None)) is not None:
                self.bytes -= _nbytes(entry[0])
        self.prints.pop(view, None)
        self.checked.discard(view)

    def _pack(
        self, key: tuple, weight: Tensor, make: frozenset[int]
    ) -> tuple[Tensor, int, Tensor] | None:
        size = _nbytes(weight)
        if (
            key[-1] not in make
            or (key[-1] == ONE_ROW and weight.numel() <= MIN_ONE_ROW_WEIGHT)
            or key in self.refused
            or weight.untyped_storage().data_ptr() not in self.storages  # made in the forward
            or self.bytes + size > self.budget
        ):
            return None
        try:
            copy = _reorder(weight.detach(), key[-1])
        except (RuntimeError, AttributeError, NotImplementedError):
            self.refused.add(key)
            return None
        view = key[:-1]
        if view not in self.checked:  # a copy in the other layout, unread in this decode, is
            now = _fingerprint(weight)  # checked here, before the new one's print replaces it
            if view in self.prints and not _same(now, self.prints[view]):
                self._drop(view)
            self.prints[view] = now
            self.checked.add(view)
        self.bytes += size
        entry = self.entries[key] = (weight.detach(), weight._version, copy)
        return entry


def _fingerprint(weight: Tensor) -> tuple[Tensor, ...]:
    """What a copy of ``weight`` is checked against: the weight's bytes read as 64-bit
    integers, each row's and each column's words weighted by secret random odd integers and
    summed (modulo 2**64; :func:`_keys`); the bytes themselves where a row is no whole number
    of such words. Integer sums are exact and do not depend on the order of the additions
    (threads, kernels). A change of one word changes its row's and its column's print; the
    keys make every other change (values moved within or across rows, edits that would
    cancel in a plain sum) change them too, but for odds of about 2**-60 that no optimizer,
    load or hand edit can aim at: the keys are drawn from the OS in each process, never from
    torch's seeded generators (which would move the samples)."""
    w = weight.detach()
    try:
        words = w.view(torch.int64)  # (out, in * itemsize / 8)
    except RuntimeError:  # rows of a size or offset not a multiple of 8 bytes (small weights)
        return (w.view(torch.uint8).clone(),)  # bytes: a NaN equals itself here
    rows, cols = words.shape
    return torch.mv(words, _keys(cols)), torch.mv(words.t(), _keys(rows, 1))


_KEYS: dict[tuple[int, int], Tensor] = {}


def _keys(n: int, which: int = 0) -> Tensor:
    """``n`` random odd 64-bit integers, the same for every call of this process (``which``
    tells the row keys from the column keys)."""
    key = _KEYS.get((n, which))
    if key is None:
        key = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64) | 1
        key = _KEYS.setdefault((n, which), key)
    return key


def _same(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _nbytes(weight: Tensor) -> int:
    """What a copy of ``weight`` takes (the budget's unit): the weight's own bytes."""
    return weight.numel() * weight.element_size()


def _product(x: Tensor, copy: Tensor, bias: Tensor | None) -> Tensor:
    """``x`` times a copy's weight, plus ``bias``."""
    return torch.ops.mkldnn._linear_pointwise(x, copy, bias, "none", [], "")


def _plain(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


FLUSH_BYTES = 64 << 20
"""Written between the race's timed calls, so that each reads its weight from memory as in
a model larger than the caches (back to back, a weight that fits the last-level cache comes
from it: at 768 wide, one row, the copies won such races and lost in the model)."""
_flush: Tensor | None = None


def _evict() -> None:
    global _flush
    if _flush is None:
        _flush = torch.empty(FLUSH_BYTES // 4)
    _flush.fill_(1.0)


def _race(x: Tensor, weight: Tensor, bias: Tensor | None, copy: Tensor) -> tuple[bool, Tensor]:
    """Whether the copy's product beats ``F.linear``'s on ``x`` here (best of two timed
    calls each, alternating, after one each, the caches flushed before each; it must be 5%
    faster), and the winner's output."""
    runs = (lambda: _product(x, copy, bias), lambda: _plain(x, weight, bias))
    outs = [run() for run in runs]
    best = [float("inf")] * 2
    for _ in range(2):
        for i, run in enumerate(runs):
            _evict()
            start = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - start)
    faster = best[0] < 0.95 * best[1]
    return faster, outs[0] if faster else outs[1]


def _reorder(weight: Tensor, rows: int) -> Tensor:
    """oneDNN's layout of ``weight`` for products of ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


_ENABLED = os.environ.get("ANYORDER_PREPACK", "1").strip().lower() not in (
    "0",
    "false",
    "off",
    "no",
)


class _Here(threading.local):
    """This thread's state: the copies its products read (``packs``, within
    :func:`prepacked`), the layouts they may make, and whether prepacking is on here."""

    packs: Prepacked | None = None
    make: frozenset[int] = frozenset()
    enabled: bool = _ENABLED


_here = _Here()
_packs: weakref.WeakKeyDictionary[nn.Module, Prepacked] = weakref.WeakKeyDictionary()
_PACKS_LOCK = threading.Lock()


def available() -> bool:
    """Whether this torch has oneDNN's linear kernels (x86 and Arm builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@contextmanager
def use_prepacked(enabled: bool) -> Iterator[None]:
    """Turn prepacked weights on or off within, in this thread (the default: on unless
    ``ANYORDER_PREPACK=0``)."""
    before, _here.enabled = _here.enabled, bool(enabled)
    try:
        yield
    finally:
        _here.enabled = before


def prepacked_for(model: nn.Module) -> Prepacked | None:
    """``model``'s copies, refreshed, for the decode about to run (None: not on the CPU, or
    turned off)."""
    if not (_here.enabled and available()):
        return None
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu":
        return None
    with _PACKS_LOCK:
        packs = _packs.get(model)
        if packs is None:
            packs = _packs[model] = Prepacked()
    packs.refresh(model)
    return packs


@contextmanager
def prepacked(packs: Prepacked | None, make=(ONE_ROW, MANY_ROWS)) -> Iterator[None]:
    """Within, in this thread, :func:`linear` reads ``packs`` (from :func:`prepacked_for`;
    None: plain) and makes missing copies in the layouts ``make`` only (``()``: none; a
    decode too short to earn a copy back, ``sampling/passes.py``)."""
    before = _here.packs, _here.make
    _here.packs, _here.make = packs, frozenset(make)
    try:
        yield
    finally:
        _here.packs, _here.make = before


@contextmanager
def every_copy() -> Iterator[None]:
    """Within (process-wide; for tests and benchmarks): every weight is copied however small
    (:data:`MIN_WEIGHT`, :data:`MIN_ONE_ROW_WEIGHT` at 0) and every copy read, unraced
    (:data:`RACE` off), in decodes of any length (:data:`READ_PASSES` at 0)."""
    global MIN_WEIGHT, MIN_ONE_ROW_WEIGHT, RACE, READ_PASSES
    saved = MIN_WEIGHT, MIN_ONE_ROW_WEIGHT, RACE, READ_PASSES
    MIN_WEIGHT, MIN_ONE_ROW_WEIGHT, RACE, READ_PASSES = 0, 0, False, (0, 0)
    try:
        yield
    finally:
        MIN_WEIGHT, MIN_ONE_ROW_WEIGHT, RACE, READ_PASSES = saved
