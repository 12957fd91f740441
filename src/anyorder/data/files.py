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


PARQUET_MEMORY_SHARE = 4
"""A parquet file's text is read only while the uncompressed size its own metadata declares
is at most 1/4 of the memory available now (:func:`check_parquet_text`): pyarrow's buffers,
the Python strings made from them and the tokens made from those each take as much again.
The file's size on disk says nothing of it: 10 GB of one repeated character compress to
kilobytes."""


def check_parquet_text(metadata, column: str, path: Path | str, *, whole: bool) -> None:
    """Refuse a parquet file whose text column declares more uncompressed bytes than the
    memory available now can hold (see :data:`PARQUET_MEMORY_SHARE`), before a page of it is
    read. ``metadata``: ``pyarrow.parquet.ParquetFile(path).metadata`` (its footer only).
    ``whole``: the file is read whole (a zero-shot test set), so its row groups add up;
    otherwise it is read a row group at a time (a data source), so the largest counts. A
    column this cannot find counts its row groups' every column."""
    from anyorder.memory import available_memory, format_bytes

    sizes = []  # (uncompressed, on disk) per row group
    for i in range(metadata.num_row_groups):
        rg = metadata.row_group(i)
        chunks = [rg.column(j) for j in range(rg.num_columns)]
        mine = [c for c in chunks if c.path_in_schema == column] or chunks
        sizes.append((sum(c.total_uncompressed_size for c in mine),
                      sum(c.total_compressed_size for c in mine)))  # fmt: skip
    if not sizes:
        return
    if whole:
        what, (size, disk) = "", tuple(map(sum, zip(*sizes)))
    else:
        i, (size, disk) = max(enumerate(sizes), key=lambda s: s[1][0])
        what = f"row group {i} of " if len(sizes) > 1 else ""
    avail = available_memory()
    if size > avail // PARQUET_MEMORY_SHARE:
        fix = "split it into smaller files" if whole else (
            "write it in smaller row groups, e.g. pyarrow.parquet.write_table(table, path, "
            "row_group_size=10000), or split it into smaller files"
        )  # fmt: skip
        raise DataError(
            f"{path}: {what}column {column!r} declares {format_bytes(size)} of text "
            f"uncompressed ({format_bytes(disk)} on disk), more than a quarter of the "
            f"{format_bytes(avail)} of memory available now; {fix}"
        )
