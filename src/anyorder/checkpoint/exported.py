"""Exported models: the folder layout, and reading one back (:func:`load_exported`).

An exported model is a Hugging Face style folder (or a hub repository) holding

* ``config.json``: every :class:`~anyorder.config.ModelConfig` field, plus
  ``model_type: "anyorder"``, ``anyorder_kind``, ``anyorder_version``, ``anyorder_format``,
  which weights were exported (``ema``/``raw``/``converted``), the training step, where the
  weights came from, and the SHA-256 of the weights file;
* ``model.safetensors``: the weights (tied copies written once);
* ``tokenizer/``: the tokenizer's own files (:meth:`Tokenizer.save`), as in a training
  checkpoint (``AutoTokenizer.from_pretrained(repo, subfolder="tokenizer")`` reads a
  ``transformers`` one);
* ``tokenizer.json`` and ``tokenizer_config.json`` for a byte tokenizer: its ids in
  ``transformers``' format (:mod:`anyorder.checkpoint.hf_tokenizer`), for ``AutoTokenizer``
  and ``pipeline``;
* ``training_config.yaml``: the run config that produced the weights, when there was one;
* ``README.md``: a model card.

:mod:`anyorder.checkpoint.exporting` writes one; :mod:`anyorder.interop.hub` uploads one and
downloads hub ids.

Design choices:

* A training checkpoint (:mod:`anyorder.checkpoint.layout`) is for resuming a run: it holds
  the optimizer and both raw and EMA weights. An export is for using and sharing a model: one
  set of weights (EMA by default), no training state, a model card. ``anyorder export``
  turns the first into the second.
* Both formats live in :mod:`anyorder.checkpoint` because :func:`~anyorder.checkpoint.load.
  load_model` reads both; the hub transport (downloads, uploads) sits above, in
  :mod:`anyorder.interop.hub`, which imports this module and never the other way round.
* Reading checks what a user can get wrong and says how to fix it, as a
  :class:`CheckpointError`: a missing file, a folder of another kind (a training
  checkpoint, a ``transformers`` model), a model of another kind than asked for, and
  weights that are corrupt (checksum, header or shapes).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anyorder.checkpoint.loaded import Loaded, check_tokenizer_fits
from anyorder.checkpoint.weights import (
    adopt_state,
    check_finite,
    fit_state,
    header_problem,
    read_header_shapes,
)
from anyorder.config import MODEL_KINDS, DataConfig, ModelConfig, RunConfig
from anyorder.data import sha256_file
from anyorder.errors import AnyorderError, CheckpointError, ConfigError

if TYPE_CHECKING:
    from anyorder.data import Tokenizer
    from anyorder.models.base import AnyOrderLM

FORMAT_VERSION = 1
"""Version of the exported layout, stored as ``anyorder_format`` in ``config.json``."""
MODEL_TYPE = "anyorder"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
RUN_CONFIG_NAME = "training_config.yaml"
TOKENIZER_DIR = "tokenizer"
STORED_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes an export stores its weights in: ``torch_dtype`` in ``config.json``."""


MAX_CONFIG_BYTES = 16 << 20
"""At most this many bytes in an export's ``config.json`` (ours hold about 1 KB): a larger
one (a sparse file of a terabyte takes no disk) is refused before it is read."""


def _config_text(path: Path) -> str:
    """The text of a ``config.json``, refused (ValueError) past :data:`MAX_CONFIG_BYTES`."""
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{size:,} bytes, more than an export's {CONFIG_NAME} holds")
    return path.read_text()


def is_exported(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding an exported anyorder model (its ``config.json``)."""
    cfg = Path(path) / CONFIG_NAME
    if not cfg.is_file():
        return False
    try:
        return json.loads(_config_text(cfg)).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


# ----------------------------------------------------------------------------- reading


def _no_constant(name: str) -> Any:
    """JSON has no NaN or Infinity: a config.json that says so was not written by us."""
    raise ValueError(f"{name} is not a number JSON allows")


def read_export_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of an export, checked to describe an anyorder model.

    Raises:
        CheckpointError: no ``config.json``, or a folder of another kind.
    """
    folder = Path(folder)
    path = folder / CONFIG_NAME
    if not path.is_file():
        if (folder / "manifest.json").is_file() or (folder / "checkpoints").is_dir():
            raise CheckpointError(
                f"{str(folder)!r} is a training checkpoint or run, not an export; load it with "
                "anyorder.load / checkpoint.load_model, or export it with anyorder export"
            )
        raise CheckpointError(
            f"{str(folder)!r} has no {CONFIG_NAME}: it is not an exported anyorder model; "
            "write one with anyorder export or anyorder convert"
        )
    try:
        config = json.loads(_config_text(path), parse_constant=_no_constant)
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else _first_line(e)[:200]
        raise CheckpointError(f"{path} is unreadable ({why}); export again") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object; export again")
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        hint = (
            f"convert it first: anyorder convert {folder} --to aogpt --out FOLDER"
            if model_type == "gpt2"
            else "it was not written by anyorder"
        )
        raise CheckpointError(
            f"{path} describes a {model_type!r} model, not an anyorder one; {hint}"
        )
    fmt = config.get("anyorder_format")
    if fmt != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has export format {fmt!r}, this version reads {FORMAT_VERSION}; use the "
            "anyorder version that wrote it"
        )
    return config


def model_config_of(config: Mapping[str, Any], where: str = CONFIG_NAME) -> ModelConfig:
    """The :class:`ModelConfig` stored in an export's ``config.json``."""
    from anyorder.config import _build

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        cfg = _build(ModelConfig, {k: v for k, v in config.items() if k in names}, "model")
    except ConfigError as e:
        raise CheckpointError(
            f"{where} holds an invalid model config ({e}); export again"
        ) from None
    # both are written from one value: a difference is an edited file, and which one the
    # weights belong to cannot be known (a wrong kind loads and decodes garbage)
    declared = config.get("anyorder_kind", cfg.kind)
    if declared != cfg.kind:
        raise CheckpointError(
            f"{where} has anyorder_kind {json.dumps(declared)[:40]} but kind "
            f"{json.dumps(config.get('kind', cfg.kind))[:40]}; they must agree: export again "
            "(or set both to the kind the weights were trained as)"
        )
    return cfg


def load_state(model: AnyOrderLM, path: Path, expected_sha256: str | None = None) -> None:
    """Load an export's weights into ``model``, checking checksum, header and shapes.

    Raises:
        CheckpointError: a missing, corrupt or mismatched weights file.
    """
    from safetensors.torch import load_file

    fix = "export or download it again"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; the export is incomplete: {fix}")
    if expected_sha256 and sha256_file(path) != expected_sha256:
        raise CheckpointError(f"{path} is corrupt (its SHA-256 differs from config.json); {fix}")
    try:
        state = load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt ({_first_line(e)}); {fix}") from None
    detail = fit_state(model, state)
    if detail:
        raise CheckpointError(f"{path} does not fit the model config.json describes ({detail})")
    check_finite(state, path, "export or convert it again from finite weights")
    adopt_state(model, state)


def check_stored_dtype(value: Any, key: str = "torch_dtype", where: str = CONFIG_NAME) -> None:
    """``value`` (a ``config.json`` dtype field ``key``) is None or names a stored dtype.

    Raises:
        CheckpointError: another value, named with the field (``transformers`` would look
            any name up as an attribute of ``torch``).
    """
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if value is not None and value not in STORED_DTYPES:
        raise CheckpointError(
            f"{where} has {key}={json.dumps(value, default=str)[:40]}, not a dtype an export "
            f"stores ({', '.join(STORED_DTYPES)}); export again"
        )


def check_kind(kind: str | None) -> None:
    """Refuse a ``kind`` that is not a model kind (None, any kind, is fine).

    Raises:
        ConfigError: an unknown kind.
    """
    if kind is not None and kind not in MODEL_KINDS:
        raise ConfigError(f"kind={kind!r} is not a model; use one of {', '.join(MODEL_KINDS)}")


def load_exported(
    folder: str | Path,
    *,
    kind: str | None = None,
    device: str | torch.device = "cpu",
    spec: str | Path | None = None,
) -> Loaded:
    """Load an exported model from a local folder.

    (:func:`anyorder.interop.hub.from_pretrained` also takes hub ids, and downloads them.)

    Args:
        folder: an export folder (also a hub snapshot folder).
        kind: the model kind the caller expects (``gpt``, ``aogpt``, ``armd``, ``mdm``);
            None accepts any.
        device: where to put the model.
        spec: what the caller asked for (a hub id...), named in errors; default ``folder``.

    Returns:
        A :class:`~anyorder.checkpoint.loaded.Loaded`; ``tokenizer`` is None when the export
        holds none, ``config`` is the training run's config when it was exported with one
        (else defaults around the model config), ``step`` is the training step (0 if unknown).

    Raises:
        CheckpointError: a missing file, a folder of another kind, a model of another kind
            than ``kind``, or corrupt weights.
        ConfigError: an unknown ``kind``.
    """
    from anyorder.models import build_model

    check_kind(kind)
    spec = folder if spec is None else spec
    folder = Path(folder).expanduser()
    config = read_export_config(folder)
    model_cfg = model_config_of(config, str(folder / CONFIG_NAME))
    if kind is not None and model_cfg.kind != kind:
        raise CheckpointError(
            f"{str(spec)!r} holds a {model_cfg.kind} model, not {kind}; load it as "
            f"{model_cfg.kind} or pick an export of a {kind} model"
        )
    for key in ("torch_dtype", "dtype"):
        check_stored_dtype(config.get(key), key, str(folder / CONFIG_NAME))
    step = config.get("step") or 0
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(
            f"{folder / CONFIG_NAME} has step {json.dumps(step)[:40]}, not a whole number >= 0; "
            "export again"
        )
    weights = folder / WEIGHTS_NAME
    if weights.is_file():  # its shapes against the config before anything is allocated
        shapes = read_header_shapes(weights, "; export or download it again")
        problem = header_problem(model_cfg, shapes)
        if problem:
            raise CheckpointError(
                f"{weights} does not fit the model {CONFIG_NAME} describes ({problem}); "
                "export or download it again"
            )
    sha = config.get("weights_sha256")
    if not isinstance(sha, str) or len(sha) != 64:
        raise CheckpointError(
            f"{folder / CONFIG_NAME} records no weights_sha256 (the checksum of "
            f"{WEIGHTS_NAME}), so its weights cannot be checked; export or download it again"
        )
    model = build_model(model_cfg, init=False)  # every weight is loaded next
    load_state(model, weights, sha)
    tokenizer = _read_tokenizer(folder)
    check_tokenizer_fits(tokenizer, model_cfg.vocab_size, repr(str(spec)))
    run_config = _read_run_config(folder, model_cfg)
    model.to(device).eval()
    return Loaded(
        model=model,
        tokenizer=tokenizer,  # type: ignore[arg-type]
        config=run_config,
        step=step,
        path=folder,
        weights=str(config.get("weights", "model")),
    )


def _read_tokenizer(folder: Path) -> Tokenizer | None:
    sub = folder / TOKENIZER_DIR
    if not sub.is_dir():
        return None
    from anyorder.data import load_tokenizer

    try:
        return load_tokenizer(str(sub.resolve()))
    except AnyorderError as e:
        raise CheckpointError(f"the tokenizer in {sub} cannot be loaded: {e}") from None


def _read_run_config(folder: Path, model_cfg: ModelConfig) -> RunConfig:
    path = folder / RUN_CONFIG_NAME
    if path.is_file():
        from anyorder.config import load_config

        try:
            cfg = load_config(path)
        except ConfigError as e:
            raise CheckpointError(f"{path} is not a config this version reads ({e})") from None
        cfg.model = model_cfg
        # a folder of the machine that trained, and the export may come from anyone: this
        # machine's cache home, not a path the folder chooses, takes `anyorder eval`'s data
        cfg.data.cache_dir = DataConfig.cache_dir
    else:
        cfg = RunConfig(model=model_cfg)
    # data for `eval`: tokenized as the model reads it (the run's own spec, bpe:N or a path
    # of the machine that trained, would tokenize anew)
    if (folder / TOKENIZER_DIR).is_dir():
        cfg.data.tokenizer = str((folder / TOKENIZER_DIR).resolve())
    return cfg
