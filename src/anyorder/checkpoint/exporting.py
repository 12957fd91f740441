"""Writing exported models: :func:`save_pretrained` (any model) and :func:`export` (a run).

The layout is :mod:`anyorder.checkpoint.exported`'s; :func:`anyorder.interop.hub.push_to_hub`
uploads the folder as is.

Design choices:

* Writes are atomic: the folder is built under a temporary name beside its place and
  renamed into it, so a failed export leaves nothing half-written. An existing folder is
  replaced only when it is empty or is itself an export.
* One set of weights, tied copies written once (as in a training checkpoint), optionally
  cast to a smaller dtype for storage; loading always builds the model in float32.
* A model card (``README.md``) says what the model is and how to load it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from anyorder.atomic import atomic_folder, short_path, write_errors
from anyorder.checkpoint.exported import (
    CARD_NAME,
    CONFIG_NAME,
    FORMAT_VERSION,
    MODEL_TYPE,
    RUN_CONFIG_NAME,
    TOKENIZER_DIR,
    WEIGHTS_NAME,
    is_exported,
)
from anyorder.checkpoint.hf_tokenizer import write_byte_tokenizer
from anyorder.checkpoint.layout import EMA_FILE, resolve_checkpoint, verify
from anyorder.checkpoint.load import load_model, read_config, weights_file
from anyorder.checkpoint.save import reading
from anyorder.checkpoint.weights import check_finite, tied_aliases
from anyorder.config import RunConfig, method_name, to_dict
from anyorder.data import ByteTokenizer, sha256_file
from anyorder.errors import CheckpointError, ConfigError
from anyorder.version import __version__

if TYPE_CHECKING:
    from anyorder.data import Tokenizer
    from anyorder.models.base import AnyOrderLM

WEIGHT_LABELS = ("ema", "raw", "converted", "model")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _version() -> str:
    return __version__


def _model_card(config: dict[str, Any], num_params: int, tokenizer: Tokenizer | None) -> str:
    kind = config["anyorder_kind"]
    name = method_name(kind, config.get("target_injection"))
    what = {
        "gpt": "a left-to-right GPT (the baseline)",
        "aogpt": "an AO-GPT any-order decoder (arXiv 2506.19935)",
        "armd": "an ARMD two-stream any-order decoder (arXiv 2601.16971)",
        "mdm": "an encoder-only masked diffusion model (the baseline)",
    }[kind]
    if name == "sigma-GPT":
        what = "a sigma-GPT any-order decoder (the target position added to the input)"
    source = config.get("source") or "trained with anyorder"
    step = config.get("step")
    tok = (
        f"`{tokenizer.name}` ({tokenizer.vocab_size} ids, EOS {tokenizer.eos_id})"
        if tokenizer
        else ("none saved: encode text yourself, or export again with a tokenizer")
    )
    if isinstance(tokenizer, ByteTokenizer):
        tok += ", also as `tokenizer.json` (`AutoTokenizer`, `pipeline(model=...)` read it)"
    rows = "\n".join(
        f"| `{k}` | `{config[k]}` |"
        for k in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "pos_emb", "norm")
    )
    return f"""---
library_name: anyorder
tags:
- anyorder
- {kind}
- {name}
- masked-diffusion
- any-order
---

# {name} model exported by anyorder {config["anyorder_version"]}

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
anyorder`) and `tokenizer/` the tokenizer. With `transformers`, after `import anyorder`
(which registers the classes; this folder holds no code and needs no `trust_remote_code`):
`AutoModelForCausalLM.from_pretrained("PATH_OR_REPO_ID")`.
"""


_EXPORT_WHERE = "another --out folder"


def _prepare_target(folder: Path) -> None:
    with write_errors(folder, _EXPORT_WHERE):
        exists, is_dir = folder.exists(), folder.is_dir()
        if exists and is_dir:
            empty = not any(folder.iterdir())
    if exists and not is_dir:
        raise CheckpointError(
            f"export target {short_path(folder)} is a file; give a folder path for --out"
        )
    if exists and not empty and not is_exported(folder):
        raise CheckpointError(
            f"export target {short_path(folder)} exists and is not an exported anyorder model; "
            "choose a new folder or delete it"
        )


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

    if weights not in WEIGHT_LABELS:
        raise ConfigError(f"weights={weights!r}: use one of {', '.join(WEIGHT_LABELS)}")
    if dtype is not None and dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
    folder = Path(folder).expanduser()
    _prepare_target(folder)
    with atomic_folder(folder, _EXPORT_WHERE) as tmp:
        aliases = tied_aliases(model)
        tensors = {}
        for k, v in model.state_dict().items():
            if k in aliases:
                continue  # a tied copy: the loader refills it from the model it builds
            v = v.detach().to("cpu")
            if dtype is not None and v.is_floating_point():
                v = v.to(_DTYPES[dtype])
            tensors[k] = v.contiguous()
        check_finite(
            tensors, source or "the model", "there is nothing to export: use finite weights"
        )
        save_file(
            tensors,
            str(tmp / WEIGHTS_NAME),
            metadata={"format": "pt", "tied": json.dumps(aliases)},
        )
        if run_config is not None:
            import yaml

            (tmp / RUN_CONFIG_NAME).write_text(yaml.safe_dump(to_dict(run_config), sort_keys=False))
        stored = dtype or str(next(model.parameters()).dtype).replace("torch.", "")
        write_export_files(
            tmp, model.cfg, model.num_params(), tokenizer, weights=weights, step=step,
            source=source, dtype=stored, extra=extra,
        )  # fmt: skip
    return folder


def write_export_files(
    tmp: Path,
    cfg: Any,
    num_params: int,
    tokenizer: Tokenizer | None,
    *,
    weights: str,
    step: int | None,
    source: str | None,
    dtype: str,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write an export's tokenizer, ``config.json`` and card into ``tmp``, beside its
    weights file (already written: ``config.json`` records its checksum).

    Args:
        tmp: the folder being built.
        cfg: the :class:`~anyorder.config.ModelConfig` of the weights.
        num_params: parameters of the model (for the card).
        tokenizer: saved under ``tokenizer/`` when given; a byte tokenizer also as
            ``transformers``' ``tokenizer.json`` at the top (:mod:`anyorder.checkpoint.
            hf_tokenizer`).
        weights: the label of the weights (:data:`WEIGHT_LABELS`).
        step: training steps behind the weights.
        source: where the weights came from.
        dtype: the stored dtype's name.
        extra: more keys for ``config.json``.
    """
    if tokenizer is not None:
        tokenizer.save(tmp / TOKENIZER_DIR)
    if isinstance(tokenizer, ByteTokenizer):  # transformers' own files, at the top
        write_byte_tokenizer(tmp, tokenizer.eos_id, cfg.seq_len)
    config: dict[str, Any] = {
        "model_type": MODEL_TYPE,
        "architectures": ["AnyorderModel"],
        "anyorder_kind": cfg.kind,
        "anyorder_version": _version(),
        "anyorder_format": FORMAT_VERSION,
        **to_dict(cfg),
        "weights": weights,
        "step": step,
        "source": source,
        "tokenizer": tokenizer.name if tokenizer is not None else None,
        "torch_dtype": dtype,
        **dict(extra or {}),
        "weights_sha256": sha256_file(tmp / WEIGHTS_NAME),
    }
    (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    (tmp / CARD_NAME).write_text(_model_card(config, num_params, tokenizer))


def export(
    checkpoint: str | Path,
    folder: str | Path,
    *,
    weights: str = "ema",
    dtype: str | None = None,
    adapters_only: bool = False,
) -> Path:
    """Export a training checkpoint (or a run folder's latest) as an uploadable folder.

    A LoRA run's adapters are merged into its base (peft's ``merge_and_unload``): the folder
    holds a plain model of the base's architecture. ``adapters_only`` writes the adapters
    apart instead, in peft's layout (:func:`anyorder.checkpoint.adapters.export_adapters`).

    Args:
        checkpoint: a run folder or ``RUN/checkpoints/step_*``.
        folder: the export folder.
        weights: ``ema`` (the EMA weights, or the raw ones when the run kept no EMA) or
            ``raw``.
        dtype: store the weights in this dtype (see :func:`save_pretrained`).
        adapters_only: a LoRA run's adapters alone, not merged.

    Returns:
        The folder.

    Raises:
        CheckpointError: a missing or damaged checkpoint, or a bad target folder.
    """
    ckpt = resolve_checkpoint(checkpoint)
    if adapters_only:
        return _export_adapters(ckpt, Path(folder).expanduser(), weights, dtype)
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


def adapter_weights_label(ckpt: Path, weights: str) -> str:
    """Which adapters an adapters-only export of the checkpoint ``ckpt`` writes when
    ``weights`` is asked for: ``ema`` where the run kept EMA weights, else ``raw`` (its
    ``model.safetensors``, also for ``ema`` on a run without EMA), as a merged export
    labels them.

    Raises:
        ConfigError, CheckpointError: as :func:`~anyorder.checkpoint.load.weights_file`.
    """
    return "ema" if weights_file(ckpt, weights).name == EMA_FILE else "raw"


def _export_adapters(ckpt: Path, folder: Path, weights: str, dtype: str | None) -> Path:
    """``export(adapters_only=True)``: the checks, then the adapters in peft's layout.

    Raises:
        ConfigError: not a LoRA run, or a ``dtype`` (the adapters keep theirs).
    """
    from anyorder.checkpoint.adapters import export_adapters

    config = read_config(ckpt)
    if config.train.lora.r == 0:
        raise ConfigError(
            f"{ckpt} trained every weight (train.lora.r=0): there are no adapters to write "
            "apart; export it without --adapters-only"
        )
    if dtype is not None:
        raise ConfigError("--dtype applies to merged exports; leave it out with --adapters-only")
    with reading(ckpt):
        file = weights_file(ckpt, weights)
        verify(ckpt, [file.name])
        return export_adapters(ckpt, folder, file, config)
