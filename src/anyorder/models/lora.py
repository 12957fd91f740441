"""LoRA adapters on any of the four models, through peft (``train.lora``).

Design choices:

* peft does the adapters: its ``LoraModel`` replaces the targeted ``nn.Linear`` layers of
  our model in place with its LoRA layers, freezes everything else, and merges the adapters
  back (``merge_and_unload``). Nothing here computes an adapter. The model keeps its class
  and methods (loss, decode, the caches), so training, validation and sampling run as they
  do without adapters.
* ``train.lora.targets`` names our layers (:data:`TARGETS`), not module paths; each maps to
  the suffixes of the module names peft matches. A name that matches no layer of the model
  (``adaln`` on a gpt) is an error, never an adapter-less run.
* The paths that read a layer's weight without calling it see the adapters through
  :func:`anyorder.layers.linear.weight_and_bias`.
* A run's adapters are the parameters that train (:func:`adapter_keys`); checkpoints hold
  them alone (:mod:`anyorder.checkpoint.adapters` puts them back on their base).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from anyorder.config import RunConfig
from anyorder.config.run import LoraConfig
from anyorder.errors import ConfigError, preview

TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("attn.qkv",),
    "attn_out": ("attn.proj",),
    "attn": ("attn.qkv", "attn.proj"),
    "mlp_in": ("mlp.fc",),
    "mlp_out": ("mlp.proj",),
    "mlp": ("mlp.fc", "mlp.proj"),
    "adaln": ("ada.linear", "final_ada.linear"),
    "query_mlp": ("query_mlp.0", "query_mlp.2"),
}
"""``train.lora.targets`` names -> suffixes of the module names they adapt."""


def lora_on(cfg: RunConfig) -> bool:
    """Whether the run trains LoRA adapters (``train.lora.r > 0``)."""
    return cfg.train.lora.r > 0


def check_lora(cfg: RunConfig) -> None:
    """The ``train.lora`` settings, checked before anything is read or written.

    Raises:
        ConfigError: a bad rank, scale, dropout or target, or adapters without a base.
    """
    lo = cfg.train.lora
    if lo.r < 0:
        raise ConfigError(f"train.lora.r={lo.r} must be >= 0 (0: no adapters), e.g. 8")
    if not lora_on(cfg):
        return
    if not 0.0 < lo.alpha < math.inf:
        raise ConfigError(f"train.lora.alpha={lo.alpha} must be a positive number, e.g. 16")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"train.lora.dropout={lo.dropout} must be in [0, 1), e.g. 0.05")
    if not lo.targets:
        raise ConfigError(f"train.lora.targets is empty; name some of {', '.join(TARGETS)}")
    for name in lo.targets:
        if name not in TARGETS:
            raise ConfigError(
                f"train.lora.targets: {preview(name)} is not a layer name; use some of "
                f"{', '.join(TARGETS)}"
            )
    if not cfg.train.init_from:
        raise ConfigError(
            f"train.lora.r={lo.r} trains adapters on pretrained weights, and the run names "
            "none; set train.init_from to an exported folder, a hub id or a run folder"
        )


def _suffixes(lora: LoraConfig) -> list[str]:
    return sorted({s for name in lora.targets for s in TARGETS[name]})


def _matches(module_name: str, suffix: str) -> bool:
    return module_name == suffix or module_name.endswith("." + suffix)


def check_targets(model: nn.Module, lora: LoraConfig) -> None:
    """Every target name adapts at least one linear layer of ``model``.

    Raises:
        ConfigError: a name that matches none (e.g. ``adaln`` on a gpt).
    """
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in lora.targets:
        if not any(_matches(n, s) for n in linears for s in TARGETS[name]):
            raise ConfigError(
                f"train.lora.targets: {name} matches no layer of a {model.cfg.kind} model; "
                "drop it from the list"
            )


def add_adapters(model: nn.Module, lora: LoraConfig) -> Any:
    """Put peft's LoRA layers into ``model`` in place and freeze everything else.

    Returns:
        peft's ``LoraModel`` over ``model``: keep it to merge the adapters
        (:func:`merge_adapters`); ``model`` itself is what the caller goes on using.

    Raises:
        ConfigError: peft is not installed, or a target matches no layer.
    """
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft.tuners.lora import LoraModel
    except ImportError:
        raise ConfigError(
            "train.lora needs the peft package: pip install 'anyorder[hf]' (or pip install peft)"
        ) from None
    check_targets(model, lora)
    config = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=_suffixes(lora),
        bias="none",
    )
    return LoraModel(model, config, "default")


def adapter_keys(model: nn.Module) -> frozenset[str]:
    """The state-dict keys of the adapters: the parameters that train."""
    return frozenset(n for n, p in model.named_parameters() if p.requires_grad)


def adapter_problem(model: nn.Module, state: Mapping[str, Tensor]) -> str:
    """How ``state`` fails to be exactly ``model``'s adapters ("" when it is)."""
    want = {k: v.shape for k, v in model.state_dict().items() if k in adapter_keys(model)}
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    wrong = sorted(k for k in set(want) & set(state) if want[k] != state[k].shape)
    return "; ".join(
        f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
        if names
    )


def load_adapters(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Load adapter weights (checked by :func:`adapter_problem` first) into ``model``."""
    full = dict(model.state_dict())
    full.update(state)
    model.load_state_dict(full, strict=True)


def merge_adapters(tuner: Any) -> nn.Module:
    """The plain model with the adapters merged into its weights (peft's
    ``merge_and_unload``): the architecture of the base, no peft layer left."""
    return tuner.merge_and_unload()


def peft_adapter_config(lora: LoraConfig, base: str | None) -> Any:
    """peft's ``LoraConfig`` of these adapters, for an adapters-only export."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=_suffixes(lora),
        bias="none",
        base_model_name_or_path=base,
    )
