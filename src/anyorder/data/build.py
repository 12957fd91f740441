"""Preparing a corpus: the cache key, and building a cache folder once, atomically.

Design choices:

* The cache key hashes everything that changes the tokens (source, tokenizer, text field,
  val_fraction, max_documents, seq_len, and the sizes and mtimes of local files), so a
  second :func:`prepare` with the same inputs only reads the manifest.
* Writes are atomic: the folder is built under a temporary name beside its final place and
  moved there with :func:`os.replace`, so an interrupted run never leaves a half-written
  shard where :func:`prepare` looks. (A killed process leaves a ``.KEY.tmp-PID-*`` folder;
  nothing reads it, and the next build in the cache removes it once that PID is gone.)
  Ranks preparing the same key at once each build their own folder; the first rename wins
  and the others use it.
* A ``bpe:VOCAB`` tokenizer is trained on the first train documents of the corpus (never
  on validation), up to :data:`BPE_TRAIN_CHARS` characters.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from anyorder.atomic import remove_stale_temps
from anyorder.config import DataConfig
from anyorder.data.chat import detect_chat, iter_records
from anyorder.data.chat_pack import pack_examples
from anyorder.data.shards import FORMAT_VERSION, STAMP, TokenData, _write_stamp, token_dtype
from anyorder.data.sources import (
    _hf_local,
    _looks_like_path,
    iter_documents,
    resolve_files,
    stdlib_files,
)
from anyorder.data.split import _pack, is_val_document
from anyorder.data.tokenizers import BPETokenizer, Tokenizer, _parse_bpe, load_tokenizer
from anyorder.errors import ConfigError, DataError, preview

BPE_TRAIN_CHARS = 256 * 2**20
"""A bpe:VOCAB tokenizer is trained on the first train documents, up to this many characters."""


def _fingerprint(paths: Iterable[Path]) -> str:
    """A digest of the paths, sizes and mtimes: changes when a local file changes."""
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _source_fingerprint(source: str) -> str | None:
    if source == "builtin:pydoc":
        return platform.python_version()
    if source == "builtin:stdlib":
        return platform.python_version() + ":" + _fingerprint(stdlib_files())
    if source == "builtin:synthetic":
        from anyorder.data.synthetic import VERSION

        return f"synthetic-v{VERSION}"
    if source.startswith("hf:"):
        rest = source[3:]
        return _fingerprint(resolve_files(rest)) if _hf_local(rest) else None
    if source.startswith("builtin:"):
        return None  # iter_documents raises the error
    return _fingerprint(resolve_files(source))


def _tokenizer_fingerprint(spec: str) -> str | None:
    path = Path(spec).expanduser()
    if spec.startswith("bpe:") or not (_looks_like_path(spec) or path.exists()):
        return None
    if not path.is_dir():
        return None  # load_tokenizer raises the error
    return _fingerprint(sorted(p for p in path.rglob("*") if p.is_file()))


DATA_FORMATS = ("auto", "text", "chat")
"""The values of ``data.format``."""


def data_format(cfg: DataConfig) -> str:
    """``data.format`` resolved: ``text`` or ``chat`` (``auto`` looks at the source).

    Raises:
        ConfigError: an unknown format.
    """
    if cfg.format not in DATA_FORMATS:
        raise ConfigError(f"data.format={preview(cfg.format)}: use auto, text or chat")
    if cfg.format != "auto":
        return cfg.format
    return "chat" if detect_chat(cfg.source) else "text"


def _check(cfg: DataConfig, seq_len: int) -> None:
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ConfigError(f"seq_len={seq_len!r} must be a positive integer")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(
            f"data.val_fraction={cfg.val_fraction} must be in [0, 1); e.g. 0.05, or 0 for none"
        )
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise ConfigError(f"data.max_documents={cfg.max_documents} must be positive or null")


def cache_key(cfg: DataConfig, seq_len: int) -> str:
    """The name of the cache folder for ``cfg`` at ``seq_len``: a hash of all that shapes
    the tokens, local files' sizes and mtimes included."""
    _check(cfg, seq_len)
    seq_len = int(seq_len)  # a numpy integer would not serialize
    ident = {
        "format": FORMAT_VERSION,
        "source": cfg.source,
        "source_files": _source_fingerprint(cfg.source),
        "tokenizer": cfg.tokenizer,
        "tokenizer_files": _tokenizer_fingerprint(cfg.tokenizer),
        "text_field": cfg.text_field,
        "val_fraction": cfg.val_fraction,
        "max_documents": cfg.max_documents,
        "seq_len": seq_len,
    }
    if data_format(cfg) == "chat":  # text corpora keep the keys they had before chat data
        ident.update(kind="chat", text_field=None)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _bpe_texts(cfg: DataConfig) -> Iterator[str]:
    """The train documents a bpe:VOCAB tokenizer learns from, up to BPE_TRAIN_CHARS."""
    budget = BPE_TRAIN_CHARS
    for text in _documents(cfg):
        if is_val_document(text, cfg.val_fraction):
            continue
        yield text
        budget -= len(text)
        if budget <= 0:
            return


def _documents(cfg: DataConfig, pieces: bool = False) -> Iterator[Any]:
    return iter_documents(
        cfg.source,
        pieces=pieces,
        text_field=cfg.text_field,
        streaming=cfg.streaming,
        max_documents=cfg.max_documents,
    )


def _build(cfg: DataConfig, seq_len: int, key: str, folder: Path, progress: bool) -> None:
    """Write shards, tokenizer and manifest of ``cfg`` into ``folder``."""
    # resolves the source first (a bad path fails before training); a large .txt file comes
    # in pieces (sources.LongText), so packing holds a piece of it at a time
    chat = data_format(cfg) == "chat"
    if chat and cfg.tokenizer.strip().startswith("bpe:"):
        raise ConfigError(
            f"data.tokenizer={cfg.tokenizer} trains on plain text; with data.format=chat use "
            "bytes, a tokenizer folder or a hub tokenizer"
        )
    docs = _documents(cfg, pieces=True) if not chat else None
    if cfg.tokenizer.strip().startswith("bpe:"):
        vocab = _parse_bpe(cfg.tokenizer.strip())
        tok: Tokenizer = BPETokenizer.train(_bpe_texts(cfg), vocab, progress=progress)
    else:
        tok = load_tokenizer(cfg.tokenizer)
    if chat:
        records = iter_records(cfg.source, streaming=cfg.streaming, max_records=cfg.max_documents)
        stats, moved = pack_examples(records, tok, seq_len, cfg.val_fraction, folder, cfg.source), 0
    else:
        stats, moved = _pack(docs, tok, seq_len, cfg.val_fraction, folder, cfg.source, progress)
    tok.save(folder / "tokenizer")
    manifest: dict[str, Any] = {"kind": "chat"} if chat else {}
    manifest |= {
        "format": FORMAT_VERSION,
        "key": key,
        "source": cfg.source,
        "tokenizer": cfg.tokenizer,
        "tokenizer_name": tok.name,
        "text_field": cfg.text_field,
        "val_fraction": cfg.val_fraction,
        "max_documents": cfg.max_documents,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "seq_len": seq_len,
        "dtype": token_dtype(tok.vocab_size).name,
        "val_fallback_documents": moved,
        "splits": stats,
    }
    # The manifest is written last: a folder with a manifest is a complete folder.
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    stamp = {}
    for info in stats.values():  # the shards were checked as they were written
        for name, digest in (("file", "sha256"), ("lengths_file", "lengths_sha256")):
            if name in info:
                st = (folder / info[name]).stat()
                stamp[info[name]] = [st.st_size, st.st_mtime_ns, info[digest]]
    _write_stamp(folder / STAMP, stamp)


def prepare(cfg: DataConfig, seq_len: int, *, progress: bool = True) -> TokenData:
    """Tokenize and pack a corpus into ``cfg.cache_dir/<key>/``, or reuse it if it is there.

    Args:
        cfg: source, tokenizer, text field, validation share, cache folder.
        seq_len: tokens per block (the model's sequence length).
        progress: report progress (a bar on a terminal, a line every few seconds in a log)
            and, for a corpus that takes long, an estimate first.

    Returns:
        The packed data; ``reused`` tells whether the folder already existed.

    Raises:
        DataError: a bad source or tokenizer, or a corpus too small for one block per split.
        ConfigError: a bad seq_len, val_fraction or max_documents.
    """
    key = cache_key(cfg, seq_len)
    seq_len = int(seq_len)
    root = cfg.cache_path()  # "auto": the cache home, never the current folder
    final = root / key
    if (final / "manifest.json").is_file():
        return TokenData.load(final, reused=True)
    made = [p for p in (root, *root.parents) if not p.exists()]  # removed again on failure
    # A unique name per process: ranks preparing the same key at once do not collide. (Not
    # tempfile.mkdtemp: its 0700 mode would survive the rename and hide the data from others.)
    tmp = root / f".{key}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    ok = False
    try:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(root, ".*.tmp-*")  # builds killed (SIGKILL) before they ended
            tmp.mkdir()
        except OSError as e:
            raise DataError(
                f"data.cache_dir={cfg.cache_dir!r} cannot be created ({e.strerror}); pick a "
                "folder you can write"
            ) from None
        try:
            _build(cfg, seq_len, key, tmp, progress)
        except OSError as e:  # reading the source is wrapped where it is read: this is writing
            raise DataError(
                f"cannot write the data cache in {str(root)!r} ({e.strerror or e}); free disk "
                "space or pick another data.cache_dir"
            ) from None
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process (another rank) finished the same key first: use its folder.
            if not (final / "manifest.json").is_file():
                raise DataError(
                    f"cache folder {final} exists but holds no manifest; delete it and run again"
                ) from None
        ok = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made if not ok else ():  # a failed first use leaves no empty cache folder
            with contextlib.suppress(OSError):
                p.rmdir()
    return TokenData.load(final, reused=False)
