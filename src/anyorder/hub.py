"""Exported models: a Hugging Face style folder that can be uploaded as is, and read back.

An exported model is a folder (or a hub repository) holding

* ``config.json``: every :class:`~anyorder.config.ModelConfig` field, plus
  ``model_type: "anyorder"``, ``anyorder_kind``, ``anyorder_version``, ``anyorder_format``,
  which weights were exported (``ema``/``raw``/``converted``), the training step, where the
  weights came from, and the SHA-256 of the weights file;
* ``model.safetensors``: the weights (tied copies written once);
* ``tokenizer/``: the tokenizer's own files (:meth:`Tokenizer.save`), as in a training
  checkpoint (``AutoTokenizer.from_pretrained(repo, subfolder="tokenizer")`` reads a
  ``transformers`` one);
* ``training_config.yaml``: the run config that produced the weights, when there was one;
* ``README.md``: a model card.

Design choices:

* A training checkpoint (:mod:`anyorder.checkpoint`) is for resuming a run: it holds the
  optimizer and both raw and EMA weights. An export is for using and sharing a model: one
  set of weights (EMA by default), no training state, a model card. ``anyorder export``
  turns the first into the second.
* Writes are atomic: the folder is built under a temporary name beside its place and
  renamed into it, so a failed export leaves nothing half-written. An existing folder is
  replaced only when it is empty or is itself an export.
* Reading checks what a user can get wrong and says how to fix it, as a
  :class:`CheckpointError`: a missing file, a folder of another kind (a training
  checkpoint, a ``transformers`` model), a model of another kind than asked for, and
  weights that are corrupt (checksum, header or shapes).
* ``huggingface_hub`` is imported only inside :func:`push_to_hub` and for hub ids in
  :func:`from_pretrained`; a hub id goes through ``snapshot_download``, which also reads
  a local cache laid out like the hub's when offline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anyorder.config import MODEL_KINDS, ModelConfig, RunConfig, to_dict
from anyorder.data import sha256_file
from anyorder.errors import AnyorderError, CheckpointError, ConfigError

if TYPE_CHECKING:
    from anyorder.checkpoint import Loaded
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
WEIGHT_LABELS = ("ema", "raw", "converted", "model")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files huggingface_hub.snapshot_download fetches for an export (no other repo content).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.yaml", "README.md", "tokenizer/*"]


def _version() -> str:
    from anyorder import __version__

    return __version__


def is_exported(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding an exported anyorder model (its ``config.json``)."""
    cfg = Path(path) / CONFIG_NAME
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


# ----------------------------------------------------------------------------- saving


def _model_card(config: dict[str, Any], num_params: int, tokenizer: Tokenizer | None) -> str:
    kind = config["anyorder_kind"]
    what = {
        "gpt": "a left-to-right GPT (the baseline)",
        "aogpt": "an AO-GPT any-order decoder (arXiv 2506.19935)",
        "armd": "an ARMD two-stream any-order decoder (arXiv 2601.16971)",
        "mdm": "an encoder-only masked diffusion model (the baseline)",
    }[kind]
    source = config.get("source") or "trained with anyorder"
    step = config.get("step")
    tok = (
        f"`{tokenizer.name}` ({tokenizer.vocab_size} ids, EOS {tokenizer.eos_id})"
        if tokenizer
        else ("none saved: encode text yourself, or export again with a tokenizer")
    )
    rows = "\n".join(
        f"| `{k}` | `{config[k]}` |"
        for k in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "pos_emb", "norm")
    )
    return f"""---
library_name: anyorder
tags:
- anyorder
- {kind}
- masked-diffusion
- any-order
---

# {kind} model exported by anyorder {config["anyorder_version"]}

This is {what}: {num_params / 1e6:.2f}M parameters, weights `{config["weights"]}`
{f"after {step} training steps" if step else ""} ({source}).

| key | value |
|---|---|
{rows}

Tokenizer: {tok}.

## Use

```python
import anyorder

model = anyorder.load("PATH_OR_REPO_ID")
print(model.generate(n={min(64, config["seq_len"])}, num_samples=2, seed=0))
print(model.score("Some text to score.", order="l2r"))
```

or from the shell, on a local copy of this folder: `anyorder sample FOLDER`. The weights
are `model.safetensors`, `config.json` holds the anyorder model config (`model_type:
anyorder`: this is not a `transformers` model) and `tokenizer/` the tokenizer.
"""


def _prepare_target(folder: Path) -> None:
    if folder.exists():
        if not folder.is_dir():
            raise CheckpointError(
                f"export target {str(folder)!r} is a file; give a folder path for --out"
            )
        if any(folder.iterdir()) and not is_exported(folder):
            raise CheckpointError(
                f"export target {str(folder)!r} exists and is not an exported anyorder model; "
                "choose a new folder or delete it"
            )
    folder.parent.mkdir(parents=True, exist_ok=True)


def _move_into_place(tmp: Path, folder: Path) -> None:
    old = None
    if folder.exists():
        old = folder.parent / f".{folder.name}.old-{os.getpid()}"
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_pretrained(
    model: AnyOrderLM,
    folder: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    weights: str = "model",
    run_config: RunConfig | None = None,
    step: int | None = None,
    source: str | None = None,
    dtype: str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` as an exported folder that can be uploaded to the hub as is.

    Args:
        model: any of the four models; its current weights are written.
        folder: the target folder (replaced when it is an earlier export; created otherwise).
        tokenizer: saved beside the weights so that :func:`from_pretrained` restores it.
        weights: label recorded in ``config.json`` and the card: ``ema``, ``raw``,
            ``converted`` or ``model`` (the weights the model holds, of unknown origin).
        run_config: the training run's config, written as ``training_config.yaml``.
        step: training steps behind the weights (recorded, shown on the card).
        source: where the weights came from (a checkpoint path, ``gpt2:NAME``...).
        dtype: store the weights as ``float32``, ``bfloat16`` or ``float16`` (default: as
            they are); loading always builds the model in float32.
        extra: more keys for ``config.json`` (e.g. conversion details).

    Returns:
        The folder.

    Raises:
        CheckpointError: the target exists and is something else than an export.
        ConfigError: an unknown ``weights`` label or ``dtype``.
    """
    from safetensors.torch import save_file

    from anyorder.checkpoint import apply_umask, make_temp_dir, tied_aliases

    if weights not in WEIGHT_LABELS:
        raise ConfigError(f"weights={weights!r}: use one of {', '.join(WEIGHT_LABELS)}")
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
    folder = Path(folder).expanduser()
    _prepare_target(folder)
    tmp = make_temp_dir(folder.parent, f".{folder.name}.tmp-")
    try:
        aliases = tied_aliases(model)
        tensors = {}
        for k, v in model.state_dict().items():
            if k in aliases:
                continue  # a tied copy: the loader refills it from the model it builds
            v = v.detach().to("cpu")
            if dtype is not None and v.is_floating_point():
                v = v.to(_DTYPES[dtype])
            tensors[k] = v.contiguous()
        save_file(
            tensors,
            str(tmp / WEIGHTS_NAME),
            metadata={"format": "pt", "tied": json.dumps(aliases)},
        )
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_DIR)
        if run_config is not None:
            import yaml

            (tmp / RUN_CONFIG_NAME).write_text(yaml.safe_dump(to_dict(run_config), sort_keys=False))
        config: dict[str, Any] = {
            "model_type": MODEL_TYPE,
            "anyorder_kind": model.cfg.kind,
            "anyorder_version": _version(),
            "anyorder_format": FORMAT_VERSION,
            **to_dict(model.cfg),
            "weights": weights,
            "step": step,
            "source": source,
            "tokenizer": tokenizer.name if tokenizer is not None else None,
            "torch_dtype": dtype or str(next(model.parameters()).dtype).replace("torch.", ""),
            **dict(extra or {}),
            "weights_sha256": sha256_file(tmp / WEIGHTS_NAME),
        }
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / CARD_NAME).write_text(_model_card(config, model.num_params(), tokenizer))
        apply_umask(tmp)
        _move_into_place(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def export(
    checkpoint: str | Path,
    folder: str | Path,
    *,
    weights: str = "ema",
    dtype: str | None = None,
) -> Path:
    """Export a training checkpoint (or a run folder's latest) as an uploadable folder.

    Args:
        checkpoint: a run folder or ``RUN/checkpoints/step_*``.
        folder: the export folder.
        weights: ``ema`` (the EMA weights, or the raw ones when the run kept no EMA) or
            ``raw``.
        dtype: store the weights in this dtype (see :func:`save_pretrained`).

    Returns:
        The folder.

    Raises:
        CheckpointError: a missing or damaged checkpoint, or a bad target folder.
    """
    from anyorder.checkpoint import load_model, resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    loaded = load_model(ckpt, weights=weights)
    return save_pretrained(
        loaded.model,
        folder,
        loaded.tokenizer,
        weights=loaded.weights,
        run_config=loaded.config,
        step=loaded.step,
        source=f"training checkpoint {ckpt.parent.parent.name}/{ckpt.name}",
        dtype=dtype,
    )


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


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


# A hub id is "name" or "owner/name"; anything else that does not exist is a missing path.
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
    try:
        local = snapshot_download(
            repo_id=text,
            revision=revision,
            cache_dir=None if cache_dir is None else str(cache_dir),
            allow_patterns=allow_patterns or _HUB_PATTERNS,
            local_files_only=local_files_only,
        )
    except Exception as e:
        raise CheckpointError(
            f"model {text!r} is neither a local folder nor downloadable from the hub "
            f"({_first_line(e)}); check the id and the network, or give a local folder"
        ) from None
    return Path(local)


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
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({_first_line(e)}); export again") from None
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
        return _build(ModelConfig, {k: v for k, v in config.items() if k in names}, "model")
    except ConfigError as e:
        raise CheckpointError(
            f"{where} holds an invalid model config ({e}); export again"
        ) from None


def load_state(model: AnyOrderLM, path: Path, expected_sha256: str | None = None) -> None:
    """Load an export's weights into ``model``, checking checksum, header and shapes.

    Raises:
        CheckpointError: a missing, corrupt or mismatched weights file.
    """
    from safetensors.torch import load_file

    from anyorder.checkpoint import fit_state

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
    model.load_state_dict(state, strict=True)


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
        A :class:`~anyorder.checkpoint.Loaded`; ``tokenizer`` is None when the export holds
        none, ``config`` is the training run's config when it was exported with one (else
        defaults around the model config), ``step`` is the training step (0 if unknown).

    Raises:
        CheckpointError: a missing file, a folder of another kind, a model of another kind
            than ``kind``, or corrupt weights.
    """
    from anyorder.checkpoint import Loaded
    from anyorder.models import build_model

    if kind is not None and kind not in MODEL_KINDS:
        raise ConfigError(f"kind={kind!r} is not a model; use one of {', '.join(MODEL_KINDS)}")
    folder = resolve_folder(
        spec, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )
    config = read_export_config(folder)
    model_cfg = model_config_of(config, str(folder / CONFIG_NAME))
    if kind is not None and model_cfg.kind != kind:
        raise CheckpointError(
            f"{str(spec)!r} holds a {model_cfg.kind} model, not {kind}; load it as "
            f"{model_cfg.kind} or pick an export of a {kind} model"
        )
    step = config.get("step") or 0
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(
            f"{folder / CONFIG_NAME} has step {json.dumps(step)[:40]}, not a whole number >= 0; "
            "export again"
        )
    weights = folder / WEIGHTS_NAME
    if weights.is_file():  # its shapes against the config before anything is allocated
        from anyorder.checkpoint import header_problem, read_header_shapes

        shapes = read_header_shapes(weights, "; export or download it again")
        problem = header_problem(model_cfg, shapes)
        if problem:
            raise CheckpointError(
                f"{weights} does not fit the model {CONFIG_NAME} describes ({problem}); "
                "export or download it again"
            )
    model = build_model(model_cfg)
    load_state(model, weights, config.get("weights_sha256"))
    tokenizer = _read_tokenizer(folder)
    from anyorder.checkpoint import check_tokenizer_fits

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
        return cfg
    cfg = RunConfig(model=model_cfg)
    if (folder / TOKENIZER_DIR).is_dir():  # data for `eval`: tokenized as the model reads it
        cfg.data.tokenizer = str((folder / TOKENIZER_DIR).resolve())
    return cfg


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
    from anyorder import checkpoint as ckpt_mod

    path = Path(spec).expanduser()
    if path.exists() and not is_exported(path):
        return ckpt_mod.read_config(ckpt_mod.resolve_checkpoint(path)).model
    folder = resolve_folder(spec)
    return model_config_of(read_export_config(folder), str(folder / CONFIG_NAME))


def load_any(
    spec: str | Path,
    *,
    kind: str | None = None,
    weights: str = "ema",
    device: str | torch.device = "cpu",
) -> Loaded:
    """Load a model from whatever ``spec`` names: an export folder, a hub id, a run folder
    or a training checkpoint folder.

    Args:
        spec: the path or hub id.
        kind: the expected model kind (None: any).
        weights: for training checkpoints: ``ema`` or ``raw``.
        device: where to put the model.

    Raises:
        CheckpointError: nothing loadable at ``spec``, or a model of another kind.
    """
    from anyorder import checkpoint as ckpt_mod

    path = Path(spec).expanduser()
    if path.exists() and not is_exported(path):
        if (path / CONFIG_NAME).is_file() and not (path / "checkpoints").is_dir():
            read_export_config(path)  # raises the "not an anyorder model" error
        loaded = ckpt_mod.load_model(path, weights=weights, device=device)
        if kind is not None and loaded.model.kind != kind:
            raise CheckpointError(
                f"{str(spec)!r} holds a {loaded.model.kind} model, not {kind}; load it as "
                f"{loaded.model.kind} or pick a checkpoint of a {kind} model"
            )
        return loaded
    return from_pretrained(spec, kind=kind, device=device)
