"""Training checkpoints: atomic folders with checksums, and :func:`load_model` for everyone else.

A checkpoint is a folder ``RUN/checkpoints/step_0000100/`` holding

* ``model.safetensors``: the raw weights; ``ema.safetensors``: the EMA weights (when on);
* ``state.pt``: optimizer, schedule, step, RNG states and the data cursor (training only);
* ``config.yaml``: the resolved :class:`~anyorder.config.RunConfig`;
* ``tokenizer/``: the tokenizer's files (:meth:`Tokenizer.save`);
* ``manifest.json``: step, and the size and SHA-256 of every other file.

Design choices:

* Atomic: everything is written into a temporary folder beside the target, every file is
  fsynced, then the folder is renamed into place with :func:`os.replace`. A folder named
  ``step_*`` with a ``manifest.json`` is complete; a killed writer leaves only a
  ``.step_*.tmp-*`` folder, which the next save removes.
* Tied weights (the head sharing the embedding) are written once: the safetensors file holds
  no alias, and the loader fills the aliases from the model it builds. That keeps the files
  readable by plain ``safetensors.torch.load_file``.
* ``state.pt`` is read with ``torch.load(weights_only=True)``: it holds only tensors and
  plain Python values (the numpy RNG state is stored as a tensor), never pickled objects.
* Every read checks the files it reads against the manifest (size, then SHA-256), so a
  truncated or altered file is a :class:`CheckpointError` naming the file, not a crash deep
  inside torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from anyorder.config import RunConfig, load_config, to_dict
from anyorder.data import sha256_file
from anyorder.errors import AnyorderError, CheckpointError, ConfigError

if TYPE_CHECKING:
    from anyorder.data import Tokenizer
    from anyorder.models.base import AnyOrderLM

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
            f"checkpoint path {str(p)!r} does not exist; give a run folder or a checkpoint folder"
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


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def manifest_problem(manifest: Any) -> str:
    """What is wrong with a parsed manifest ("" when nothing; "format" for another version).

    The schema: an object with ``format`` (this version's), ``step`` (an int >= 0),
    ``files`` (relative paths inside the folder -> ``{"bytes": int >= 0, "sha256": 64 hex
    digits}``, at least the weights and the config) and, when present, ``has_ema`` (a bool
    that agrees with whether ``ema.safetensors`` is listed).
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


# ----------------------------------------------------------------------------- weights


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for parameters shared under several names (a tied head).

    The canonical name is the first one ``named_parameters`` yields (``tok_emb.weight``).
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def save_weights(
    state: Mapping[str, Tensor], path: str | Path, aliases: Mapping[str, str] | None = None
) -> None:
    """Write a state dict to safetensors, without the ``aliases`` (tied copies)."""
    from safetensors.torch import save_file

    aliases = dict(aliases or {})
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items() if k not in aliases}
    save_file(tensors, str(path), metadata={"format": "pt", "tied": json.dumps(aliases)})


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load a safetensors file written by :func:`save_weights` into ``model`` (strictly).

    Raises:
        CheckpointError: the file's tensors do not fit the model.
    """
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except Exception as e:  # removed by a prune, or not safetensors at all
        raise CheckpointError(
            f"weights file {path} cannot be read ({type(e).__name__}: {_first_line(e)})"
        ) from None
    detail = fit_state(model, state)
    if detail:
        raise CheckpointError(
            f"weights in {path} do not fit the model its config.yaml describes ({detail}); "
            "the checkpoint was altered or written by another version"
        )
    model.load_state_dict(state, strict=True)


_MAX_HEADER = 100 * 2**20  # a safetensors header larger than this is not one of ours


def read_header_shapes(path: str | Path, fix: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a safetensors file's header (nothing else is read).

    Raises:
        CheckpointError: the file is missing or its header is malformed.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        shapes = {
            k: tuple(int(d) for d in v["shape"]) for k, v in header.items() if k != "__metadata__"
        }
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise CheckpointError(
            f"{path} is corrupt (its safetensors header: {_first_line(e)}){fix}"
        ) from None
    return shapes


def header_problem(model_cfg: Any, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """How a weights file's tensor shapes (its header) do not fit a model config ("" when
    they do), decided before the model is built: first the number of blocks and the
    embedding (cheap, and they bound the model's size by the file's), then every tensor of
    the model built on the meta device (no memory)."""
    from anyorder.models import build_model

    blocks = {k.split(".")[1] for k in shapes if k.startswith("blocks.") and k.count(".") > 1}
    if len(blocks) != model_cfg.n_layer:
        return f"the weights hold {len(blocks)} blocks, the config says n_layer={model_cfg.n_layer}"
    emb = shapes.get("tok_emb.weight")
    if emb is None or len(emb) != 2 or emb[1] != model_cfg.d_model:
        return f"tok_emb.weight is {emb}, the config says d_model={model_cfg.d_model}"
    with torch.device("meta"):
        model = build_model(model_cfg)
    aliases = tied_aliases(model)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in aliases}
    missing = sorted(set(want) - set(shapes))
    unexpected = sorted(set(shapes) - set(want) - set(aliases))
    wrong = sorted(k for k in set(want) & set(shapes) if want[k] != shapes[k])
    return "; ".join(
        f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
        if names
    )


def fit_state(model: nn.Module, state: dict[str, Tensor]) -> str:
    """Restore tied copies in ``state`` (in place) and say how it does not fit ``model``.

    Returns:
        "" when every key is there with the right shape, else a short description of the
        missing, unexpected and wrongly shaped keys (for the caller's error message).
    """
    for alias, canonical in tied_aliases(model).items():
        if alias not in state and canonical in state:
            state[alias] = state[canonical]
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    wrong = sorted(k for k in set(want) & set(state) if want[k].shape != state[k].shape)
    return "; ".join(
        f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
        if names
    )


# ----------------------------------------------------------------------------- saving


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A new folder ``parent/PREFIX<random>`` with the mode a plain ``mkdir`` gives.

    (Not ``tempfile.mkdtemp``: its 0700 would survive the rename into place and hide a
    checkpoint or an export from everyone but its owner.)
    """
    for _ in range(100):
        path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"could not create a temporary folder in {parent}")


def apply_umask(folder: Path) -> None:
    """Give the files and folders under ``folder`` the modes the umask gives new ones.

    Some writers make private files (safetensors writes weights 0600); a checkpoint or an
    export is for reading like any file the user makes.
    """
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


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


_TEMP_PID = re.compile(r"\.tmp-(?:del-|old-)?(\d+)(?:-|$)")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # someone else's process: alive
    return True


def _remove_stale_temps(root: Path) -> None:
    """Remove temporary folders of this process or of dead ones: a folder named with a live
    PID belongs to a writer still at work (names without a PID come from older versions)."""
    for p in root.glob(".step_*.tmp-*"):
        m = _TEMP_PID.search(p.name)
        pid = int(m.group(1)) if m else None
        if pid is None or pid == os.getpid() or not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


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

    Returns:
        The checkpoint folder.
    """
    import yaml

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
        save_weights(weights, tmp / MODEL_FILE, aliases)
        if ema is not None:
            save_weights(ema, tmp / EMA_FILE, aliases)
        if state is not None:
            torch.save(dict(state), tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
        tokenizer.save(tmp / TOKENIZER_DIR)
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
        with open(tmp / MANIFEST, "w") as f:  # last: a folder with a manifest is complete
            f.write(json.dumps(manifest, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        apply_umask(tmp)
        _fsync_dir(tmp)
        old = None
        if final.exists():  # the same step saved again (e.g. a stop right after a save)
            old = root / f".{name}.tmp-old-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except Exception as e:  # disk full, quota, permissions (torch and safetensors wrap them)
        shutil.rmtree(tmp, ignore_errors=True)
        before = latest_checkpoint(run_dir)
        kept = f"; {before} is intact" if before is not None else ""
        raise CheckpointError(
            f"cannot write checkpoint {final} ({type(e).__name__}: {_first_line(e)}){kept}; "
            "free disk space or fix the folder's permissions, then resume"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, config.train.keep_last if keep_last is None else keep_last)
    return final


# ----------------------------------------------------------------------------- loading


def read_config(ckpt: str | Path) -> RunConfig:
    """The run config stored in a checkpoint (its checksum checked).

    Raises:
        CheckpointError: a missing, altered or invalid ``config.yaml``.
    """
    ckpt = Path(ckpt)
    verify(ckpt, [CONFIG_FILE])
    try:
        return load_config(ckpt / CONFIG_FILE)
    except ConfigError as e:
        if not ckpt.is_dir():
            raise CheckpointError(
                f"checkpoint {ckpt} disappeared while it was read (pruned by a running "
                "training?); give the run folder to use its latest checkpoint"
            ) from None
        raise CheckpointError(
            f"{ckpt / CONFIG_FILE} is not a config this version reads ({e}); use the anyorder "
            "version that wrote it"
        ) from None


def read_tokenizer(ckpt: str | Path) -> Tokenizer:
    """The tokenizer stored in a checkpoint (its checksums checked)."""
    from anyorder.data import load_tokenizer

    ckpt = Path(ckpt)
    verify(ckpt, [TOKENIZER_DIR + "/"])
    try:
        return load_tokenizer(str(ckpt / TOKENIZER_DIR))
    except AnyorderError as e:
        raise CheckpointError(f"the tokenizer in {ckpt} cannot be loaded: {e}") from None


def read_state(ckpt: str | Path) -> dict[str, Any]:
    """The training state (``state.pt``) of a checkpoint, for resuming.

    Raises:
        CheckpointError: a checkpoint without training state, or a damaged one.
    """
    ckpt = Path(ckpt)
    manifest = verify(ckpt, [STATE_FILE])
    if STATE_FILE not in manifest["files"]:
        raise CheckpointError(
            f"{ckpt} holds weights only (no {STATE_FILE}); it cannot be resumed, only loaded"
        )
    return torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=True)


def weights_file(ckpt: str | Path, weights: str = "ema") -> Path:
    """The weights file to read: ``ema.safetensors`` if asked for and present, else raw.

    Raises:
        ConfigError: ``weights`` is neither ``ema`` nor ``raw``.
    """
    if weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r} is not a choice; use ema or raw")
    manifest = read_manifest(ckpt)
    if weights == "ema" and EMA_FILE in manifest["files"]:
        return Path(ckpt) / EMA_FILE
    if weights == "ema" and (Path(ckpt) / EMA_FILE).exists():
        # The run kept EMA weights but the manifest does not vouch for them: never fall back
        # to the raw weights silently (--weights raw is the explicit choice).
        raise CheckpointError(
            f"{Path(ckpt) / MANIFEST} does not list {EMA_FILE}, which is there; the manifest "
            f"is damaged: delete {ckpt} and use an earlier checkpoint, or pass --weights raw"
        )
    return Path(ckpt) / MODEL_FILE


def check_tokenizer_fits(tokenizer: Tokenizer | None, vocab_size: int, where: str) -> None:
    """A tokenizer must not give ids the model cannot read (fewer is fine: padded vocabularies).

    Raises:
        CheckpointError: the tokenizer has more ids than the model's ``vocab_size``.
    """
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise CheckpointError(
            f"the tokenizer of {where} has {tokenizer.vocab_size} token ids but the model reads "
            f"{vocab_size}; use the tokenizer the model was trained with"
        )


@dataclass
class Loaded:
    """A model loaded from a checkpoint, ready for sampling and evaluation."""

    model: AnyOrderLM
    """The model, in eval mode, on the requested device."""
    tokenizer: Tokenizer
    """The tokenizer the model was trained with."""
    config: RunConfig
    """The resolved config of the training run."""
    step: int
    """Optimizer steps the weights had when saved."""
    path: Path
    """The checkpoint folder."""
    weights: str = "raw"
    """Which weights were loaded: ``ema`` or ``raw``."""


def load_model(
    path: str | Path, *, weights: str = "ema", device: str | torch.device = "cpu"
) -> Loaded:
    """Load a trained model from a run folder (its latest checkpoint) or a checkpoint folder.

    Args:
        path: a run folder or ``RUN/checkpoints/step_*`` (or an exported folder, read by
            :func:`anyorder.hub.from_pretrained`; ``weights`` does not apply to it).
        weights: ``ema`` (the EMA weights; the raw ones when the run had no EMA) or ``raw``.
        device: where to put the model.

    Returns:
        A :class:`Loaded` with the model in eval mode.

    Raises:
        CheckpointError: a missing path, a folder without checkpoints, or a damaged file.
    """
    from anyorder import hub

    if hub.is_exported(path):  # an exported model (anyorder export/convert): one set of weights
        return hub.from_pretrained(path, device=device)
    for attempt in (1, 2):  # a training may prune the latest checkpoint while it is read
        ckpt = resolve_checkpoint(path)
        try:
            with reading(ckpt):
                return _load_checkpoint(ckpt, weights, device)
        except CheckpointError:
            if attempt == 2 or ckpt.is_dir() or ckpt == Path(path).expanduser():
                raise
    raise AssertionError("unreachable")


def _load_checkpoint(ckpt: Path, weights: str, device: str | torch.device) -> Loaded:
    from anyorder.models import build_model

    manifest = read_manifest(ckpt)
    config = read_config(ckpt)
    tokenizer = read_tokenizer(ckpt)
    check_tokenizer_fits(tokenizer, config.model.vocab_size, str(ckpt))
    file = weights_file(ckpt, weights)
    if weights == "ema" and file.name != EMA_FILE and config.train.ema > 0:
        raise CheckpointError(
            f"{ckpt / MANIFEST} lists no {EMA_FILE} but the run kept EMA weights "
            f"(train.ema={config.train.ema}); delete {ckpt} and use an earlier checkpoint, or "
            "pass --weights raw"
        )
    verify(ckpt, [file.name])
    shapes = read_header_shapes(file, f"; delete {ckpt} and use an earlier checkpoint")
    problem = header_problem(config.model, shapes)
    if problem:
        raise CheckpointError(
            f"weights in {file} do not fit the model its config.yaml describes ({problem}); "
            "the checkpoint was altered or written by another version"
        )
    model = build_model(config.model)
    load_weights(model, file)
    model.to(device).eval()
    return Loaded(
        model=model,
        tokenizer=tokenizer,
        config=config,
        step=int(manifest["step"]),
        path=ckpt,
        weights="ema" if file.name == EMA_FILE else "raw",
    )
