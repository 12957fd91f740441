"""Progress for long work: a tqdm bar on a terminal, a plain line every few seconds in a log.

Design choices:

* One factory, :func:`progress`, for every long loop (training, evaluation, experiments,
  data preparation). On a terminal it is a tqdm bar. When stderr is not a terminal (a log
  file, CI, ``nohup``) it writes one short line every ``every_s`` seconds or every
  ``every_frac`` of the total, whichever comes first, and one at the end: no ``\\r`` spam
  and no silence.
* :func:`estimate` prints what a command is about to cost, before it starts, from a count
  of units and a measured (or calibrated) time per unit.
* The returned object has the part of tqdm's interface the library uses: ``update``,
  ``set_postfix_str``, ``write``, ``close``, iteration and ``with``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    """``42 s``, ``3.5 min``, ``1.2 h``: a duration for a person."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def estimate(what: str, units: int, seconds_per_unit: float, unit: str = "passes",
             stream: TextIO | None = None, how: str = "measured") -> float:  # fmt: skip
    """Print ``what: about 3.5 min (1,200 passes x 0.18 s measured)`` and return the seconds.

    ``how`` says where the time per unit comes from (``measured``, or e.g. ``calibrated on
    2 idle cores`` for a figure taken before anything ran).
    """
    total = units * seconds_per_unit
    stream = stream if stream is not None else sys.stderr
    print(
        f"{what}: about {format_duration(total)} ({units:,} {unit} x "
        f"{seconds_per_unit:.3g} s {how})",
        file=stream,
        flush=True,
    )
    return total


class LineProgress:
    """A tqdm stand-in for non-terminal streams: a line every ``every_s`` seconds or
    ``every_frac`` of ``total``, and one when closed."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        initial: int = 0,
        desc: str = "",
        unit: str = "it",
        stream: TextIO | None = None,
        every_s: float = 10.0,
        every_frac: float = 0.05,
    ) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.n = initial
        self.desc = desc
        self.unit = unit.strip() or "it"
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.every_frac = every_frac
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._n0 = initial
        self._last_t = self._t0
        self._last_n = initial
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("this progress object was made without an iterable")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self) -> str:
        """The current state as one line: ``desc: 120/1,000 steps (12%), 3.2 steps/s, 4.6 min
        left | postfix``."""
        elapsed = time.perf_counter() - self._t0
        done = self.n - self._n0
        rate = done / elapsed if elapsed > 0 else 0.0
        count = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        parts = [f"{count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        if rate > 0:
            parts.append(f"{rate:.3g} {self.unit}/s")
            if self.total and self.n < self.total:
                parts.append(f"{format_duration((self.total - self.n) / rate)} left")
        text = f"{self.desc}: " if self.desc else ""
        text += ", ".join(parts)
        return text + (f" | {self.postfix}" if self.postfix else "")

    def _emit(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self._last_t = time.perf_counter()
        self._last_n = self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        frac_due = bool(self.total) and (self.n - self._last_n) >= self.every_frac * self.total
        if now - self._last_t >= self.every_s or frac_due:
            self._emit()

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self.postfix = s

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def write(self, msg: str) -> None:
        print(msg, file=self.stream, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.n != self._last_n or self.n == self._n0:
            self._emit()


class _Silent(LineProgress):
    """Counts but prints nothing (``enabled=False``); ``write`` still prints."""

    def _emit(self) -> None:
        self._last_n = self.n


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    initial: int = 0,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    stream: TextIO | None = None,
    every_s: float = 10.0,
    every_frac: float = 0.05,
    leave: bool = True,
) -> Any:
    """A progress reporter over ``iterable`` (or updated by hand up to ``total``).

    Args:
        enabled: ``False`` reports nothing (``write`` still prints).
        stream: where to report (default stderr). A terminal gets a tqdm bar; anything else
            gets a line every ``every_s`` seconds or ``every_frac`` of the total.
        leave: keep the tqdm bar on screen when done (terminals only).
    """
    stream = stream if stream is not None else sys.stderr
    kwargs = dict(total=total, initial=initial, desc=desc, unit=unit, stream=stream)
    if not enabled:
        return _Silent(iterable, **kwargs)
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        from tqdm.auto import tqdm

        return tqdm(
            iterable,
            total=total,
            initial=initial,
            desc=desc,
            unit=unit,
            file=stream,
            dynamic_ncols=True,
            leave=leave,
        )
    return LineProgress(iterable, every_s=every_s, every_frac=every_frac, **kwargs)
