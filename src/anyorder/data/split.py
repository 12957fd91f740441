"""Packing documents into token blocks, and the train/validation split.

Design choices:

* Packing follows the papers (GPT-2 / OpenWebText style): every document is tokenized, one
  EOS token is appended after it, the documents are concatenated and cut into blocks of
  ``seq_len`` tokens, and the remainder that does not fill a block is dropped. Blocks cross
  document boundaries; the EOS marks them.
* Train/validation split by a stable hash of the document text (SHA-1, not Python's salted
  ``hash``): a document is held out when ``int(sha1(text)[:8], 16) / 2**32 < val_fraction``.
  A document's split depends on nothing but its text. When the hash leaves validation
  without a single full block while ``val_fraction > 0`` (small corpora), the last train
  documents of the corpus move to validation, after the hashed ones, until it has one
  block; train must keep at least one block. When whole documents cannot do that (a
  corpus that is one large ``.txt`` file is one document), the last ``val_fraction`` of the
  train tokens (at least one block) becomes validation, said in one log line and recorded
  as ``splits.val.split_tokens``; below one block per split, :class:`DataError`.
* Bits per byte: the manifest records each split's UTF-8 bytes and tokens (EOS included)
  before the remainder is dropped; ``bytes_per_token`` turns a loss in bits/token into
  bits/byte.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from anyorder.data.shards import SPLITS, sha256_file, token_dtype
from anyorder.data.sources import LongText, source_bytes
from anyorder.data.tokenizers import Tokenizer, _text_ids
from anyorder.errors import DataError

ESTIMATE_OVER_S = 20.0
"""Tokenizing a corpus expected to take longer than this prints an estimate first."""

_FLUSH_TOKENS = 1 << 20  # tokens buffered in memory per split before a write
_ENCODE_CHUNK = 256  # documents per batched tokenizer call


def is_val_document(text: str, val_fraction: float) -> bool:
    """Whether ``text`` is held out: ``int(sha1(text)[:8], 16) / 2**32 < val_fraction``."""
    digest = hashlib.sha1(text.encode("utf-8", errors="replace")).hexdigest()
    return _held_out(digest, val_fraction)


def _held_out(sha1_hex: str, val_fraction: float) -> bool:
    return int(sha1_hex[:8], 16) / 2**32 < val_fraction


class _SplitWriter:
    """Appends one split's tokens to its .bin file and counts documents, tokens and bytes."""

    def __init__(self, path: Path, tok: Tokenizer, dtype: np.dtype) -> None:
        self.path = path
        self.tok = tok
        self.dtype = dtype
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.pending: list[int] = []
        self.documents = 0
        self.tokens = 0
        self.bytes = 0

    def add(self, ids: list[int], eos: int, nbytes: int) -> None:
        self.pending += ids
        self.pending.append(eos)
        self.documents += 1
        self.tokens += len(ids) + 1
        self.bytes += nbytes
        if len(self.pending) >= _FLUSH_TOKENS:
            self.flush()

    def add_file(self, spill: Path, ntokens: int, eos: int, nbytes: int) -> None:
        """Append a document whose ids were written to ``spill`` (this split's dtype, checked)
        in blocks, then its EOS: memory for a block, not the document."""
        self.flush()
        with open(spill, "rb") as src:
            while block := src.read(1 << 22):
                self.file.write(block)
        self.pending.append(eos)
        self.documents += 1
        self.tokens += ntokens + 1
        self.bytes += nbytes

    def flush(self) -> None:
        if self.pending:
            ids = np.asarray(self.pending, dtype=np.int64)
            # A cast to uint16 would silently wrap an id the vocabulary does not have.
            if ids.max() >= self.tok.vocab_size or ids.min() < 0:
                raise DataError(
                    f"tokenizer {self.tok.spec!r} produced an id outside 0.."
                    f"{self.tok.vocab_size - 1}; its vocab_size is wrong, use another tokenizer"
                )
            self.file.write(ids.astype(self.dtype).tobytes())
            self.pending = []
        self.file.flush()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.file.close()


def _encode_many(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    batch = getattr(tok, "encode_batch", None)
    return batch(texts) if batch is not None else [tok.encode(t) for t in texts]


def _chunks(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Lists of up to ``size`` documents; a :class:`LongText` comes alone, in its place."""
    chunk: list[Any] = []
    for item in items:
        if isinstance(item, LongText):
            if chunk:
                yield chunk
            yield [item]
            chunk = []
            continue
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _spill_long(
    doc: LongText, tok: Tokenizer, spill: Path, dtype: np.dtype
) -> tuple[str, int, int]:
    """Tokenize a long document piece by piece into ``spill``; returns the SHA-1 of its
    UTF-8 text (what :func:`is_val_document` hashes), its tokens and its bytes."""
    digest, ntokens, nbytes = hashlib.sha1(), 0, 0
    with open(spill, "wb") as f:
        for piece in doc.pieces():
            raw = piece.encode("utf-8", errors="replace")
            digest.update(raw)
            nbytes += len(raw)
            ids = np.asarray(tok.encode(piece), dtype=np.int64)
            if len(ids) and (ids.max() >= tok.vocab_size or ids.min() < 0):
                raise DataError(
                    f"tokenizer {tok.spec!r} produced an id outside 0..{tok.vocab_size - 1}; "
                    "its vocab_size is wrong, use another tokenizer"
                )
            f.write(ids.astype(dtype).tobytes())
            ntokens += len(ids)
    return digest.hexdigest(), ntokens, nbytes


def _encoded(
    chunk: list[Any], tok: Tokenizer, folder: Path, dtype: np.dtype
) -> list[tuple[str, int, int, Any]]:
    """``(sha1 of the text, tokens, UTF-8 bytes, ids)`` of each document of a chunk; a
    :class:`LongText` comes alone and its ids are the file they were spilled to."""
    if isinstance(chunk[0], LongText):
        spill = folder / ".long-document.tmp"
        sha, ntok, nbytes = _spill_long(chunk[0], tok, spill, dtype)
        return [(sha, ntok, nbytes, spill)]
    items = []
    for text, ids in zip(chunk, _encode_many(tok, chunk)):
        raw = text.encode("utf-8", errors="replace")
        items.append((hashlib.sha1(raw).hexdigest(), len(ids), len(raw), ids))
    return items


def _pack(
    docs: Iterable[Any],
    tok: Tokenizer,
    seq_len: int,
    val_fraction: float,
    folder: Path,
    source: str,
    progress: bool,
) -> tuple[dict[str, dict[str, Any]], int]:
    """Tokenize, split and write ``train.bin``/``val.bin``; returns (stats, docs moved to val)."""
    dtype = token_dtype(tok.vocab_size)
    eos = tok.eos_id
    writers = {s: _SplitWriter(folder / f"{s}.bin", tok, dtype) for s in SPLITS}
    # The last train documents, (start, tokens, bytes), enough to fill one block: the ones
    # that move to validation when the hash leaves it without a block.
    tail: deque[tuple[int, int, int]] = deque()
    tail_tokens = 0
    try:
        from anyorder.progress import estimate
        from anyorder.progress import progress as progress_bar

        bar = progress_bar(desc=f"tokenizing {source}", unit="docs", enabled=progress)
        total = source_bytes(source) if progress else None
        t0, done = time.perf_counter(), 0
        with bar:
            for chunk in _chunks(docs, _ENCODE_CHUNK):
                items = _encoded(chunk, tok, folder, dtype)
                for sha, ntok, nbytes, ids in items:
                    done += nbytes
                    split = "val" if _held_out(sha, val_fraction) else "train"
                    w = writers[split]
                    if split == "train":
                        tail.append((w.tokens, ntok + 1, nbytes))
                        tail_tokens += ntok + 1
                        while tail_tokens - tail[0][1] >= seq_len:
                            tail_tokens -= tail.popleft()[1]
                    if isinstance(ids, Path):
                        w.add_file(ids, ntok, eos, nbytes)
                        ids.unlink()
                    else:
                        w.add(ids, eos, nbytes)
                if total is not None and done:  # after the first chunk: the measured rate
                    per_mb = (time.perf_counter() - t0) / done * 1e6
                    if total / 1e6 * per_mb > ESTIMATE_OVER_S:
                        estimate(f"tokenizing {source}", max(1, round(total / 1e6)), per_mb, "MB")
                    total = None
                bar.update(len(chunk))
    finally:
        for w in writers.values():
            w.close()

    train, val = writers["train"], writers["val"]
    if train.documents + val.documents == 0:
        raise DataError(
            f"data.source {source!r} holds no documents (all empty); give a corpus with text"
        )
    moved = split_tokens = 0
    if val_fraction > 0 and val.tokens < seq_len:
        need = seq_len - val.tokens
        take: list[tuple[int, int, int]] = []
        while tail and sum(t[1] for t in take) < need:
            take.insert(0, tail.pop())
        got = sum(t[1] for t in take)
        if got >= need and train.tokens - got >= seq_len:
            _move_tail(train, val, take[0][0], dtype, None)
            moved_bytes = sum(t[2] for t in take)
            moved = len(take)
            train.documents -= moved
            val.documents += moved
            train.tokens -= got
            val.tokens += got
            train.bytes -= moved_bytes
            val.bytes += moved_bytes
    if val_fraction > 0 and min(train.tokens, val.tokens) < seq_len:
        # Too few documents to split by whole ones (one large .txt file is one document,
        # and its hash puts it all in one split): split the tokens instead.
        split_tokens = _split_by_tokens(train, val, seq_len, val_fraction, dtype, tok, source)
    if train.tokens < seq_len:
        raise DataError(
            f"corpus {source!r} has {train.tokens} train tokens, fewer than one block of "
            f"seq_len={seq_len}; use a larger corpus or a smaller model.seq_len"
        )

    stats: dict[str, dict[str, Any]] = {}
    for name, w in writers.items():
        blocks = w.tokens // seq_len
        # Drop the remainder: the file then holds exactly (blocks, seq_len) tokens.
        os.truncate(w.path, blocks * seq_len * dtype.itemsize)
        stats[name] = {
            "file": w.path.name,
            "documents": w.documents,
            "tokens": w.tokens,
            "blocks": blocks,
            "kept_tokens": blocks * seq_len,
            "bytes": w.bytes,
            "bytes_per_token": w.bytes / w.tokens if w.tokens else 0.0,
            "sha256": sha256_file(w.path),
        }
    stats["val"]["split_tokens"] = split_tokens  # taken from the end of the train text
    return stats, moved


def _split_by_tokens(
    train: _SplitWriter,
    val: _SplitWriter,
    seq_len: int,
    val_fraction: float,
    dtype: np.dtype,
    tok: Tokenizer,
    source: str,
) -> int:
    """Make validation the last ``val_fraction`` of all tokens (at least one block, leaving
    train one): train's tail moves to val, or val's head to train. Says so in one line.
    Returns the size of validation in tokens.

    Raises:
        DataError: fewer than two blocks in all.
    """
    total = train.tokens + val.tokens
    want = min(total - seq_len, max(seq_len, math.ceil(val_fraction * total)))
    if want < seq_len:
        raise DataError(
            f"corpus {source!r} has {total} tokens, fewer than one train and one validation "
            f"block of seq_len={seq_len} ({2 * seq_len} tokens); use a larger corpus or a "
            "smaller model.seq_len"
        )
    if val.tokens < want:
        count = want - val.tokens
        moved_bytes = _move_tail(train, val, train.tokens - count, dtype, tok)
        train.tokens, val.tokens = train.tokens - count, val.tokens + count
        train.bytes, val.bytes = train.bytes - moved_bytes, val.bytes + moved_bytes
    else:
        count = val.tokens - want
        itemsize = dtype.itemsize
        with open(val.path, "rb") as src, open(train.path, "ab") as dst:
            left = count * itemsize
            while left:
                chunk = src.read(min(left, 1 << 22))
                dst.write(chunk)
                left -= len(chunk)
            rest = np.frombuffer(src.read(), dtype=dtype)
        rest.tofile(val.path)
        kept = tok.decode(_text_ids(rest, tok.vocab_size, tok.eos_id))
        moved_bytes = val.bytes - len(kept.encode("utf-8", errors="replace"))
        train.tokens, val.tokens = train.tokens + count, val.tokens - count
        train.bytes, val.bytes = train.bytes + moved_bytes, val.bytes - moved_bytes
    print(
        f"data: {source!r} has too few documents to hold some out; its last {want:,} tokens "
        f"({want / total:.1%}) are the validation split",
        flush=True,
    )
    return want


def _move_tail(
    train: _SplitWriter, val: _SplitWriter, start: int, dtype: np.dtype, tok: Tokenizer | None
) -> int:
    """Move train tokens ``start:`` to the end of val; returns their UTF-8 bytes when ``tok``
    is given (decoded, EOS left out; a cut inside a character counts its replacement)."""
    itemsize = dtype.itemsize
    tail_ids = np.fromfile(train.path, dtype=dtype, offset=start * itemsize)
    with open(val.path, "ab") as f:
        f.write(tail_ids.tobytes())
    os.truncate(train.path, start * itemsize)
    if tok is None:
        return 0
    text = tok.decode(_text_ids(tail_ids, tok.vocab_size, tok.eos_id))
    return len(text.encode("utf-8", errors="replace"))
