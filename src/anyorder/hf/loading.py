"""The options of :meth:`~anyorder.hf.model.AnyorderModel.from_pretrained`: where the folder
is, which device and dtype the model gets, and which options are refused.

``transformers``' loaders pass many options on every call, set or not: ``AutoModel*`` passes
``cache_dir``, ``force_download``, ``local_files_only``, ``proxies``, ``subfolder=""``,
``revision`` (resolved to a commit for a hub id), ``trust_remote_code``, ``adapter_kwargs``
and ``config``; ``pipeline`` adds ``dtype="auto"`` and ``_from_pipeline``.

Design choices:

* An option at its default (None, False, ``""``) is accepted whatever its name: the loaders
  pass them all. A set option is honoured (the hub options of a hub id, ``subfolder``, the
  device and dtype) or refused in one line naming it; none is ignored.
* A hub id is downloaded by anyorder's own hub code (:func:`anyorder.interop.hub.
  resolve_folder`), at ``revision``, into ``cache_dir``; ``local_files_only`` reads the
  cache only. What it cannot do (a ``token`` or ``proxies`` given here, ``force_download``)
  is refused with the way to do it. For a local folder the hub options mean nothing, as
  in ``transformers``, but a ``revision`` other than ``"main"`` (a version the folder cannot
  give) is refused.
* ``device_map="meta"`` would make a model without weights, which cannot generate: refused
  (anyorder's loader always reads the weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from anyorder.checkpoint.exported import STORED_DTYPES
from anyorder.errors import CheckpointError, ConfigError

_DTYPES = {name: getattr(torch, name) for name in STORED_DTYPES}
_SPLIT_STRATEGIES = ("balanced", "balanced_low_0", "sequential")
_ONE_DEVICE = "pass device_map='auto', 'cpu' or one device such as 'cuda:0'"

HARMLESS = {
    "_from_auto", "_from_pipeline", "_commit_hash", "trust_remote_code", "code_revision",
    "low_cpu_mem_usage", "use_safetensors", "name_or_path", "attn_implementation",
}  # fmt: skip
"""Options that change nothing here whatever their value: ``transformers``' bookkeeping,
``trust_remote_code`` and ``code_revision`` (an export ships no code: the classes are ours),
how weights are read (anyorder's loader reads the one safetensors file), the attention
kernel (anyorder's attention is its own; ``eager`` or ``sdpa`` compute the same function,
and ``AutoConfig`` keeps the option in the config, where nothing reads it)."""


HUB_OPTIONS = (
    "revision", "cache_dir", "local_files_only", "force_download", "proxies", "token",
    "subfolder",
)  # fmt: skip
"""Where the files come from: read by :func:`load_folder`."""


def unused(kwargs: dict[str, Any], harmless: set[str], what: str) -> None:
    """Refuse the options in ``kwargs`` that are set (not None, False or ``""``) and would
    change something we ignore.

    Raises:
        ConfigError: one line naming them.
    """
    set_ = sorted(
        k for k, v in kwargs.items() if k not in harmless and v is not None and v is not False
        and not (isinstance(v, str) and v == "")
    )  # fmt: skip
    if set_:
        raise ConfigError(f"{what} does not take {', '.join(set_)} (an anyorder model ignores it)")


def load_folder(spec: Any, options: dict[str, Any]) -> Path:
    """The local folder to read: ``spec`` itself, or the hub snapshot of a hub id, and
    ``subfolder`` inside it, as ``options`` (:data:`HUB_OPTIONS`) say.

    Raises:
        ConfigError: a hub option that cannot be honoured.
        CheckpointError: a subfolder that is not there, a hub id that cannot be downloaded.
    """
    from anyorder.interop.hub import resolve_folder

    revision = options.get("revision")
    cache_dir = options.get("cache_dir")
    local_files_only = options.get("local_files_only", False)
    force = options.get("force_download", False)
    proxies = options.get("proxies")
    token = options.get("token")
    sub = options.get("subfolder") or ""
    if not isinstance(sub, str):
        raise ConfigError(f"subfolder={sub!r} must be a folder name (a string)")
    sub = sub.strip("/")
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        if revision is not None and revision != "main":  # "main": transformers' default
            raise ConfigError(
                f"revision={str(revision)!r} picks a hub revision, but {text!r} is a local "
                "folder; drop revision, or give the hub id"
            )
        folder = path
    else:
        fixes = (
            (proxies, "proxies", "set HTTPS_PROXY in the environment"),
            (token not in (None, True), "token", "log in (huggingface-cli login) or set HF_TOKEN"),
            (force, "force_download", "delete the model's folder from the hub cache"),
        )
        for value, name, fix in fixes:
            if value:
                raise ConfigError(
                    f"from_pretrained({name}=...) is not passed to anyorder's hub download; {fix}"
                )
        folder = resolve_folder(
            text, revision=revision, cache_dir=cache_dir, local_files_only=bool(local_files_only),
            allow_patterns=[f"{sub}/*"] if sub else None,
        )  # fmt: skip
    if sub:
        if not (folder / sub).is_dir():
            raise CheckpointError(f"{text!r} has no subfolder {sub!r}; check subfolder=")
        folder = folder / sub
    return folder


def load_device(device_map: Any, device: Any) -> torch.device:
    """The one device a model goes to from ``device_map`` (``"auto"``, a device, or a dict
    that maps every part to one device) or ``device``; default cpu.

    Raises:
        ConfigError: a map that splits the model, ``meta``, a device that is not here, or
            something that is not a device.
    """
    spec = device if device_map is None else device_map
    if isinstance(spec, dict):
        # an int is a CUDA index (torch.device(0) would raise on a machine without one)
        places = {f"cuda:{v}" if isinstance(v, int) else str(v) for v in spec.values()}
        if len(places) != 1:
            raise ConfigError(
                f"device_map puts parts of the model on {', '.join(sorted(places))}; an anyorder "
                f"model runs on one device: {_ONE_DEVICE}"
            )
        spec = places.pop()
    if spec is None:
        return torch.device("cpu")
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = f"cuda:{spec}"  # transformers' meaning of an index
    if isinstance(spec, str) and spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(spec, str) and spec in _SPLIT_STRATEGIES:
        raise ConfigError(
            f"device_map={spec!r} splits the model over devices; an anyorder model runs on one: "
            f"{_ONE_DEVICE}"
        )
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"device_map={str(spec)[:40]!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if dev.type == "meta":
        raise ConfigError(
            f"device_map={str(spec)!r} makes a model without weights, which cannot run; an "
            f"anyorder model is loaded with its weights: {_ONE_DEVICE}"
        )
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device_map={str(spec)!r}: no CUDA device here; use 'cpu' or 'auto'")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(
                f"device_map={str(spec)!r}: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}"
            )
    elif dev.type != "cpu":
        backend = getattr(torch, dev.type, None)
        if not (backend is not None and getattr(backend, "is_available", lambda: False)()):
            raise ConfigError(
                f"device_map={str(spec)!r}: no {dev.type} device here; use 'cpu' or 'auto'"
            )
    return dev


def load_dtype(dtype: Any, stored: str | None) -> torch.dtype:
    """The dtype a loaded model runs in: ``dtype`` (a torch dtype or its name), ``"auto"``
    (the dtype the export stores, ``stored``), or float32 when None (as ``anyorder.load``).

    Raises:
        ConfigError: another name or object.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype == "auto":
        return _DTYPES[stored or "float32"]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ConfigError(
        f"dtype={str(dtype)[:40]!r} is not one an anyorder model runs in; use 'auto', "
        f"{', '.join(STORED_DTYPES)}"
    )
