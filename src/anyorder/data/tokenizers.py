"""Tokenizers: UTF-8 bytes, a byte-level BPE trained here, and ``transformers`` tokenizers.

Design choices:

* One small protocol, :class:`Tokenizer`, is all that packing, training and sampling need.
  Every tokenizer saves itself into a folder with a marker file that says how to reload it,
  so a data cache, a checkpoint or an exported model carries its own tokenizer.
* Tokenizers treat text as ordinary text: a literal EOS string inside a document
  (``<|endoftext|>`` in a file about GPT-2) is tokenized as text, never as EOS, as
  tiktoken's ``encode_ordinary`` does.
* ``bpe:VOCAB`` is a GPT-2-style byte-level BPE with ``<|endoftext|>`` as EOS, trained on the
  corpus (see :func:`anyorder.data.build.prepare`).
* ``transformers`` and ``tokenizers`` are imported only where they are needed. A hub id that
  is not cached fails at once, in one line, when the hub cannot be reached.
* A tokenizer folder is untrusted input (it comes with a downloaded model): nothing in it may
  run code. Every ``from_pretrained`` passes ``trust_remote_code=False`` (so transformers
  never prompts either), and a folder whose JSON asks for code (an ``auto_map``, a
  ``tokenizer_class`` transformers does not ship) is refused by name before transformers
  reads it (:mod:`anyorder.data.untrusted`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from anyorder.data.sources import _first_line, _looks_like_path
from anyorder.data.untrusted import (
    asks_for_code,
    hub_code_refusal,
    refuse_custom_code,
    refuse_loaded_auto_map,
)
from anyorder.errors import DataError

EOT = "<|endoftext|>"
"""The EOS token of GPT-2 and of the BPE tokenizers trained here."""

_META = "anyorder_tokenizer.json"  # written by every Tokenizer.save; says how to reload
_MIN_VOCAB = 256  # a real subword vocabulary is larger; fewer means broken tokenizer files


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


def _replaced(text: str) -> str:
    """``text`` with each lone surrogate (which the tokenizers library refuses) as ``?``."""
    return text.encode("utf-8", errors="replace").decode("utf-8")


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
        try:
            return list(self.tok.encode(text, add_special_tokens=False))
        except TypeError:  # a lone surrogate: "?", as ByteTokenizer encodes it
            if not isinstance(text, str):
                raise
            return list(self.tok.encode(_replaced(text), add_special_tokens=False))

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
        try:
            return self.tok.encode(text, add_special_tokens=False).ids
        except TypeError:  # a lone surrogate: "?", as ByteTokenizer encodes it
            if not isinstance(text, str):
                raise
            return self.tok.encode(_replaced(text), add_special_tokens=False).ids

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


def _text_ids(ids: Sequence[int], vocab_size: int, eos_id: int) -> list[int]:
    """The ids worth decoding to text: in range and not EOS."""
    return [i for i in (int(x) for x in ids) if 0 <= i < vocab_size and i != eos_id]


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
    if vocab > 2**32:  # beyond 64 bits the trainer itself overflows
        raise DataError(
            f"tokenizer {spec!r}: the vocabulary must hold at most {2**32} tokens (ids are "
            "stored as 32-bit integers), e.g. data.tokenizer=bpe:8192"
        )
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
    refuse_custom_code(path)
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
                    auto.from_pretrained(str(path), trust_remote_code=False),
                    name=name,
                    spec=spec,
                    eos_id=eos,
                )
            raise DataError(f"tokenizer folder {spec!r} has an unknown kind {kind!r} in {_META}")
        has = {p.name for p in path.iterdir()}
        if {"vocab.json", "merges.txt"} <= has and "tokenizer_config.json" not in has:
            # GPT-2's own files. In transformers 5 the vocab_file=/merges_file= keywords build
            # an empty tokenizer; from_pretrained(folder) reads them correctly.
            fast = _import_transformers().GPT2TokenizerFast
            tok = fast.from_pretrained(str(path), trust_remote_code=False)
            return HFTokenizer(tok, name=path.name, spec=spec)
        if "tokenizer_config.json" in has:
            auto = _import_transformers().AutoTokenizer
            tok = auto.from_pretrained(str(path), trust_remote_code=False)
            return HFTokenizer(tok, name=path.name, spec=spec)
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
        tok = auto.from_pretrained(spec, local_files_only=True, trust_remote_code=False)
    except Exception as e:
        if asks_for_code(e):
            raise hub_code_refusal(spec) from None
        unreachable = _hub_unreachable()
        if unreachable:  # fail now, not after a minute of retries and a screen of warnings
            raise DataError(
                f"tokenizer {spec!r} is not a local folder or a cached hub tokenizer, and the "
                f"Hugging Face hub cannot be reached ({unreachable}); check the name, or pass a "
                "local tokenizer folder as data.tokenizer"
            ) from None
        try:
            tok = auto.from_pretrained(spec, trust_remote_code=False)
        except Exception as e:
            if asks_for_code(e):
                raise hub_code_refusal(spec) from None
            raise DataError(
                f"tokenizer {spec!r} could not be loaded offline or from the Hugging Face hub "
                f"({_first_line(e)}); pass a local tokenizer folder as data.tokenizer"
            ) from None
    refuse_loaded_auto_map(tok, spec)
    return HFTokenizer(tok, name=spec, spec=spec)
