"""What a training checkpoint is on disk: its folder names, its manifest, and checking files.

A checkpoint is a folder ``RUN/checkpoints/step_0000100/`` holding

* ``model.safetensors``: the raw weights; ``ema.safetensors``: the EMA weights (when on);
* ``state.pt``: optimizer, schedule, step, RNG states and the data cursor (training only);
* ``config.yaml``: the resolved :class:`~anyorder.config.RunConfig`;
* ``tokenizer/``: the tokenizer's files (:meth:`Tokenizer.save`);
* ``manifest.json``: step, and the size and SHA-256 of every other file.

Design choices:

* A folder named ``step_*`` with a ``manifest.json`` is complete (the manifest is written
  last, see :mod:`anyorder.checkpoint.save`); anything else in ``checkpoints/`` is ignored.
* Every read checks the files it reads against the manifest (size, then SHA-256), so a
  truncated or altered file is a :class:`CheckpointError` naming the file, not a crash deep
  inside torch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from anyorder.atomic import short_path
from anyorder.data import sha256_file
from anyorder.errors import CheckpointError

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
"""Sub-folder of a run that holds its checkpoints."""
MODEL_FILE = "model.safetensors"
EMA_FILE = "ema.safetensors"
STATE_FILE = "state.pt"
CONFIG_FILE = "config.yaml"
TOKENIZER_DIR = "tokenizer"
MANIFEST = "manifest.json"
WEIGHTS = ("ema", "raw")

_NAME = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint after ``step`` optimizer steps."""
    return f"step_{step:07d}"


# ----------------------------------------------------------------------------- finding


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run (folders with a manifest), oldest step first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint of a run with the highest step, or None when it has none."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint folder (it has a manifest)."""
    p = Path(path)
    return p.is_dir() and (p / MANIFEST).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a checkpoint folder or a run folder (its latest checkpoint).

    Raises:
        CheckpointError: the path does not exist, or holds no checkpoint.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(
            f"checkpoint path {short_path(p)} does not exist; give a run folder or a checkpoint "
            "folder"
        )
    if is_checkpoint(p):
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"{str(p)!r} holds no checkpoint (no {CHECKPOINTS}/step_*/{MANIFEST}); train into it "
            "first (anyorder train CONFIG train.out_dir=...) or give a checkpoint folder"
        )
    return latest


# ----------------------------------------------------------------------------- checksums


def read_manifest(ckpt: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder.

    Raises:
        CheckpointError: no manifest or an unreadable one.
    """
    path = Path(ckpt) / MANIFEST
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:  # a sparse file of a terabyte takes no disk
            raise CheckpointError(
                f"{path} is {size:,} bytes, more than a manifest holds; the checkpoint is "
                f"damaged: delete {ckpt} and use an earlier checkpoint"
            )
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        if not Path(ckpt).is_dir():
            raise CheckpointError(
                f"checkpoint {ckpt} disappeared while it was read (pruned by a running "
                "training?); give the run folder to use its latest checkpoint"
            ) from None
        raise CheckpointError(
            f"{path} is missing or unreadable ({type(e).__name__}); the checkpoint is "
            f"incomplete: delete {ckpt} and use an earlier checkpoint"
        ) from None
    problem = manifest_problem(manifest)
    if problem == "format":
        raise CheckpointError(
            f"{path} has checkpoint format {manifest.get('format')!r}, this version reads "
            f"{FORMAT_VERSION}; use the anyorder version that wrote it"
        )
    if problem:
        raise CheckpointError(
            f"{path} is damaged ({problem}); delete {ckpt} and use an earlier checkpoint"
        )
    return manifest


MAX_MANIFEST_BYTES = 16 << 20
"""At most this many bytes in a ``manifest.json`` (ours hold about 1 KB): a larger one is
refused before it is read."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def manifest_problem(manifest: Any) -> str:
    """What is wrong with a parsed manifest ("" when nothing; "format" for another version).

    The schema: an object with ``format`` (this version's), ``step`` (an int >= 0),
    ``files`` (relative paths inside the folder -> ``{"bytes": int >= 0, "sha256": 64 hex
    digits}``, at least the weights and the config) and, when present, ``has_ema`` (a bool
    that agrees with whether ``ema.safetensors`` is listed) and, for a LoRA run, ``base``
    (``{"path": str, "sha256": 64 hex digits}``).
    """
    if not isinstance(manifest, dict):
        return f"it holds {type(manifest).__name__}, not a JSON object"
    if manifest.get("format") != FORMAT_VERSION:
        return "format"
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"step is {json.dumps(step)[:40]}, not a whole number >= 0"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "'files' is not an object of file names"
    for name, info in files.items():
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or not parts or name == MANIFEST:
            return f"file name {name[:60]!r} is not a path inside the checkpoint"
        if not isinstance(info, dict):
            return f"the entry of {name} is not an object"
        size = info.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"the entry of {name} has no byte count"
        if not isinstance(info.get("sha256"), str) or not _SHA256.match(info["sha256"]):
            return f"the entry of {name} has no SHA-256"
    for need in (MODEL_FILE, CONFIG_FILE):
        if need not in files:
            return f"it lists no {need}"
    base = manifest.get("base")
    if base is not None and not (
        isinstance(base, dict)
        and isinstance(base.get("path"), str)
        and isinstance(base.get("sha256"), str)
        and _SHA256.match(base["sha256"])
    ):
        return "'base' is not an object with a path and a SHA-256"
    has_ema = manifest.get("has_ema")
    if has_ema is not None and has_ema is not (EMA_FILE in files):
        return f"has_ema is {json.dumps(has_ema)} but {EMA_FILE} is {'not ' * bool(has_ema)}listed"
    return ""


def verify(ckpt: str | Path, files: Iterable[str] | None = None) -> dict[str, Any]:
    """Check files of a checkpoint (default: all) against the manifest's sizes and SHA-256.

    Args:
        ckpt: the checkpoint folder.
        files: relative paths to check; a prefix ending in ``/`` checks a whole sub-folder.

    Returns:
        The manifest.

    Raises:
        CheckpointError: a file that is missing, truncated or altered.
    """
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    listed: dict[str, dict[str, Any]] = manifest["files"]
    if files is None:
        names = list(listed)
    else:
        names = []
        for want in files:
            if want.endswith("/"):
                names += [n for n in listed if n.startswith(want)]
            elif want in listed:
                names.append(want)
    for name in names:
        info = listed[name]
        path = ckpt / name
        fix = f"delete {ckpt} and use an earlier checkpoint"
        try:
            size = path.stat().st_size if path.is_file() else None
            digest = sha256_file(path) if size == info["bytes"] else None
        except OSError:  # removed between the checks (a prune) or unreadable
            size = digest = None
        if size is None and not ckpt.is_dir():
            raise CheckpointError(
                f"checkpoint {ckpt} disappeared while it was read (pruned by a running "
                "training?); give the run folder to use its latest checkpoint"
            )
        if size is None:
            raise CheckpointError(f"checkpoint file {path} is missing or unreadable; {fix}")
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered ({size} bytes, the manifest "
                f"says {info['bytes']}); {fix}"
            )
        if digest != info["sha256"]:
            raise CheckpointError(f"checkpoint file {path} does not match its checksum; {fix}")
    return manifest


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), for one-line errors."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]
