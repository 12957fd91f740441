"""A source folder's safetensors, read as untrusted data: one tensor at a time, in bounded memory.

:class:`Source` reads the tensors of a checkpoint folder (``model.safetensors``, or the shards
``model.safetensors.index.json`` names); :func:`write_safetensors` writes an export's file
tensor by tensor. Both :mod:`anyorder.interop.streaming` (Llama/Qwen/Mistral) and
:mod:`anyorder.interop.convert` (GPT-2) read their sources here.

Design choices:

* A folder is data from elsewhere. The index's names stay inside the folder as written, a
  weight file may lead through links only into the folder or, for a hub cache snapshot, into
  its ``blobs/``; every file is a regular file opened once (never a named pipe or a device),
  and a safetensors header is checked (length, dtypes, offsets against shapes and the file's
  size) before anything is allocated.
* Reads go into each tensor's own buffer with plain file reads, not through a map of the
  whole file (whose touched pages stay resident).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from anyorder.data.untrusted import (
    open_regular,
    parse_json,
    plain_name,
    read_regular,
    refuse_links_out,
)
from anyorder.errors import CheckpointError

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_FROM_ST = {v: k for k, v in _ST_DTYPES.items()}


INDEX_NAME = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 << 20
"""At most this many bytes in a source's config.json or shard index (a 405B model's index
is well under 1 MB)."""
MAX_HEADER_BYTES = 100_000_000
"""At most this many bytes in a safetensors header (the ``safetensors`` library's own limit)."""
_ST_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
    "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_AGAIN = "download the checkpoint again"


def read_source_json(folder: Path, name: str) -> Any:
    """The JSON file ``name`` of a source folder, or None when there is none: a regular file
    of at most :data:`MAX_JSON_BYTES`, read once.

    Raises:
        CheckpointError: a named pipe, a device or a folder there, too large, or not JSON
            (nested too deeply included).
    """
    path = folder / name
    raw = read_regular(path, MAX_JSON_BYTES, CheckpointError)
    return None if raw is None else parse_json(raw, path, _AGAIN, CheckpointError)


def weight_files(folder: Path) -> tuple[list[str], dict[str, str]]:
    """The weight files of a source folder and its index's weight map: ``model.safetensors``
    (no map), or the shards its ``model.safetensors.index.json`` names.

    An index is data, and a name in it is read as a path relative to the folder, so it must
    stay inside it as written: no absolute path, no ``..``. A weight file that is a link is
    checked where it is opened (:func:`~anyorder.data.untrusted.refuse_links_out`): it must
    lead into the folder, or into the hub cache's ``blobs/`` where the folder is a snapshot.

    Raises:
        CheckpointError: neither file, an index that is not a weight map, or a name in it
            that leaves the folder.
    """
    if (folder / "model.safetensors").exists():  # Source refuses it if it is no file
        return ["model.safetensors"], {}
    index = read_source_json(folder, INDEX_NAME)
    if index is None:
        raise CheckpointError(
            f"{str(folder)!r} holds no model.safetensors or {INDEX_NAME}; save the model "
            "with safetensors"
        )
    path = folder / INDEX_NAME
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(f"{path} holds no weight_map of tensor names to files; {_AGAIN}")
    names = sorted(set(wmap.values()))
    for name in names:
        if not plain_name(name):
            raise CheckpointError(
                f"{path} names the weight file {name[:120]!r}, which is not inside "
                f"{str(folder)!r}; an index names the files beside it: {_AGAIN}"
            )
    return names, wmap


class Source:
    """The tensors of a safetensors checkpoint folder (one file or shards), read one at a time.

    Each file is opened once (:func:`~anyorder.data.untrusted.open_regular`: a regular file)
    and its header checked here, before anything is allocated: its length, each tensor's
    dtype, and its offsets against its shape and the file's size. The bytes are then read
    with plain file reads into each tensor's own buffer. (``get_tensor`` reads through a map
    of the whole file, and every page it touches stays in the process's resident set:
    converting a 2-layer Llama-3.2-1B-shaped checkpoint peaked at 1.58x its size that way,
    measured.) A :class:`Source` is a context manager that closes its files.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[str, BinaryIO] = {}
        # name -> (file, dtype or the safetensors dtype convert does not read, shape, start)
        self.where: dict[str, tuple[str, torch.dtype | str, list[int], int]] = {}
        self.doubles: list[tuple[str, str, str, str]] = []  # (tensor, file read, other, why)
        try:
            names, chosen = weight_files(folder)
            for name in names:
                self._open(name, chosen)
        except BaseException:
            self.close()
            raise

    def _open(self, name: str, chosen: dict[str, str]) -> None:
        path = self.folder / name
        refuse_links_out(self.folder, path, _AGAIN, CheckpointError)
        f = open_regular(path, CheckpointError)
        if f is None:
            raise CheckpointError(f"weight file {str(path)!r} is missing; {_AGAIN}")
        self.files[name] = f
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                f"{path} is not a safetensors file (a header of {n} bytes claimed in a file of "
                f"{size}); {_AGAIN}"
            )
        header = parse_json(f.read(n), path, _AGAIN, CheckpointError)
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} has no safetensors header; {_AGAIN}")
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            dtype, shape, start = self._entry(path, key, entry, 8 + n, size)
            if key in self.where:
                first = self.where[key][0]
                keep = name if chosen.get(key) == name else first
                why = "the file the index names" if chosen.get(key) == keep else "the first by name"
                self.doubles.append((key, keep, first if keep == name else name, why))
                if keep == first:
                    continue
            self.where[key] = (name, dtype, shape, start)

    @staticmethod
    def _entry(
        path: Path, key: str, entry: Any, base: int, size: int
    ) -> tuple[torch.dtype | str, list[int], int]:
        """One header entry, checked: a dtype of safetensors, a shape, and offsets that hold
        exactly the shape's bytes inside the file."""
        try:
            st, shape, (a, b) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ints = [*shape, a, b]
            ok = all(type(v) is int and v >= 0 for v in ints) and st in _ST_ITEMSIZE
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(
                f"{path}: tensor {key[:120]!r} has a damaged header entry "
                f"({json.dumps(entry)[:120]}); {_AGAIN}"
            )
        if b - a != math.prod(shape) * _ST_ITEMSIZE[st] or base + b > size:
            raise CheckpointError(
                f"{path}: tensor {key[:120]!r} claims bytes {a}..{b} for shape {shape} "
                f"{st}, and the file holds {size - base} bytes of data; {_AGAIN}"
            )
        return _FROM_ST.get(st, st), list(shape), base + a

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def has(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> list[int]:
        return list(self.where[name][2])

    def dtype(self, name: str) -> torch.dtype:
        dtype = self.where[name][1]
        if isinstance(dtype, str):
            raise CheckpointError(
                f"weight {name!r} is stored as {dtype}; convert reads F32, BF16 and F16 "
                "weights: save the checkpoint in one of those"
            )
        return dtype

    def _read(self, name: str, shape: list[int], skip: int = 0) -> Tensor:
        file, _, _, start = self.where[name]
        out = torch.empty(shape, dtype=self.dtype(name))
        buf = out.view(-1).view(torch.uint8).numpy()
        f = self.files[file]
        f.seek(start + skip)
        if f.readinto(buf) != buf.nbytes:
            raise CheckpointError(f"{self.folder / file} is truncated at {name!r}; {_AGAIN}")
        return out

    def get(self, name: str) -> Tensor:
        return self._read(name, self.shape(name))

    def row(self, name: str, i: int) -> Tensor:
        """Row ``i`` of a matrix, read alone."""
        shape = self.shape(name)
        width = torch.Size(shape[1:]).numel() * self.dtype(name).itemsize
        return self._read(name, shape[1:], skip=i * width)


def write_safetensors(
    path: Path,
    specs: list[tuple[str, list[int], torch.dtype]],
    produce: Callable[[str], Tensor],
    metadata: dict[str, str],
) -> None:
    """Write a safetensors file tensor by tensor: the header from ``specs`` (name, shape,
    dtype), then ``produce(name)`` of each in that order, never two held at once."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in specs:
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": shape,
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype in specs:
            t = produce(name)
            if list(t.shape) != shape or t.dtype != dtype:  # a bug, not a user error
                raise AssertionError(f"{name}: {tuple(t.shape)} {t.dtype}, not {shape} {dtype}")
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().data)


def checked_state(obj: Any, path: Path, skip: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """``obj`` (a ``torch.load`` of ``path``) as a state dict of float32, bfloat16 or float16
    tensors, names ending in ``skip`` (buffers) left out: what the safetensors reader
    (:class:`Source`) takes, so that nothing is cast into numbers silently.

    Raises:
        CheckpointError: not a dict, a key that is not text, a value that is not a tensor,
            or a tensor of another dtype.
    """
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        raise CheckpointError(f"{path} holds {kind}, not a state dict of tensors; {_AGAIN}")
    out: dict[str, Tensor] = {}
    for key, t in obj.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{path} holds the key {key!r}, not a tensor name; {_AGAIN}")
        if not isinstance(t, Tensor):
            kind = type(t).__name__
            raise CheckpointError(f"{path} holds {key[:120]!r}: {kind}, not a tensor; {_AGAIN}")
        if key.endswith(skip) and t.dim() != 1:
            continue
        if t.dtype not in _ST_DTYPES:
            raise CheckpointError(
                f"weight {key[:120]!r} is stored as {t.dtype}; convert reads float32, bfloat16 "
                "and float16 weights: save the checkpoint in one of those"
            )
        out[key] = t
    return out
