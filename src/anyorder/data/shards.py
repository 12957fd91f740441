"""A prepared data folder: packed token shards, their manifest, and their verification.

Design choices:

* Shards are raw numpy memmaps of shape ``(num_blocks, seq_len)``, uint16 when the
  vocabulary fits and uint32 otherwise, in ``cache_dir/<key>/`` beside the tokenizer files
  and a ``manifest.json`` (written by :func:`anyorder.data.build.prepare`).
* Opening a cache checks it: the manifest's schema (types, the dtype the vocabulary
  implies, shard names), each shard's size, SHA-256 and largest token id against the
  vocabulary. The hash is taken once: ``verified.json`` records each shard's size and
  modification time at its last check, and a shard that still matches is not read again.
* ``torch`` is imported only by :meth:`TokenData.batch`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from anyorder.data.sources import _first_line
from anyorder.data.tokenizers import Tokenizer, load_tokenizer
from anyorder.errors import DataError

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
"""Version of the shard layout; part of the cache key, so a new layout never reads an old one."""

SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65535), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks (shards, checkpoints, exports)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


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
    lengths: dict[str, np.ndarray] | None = None
    """Conversational data (``manifest["kind"] == "chat"``): per split, (N, 2) int32 rows of
    (prompt length, answer length with its EOS) per block; None for text."""

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
        lengths = _load_lengths(folder, manifest) if manifest.get("kind") == "chat" else None
        tokenizer = load_tokenizer(str(folder / "tokenizer"))
        if tokenizer.vocab_size != manifest["vocab_size"]:
            raise DataError(
                f"the tokenizer in {folder} has {tokenizer.vocab_size} token ids but its manifest "
                f"says {manifest['vocab_size']}; delete {folder} and prepare again"
            )
        data = cls(folder, manifest, tokenizer, arrays["train"], arrays["val"], reused, lengths)
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

    @property
    def is_chat(self) -> bool:
        """Whether the blocks are conversational examples with a prompt each."""
        return self.lengths is not None

    def prompt_lengths(self, split: str, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """The prompt length of blocks ``indices`` of a split as a LongTensor (B,).

        Raises:
            DataError: the data is text, with no prompts.
        """
        import torch

        if self.lengths is None:
            raise DataError(
                f"{self.path} holds text, not prompt/response examples; prepare the data with "
                "data.format=chat"
            )
        self.split(split)
        idx = np.asarray(indices, dtype=np.int64)
        return torch.from_numpy(np.asarray(self.lengths[split][idx, 0], dtype=np.int64))

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
            if "lengths_file" in info:
                path = self.path / info["lengths_file"]
                st = path.stat()
                fresh[path.name] = [st.st_size, st.st_mtime_ns, info["lengths_sha256"]]
                if stamp.get(path.name) != fresh[path.name] and (
                    sha256_file(path) != info["lengths_sha256"]
                ):
                    raise DataError(
                        f"shard {path} does not match its checksum; delete {self.path} and "
                        "prepare again"
                    )
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


def _load_lengths(folder: Path, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    """The (blocks, 2) int32 lengths of each split of conversational data, sizes checked."""
    out = {}
    for split in SPLITS:
        info = manifest["splits"][split]
        path = folder / info["lengths_file"]
        blocks = int(info["blocks"])
        size = path.stat().st_size if path.is_file() else -1
        if size != blocks * 2 * 4:
            raise DataError(
                f"shard {path} is missing or has the wrong size; delete {folder} and prepare again"
            )
        out[split] = (
            np.memmap(path, dtype=np.int32, mode="r", shape=(blocks, 2))
            if blocks
            else np.zeros((0, 2), dtype=np.int32)
        )
    return out


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
        if manifest.get("kind") == "chat":
            if info.get("lengths_file") != f"{split}.lengths.bin":
                return f"the {split} split has no {split}.lengths.bin"
            digest = info.get("lengths_sha256")
            if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX64:
                return f"the {split} lengths have no SHA-256"
    return ""
