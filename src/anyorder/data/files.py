"""Reading local data files without trusting their size or kind.

* :func:`special_kind` says what a path is when it is neither a regular file nor a folder (a
  named pipe, a socket, a device) from ``stat`` alone: opening a named pipe blocks until a
  writer comes, so such a path is refused by name, never opened.
* :func:`bounded_lines` reads a text file's lines up to :data:`MAX_LINE_CHARS` characters
  each: a ``.jsonl`` line is held whole to be parsed, and a file without newlines (a sparse
  file of a terabyte takes no disk) must not be read into memory as one line.
"""

from __future__ import annotations

import os
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


MEMORY_SHARE = 4
"""Text read whole is read only while it is at most 1/4 of the memory available now: a
parquet column by the uncompressed size its own footer declares (:func:`check_parquet_text`;
its size on disk says nothing of it, 10 GB of one repeated character compress to
kilobytes), a text file by its size (:func:`check_whole_read`). The bytes, the Python string
made from them (up to 4 bytes a character) and the tokens made from that each take as much
again."""


def check_parquet_text(metadata, column: str, path: Path | str, *, whole: bool) -> None:
    """Refuse a parquet file whose text column declares more uncompressed bytes than the
    memory available now can hold (see :data:`MEMORY_SHARE`), before a page of it is
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
    if size > avail // MEMORY_SHARE:
        fix = "split it into smaller files" if whole else (
            "write it in smaller row groups, e.g. pyarrow.parquet.write_table(table, path, "
            "row_group_size=10000), or split it into smaller files"
        )  # fmt: skip
        raise DataError(
            f"{path}: {what}column {column!r} declares {format_bytes(size)} of text "
            f"uncompressed ({format_bytes(disk)} on disk), more than a quarter of the "
            f"{format_bytes(avail)} of memory available now; {fix}"
        )


def check_parquet_files(files: list[Path], column: str) -> None:
    """:func:`check_parquet_text` on each file's footer, a row group at a time (``datasets``
    reads them so; a file whose footer cannot be read is left to it to name)."""
    import pyarrow.parquet as pq

    for path in files:
        try:
            metadata = pq.ParquetFile(path).metadata
        except Exception:
            continue
        check_parquet_text(metadata, column, path, whole=False)


WHOLE_READ_FREE = 1 << 22
"""A file of at most this many bytes (4 MiB) is read whole unasked: it fits wherever this
runs, and a corpus of a million small files asks the memory nothing (34 us a question)."""


def check_whole_read(path: Path | str, how: str, fix: str, size: int | None = None) -> None:
    """Refuse a file (or a folder's files, ``size`` bytes together) that is read whole
    (``how``) and is larger than :data:`MEMORY_SHARE` of the memory available now, from
    ``os.stat`` alone: the fix in one line, not the kernel's out-of-memory kill. One of at
    most :data:`WHOLE_READ_FREE` bytes passes unasked."""
    from anyorder.memory import available_memory, format_bytes

    size = os.stat(path).st_size if size is None else size
    if size <= WHOLE_READ_FREE:
        return
    avail = available_memory()
    if size > avail // MEMORY_SHARE:
        raise DataError(
            f"{path} is {format_bytes(size)}, {how}: more than a quarter of the "
            f"{format_bytes(avail)} of memory available now; {fix}"
        )
