"""Text sources, tokenizers and packing into fixed-length token blocks.

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
* Opening a cache checks it: the manifest's schema (types, the dtype the vocabulary
  implies, shard names), each shard's size, SHA-256 and largest token id against the
  vocabulary. The hash is taken once: ``verified.json`` records each shard's size and
  modification time at its last check, and a shard that still matches is not read again.
* Shards are raw numpy memmaps of shape ``(num_blocks, seq_len)``, uint16 when the
  vocabulary fits and uint32 otherwise, in ``cache_dir/<key>/`` beside the tokenizer files
  and a ``manifest.json``. The key hashes everything that changes the tokens (source,
  tokenizer, text field, val_fraction, max_documents, seq_len, and the sizes and mtimes of
  local files), so a second :func:`prepare` with the same inputs only reads the manifest.
* Writes are atomic: the folder is built under a temporary name beside its final place and
  moved there with :func:`os.replace`, so an interrupted run never leaves a half-written
  shard where :func:`prepare` looks. (A killed process can leave a ``.KEY.tmp-*`` folder;
  nothing reads it and it is safe to delete.)
* A ``.txt`` file is one document (blank lines do not split it): that is what the
  ``datasets`` text builder does with ``sample_by="document"``, so a local folder read
  directly and through ``hf:`` gives the same documents. ``.jsonl`` holds one document per
  line, ``.parquet`` one per row. Empty documents are skipped everywhere (they would add a
  lone EOS and nothing else).
* Tokenizers treat text as ordinary text: a literal EOS string inside a document
  (``<|endoftext|>`` in a file about GPT-2) is tokenized as text, never as EOS, as
  tiktoken's ``encode_ordinary`` does.
* Bits per byte: the manifest records each split's UTF-8 bytes and tokens (EOS included)
  before the remainder is dropped; ``bytes_per_token`` turns a loss in bits/token into
  bits/byte.
* Training batches come from :class:`BlockSampler`, a seeded permutation per epoch whose
  whole state is ``(epoch, position)``: resume is exact, and ranks take strided shares of
  one global batch, so the data a run sees does not depend on the number of processes.
* ``transformers``, ``datasets`` and ``torch`` are imported only where they are needed, so
  importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import hashlib
import itertools
import json
import math
import os
import platform
import secrets
import shutil
import sys
import sysconfig
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable

import numpy as np

from anyorder.config import DataConfig
from anyorder.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
"""Version of the shard layout; part of the cache key, so a new layout never reads an old one."""
EOT = "<|endoftext|>"
"""The EOS token of GPT-2 and of the BPE tokenizers trained here."""
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
"""File types a local source may hold."""
SPLITS = ("train", "val")
BPE_TRAIN_CHARS = 256 * 2**20
"""A bpe:VOCAB tokenizer is trained on the first train documents, up to this many characters."""

_META = "anyorder_tokenizer.json"  # written by every Tokenizer.save; says how to reload
_MIN_VOCAB = 256  # a real subword vocabulary is larger; fewer means broken tokenizer files
_STDLIB_SKIP = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "test",
    "tests",
    "idle_test",
    "idlelib",
}
ESTIMATE_OVER_S = 20.0
"""Tokenizing a corpus expected to take longer than this prints an estimate first."""
_FLUSH_TOKENS = 1 << 20  # tokens buffered in memory per split before a write
_ENCODE_CHUNK = 256  # documents per batched tokenizer call


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
            from anyorder import synthetic

            return synthetic.DOCUMENTS * synthetic.DOC_BYTES
        if source.startswith(("builtin:", "hf:")):
            return None
        return sum(p.stat().st_size for p in resolve_files(source))
    except (ImportError, OSError, DataError):
        return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# ----------------------------------------------------------------------------- tokenizers


@runtime_checkable
class Tokenizer(Protocol):
    """What packing, training and sampling need from a tokenizer.

    Attributes:
        name: a short human-readable name (``bytes``, ``gpt2``, ``bpe:8192``).
        vocab_size: number of ids the model reads and predicts, EOS included.
        eos_id: the id appended after every document.
        spec: a string that :func:`load_tokenizer` turns back into this tokenizer (a
            saved folder for tokenizers trained here).
    """

    name: str
    vocab_size: int
    eos_id: int
    spec: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no EOS appended."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; EOS and out-of-range ids are skipped, bad bytes replaced."""
        ...

    def save(self, folder: Path) -> None:
        """Write files into ``folder`` so that ``load_tokenizer(str(folder))`` restores it."""
        ...


def _write_meta(folder: Path, tok: Tokenizer, kind: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "kind": kind,
        "name": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
    }
    (folder / _META).write_text(json.dumps(meta, indent=2) + "\n")


def _encode_ordinary(
    encode: Callable[[str], list[int]], text: str, eos_text: str, literal: list[int]
) -> list[int]:
    """Encode ``text`` with every occurrence of ``eos_text`` spelled as plain ``literal`` ids.

    Subword tokenizers match their special tokens anywhere in the input, so a document that
    mentions ``<|endoftext|>`` would otherwise get an EOS in its middle.
    """
    parts = text.split(eos_text)
    ids = encode(parts[0])
    for part in parts[1:]:
        ids += literal
        ids += encode(part)
    return ids


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and EOS = 256: no files, no training, no download."""

    name = "bytes"
    spec = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (lone surrogates become ``?``)."""
        return list(text.encode("utf-8", errors="replace"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes ``< 256`` decoded as UTF-8 with replacement; EOS and others skipped."""
        raw = bytes(i for i in (int(x) for x in ids) if 0 <= i < 256)
        return raw.decode("utf-8", errors="replace")

    def save(self, folder: Path) -> None:
        """Write the marker file that reloads a byte tokenizer."""
        _write_meta(Path(folder), self, "bytes")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _eos_of_vocab(vocab: dict[str, int], *fallback: int | None) -> int | None:
    if EOT in vocab:
        return vocab[EOT]
    for tid in fallback:
        if tid is not None:
            return int(tid)
    return None


class HFTokenizer:
    """A ``transformers`` tokenizer (gpt2, bert-base-uncased, a saved folder).

    EOS is ``<|endoftext|>`` when the vocabulary has it, else the tokenizer's EOS token,
    else its separator (``[SEP]`` for BERT).
    """

    def __init__(self, tok: Any, *, name: str, spec: str, eos_id: int | None = None) -> None:
        # Whole documents are tokenized before packing: the model's max length does not
        # apply here, and the "sequence longer than" warning would be noise.
        tok.model_max_length = sys.maxsize
        self.tok = tok
        self.name = name
        self.spec = spec
        self.vocab_size = len(tok)
        if self.vocab_size < _MIN_VOCAB:
            raise DataError(
                f"tokenizer {spec!r} loaded with only {self.vocab_size} tokens, an empty or "
                "broken vocabulary; check its files (vocab.json + merges.txt or tokenizer.json)"
            )
        if eos_id is None:
            eos_id = _eos_of_vocab(
                tok.get_vocab(),
                getattr(tok, "eos_token_id", None),
                getattr(tok, "sep_token_id", None),
            )
        if eos_id is None:
            raise DataError(
                f"tokenizer {spec!r} has no {EOT}, EOS or SEP token to end documents with; "
                "use a tokenizer that has one"
            )
        self.eos_id = int(eos_id)
        self._eos_text = tok.convert_ids_to_tokens(self.eos_id)
        self._literal = self._plain(self._eos_text[:1]) + self._plain(self._eos_text[1:])

    def _plain(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens ([CLS]/[SEP] are not added)."""
        if self._eos_text in text:
            return _encode_ordinary(self._plain, text, self._eos_text, self._literal)
        return self._plain(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text in one batched (parallel, for fast tokenizers) call."""
        out = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return [self.encode(t) if self._eos_text in t else list(ids) for t, ids in zip(texts, out)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, skipping EOS, special tokens and out-of-range ids."""
        return self.tok.decode(
            _text_ids(ids, self.vocab_size, self.eos_id), skip_special_tokens=True
        )

    def save(self, folder: Path) -> None:
        """``save_pretrained`` into ``folder`` plus the marker that records the EOS id."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tok.save_pretrained(str(folder))
        _write_meta(folder, self, "transformers")

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


class BPETokenizer:
    """A ``tokenizers`` tokenizer: the byte-level BPE trained by ``bpe:VOCAB``, or any
    ``tokenizer.json``."""

    def __init__(self, tok: Any, *, name: str, spec: str, eos_id: int | None = None) -> None:
        self.tok = tok
        self.name = name
        self.spec = spec
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        if self.vocab_size < _MIN_VOCAB:
            raise DataError(
                f"tokenizer {spec!r} loaded with only {self.vocab_size} tokens, an empty or "
                "broken vocabulary; check its tokenizer.json"
            )
        if eos_id is None:
            vocab = tok.get_vocab(with_added_tokens=True)
            eos_id = _eos_of_vocab(vocab, *(vocab.get(t) for t in ("</s>", "<eos>", "[SEP]")))
        if eos_id is None:
            raise DataError(
                f"tokenizer {spec!r} has no {EOT}, </s>, <eos> or [SEP] token to end documents "
                "with; use a tokenizer that has one"
            )
        self.eos_id = int(eos_id)
        self._eos_text = tok.id_to_token(self.eos_id)
        self._literal = self._plain(self._eos_text[:1]) + self._plain(self._eos_text[1:])

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, *, progress: bool = False
    ) -> BPETokenizer:
        """Train a GPT-2-style byte-level BPE with ``<|endoftext|>`` (id 0) as EOS.

        Args:
            texts: the training documents.
            vocab_size: the vocabulary size to aim for (fewer when the corpus runs out of
                merges); at least 257, the 256 bytes plus EOS.
            progress: show the trainer's progress bar.
        """
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = RawTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            # All 256 bytes from the start: any text can be encoded, nothing is <unk>.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=progress and sys.stderr.isatty(),
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(
            tok, name=f"bpe:{vocab_size}", spec=f"bpe:{vocab_size}", eos_id=tok.token_to_id(EOT)
        )

    def _plain(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS appended)."""
        if self._eos_text in text:
            return _encode_ordinary(self._plain, text, self._eos_text, self._literal)
        return self._plain(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text in one parallel call."""
        out = self.tok.encode_batch(list(texts), add_special_tokens=False)
        return [self.encode(t) if self._eos_text in t else e.ids for t, e in zip(texts, out)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, skipping EOS, special tokens and out-of-range ids."""
        return self.tok.decode(
            _text_ids(ids, self.vocab_size, self.eos_id), skip_special_tokens=True
        )

    def save(self, folder: Path) -> None:
        """Write ``tokenizer.json`` and the marker that records the EOS id."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(folder / "tokenizer.json"))
        _write_meta(folder, self, "tokenizers")

    def __repr__(self) -> str:
        return f"BPETokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


def _looks_like_path(spec: str) -> bool:
    # Hub ids contain "/" too ("org/name"), so only explicit path forms count.
    return spec.startswith(("/", "./", "../", "~")) or spec in (".", "..")


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise DataError(
            "this tokenizer needs the transformers package; pip install 'anyorder[hf]'"
        ) from None
    return transformers


def _parse_bpe(spec: str) -> int:
    try:
        vocab = int(spec.partition(":")[2])
    except ValueError:
        raise DataError(
            f"tokenizer {spec!r} needs a vocabulary size, e.g. data.tokenizer=bpe:8192"
        ) from None
    if vocab < 257:
        raise DataError(f"tokenizer {spec!r}: the vocabulary must hold at least 257 tokens")
    return vocab


def load_tokenizer(spec: str, texts: Iterable[str] | None = None) -> Tokenizer:
    """Build or load a tokenizer.

    Args:
        spec: ``bytes``; ``bpe:VOCAB`` (trained on ``texts``); a local folder (written by
            :meth:`Tokenizer.save`, or holding ``vocab.json`` + ``merges.txt``,
            ``tokenizer_config.json`` or ``tokenizer.json``); or a Hugging Face hub id such as
            ``gpt2`` or ``bert-base-uncased``.
        texts: training documents, needed only for ``bpe:VOCAB``.

    Raises:
        DataError: an unknown spec, a missing or broken folder, a hub id that cannot be
            reached, or ``bpe:VOCAB`` without texts.
    """
    spec = spec.strip()
    if spec in ("bytes", "byte"):
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        vocab = _parse_bpe(spec)
        if texts is None:
            raise DataError(
                f"tokenizer {spec!r} must be trained on texts; call prepare() (which trains it "
                "on the corpus) or pass the folder it was saved to"
            )
        return BPETokenizer.train(texts, vocab)
    path = Path(spec).expanduser()
    if _looks_like_path(spec) or path.exists():
        return _load_folder(path)
    return _load_hub(spec)


def _load_folder(path: Path) -> Tokenizer:
    if not path.exists():
        raise DataError(f"tokenizer folder {str(path)!r} does not exist; give an existing folder")
    if not path.is_dir():
        raise DataError(
            f"tokenizer path {str(path)!r} is not a folder; give the folder that holds the "
            "tokenizer files"
        )
    spec = str(path.resolve())
    try:
        meta_file = path / _META
        if meta_file.is_file():
            meta = json.loads(meta_file.read_text())
            kind, name, eos = meta["kind"], meta["name"], int(meta["eos_id"])
            if kind == "bytes":
                return ByteTokenizer()
            if kind == "tokenizers":
                from tokenizers import Tokenizer as RawTokenizer

                raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
                return BPETokenizer(raw, name=name, spec=spec, eos_id=eos)
            if kind == "transformers":
                auto = _import_transformers().AutoTokenizer
                return HFTokenizer(
                    auto.from_pretrained(str(path)), name=name, spec=spec, eos_id=eos
                )
            raise DataError(f"tokenizer folder {spec!r} has an unknown kind {kind!r} in {_META}")
        has = {p.name for p in path.iterdir()}
        if {"vocab.json", "merges.txt"} <= has and "tokenizer_config.json" not in has:
            # GPT-2's own files. In transformers 5 the vocab_file=/merges_file= keywords build
            # an empty tokenizer; from_pretrained(folder) reads them correctly.
            fast = _import_transformers().GPT2TokenizerFast
            return HFTokenizer(fast.from_pretrained(str(path)), name=path.name, spec=spec)
        if "tokenizer_config.json" in has:
            auto = _import_transformers().AutoTokenizer
            return HFTokenizer(auto.from_pretrained(str(path)), name=path.name, spec=spec)
        if "tokenizer.json" in has:
            from tokenizers import Tokenizer as RawTokenizer

            raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
            return BPETokenizer(raw, name=path.name, spec=spec)
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"tokenizer folder {spec!r} could not be loaded ({_first_line(e)}); check its files"
        ) from None
    raise DataError(
        f"tokenizer folder {spec!r} holds no tokenizer files; it needs tokenizer.json, "
        "tokenizer_config.json, or vocab.json + merges.txt"
    )


def _hub_unreachable(timeout_s: float = 5.0) -> str:
    """Why the hub cannot be reached ("" when a TCP connection to it opens), in one try:
    ``HF_HUB_OFFLINE``, a name that does not resolve, a refused or timed-out connection."""
    import socket
    from urllib.parse import urlsplit

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return f"{host}: {e.strerror or type(e).__name__}"
    return ""


def _load_hub(spec: str) -> Tokenizer:
    auto = _import_transformers().AutoTokenizer
    try:
        # The local cache first: it answers at once, where a failing hub retries for a minute.
        tok = auto.from_pretrained(spec, local_files_only=True)
    except Exception:
        unreachable = _hub_unreachable()
        if unreachable:  # fail now, not after a minute of retries and a screen of warnings
            raise DataError(
                f"tokenizer {spec!r} is not a local folder or a cached hub tokenizer, and the "
                f"Hugging Face hub cannot be reached ({unreachable}); check the name, or pass a "
                "local tokenizer folder as data.tokenizer"
            ) from None
        try:
            tok = auto.from_pretrained(spec)
        except Exception as e:
            raise DataError(
                f"tokenizer {spec!r} could not be loaded offline or from the Hugging Face hub "
                f"({_first_line(e)}); pass a local tokenizer folder as data.tokenizer"
            ) from None
    return HFTokenizer(tok, name=spec, spec=spec)


# ----------------------------------------------------------------------------- sources


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
    raise DataError(
        f"data.source {source!r} does not exist; give an existing file, folder or glob of "
        f"{kinds} files, builtin:pydoc, builtin:stdlib or hf:NAME"
    )


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
            "parquet", data_files=[str(path)], split="train", streaming=True
        )
        for row in ds:
            yield _text_of(row, text_field, str(path))
        return
    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise DataError(
            f"{path} has no column {text_field!r} (it has: {', '.join(pf.schema_arrow.names)}); "
            "set data.text_field to the column that holds the text"
        )
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield _text_of({text_field: value}, text_field, str(path))


def _read_file(path: Path, text_field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            # Text mode (universal newlines) matches the datasets text builder exactly.
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
        elif suffix == ".jsonl":
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(
                            f"{path}:{lineno} is not valid JSON ({e.msg}); fix or remove the line"
                        ) from None
                    yield _text_of(record, text_field, f"{path}:{lineno}")
        else:
            yield from _read_parquet(path, text_field)
    except DataError:
        raise
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
        # Streaming reads the files in place instead of copying them into the datasets cache.
        args: tuple[Any, ...] = (builder,)
        kwargs: dict[str, Any] = dict(data_files={split: [str(f) for f in files]}, streaming=True)
        if builder == "text":
            kwargs.update(sample_by="document", encoding_errors="replace")
            text_field = "text"  # the text builder always names its column "text"
    else:
        name, _, config = rest.partition(":")
        args, kwargs = (name, config or None), dict(streaming=streaming)
    where = f"hf:{rest}"
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
) -> Iterator[str]:
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

    Raises:
        DataError: a missing path, a folder without supported files, an unknown builtin, or
            (while iterating) an unreadable file or unreachable dataset.
    """
    if source == "builtin:pydoc":
        docs = _pydoc_documents()
    elif source == "builtin:stdlib":
        docs = _stdlib_documents()
    elif source == "builtin:synthetic":
        from anyorder.synthetic import documents

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
        docs = itertools.chain.from_iterable(_read_file(f, text_field) for f in files)
    docs = (d for d in docs if d)
    if max_documents is not None:
        docs = itertools.islice(docs, max_documents)
    return docs


# ----------------------------------------------------------------------------- packing


def is_val_document(text: str, val_fraction: float) -> bool:
    """Whether ``text`` is held out: ``int(sha1(text)[:8], 16) / 2**32 < val_fraction``."""
    digest = hashlib.sha1(text.encode("utf-8", errors="replace")).hexdigest()
    return int(digest[:8], 16) / 2**32 < val_fraction


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65535), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


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
        from anyorder import synthetic

        return f"synthetic-v{synthetic.VERSION}"
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
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


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


def _text_ids(ids: Sequence[int], vocab_size: int, eos_id: int) -> list[int]:
    """The ids worth decoding to text: in range and not EOS."""
    return [i for i in (int(x) for x in ids) if 0 <= i < vocab_size and i != eos_id]


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks (shards, checkpoints, exports)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _encode_many(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    batch = getattr(tok, "encode_batch", None)
    return batch(texts) if batch is not None else [tok.encode(t) for t in texts]


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _pack(
    docs: Iterable[str],
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
                encoded = _encode_many(tok, chunk)
                for text, ids in zip(chunk, encoded):
                    raw = text.encode("utf-8", errors="replace")
                    done += len(raw)
                    split = "val" if is_val_document(text, val_fraction) else "train"
                    w = writers[split]
                    if split == "train":
                        tail.append((w.tokens, len(ids) + 1, len(raw)))
                        tail_tokens += len(ids) + 1
                        while tail_tokens - tail[0][1] >= seq_len:
                            tail_tokens -= tail.popleft()[1]
                    w.add(ids, eos, len(raw))
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


def _documents(cfg: DataConfig) -> Iterator[str]:
    return iter_documents(
        cfg.source,
        text_field=cfg.text_field,
        streaming=cfg.streaming,
        max_documents=cfg.max_documents,
    )


def _build(cfg: DataConfig, seq_len: int, key: str, folder: Path, progress: bool) -> None:
    """Write shards, tokenizer and manifest of ``cfg`` into ``folder``."""
    docs = _documents(cfg)  # resolves the source first: a bad path fails before training
    if cfg.tokenizer.strip().startswith("bpe:"):
        vocab = _parse_bpe(cfg.tokenizer.strip())
        tok: Tokenizer = BPETokenizer.train(_bpe_texts(cfg), vocab, progress=progress)
    else:
        tok = load_tokenizer(cfg.tokenizer)
    stats, moved = _pack(docs, tok, seq_len, cfg.val_fraction, folder, cfg.source, progress)
    tok.save(folder / "tokenizer")
    manifest = {
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
        st = (folder / info["file"]).stat()
        stamp[info["file"]] = [st.st_size, st.st_mtime_ns, info["sha256"]]
    _write_stamp(folder / STAMP, stamp)


@dataclass(eq=False)  # arrays make == ambiguous; compare .train/.val explicitly
class TokenData:
    """Packed token blocks of one corpus: memmaps of shape ``(num_blocks, seq_len)``.

    Attributes:
        path: the cache folder.
        manifest: the contents of ``manifest.json``.
        tokenizer: the tokenizer the blocks were made with.
        train: train blocks, (N_train, seq_len).
        val: validation blocks, (N_val, seq_len); zero rows when val_fraction is 0.
        reused: True when :func:`prepare` found the folder ready and tokenized nothing.
    """

    path: Path
    manifest: dict[str, Any]
    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray
    reused: bool = False

    def __repr__(self) -> str:
        return (
            f"TokenData(path={str(self.path)!r}, train={tuple(self.train.shape)}, "
            f"val={tuple(self.val.shape)}, tokenizer={self.tokenizer!r}, reused={self.reused})"
        )

    @classmethod
    def load(cls, folder: str | Path, *, reused: bool = True) -> TokenData:
        """Open a folder written by :func:`prepare`.

        Raises:
            DataError: no manifest, another format, or a shard of the wrong size.
        """
        folder = Path(folder)
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise DataError(
                f"{folder} is not a prepared data folder ({_first_line(e)}); run prepare again"
            ) from None
        if isinstance(manifest, dict) and manifest.get("format") != FORMAT_VERSION:
            raise DataError(
                f"{folder} has data format {manifest.get('format')}, this version reads "
                f"{FORMAT_VERSION}; delete the folder and prepare again"
            )
        problem = data_manifest_problem(manifest)
        if problem:
            raise DataError(
                f"data cache manifest {folder / 'manifest.json'} is damaged ({problem}); delete "
                f"{folder} and prepare again"
            )
        seq_len = int(manifest["seq_len"])
        dtype = np.dtype(manifest["dtype"])
        arrays = {}
        for split in SPLITS:
            info = manifest["splits"][split]
            path = folder / info["file"]
            blocks = int(info["blocks"])
            size = path.stat().st_size if path.is_file() else -1
            if size != blocks * seq_len * dtype.itemsize:
                raise DataError(
                    f"shard {path} is missing or has the wrong size; delete {folder} and "
                    "prepare again"
                )
            # np.memmap cannot map an empty file: an empty split is a plain (0, seq_len) array.
            arrays[split] = (
                np.memmap(path, dtype=dtype, mode="r", shape=(blocks, seq_len))
                if blocks
                else np.zeros((0, seq_len), dtype=dtype)
            )
        tokenizer = load_tokenizer(str(folder / "tokenizer"))
        if tokenizer.vocab_size != manifest["vocab_size"]:
            raise DataError(
                f"the tokenizer in {folder} has {tokenizer.vocab_size} token ids but its manifest "
                f"says {manifest['vocab_size']}; delete {folder} and prepare again"
            )
        data = cls(folder, manifest, tokenizer, arrays["train"], arrays["val"], reused)
        data.verify(stamped=True)
        return data

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["eos_id"])

    def split(self, name: str) -> np.ndarray:
        """The blocks of ``train`` or ``val``."""
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}; use train or val")
        return self.train if name == "train" else self.val

    def num_blocks(self, split: str) -> int:
        """Number of blocks in a split."""
        return int(self.split(split).shape[0])

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes per token of a split: bits/byte = bits/token / bytes_per_token."""
        self.split(split)
        return float(self.manifest["splits"][split]["bytes_per_token"])

    def batch(self, split: str, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Blocks ``indices`` of a split as a LongTensor of shape (B, seq_len)."""
        import torch

        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(np.asarray(self.split(split)[idx], dtype=np.int64))

    def verify(self, stamped: bool = False) -> None:
        """Check every shard against the SHA-256 in the manifest and its token ids against
        the vocabulary. :meth:`load` calls it with ``stamped``: a shard whose size and
        modification time match the stamp of its last check (``verified.json``) is not read
        again, so a large cache is hashed once, not at every start.

        Raises:
            DataError: a shard whose contents changed, or an id outside the vocabulary.
        """
        stamp_path = self.path / STAMP
        stamp: dict[str, Any] = {}
        if stamped:
            with contextlib.suppress(OSError, ValueError, RecursionError):
                stamp = json.loads(stamp_path.read_text())
            stamp = stamp if isinstance(stamp, dict) else {}
        fresh = {}
        for split in SPLITS:
            info = self.manifest["splits"][split]
            path = self.path / info["file"]
            st = path.stat()
            fresh[info["file"]] = [st.st_size, st.st_mtime_ns, info["sha256"]]
            if stamp.get(info["file"]) == fresh[info["file"]]:
                continue
            digest, top = _scan_shard(path, np.dtype(self.manifest["dtype"]))
            if digest != info["sha256"]:
                raise DataError(
                    f"shard {path} does not match its checksum; delete {self.path} and "
                    "prepare again"
                )
            if top >= self.vocab_size:
                raise DataError(
                    f"shard {path} holds token id {top}, outside the vocabulary of "
                    f"{self.vocab_size} ids; delete {self.path} and prepare again"
                )
        if fresh != stamp:
            _write_stamp(stamp_path, fresh)


STAMP = "verified.json"
"""A cache folder's record of its last shard check: file -> [size, mtime_ns, sha256]."""


def _write_stamp(path: Path, stamp: dict[str, Any]) -> None:
    """Write the stamp atomically; a read-only cache just goes unstamped (checked again)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text(json.dumps(stamp) + "\n")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _scan_shard(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """SHA-256 and the largest token id of a shard, in one pass of 4 MiB chunks."""
    h = hashlib.sha256()
    top = -1
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
            ids = np.frombuffer(chunk[: len(chunk) - len(chunk) % dtype.itemsize], dtype=dtype)
            if ids.size:
                top = max(top, int(ids.max()))
    return h.hexdigest(), top


_HEX64 = frozenset("0123456789abcdef")


def _count(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def data_manifest_problem(manifest: Any) -> str:
    """What is wrong with a data cache's parsed manifest ("" when nothing): the keys
    :class:`TokenData` reads, with their types and the dtype the vocabulary implies."""
    if not isinstance(manifest, dict):
        return f"it holds {type(manifest).__name__}, not a JSON object"
    for key in ("seq_len", "vocab_size"):
        if not _count(manifest.get(key), 1):
            return f"{key} is {json.dumps(manifest.get(key))[:40]}, not a whole number >= 1"
    vocab = manifest["vocab_size"]
    eos = manifest.get("eos_id")
    if not _count(eos) or eos >= vocab:
        return f"eos_id is {json.dumps(eos)[:40]}, not an id below vocab_size={vocab}"
    if manifest.get("dtype") != token_dtype(vocab).name:
        return f"dtype is {json.dumps(manifest.get('dtype'))[:40]}, not {token_dtype(vocab).name}"
    splits = manifest.get("splits")
    if not isinstance(splits, dict):
        return "'splits' is not an object"
    for split in SPLITS:
        info = splits.get(split)
        if not isinstance(info, dict):
            return f"it has no {split} split"
        if info.get("file") != f"{split}.bin":
            return f"the {split} file is {json.dumps(info.get('file'))[:60]}, not {split}.bin"
        if not _count(info.get("blocks")):
            return f"the {split} split has no block count"
        digest = info.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX64:
            return f"the {split} split has no SHA-256"
        bpt = info.get("bytes_per_token")
        if not isinstance(bpt, (int, float)) or isinstance(bpt, bool) or not 0 <= bpt < 1e6:
            return f"the {split} split has no bytes_per_token"
    return ""


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
    root = Path(cfg.cache_dir).expanduser()
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


# ----------------------------------------------------------------------------- batches


class BlockSampler:
    """Global batches of block indices from a seeded permutation per epoch, for exact resume.

    The global batch is ``batch_size`` consecutive entries of the epoch's permutation
    (continuing into the next epoch's permutation when one runs out); rank ``r`` gets
    ``global[r::world_size]``. The state is ``(epoch, position)`` in global indices, so a
    run resumes exactly, even on another number of ranks.

    Args:
        num_blocks: blocks in the split.
        batch_size: global batch size, a multiple of ``world_size``.
        seed: seed of the permutations (epoch ``e`` uses ``default_rng([seed, e])``).
        rank: this process's rank.
        world_size: number of processes.

    Raises:
        ConfigError: batch_size not divisible by world_size, or a bad size or rank.
    """

    def __init__(
        self, num_blocks: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        if num_blocks < 1:
            raise DataError("the split has no blocks to sample; use a larger corpus")
        if batch_size < 1 or world_size < 1:
            raise ConfigError("batch_size and world_size must be positive")
        if batch_size % world_size:
            raise ConfigError(
                f"train.batch_size={batch_size} is not divisible by world_size={world_size}; "
                "use a multiple of the number of processes"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} must be in [0, world_size={world_size})")
        self.num_blocks = num_blocks
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of block indices in ``epoch``."""
        if epoch != self._perm_epoch:
            # SeedSequence takes only non-negative entries; the mask keeps any int seed valid.
            rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, epoch])
            self._perm = rng.permutation(self.num_blocks)
            self._perm_epoch = epoch
        return self._perm

    def next_indices(self) -> np.ndarray:
        """This rank's share of the next global batch, (batch_size // world_size,) int64."""
        out = np.empty(self.batch_size, dtype=np.int64)
        filled = 0
        while filled < self.batch_size:
            perm = self.permutation(self.epoch)
            take = min(self.batch_size - filled, self.num_blocks - self.position)
            out[filled : filled + take] = perm[self.position : self.position + take]
            filled += take
            self.position += take
            if self.position == self.num_blocks:
                self.epoch += 1
                self.position = 0
        return out[self.rank :: self.world_size]

    def state_dict(self) -> dict[str, int]:
        """The position in the stream of global indices (same on every rank)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_blocks": self.num_blocks,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from :meth:`state_dict`.

        Raises:
            DataError: the state belongs to data with another number of blocks or seed.
        """
        if (
            int(state.get("num_blocks", self.num_blocks)) != self.num_blocks
            or int(state.get("seed", self.seed)) != self.seed
        ):
            raise DataError(
                f"sampler state is for {state.get('num_blocks')} blocks and seed "
                f"{state.get('seed')}, not {self.num_blocks} and {self.seed}; resume with the "
                "same data and train.seed"
            )
        position = int(state["position"])
        if not 0 <= position < self.num_blocks:
            raise DataError(f"sampler state has position {position} outside the epoch")
        self.epoch = int(state["epoch"])
        self.position = position


def iter_eval_blocks(
    data: TokenData,
    split: str = "val",
    max_blocks: int | None = None,
    *,
    batch_size: int = 8,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[torch.Tensor]:
    """The first ``max_blocks`` blocks of a split, in order, as (B, seq_len) LongTensors.

    Rank ``r`` of ``world_size`` gets blocks ``r, r + world_size, ...`` of those, so the
    ranks together cover each block once.

    Raises:
        DataError: the split has no blocks (validation with val_fraction=0).
    """
    n = data.num_blocks(split)
    if n == 0:
        raise DataError(f"the {split} split has no blocks; set data.val_fraction > 0")
    if max_blocks is not None:
        n = min(n, max_blocks)
    idx = np.arange(rank, n, world_size)
    for start in range(0, len(idx), batch_size):
        yield data.batch(split, idx[start : start + batch_size])


# ----------------------------------------------------------------------------- statistics


def unigram_entropy(data: TokenData, split: str = "train") -> float:
    """Entropy in bits/token of the split's unigram distribution (over the kept blocks)."""
    blocks = data.split(split)
    counts = np.zeros(data.vocab_size, dtype=np.int64)
    rows = max(1, (1 << 24) // data.seq_len)  # ~16M tokens at a time: bounded memory
    for start in range(0, blocks.shape[0], rows):
        chunk = np.asarray(blocks[start : start + rows]).ravel()
        counts += np.bincount(chunk, minlength=data.vocab_size)[: data.vocab_size]
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def unigram_bits_per_byte(data: TokenData) -> float:
    """The unigram baseline in bits/byte: train unigram entropy / train bytes_per_token.

    A trained model's bits/byte must come out below this to have learnt anything beyond
    token frequencies.
    """
    return unigram_entropy(data, "train") / data.bytes_per_token("train")


def data_main(cfg: DataConfig, seq_len: int) -> dict[str, Any]:
    """Prepare the data and print its statistics (the ``anyorder data`` command).

    Returns:
        path, reused, source, tokenizer, vocab_size, seq_len, dtype, per split documents,
        tokens, blocks, bytes and bytes_per_token, and the unigram baseline in bits/token
        and bits/byte.
    """
    data = prepare(cfg, seq_len, progress=True)
    m = data.manifest
    bits_token = unigram_entropy(data, "train")
    stats: dict[str, Any] = {
        "path": str(data.path),
        "reused": data.reused,
        "source": m["source"],
        "tokenizer": m["tokenizer"],
        "vocab_size": m["vocab_size"],
        "seq_len": m["seq_len"],
        "dtype": m["dtype"],
        "unigram_bits_per_token": bits_token,
        "unigram_bits_per_byte": bits_token / data.bytes_per_token("train"),
    }
    for split in SPLITS:
        s = m["splits"][split]
        keys = ("documents", "tokens", "blocks", "bytes", "bytes_per_token")
        stats[split] = {k: s[k] for k in keys}
    print(f"data: {stats['path']} ({'reused' if data.reused else 'prepared'})")
    print(
        f"  source {stats['source']}, tokenizer {stats['tokenizer']} "
        f"(vocab {stats['vocab_size']}, {stats['dtype']}), seq_len {stats['seq_len']}"
    )
    for split in SPLITS:
        s = stats[split]
        print(
            f"  {split:5s} {s['documents']:>9,} docs {s['tokens']:>13,} tokens "
            f"{s['blocks']:>9,} blocks {s['bytes_per_token']:.3f} bytes/token"
        )
    print(
        f"  unigram baseline: {bits_token:.3f} bits/token = "
        f"{stats['unigram_bits_per_byte']:.3f} bits/byte"
    )
    return stats
