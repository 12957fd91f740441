"""Writing checkpoints atomically, pruning old ones, and the locks that keep readers safe.

Design choices:

* Atomic: everything is written into a temporary folder beside the target, every file is
  fsynced, then the folder is renamed into place with :func:`os.replace`. A folder named
  ``step_*`` with a ``manifest.json`` is complete; a killed writer leaves only a
  ``.step_*.tmp-*`` folder, which the next save removes (unless its writer still runs:
  temporary folders carry their writer's PID).
* ``state.pt`` is read with ``torch.load(weights_only=True)``: it holds only tensors and
  plain Python values (the numpy RNG state is stored as a tensor), never pickled objects.
* A reader holds a shared ``flock`` on the manifest (:func:`reading`); a prune takes an
  exclusive one without waiting and leaves a held checkpoint for a later prune.
* Temporary folders get the modes a plain ``mkdir`` gives, and finished folders the modes
  the umask gives (:func:`make_temp_dir`, :func:`apply_umask`); exports use both too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from anyorder.atomic import (
    apply_umask,
    make_temp_dir,
    os_cause,
    remove_stale_temps,
)
from anyorder.atomic import (
    fsync_dir as _fsync_dir,
)
from anyorder.checkpoint.layout import (
    CHECKPOINTS,
    CONFIG_FILE,
    EMA_FILE,
    FORMAT_VERSION,
    MANIFEST,
    MODEL_FILE,
    STATE_FILE,
    TOKENIZER_DIR,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
)
from anyorder.checkpoint.weights import save_weights, tied_aliases
from anyorder.config import RunConfig, to_dict
from anyorder.data import sha256_file
from anyorder.errors import CheckpointError

if TYPE_CHECKING:
    from anyorder.data import Tokenizer


def _finalize(folder: Path) -> dict[str, dict[str, Any]]:
    """fsync every file under ``folder`` and return its sizes and checksums."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        rel = path.relative_to(folder).as_posix()
        files[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    for sub in sorted({p.parent for p in folder.rglob("*")}):
        _fsync_dir(sub)
    return files


def _remove_stale_temps(root: Path) -> None:
    """Remove temporary checkpoint folders of this process or of dead ones (a folder named
    with a live PID belongs to a writer still at work)."""
    remove_stale_temps(root, ".step_*.tmp-*")


def _lock_manifest(ckpt: Path, exclusive: bool) -> int | None:
    """An open fd of ``ckpt``'s manifest holding a shared (reader) or exclusive (pruner)
    ``flock``; None where there is no manifest or no ``fcntl``. A pruner does not wait:
    it raises BlockingIOError when a reader holds the checkpoint. A reader waits for a
    prune in progress (milliseconds), then finds its checkpoint gone and starts again."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(ckpt / MANIFEST, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def reading(ckpt: Path) -> Iterator[None]:
    """Hold ``ckpt`` while it is read: a training's prune leaves it for a later save."""
    fd = _lock_manifest(ckpt, exclusive=False)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def prune(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints; returns the deleted folders.

    A checkpoint a reader holds (:func:`reading`) is left for a later prune."""
    found = list_checkpoints(run_dir)
    doomed = found[: max(0, len(found) - max(1, keep_last))]
    deleted = []
    for p in doomed:
        try:
            fd = _lock_manifest(p, exclusive=True)
        except OSError:  # a reader holds it: next time
            continue
        try:
            # Renamed out of the way first (atomic), so a process killed mid-delete never
            # leaves a half-deleted step_* folder that still looks complete; the next save
            # sweeps it.
            gone = p.with_name(f".{p.name}.tmp-del-{os.getpid()}")
            try:
                os.replace(p, gone)
            except OSError:
                gone = p
            shutil.rmtree(gone, ignore_errors=True)
            deleted.append(p)
        finally:
            if fd is not None:
                os.close(fd)
    return deleted


def _write_files(
    tmp: Path,
    step: int,
    weights: Mapping[str, Tensor],
    aliases: Mapping[str, str],
    *,
    ema: Mapping[str, Tensor] | None,
    state: Mapping[str, Any] | None,
    config: RunConfig,
    tok: Tokenizer,
    base: Mapping[str, str] | None = None,
) -> None:
    """Write every file of a checkpoint into ``tmp``, the manifest last, all fsynced."""
    import yaml

    save_weights(weights, tmp / MODEL_FILE, aliases)
    if ema is not None:
        save_weights(ema, tmp / EMA_FILE, aliases)
    if state is not None:
        torch.save(dict(state), tmp / STATE_FILE)
    (tmp / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    tok.save(tmp / TOKENIZER_DIR)
    files = _finalize(tmp)
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "kind": config.model.kind,
        "seed": config.train.seed,
        "has_ema": ema is not None,
        "files": files,
    }
    if base is not None:  # a LoRA run's: the weights hold its adapters, this names the base
        manifest["base"] = dict(base)
    with open(tmp / MANIFEST, "w") as f:  # last: a folder with a manifest is complete
        f.write(json.dumps(manifest, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    apply_umask(tmp)
    _fsync_dir(tmp)


def _replace(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` to ``final`` (atomic), replacing a checkpoint of that step."""
    root = final.parent
    old = None
    if final.exists():  # the same step saved again (e.g. a stop right after a save)
        old = root / f".{final.name}.tmp-old-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: nn.Module | Mapping[str, Tensor],
    config: RunConfig,
    tokenizer: Tokenizer,
    ema: Mapping[str, Tensor] | None = None,
    state: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    aliases: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> Path:
    """Write ``RUN/checkpoints/step_<step>/`` atomically and prune old checkpoints.

    Args:
        run_dir: the run folder.
        step: optimizer steps done.
        model: the model (unwrapped), or its full state dict.
        config: the resolved run config (written as ``config.yaml``).
        tokenizer: saved under ``tokenizer/``.
        ema: the EMA weights as a state dict with the model's keys, or None.
        state: the training state for ``state.pt`` (optimizer, RNG, data cursor...), or None.
        keep_last: keep this many checkpoints (default ``config.train.keep_last``).
        aliases: ``{alias: canonical}`` tied names; taken from ``model`` when it is a module.
        base: a LoRA run's base (``{"path", "sha256"}``), whose adapters ``model`` holds.

    Returns:
        The checkpoint folder.
    """
    root = Path(run_dir) / CHECKPOINTS
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot create {root} ({e.strerror}); pick a folder you can write"
        ) from None
    _remove_stale_temps(root)
    name = checkpoint_name(step)
    final = root / name
    if isinstance(model, nn.Module):
        aliases = tied_aliases(model)
        weights: Mapping[str, Tensor] = model.state_dict()
    else:
        weights = model
        aliases = dict(aliases or {})
    try:
        tmp = make_temp_dir(root, f".{name}.tmp-")  # named with our PID (temp ownership)
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint {final} ({e.strerror}); free disk space or fix the "
            "folder's permissions, then resume"
        ) from None
    try:
        _write_files(
            tmp, step, weights, aliases, ema=ema, state=state, config=config, tok=tokenizer,
            base=base,
        )  # fmt: skip
        _replace(tmp, final)
    except Exception as e:  # disk full, quota, permissions (torch and safetensors wrap them)
        shutil.rmtree(tmp, ignore_errors=True)
        before = latest_checkpoint(run_dir)
        kept = f"; {before} is intact" if before is not None else ""
        raise CheckpointError(
            f"cannot write checkpoint {final} ({os_cause(e)}){kept}; "
            "free disk space or fix the folder's permissions, then resume"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, config.train.keep_last if keep_last is None else keep_last)
    return final
