"""The Hugging Face hub: hub ids to local folders, uploads, and loading whatever a user names.

An exported model (the folder layout: :mod:`anyorder.checkpoint.exported`; writing one:
:mod:`anyorder.checkpoint.exporting`) can be uploaded as is (:func:`push_to_hub`) and read
back from a folder or a hub id (:func:`from_pretrained`). :func:`load_any` takes any of an
export folder, a hub id, a run folder and a checkpoint folder; ``train.init_from``
(:func:`init_model_config`, :func:`init_weights_from`) starts a run from one.

Design choices:

* ``huggingface_hub`` is imported only inside :func:`push_to_hub` and for hub ids in
  :func:`resolve_folder`; a hub id goes through ``snapshot_download``, which also reads
  a local cache laid out like the hub's when offline.
* This module sits above :mod:`anyorder.checkpoint` and imports it; checkpoint never imports
  this module (it reads local export folders itself).
* ``train.init_from`` takes the architecture from the weights: only ``model.dropout`` may
  differ, and a config key that contradicts the weights is an error naming it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from anyorder.checkpoint.exported import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_kind,
    is_exported,
    load_exported,
    model_config_of,
    read_export_config,
)
from anyorder.checkpoint.exporting import _version
from anyorder.checkpoint.layout import resolve_checkpoint
from anyorder.checkpoint.load import load_model, read_config
from anyorder.config import ModelConfig, RunConfig, to_dict
from anyorder.errors import CheckpointError

if TYPE_CHECKING:
    from anyorder.checkpoint.loaded import Loaded
    from anyorder.models.base import AnyOrderLM

# Files huggingface_hub.snapshot_download fetches for an export (no other repo content).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.yaml", "README.md", "tokenizer/*"]


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


# A hub id is "name" or "owner/name"; anything else that does not exist is a missing path.
def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why the hub cannot be reached (one TCP connection to ``HF_ENDPOINT``), or None.

    The hub client retries a failed request five times with back-off (about 25 s or more,
    and a line per retry) before it gives up; one quick connection tells an offline machine
    at once. ``HF_HUB_OFFLINE=1`` is the user's own word that there is no network.
    """
    import os
    import socket
    from urllib.parse import urlsplit

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        return f"{host}:{port} cannot be reached: {why}"
    return None


def _cached_or_reachable(download, text: str, fix: str):
    """``download(local_files_only=True)`` (the hub cache, no network); else, when the hub
    is reachable, ``download(local_files_only=False)``; else one clear error at once."""
    try:
        return download(local_files_only=True)
    except Exception:
        pass
    why = hub_unreachable()
    if why is not None:
        raise CheckpointError(f"{text!r} is not in the hub cache and {why}; {fix}")
    return download(local_files_only=False)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def resolve_folder(
    spec: str | Path,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    allow_patterns: list[str] | None = None,
    local_files_only: bool = False,
) -> Path:
    """A local folder for ``spec``: the folder itself, or a hub snapshot of a hub id.

    ``allow_patterns`` limits what a hub download fetches (default: an export's files);
    ``local_files_only`` reads the hub cache only (no network).

    Raises:
        CheckpointError: a local path that does not exist, or a hub id that cannot be
            downloaded (offline and not in the cache).
    """
    path = Path(spec).expanduser()
    if path.exists():
        return path
    text = str(spec)
    if not _HUB_ID.match(text):
        raise CheckpointError(
            f"model path {text!r} does not exist; give an exported folder, a run folder, a "
            "checkpoint folder or a hub id (user/name)"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(
            f"{text!r} is not a local folder and loading hub ids needs huggingface_hub; "
            "pip install 'anyorder[hf]' or give a local folder"
        ) from None

    def download(local_files_only: bool) -> str:
        return snapshot_download(
            repo_id=text,
            revision=revision,
            cache_dir=None if cache_dir is None else str(cache_dir),
            allow_patterns=allow_patterns or _HUB_PATTERNS,
            local_files_only=local_files_only,
        )

    try:
        if local_files_only:
            local = download(True)
        else:
            fix = "connect to the network, or give a local folder"
            local = _cached_or_reachable(download, text, fix)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"model {text!r} is neither a local folder nor downloadable from the hub "
            f"({_first_line(e)}); check the id and the network, or give a local folder"
        ) from None
    return Path(local)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload an exported folder to the Hugging Face hub (``huggingface_hub.upload_folder``).

    Args:
        folder: an export written by :func:`save_pretrained` / :func:`export`.
        repo_id: ``user/name`` of the model repository (created when missing).
        private: create the repository as private.
        token: a hub token (default: the one ``huggingface-cli login`` stored).
        commit_message: the commit message.

    Returns:
        The URL of the commit.

    Raises:
        CheckpointError: the folder is not a complete export, ``huggingface_hub`` is
            missing, or the upload fails.
    """
    folder = Path(folder)
    if not is_exported(folder) or not (folder / WEIGHTS_NAME).is_file():
        raise CheckpointError(
            f"{str(folder)!r} is not a complete exported model (config.json with model_type "
            f"anyorder and {WEIGHTS_NAME}); write it with anyorder export or anyorder convert"
        )
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise CheckpointError(
            "pushing to the hub needs huggingface_hub; pip install 'anyorder[hf]'"
        ) from None
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message=commit_message or f"Upload anyorder model ({_version()})",
        )
    except Exception as e:
        raise CheckpointError(
            f"upload of {str(folder)!r} to {repo_id!r} failed ({_first_line(e)}); check the "
            "network and your token (huggingface-cli login)"
        ) from None
    return str(getattr(info, "commit_url", info))


# ----------------------------------------------------------------------------- loading


def from_pretrained(
    spec: str | Path,
    *,
    kind: str | None = None,
    device: str | torch.device = "cpu",
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> Loaded:
    """Load an exported model from a folder or a hub id.

    Args:
        spec: an export folder (also a hub snapshot folder), or a hub id ``user/name``.
        kind: the model kind the caller expects (``gpt``, ``aogpt``, ``armd``, ``mdm``);
            None accepts any.
        device: where to put the model.
        revision: the hub revision (branch, tag or commit) for a hub id.
        cache_dir: the hub cache folder (default: huggingface_hub's).
        local_files_only: for a hub id, read the hub cache only (no network).

    Returns:
        A :class:`~anyorder.checkpoint.loaded.Loaded`; ``tokenizer`` is None when the export
        holds none, ``config`` is the training run's config when it was exported with one
        (else defaults around the model config), ``step`` is the training step (0 if unknown).

    Raises:
        CheckpointError: a missing file, a folder of another kind, a model of another kind
            than ``kind``, or corrupt weights.
    """
    check_kind(kind)
    folder = resolve_folder(
        spec, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )
    return load_exported(folder, kind=kind, device=device, spec=spec)


# ----------------------------------------------------------------------------- init_from


_TRAINING_TIME = ("dropout",)


def architecture_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Model config keys (besides ``dropout``) whose values differ between ``a`` and ``b``."""
    da, db = to_dict(a), to_dict(b)
    return [k for k in da if k not in _TRAINING_TIME and da[k] != db[k]]


def init_weights_from(model: AnyOrderLM, spec: str | Path) -> Loaded:
    """Copy the weights of ``spec`` (``train.init_from``) into a freshly built ``model``.

    ``spec`` is an export folder or hub id (``anyorder convert`` / ``anyorder export``), or a
    training run or checkpoint folder (its EMA weights). ``model`` must have the same
    architecture (build it from :func:`init_model_config`'s config); ``dropout`` may differ.

    Returns:
        What was loaded (its ``model`` is a separate copy; ``model`` now holds its weights).

    Raises:
        CheckpointError: ``spec`` cannot be loaded, or holds another architecture.
    """
    loaded = load_any(spec)
    diff = architecture_diff(loaded.model.cfg, model.cfg)
    if "vocab_size" in diff:
        raise CheckpointError(
            f"train.init_from={str(spec)!r} reads {loaded.model.cfg.vocab_size} token ids but the "
            f"run's tokenizer has {model.cfg.vocab_size}; set data.tokenizer to the tokenizer "
            "init_from was made with (its folder)"
        )
    if diff:
        k = diff[0]
        raise CheckpointError(
            f"train.init_from={str(spec)!r} holds model.{k}={getattr(loaded.model.cfg, k)!r} but "
            f"the run's model has {getattr(model.cfg, k)!r}; drop model.{k} from the config (the "
            "architecture comes from init_from)"
        )
    with torch.no_grad():
        model.load_state_dict(loaded.model.state_dict(), strict=True)
    return loaded


def init_model_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its ``model`` section taken from ``cfg.train.init_from`` (if set).

    The architecture comes from the weights; only ``model.dropout`` is kept from ``cfg``.
    Keys of ``cfg.model`` that differ both from the defaults and from ``init_from`` are an
    error (the user asked for something the weights cannot give).

    Raises:
        CheckpointError: ``init_from`` cannot be read, or contradicts an explicit key.
    """
    spec = getattr(cfg.train, "init_from", None)
    if not spec:
        return cfg
    have = _peek_model_config(spec)
    default = ModelConfig(kind=cfg.model.kind)
    explicit = set(architecture_diff(cfg.model, default)) - {"kind"}
    if cfg.model.kind != ModelConfig().kind:
        explicit.add("kind")
    clash = [k for k in explicit if getattr(cfg.model, k) != getattr(have, k)]
    if clash:
        k = sorted(clash)[0]
        raise CheckpointError(
            f"model.{k}={getattr(cfg.model, k)!r} contradicts train.init_from={spec!r}, which "
            f"holds model.{k}={getattr(have, k)!r}; drop model.{k} from the config (the "
            "architecture comes from init_from)"
        )
    merged = ModelConfig(**{**to_dict(have), "dropout": cfg.model.dropout})
    return dataclasses.replace(cfg, model=merged)


def _peek_model_config(spec: str | Path) -> ModelConfig:
    """The model config of an export or checkpoint, without loading its weights."""
    path = Path(spec).expanduser()
    if path.exists() and not is_exported(path):
        return read_config(resolve_checkpoint(path)).model
    folder = resolve_folder(spec)
    return model_config_of(read_export_config(folder), str(folder / CONFIG_NAME))


def load_any(
    spec: str | Path,
    *,
    kind: str | None = None,
    weights: str = "ema",
    device: str | torch.device = "cpu",
    huge_pages: bool = False,
) -> Loaded:
    """Load a model from whatever ``spec`` names: an export folder, a hub id, a run folder
    or a training checkpoint folder.

    Args:
        spec: the path or hub id.
        kind: the expected model kind (None: any).
        weights: for training checkpoints: ``ema`` or ``raw``.
        device: where to put the model.
        huge_pages: on a CPU, copy the weights into 2 MB pages
            (:func:`anyorder.hugepages.place_in_huge_pages`: faster decoding, a slower load).

    Raises:
        CheckpointError: nothing loadable at ``spec``, or a model of another kind.
    """
    from anyorder.hugepages import place_in_huge_pages

    path = Path(spec).expanduser()
    if path.exists() and not is_exported(path):
        if (path / CONFIG_NAME).is_file() and not (path / "checkpoints").is_dir():
            read_export_config(path)  # raises the "not an anyorder model" error
        loaded = load_model(path, weights=weights, device=device)
        if kind is not None and loaded.model.kind != kind:
            raise CheckpointError(
                f"{str(spec)!r} holds a {loaded.model.kind} model, not {kind}; load it as "
                f"{loaded.model.kind} or pick a checkpoint of a {kind} model"
            )
    else:
        loaded = from_pretrained(spec, kind=kind, device=device)
    if huge_pages:
        place_in_huge_pages(loaded.model)
    return loaded
