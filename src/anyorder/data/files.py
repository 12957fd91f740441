"""Reading local data files without trusting their size or kind.

* :func:`special_kind` says what a path is when it is neither a regular file nor a folder (a
  named pipe, a socket, a device) from ``stat`` alone: opening a named pipe blocks until a
  writer comes, so such a path is refused by name, never opened.
* :func:`bounded_lines` reads a text file's lines up to :data:`MAX_LINE_CHARS` characters
  each: a ``.jsonl`` line is held whole to be parsed, and a file without newlines (a sparse
  file of a terabyte takes no disk) must not be read into memory as one line.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from anyorder.errors import DataError

MAX_LINE_CHARS = 1 << 28
"""The longest line of a ``.jsonl`` file read (256 Mi characters: one record a line)."""


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def kind_of(mode: int) -> str:
    """What a ``stat`` mode that is not a regular file's is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def special_kind(path: Path) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a folder (a named
    pipe, a socket, a device), else None. Only ``stat`` is asked: nothing is opened."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else kind_of(mode)


def bounded_lines(f: TextIO, path: Path | str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of the open text file ``f``, each line at most
    :data:`MAX_LINE_CHARS` characters.

    Raises:
        DataError: a longer line, named with ``path`` and its number.
    """
    limit = MAX_LINE_CHARS
    lineno = 0
    while line := f.readline(limit + 1):
        lineno += 1
        if len(line) > limit and not (len(line) == limit + 1 and line.endswith("\n")):
            raise DataError(
                f"{path}:{lineno} is longer than {limit:,} characters, more than a record "
                "holds; fix the file (one JSON record a line)"
            )
        yield lineno, line
