"""Text sources: local files, folders and globs, Hugging Face datasets and the builtins.

Design choices:

* A source is named by one string (``data.source``): a local file, folder (searched
  recursively, hidden files skipped) or glob; ``hf:NAME[:CONFIG]`` for a Hugging Face
  dataset (``hf:/local/folder`` reads local files through ``datasets``); or a builtin
  (``builtin:pydoc``, ``builtin:stdlib``, ``builtin:synthetic`` from
  :mod:`anyorder.data.synthetic`). Its documents come in a deterministic order.
* A ``.txt`` file is one document (blank lines do not split it): that is what the
  ``datasets`` text builder does with ``sample_by="document"``, so a local folder read
  directly and through ``hf:`` gives the same documents. ``.jsonl`` holds one document per
  line, ``.parquet`` one per row. Empty documents are skipped everywhere (they would add a
  lone EOS and nothing else).
* A file that cannot be read, or a dataset that cannot be reached, is a :class:`DataError`
  naming it, raised while iterating.
* Local ``.txt`` and ``.jsonl`` files must be UTF-8 text: invalid bytes, a UTF-16/32
  byte-order mark and NUL bytes (binary data) are refused, naming the file and the offset.
  (Decoding with replacement turned 200 KB of random bytes into 344K tokens of U+FFFD
  without a word.)
* A ``.txt`` file over :data:`LONG_TEXT_BYTES` is still one document, but
  :func:`iter_documents` with ``pieces=True`` yields it as a :class:`LongText` read in
  pieces cut before a space between two words, so preparing it takes memory for a piece,
  not the file. Byte-level tokenizers and GPT-2-style BPEs never merge across such a cut.
* ``datasets`` and ``pyarrow`` are imported only where they are needed.
"""

from __future__ import annotations

import glob as globlib
import itertools
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from anyorder.data.files import (
    bounded_lines,
    check_parquet_files,
    check_parquet_text,
    check_whole_read,
    special_kind,
)
from anyorder.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
"""File types a local source may hold."""
LONG_TEXT_BYTES = 1 << 22
"""A .txt file larger than this is read in pieces of about this many characters."""
_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
         b"\xfe\xff": "UTF-16"}  # fmt: skip


def _not_text(path: Path, data: bytes | None = None) -> DataError:
    """The error for a file that is not UTF-8 text: a UTF-16/32 mark, the first invalid
    byte, or the first NUL byte (read from ``data``, or the file in blocks)."""
    import codecs

    with open(path, "rb") as f:
        head = f.read(4)
        for mark, name in _BOMS.items():
            if head.startswith(mark):
                return DataError(
                    f"{path} is {name} text (it starts with a byte-order mark); convert it to "
                    f"UTF-8 (e.g. iconv -f {name.lower()} -t utf-8) or remove it from data.source"
                )
        f.seek(0)
        dec, offset = codecs.getincrementaldecoder("utf-8")(), 0
        while block := f.read(1 << 20):
            held = len(dec.getstate()[0])  # bytes of a character cut by the last block
            try:
                dec.decode(block)
            except UnicodeDecodeError as e:  # e.object is the held bytes and this block
                return DataError(
                    f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                    f"{offset - held + e.start}); convert it to UTF-8 (e.g. iconv -f latin1 "
                    "-t utf-8) or remove it from data.source"
                )
            if (nul := block.find(b"\0")) >= 0:
                return DataError(
                    f"{path} holds a NUL byte at offset {offset + nul}: binary data, not text; "
                    "remove it from data.source"
                )
            offset += len(block)
    return DataError(f"{path} is not UTF-8 text; convert it to UTF-8 or remove it from data.source")


def _checked(text: str, path: Path) -> str:
    """``text`` read from ``path``, refused when it holds a NUL byte (binary data)."""
    if "\0" in text:
        raise _not_text(path)
    return text


class LongText:
    """A .txt document too large to hold whole: its text in pieces (see the module notes).

    Args:
        path: the file.
        piece_chars: about this many characters a piece (default :data:`LONG_TEXT_BYTES`).
    """

    def __init__(self, path: Path, piece_chars: int | None = None) -> None:
        self.path = path
        self.piece_chars = piece_chars or LONG_TEXT_BYTES

    def __bool__(self) -> bool:  # an empty file is an empty document (skipped)
        return self.path.stat().st_size > 0

    def pieces(self) -> Iterator[str]:
        """The text in order; each piece but the last ends before a space that stands
        between two non-space characters (or, after 4 pieces' worth without one, anywhere)."""
        carry = ""
        try:
            with open(self.path, encoding="utf-8") as f:  # strict; universal newlines
                while block := f.read(self.piece_chars):
                    text = carry + _checked(block, self.path)
                    cut = _cut(text)
                    if cut == len(text) and len(text) < 4 * self.piece_chars:
                        cut = 0  # no cut point yet: read on (a word of megabytes is cut anyway)
                    carry = text[cut:]
                    if cut:
                        yield text[:cut]
        except UnicodeDecodeError:
            raise _not_text(self.path) from None
        if carry:
            yield carry

    def __str__(self) -> str:
        return "".join(self.pieces())


def _cut(text: str) -> int:
    """Where to end a piece: before the last space that has a non-space on either side
    (no tokenizer we use merges across it), else the whole text."""
    i = len(text) - 1
    while (i := text.rfind(" ", 1, i)) > 0:
        if i + 1 < len(text) and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
    return len(text)


_STDLIB_SKIP = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "test",
    "tests",
    "idle_test",
    "idlelib",
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _looks_like_path(spec: str) -> bool:
    # Hub ids contain "/" too ("org/name"), so only explicit path forms count.
    return spec.startswith(("/", "./", "../", "~")) or spec in (".", "..")


def source_bytes(source: str) -> int | None:
    """The size in bytes of a source's text where it is known without reading it (local
    files, the builtins), else None (hub datasets). For the up-front estimate."""
    try:
        if source == "builtin:pydoc":
            from pydoc_data.topics import topics

            return sum(len(t) for t in topics.values())
        if source == "builtin:stdlib":
            return sum(p.stat().st_size for p in stdlib_files())
        if source == "builtin:synthetic":
            from anyorder.data.synthetic import DOC_BYTES, DOCUMENTS

            return DOCUMENTS * DOC_BYTES
        if source.startswith(("builtin:", "hf:")):
            return None
        return sum(p.stat().st_size for p in resolve_files(source))
    except (ImportError, OSError, DataError):
        return None


def _has_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def _files_under(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES and _visible(p, folder)
    )


def resolve_files(source: str) -> list[Path]:
    """The files of a local source (file, folder searched recursively, or glob), sorted.

    Raises:
        DataError: the path does not exist, or holds no .txt/.jsonl/.parquet files.
    """
    kinds = "/".join(TEXT_SUFFIXES)
    if _has_glob(source):
        files: list[Path] = []
        for match in sorted(globlib.glob(os.path.expanduser(source), recursive=True)):
            p = Path(match)
            if p.is_dir():
                files += _files_under(p)
            elif p.suffix.lower() in TEXT_SUFFIXES:
                special = special_kind(p)
                if special:  # never opened: a named pipe would block the build for ever
                    raise DataError(
                        f"data.source glob {source!r} matches {match!r}, {special}, not a "
                        "file; remove it or narrow the pattern"
                    )
                files.append(p)
        if not files:
            raise DataError(
                f"data.source glob {source!r} matches no {kinds} files; fix the pattern"
            )
        return sorted(set(files))
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise DataError(
                f"data.source file {source!r} is not a {kinds} file; convert it or give a "
                "folder of such files"
            )
        return [path]
    if path.is_dir():
        files = _files_under(path)
        if not files:
            raise DataError(
                f"data.source folder {source!r} holds no {kinds} files; add text files or point "
                "data.source at another folder"
            )
        return files
    special = special_kind(path)
    if special:
        raise DataError(
            f"data.source {source!r} is {special}, not a file; give a file, folder or glob of "
            f"{kinds} files"
        )
    raise DataError(
        f"data.source {source!r} does not exist; give an existing file, folder or glob of "
        f"{kinds} files, builtin:pydoc, builtin:stdlib, builtin:synthetic or hf:NAME"
    )


def jsonl_records(path: Path) -> Iterator[tuple[Any, str]]:
    """The records of a ``.jsonl`` file with where each stands (``path:line``), blank lines
    skipped; a line that is not JSON stops with one line naming it."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in bounded_lines(f, path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno} is not valid JSON ({e.msg}); fix or remove the line"
                ) from None
            except RecursionError:  # json's C reader recurses once per level
                raise DataError(
                    f"{path}:{lineno} nests too deep for a JSON reader; fix or remove the line"
                ) from None
            except ValueError:  # a number longer than Python's int-from-string limit
                raise DataError(
                    f"{path}:{lineno} holds a number of more than "
                    f"{sys.get_int_max_str_digits()} digits, which Python's JSON reader "
                    "refuses; fix or remove the line"
                ) from None
            yield record, f"{path}:{lineno}"


def _text_of(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        fields = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where} has no field {text_field!r} (it has: {fields}); set data.text_field to "
            "the field that holds the text"
        )
    value = record[text_field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {text_field!r} holds {type(value).__name__}, not text; set "
            "data.text_field to a text field"
        )
    return value


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # datasets brings pyarrow, but fall back to it if pyarrow is absent
        ds = _import_datasets().load_dataset(
            "parquet", data_files=[str(path)], split="train", streaming=True,
            trust_remote_code=False,
        )  # fmt: skip
        for row in ds:
            yield _text_of(row, text_field, str(path))
        return
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise DataError(
            f"{path} has no column {text_field!r} (it has: {', '.join(pf.schema_arrow.names)}); "
            "set data.text_field to the column that holds the text"
        )
    check_parquet_text(pf.metadata, text_field, path, whole=False)
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield _text_of({text_field: value}, text_field, str(path))


def _read_file(path: Path, text_field: str, pieces: bool = False) -> Iterator[str | LongText]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt" and pieces and path.stat().st_size > LONG_TEXT_BYTES:
            yield LongText(path)
        elif suffix == ".txt":
            check_whole_read(
                path, "read whole as one document (a bpe:VOCAB tokenizer learns from whole "
                "documents)", "split it into smaller .txt files, or use a tokenizer trained "
                "already (data.tokenizer=bytes, gpt2 or a tokenizer folder)",
            )  # fmt: skip
            # Text mode (universal newlines) matches the datasets text builder exactly.
            with open(path, encoding="utf-8") as f:
                yield _checked(f.read(), path)
        elif suffix == ".jsonl":
            for record, where in jsonl_records(path):
                yield _text_of(record, text_field, where)
        else:
            yield from _read_parquet(path, text_field)
    except DataError:
        raise
    except UnicodeDecodeError:
        raise _not_text(path) from None
    except Exception as e:  # OSError, a corrupt parquet file, ...
        raise DataError(f"cannot read {path} ({_first_line(e)}); fix or remove the file") from None


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "hf: sources need the datasets package; pip install 'anyorder[hf]'"
        ) from None
    return datasets


def _hf_local(rest: str) -> bool:
    if not rest:
        return False
    return _looks_like_path(rest) or _has_glob(rest) or Path(rest).expanduser().exists()


def _hf_documents(rest: str, text_field: str, streaming: bool, split: str) -> Iterator[str]:
    datasets = _import_datasets()
    if _hf_local(rest):
        files = resolve_files(rest)
        suffixes = {f.suffix.lower() for f in files}
        if len(suffixes) > 1:
            raise DataError(
                f"hf:{rest} mixes {', '.join(sorted(suffixes))} files; datasets reads one kind "
                "at a time, so keep one kind per folder"
            )
        builder = {".jsonl": "json", ".parquet": "parquet", ".txt": "text"}[suffixes.pop()]
        if builder == "parquet":  # read by datasets a row group at a time
            check_parquet_files(files, text_field)
        # Streaming reads the files in place instead of copying them into the datasets cache.
        args: tuple[Any, ...] = (builder,)
        kwargs: dict[str, Any] = dict(data_files={split: [str(f) for f in files]}, streaming=True)
        if builder == "text":  # each file one document, read whole by datasets
            for f in files:
                check_whole_read(
                    f, "and datasets reads each .txt file of an hf: folder whole",
                    f"give the folder without hf: (data.source={rest}), where a large .txt "
                    "file is read in pieces, or split the file",
                )  # fmt: skip
            kwargs.update(sample_by="document", encoding_errors="replace")
            text_field = "text"  # the text builder always names its column "text"
    else:
        name, _, config = rest.partition(":")
        args, kwargs = (name, config or None), dict(streaming=streaming)
    where = f"hf:{rest}"
    # A dataset's loading script is code from the hub (or a folder): never run it. datasets
    # before 3.0 ran one unasked; since 4.0 it refuses scripts and ignores False.
    kwargs["trust_remote_code"] = False
    try:
        ds = datasets.load_dataset(*args, split=split, **kwargs)
        for row in ds:
            yield _text_of(row, text_field, f"a record of {where}")
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"could not read dataset {where} split={split!r} ({_first_line(e)}); check the name, "
            "config and network, or download it and pass a local folder as hf:/path/to/folder"
        ) from None


def _pydoc_documents() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError(
            "this Python has no pydoc_data module; use builtin:stdlib or a local corpus"
        ) from None
    for key in sorted(topics):
        yield topics[key]


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without site-packages, tests and idlelib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place keeps os.walk out of site-packages (which can be huge) and test
        # folders (which hold deliberately broken encodings).
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith("."))
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _stdlib_documents() -> Iterator[str]:
    for path in stdlib_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def iter_documents(
    source: str,
    *,
    text_field: str = "text",
    streaming: bool = False,
    max_documents: int | None = None,
    split: str = "train",
    pieces: bool = False,
) -> Iterator[Any]:
    """The documents of a source, in a deterministic order; empty documents are skipped.

    Args:
        source: ``builtin:pydoc`` (Python's topic help, ~0.5 MB), ``builtin:stdlib`` (the
            standard library's .py files, ~12 MB), a local file, folder or glob of
            .txt (one file = one document), .jsonl (one document per line) or .parquet (one
            per row) files, or ``hf:NAME[:CONFIG]`` for a Hugging Face dataset;
            ``hf:/local/folder`` reads local files through ``datasets``.
        text_field: the field holding the text in .jsonl/.parquet/dataset records.
        streaming: stream a hub dataset instead of downloading it whole.
        max_documents: stop after this many (non-empty) documents.
        split: the dataset split to read (hub datasets; local files are all one split).
        pieces: yield a large ``.txt`` file as a :class:`LongText` (read in pieces), not a
            string.

    Raises:
        DataError: a missing path, a folder without supported files, an unknown builtin, or
            (while iterating) an unreadable file or unreachable dataset.
    """
    if source == "builtin:pydoc":
        docs = _pydoc_documents()
    elif source == "builtin:stdlib":
        docs = _stdlib_documents()
    elif source == "builtin:synthetic":
        from anyorder.data.synthetic import documents

        docs = documents()
    elif source.startswith("builtin:"):
        raise DataError(
            f"unknown data.source {source!r}; use builtin:pydoc, builtin:stdlib or "
            "builtin:synthetic"
        )
    elif source.startswith("hf:"):
        rest = source[3:]
        if not rest.partition(":")[0]:
            raise DataError(
                "data.source 'hf:' needs a dataset name, e.g. hf:Skylion007/openwebtext"
            )
        if _hf_local(rest):
            resolve_files(rest)  # raise on a missing path now, not at the first next()
        docs = _hf_documents(rest, text_field, streaming, split)
    else:
        files = resolve_files(source)
        docs = itertools.chain.from_iterable(_read_file(f, text_field, pieces) for f in files)
    docs = (d for d in docs if d)
    if max_documents is not None:
        docs = itertools.islice(docs, max_documents)
    return docs
