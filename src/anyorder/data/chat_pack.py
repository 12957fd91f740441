"""Packing conversational examples: one block each, the prompt's length kept beside it.

Design choices:

* Each example is one block of ``seq_len``: the prompt, the answer ending with EOS, and EOS
  padding to the end (LLaDA's way: the model is trained on the padding too, so it learns
  to end; an answer shorter than the block is not a special case). No two examples share a
  block, so the prompt/response boundary is the same for every order.
* Beside ``SPLIT.bin`` (the blocks, as for text) ``SPLIT.lengths.bin`` holds int32 pairs
  ``(prompt length, answer length)`` per block, the answer's length counting its EOS but
  not the padding; the manifest records its SHA-256 as it does the blocks'.
* The split is the text corpora's rule applied to the record (the hash of its messages as
  JSON): when it holds out no example while ``val_fraction > 0``, the last train example
  moves to validation. Fewer than two examples is an error.
* A bad record stops the build with one line naming its file and line, and the build
  writes into the temporary folder :func:`anyorder.data.build.prepare` renames at the end:
  nothing is left half-written.
* Bytes per token (for bits per byte) is the answers' UTF-8 bytes over the answer blocks'
  tokens (padding included): the bits of a whole answer block over the bytes of its text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from anyorder.data.chat import encode_example
from anyorder.data.shards import SPLITS, sha256_file, token_dtype
from anyorder.data.split import _held_out
from anyorder.data.tokenizers import Tokenizer
from anyorder.errors import DataError

LENGTHS_DTYPE = np.dtype(np.int32)
"""The dtype of ``SPLIT.lengths.bin``: (prompt length, answer length) per block."""


def lengths_file(split: str) -> str:
    """The name of a split's lengths file."""
    return f"{split}.lengths.bin"


class _ChatWriter:
    """Appends one split's blocks and lengths, and counts examples, answer tokens and bytes."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype) -> None:
        self.path = folder / f"{split}.bin"
        self.lengths_path = folder / lengths_file(split)
        self.dtype = dtype
        self.file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self.lengths: BinaryIO = open(self.lengths_path, "wb")  # noqa: SIM115
        self.blocks = self.answer_positions = self.answer_tokens = self.bytes = self.cut = 0

    def add(self, block: list[int], prompt: int, answer: int, nbytes: int, cut: bool) -> None:
        self.file.write(np.asarray(block, dtype=np.int64).astype(self.dtype).tobytes())
        self.lengths.write(np.asarray([prompt, answer], dtype=LENGTHS_DTYPE).tobytes())
        self.blocks += 1
        self.answer_positions += len(block) - prompt
        self.answer_tokens += answer
        self.bytes += nbytes
        self.cut += int(cut)

    def close(self) -> None:
        self.file.close()
        self.lengths.close()

    def stats(self) -> dict[str, Any]:
        seq = self.answer_positions  # tokens the loss and validation cover
        return {
            "file": self.path.name,
            "documents": self.blocks,
            "tokens": seq,
            "blocks": self.blocks,
            "kept_tokens": seq,
            "bytes": self.bytes,
            "bytes_per_token": self.bytes / seq if seq else 0.0,
            "sha256": sha256_file(self.path),
            "lengths_file": self.lengths_path.name,
            "lengths_sha256": sha256_file(self.lengths_path),
            "answer_tokens": self.answer_tokens,
            "cut_answers": self.cut,
        }


def _move_last(train: _ChatWriter, val: _ChatWriter, seq_len: int) -> None:
    """Move train's last block (and its lengths) to validation."""
    train.close()
    val.close()
    itemsize = train.dtype.itemsize
    block = np.fromfile(
        train.path, dtype=train.dtype, offset=(train.blocks - 1) * seq_len * itemsize
    )
    pair = np.fromfile(
        train.lengths_path,
        dtype=LENGTHS_DTYPE,
        offset=(train.blocks - 1) * 2 * LENGTHS_DTYPE.itemsize,
    )
    with open(val.path, "ab") as f:
        f.write(block.tobytes())
    with open(val.lengths_path, "ab") as f:
        f.write(pair.tobytes())
    with open(train.path, "r+b") as f:
        f.truncate((train.blocks - 1) * seq_len * itemsize)
    with open(train.lengths_path, "r+b") as f:
        f.truncate((train.blocks - 1) * 2 * LENGTHS_DTYPE.itemsize)


def pack_examples(
    records: Iterable[tuple[Any, str]],
    tok: Tokenizer,
    seq_len: int,
    val_fraction: float,
    folder: Path,
    source: str,
) -> dict[str, dict[str, Any]]:
    """Encode records into one block each and write both splits into ``folder``.

    Args:
        records: ``(record, where)`` pairs, ``where`` naming the file and line.
        tok: the tokenizer (its chat template, else the plain one).
        seq_len: tokens per block.
        val_fraction: the share of examples held out, by the hash of each record.
        folder: the (temporary) cache folder.
        source: ``data.source``, for messages.

    Returns:
        The manifest's ``splits``.

    Raises:
        DataError: a bad record (one line naming it), or fewer than two examples.
    """
    dtype = token_dtype(tok.vocab_size)
    writers = {s: _ChatWriter(folder, s, dtype) for s in SPLITS}
    last: tuple[int, int, int] | None = None  # the last train block's answer positions etc.
    try:
        for record, where in records:
            ex = encode_example(record, tok, seq_len, tok.eos_id, where=where)
            answer = (
                record["messages"][-1]["content"] if "messages" in record else record["response"]
            )
            nbytes = len(answer.encode("utf-8", errors="replace"))
            key = json.dumps(record.get("messages", [record.get("prompt"), answer]), sort_keys=True)
            split = (
                "val"
                if _held_out(hashlib.sha1(key.encode()).hexdigest(), val_fraction)
                else "train"
            )
            cut = (
                ex.response_ids[-1] != tok.eos_id
                or len(ex.prompt_ids) + len(ex.response_ids) > seq_len
            )
            writers[split].add(
                ex.block(seq_len, tok.eos_id), ex.prompt_len, len(ex.response_ids), nbytes, cut
            )
            if split == "train":
                last = (seq_len - ex.prompt_len, len(ex.response_ids), nbytes)
    finally:
        for w in writers.values():
            w.close()
    train, val = writers["train"], writers["val"]
    total = train.blocks + val.blocks
    if total < 2:
        raise DataError(
            f"data.source {source!r} holds {total} example(s), fewer than one train and one "
            "validation example; give it more records"
        )
    if val_fraction > 0 and val.blocks == 0 and last is not None:
        _move_last(train, val, seq_len)
        positions, answer, nbytes = last
        for w, sign in ((train, -1), (val, 1)):
            w.blocks += sign
            w.answer_positions += sign * positions
            w.answer_tokens += sign * answer
            w.bytes += sign * nbytes
    return {name: w.stats() for name, w in writers.items()}
