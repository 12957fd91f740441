"""A LoRA run's checkpoints (``train.lora``): adapters that name their base.

Design choices:

* A LoRA checkpoint's ``model.safetensors`` (and ``ema.safetensors``) holds the adapters
  alone, under the keys peft gives them inside our model (``...qkv.lora_A.default.weight``).
  The base is not copied into every checkpoint: the manifest's ``base`` names the folder
  ``train.init_from`` resolved to and the :func:`~anyorder.checkpoint.weights.state_digest`
  of its weights, so a base changed since (re-exported, re-converted) is refused by name
  instead of silently giving another model.
* Loading (sampling, evaluation, export) reads the base, puts the adapters on it and merges
  them with peft (:func:`~anyorder.models.lora.merge_adapters`): what comes out is a plain
  model of the base's architecture, as fast as one trained in full.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from anyorder.checkpoint.layout import _first_line, read_manifest
from anyorder.checkpoint.weights import check_finite, state_digest
from anyorder.config import RunConfig
from anyorder.errors import CheckpointError


def read_adapters(model: nn.Module, path: str | Path) -> dict[str, Tensor]:
    """The adapter weights in ``path``, checked against ``model``'s adapters.

    Raises:
        CheckpointError: an unreadable file, other keys or shapes, or weights not finite.
    """
    from safetensors.torch import load_file

    from anyorder.models.lora import adapter_problem

    try:
        state = load_file(str(path))
    except Exception as e:  # removed by a prune, or not safetensors at all
        raise CheckpointError(
            f"adapters file {path} cannot be read ({type(e).__name__}: {_first_line(e)})"
        ) from None
    problem = adapter_problem(model, state)
    if problem:
        raise CheckpointError(
            f"the adapters in {path} do not fit the model and train.lora its config.yaml "
            f"describe ({problem}); the checkpoint was altered or written by another version"
        )
    check_finite(state, path, "the run diverged before this save: use an earlier checkpoint")
    return state


def base_of(ckpt: str | Path) -> dict[str, str]:
    """The manifest's ``base`` of a LoRA checkpoint: ``{"path", "sha256"}``.

    Raises:
        CheckpointError: the manifest names no base.
    """
    base = read_manifest(ckpt).get("base")
    if not isinstance(base, dict):
        raise CheckpointError(
            f"{ckpt} holds LoRA adapters but its manifest names no base; the checkpoint was "
            "altered or written by another version: use an earlier checkpoint"
        )
    return base


def check_base(ckpt: str | Path, base: Mapping[str, str] | None) -> None:
    """The base a run (or a load) has in hand is the one ``ckpt``'s adapters were trained on.

    Raises:
        CheckpointError: the weights differ (naming both folders and how to fix it).
    """
    if "base" not in read_manifest(ckpt):
        raise CheckpointError(
            f"{ckpt} was trained without adapters (train.lora.r=0); continue it with "
            f"train.lora.r=0, or train adapters on it in a new run (train.init_from={ckpt})"
        )
    want = base_of(ckpt)
    have = dict(base or {})
    if have.get("sha256") != want["sha256"]:
        raise CheckpointError(
            f"the adapters in {ckpt} were trained on the base {want['path']} "
            f"(weights sha256 {want['sha256'][:12]}), but {have.get('path')} now holds other "
            f"weights (sha256 {str(have.get('sha256'))[:12]}); restore that base, or start "
            "a new run on this one"
        )


def adapted_model(
    base: nn.Module, base_path: str, config: RunConfig, ckpt: Path, file: Path
) -> Any:
    """``base`` with the adapters of ``ckpt`` (its weights file ``file``) merged in.

    Raises:
        CheckpointError: another base than the adapters were trained on, or adapters that do
            not fit.
    """
    from anyorder.models.lora import add_adapters, load_adapters, merge_adapters

    check_base(ckpt, {"path": base_path, "sha256": state_digest(base)})
    tuner = add_adapters(base, config.train.lora)
    load_adapters(base, read_adapters(base, file))
    return merge_adapters(tuner)


ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's file names: what ``PeftConfig.from_pretrained`` and peft's loaders read."""
ADAPTER_CONFIG = "adapter_config.json"


def export_adapters(ckpt: Path, folder: Path, file: Path, config: RunConfig) -> Path:
    """Write a LoRA checkpoint's adapters apart, in peft's layout: ``adapter_config.json``
    (peft's ``LoraConfig``, its ``base_model_name_or_path`` the base's folder) and
    ``adapter_model.safetensors`` (peft's names for the adapters inside our model, as
    ``get_peft_model_state_dict`` gives them).

    Raises:
        CheckpointError: the target exists and holds something else, or the adapters do not
            fit.
    """
    import torch
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    from anyorder.atomic import atomic_folder, short_path
    from anyorder.models import build_model
    from anyorder.models.lora import add_adapters, peft_adapter_config

    if folder.exists() and not (folder.is_dir() and _empty_or_adapters(folder)):
        raise CheckpointError(
            f"export target {short_path(folder)} exists and is not an adapters folder; "
            "choose a new folder or delete it"
        )
    with torch.device("meta"):  # the names and shapes alone: no memory for the base
        model = build_model(config.model, init=False)
    add_adapters(model, config.train.lora)
    state = read_adapters(model, file)
    tensors = get_peft_model_state_dict(model, state_dict=state)
    peft_config = peft_adapter_config(config.train.lora, base_of(ckpt)["path"])
    with atomic_folder(folder, "another --out folder") as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS))
        peft_config.save_pretrained(str(tmp))
    return folder


def _empty_or_adapters(folder: Path) -> bool:
    return not any(folder.iterdir()) or (folder / ADAPTER_CONFIG).is_file()
