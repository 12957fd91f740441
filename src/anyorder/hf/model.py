"""The ``transformers`` model class of an export: ``AutoModel`` / ``AutoModelForCausalLM``.

::

    import anyorder  # registers the classes with transformers' Auto classes
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained("my-export")    # no remote code
    out = model(input_ids, labels=input_ids)                     # .logits, .loss
    ids = model.generate(input_ids, max_new_tokens=32, do_sample=True, top_p=0.9)

Design choices:

* An export ships no Python: ``import anyorder`` registers these classes (see
  :mod:`anyorder.hf`), so ``transformers`` never runs code from a model folder and
  ``trust_remote_code`` is not needed. (Earlier exports carry ``auto_map`` and a
  ``modeling_anyorder.py``; once the classes are registered ``transformers`` prefers them and
  the file is never run, ``trust_remote_code=True`` or not.)
* :meth:`AnyorderModel.from_pretrained` reads the folder with anyorder's own loader
  (:func:`anyorder.interop.hub.load_any`: checksums, tied weights, the same model class), so
  the module is ``anyorder.load(folder).model`` and the logits agree bit for bit;
  :meth:`AnyorderModel.save_pretrained` writes with anyorder's writer, so a re-saved model
  loads in both. What either cannot honour (a device map that splits the model, a padded
  batch, beams...) is refused in one line, never ignored.
* The logits are anyorder's, slot-aligned: ``logits[:, t]`` predicts ``input_ids[:, t]``
  from the tokens before it (``transformers``' causal models predict ``t + 1``), so
  ``labels`` are not shifted: ``loss`` is the mean left-to-right NLL of the labelled tokens,
  the first one included, for every kind (mdm: its left-to-right conditionals, not its ELBO).
* ``generate`` is anyorder's sampler behind ``transformers``' call (:mod:`anyorder.hf.
  generation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from anyorder.checkpoint.exported import CONFIG_NAME, STORED_DTYPES, check_stored_dtype
from anyorder.errors import ConfigError
from anyorder.hf.config import AnyorderConfig
from anyorder.hf.generation import check_mask, generate

_DTYPES = {name: getattr(torch, name) for name in STORED_DTYPES}
_SPLIT_STRATEGIES = ("balanced", "balanced_low_0", "sequential")
# from_pretrained options that change nothing here whatever their value: transformers' own
# bookkeeping, and trust_remote_code (an export ships no code to trust: the classes are ours)
_HARMLESS_LOAD = {
    "_from_auto", "_from_pipeline", "_commit_hash", "trust_remote_code", "low_cpu_mem_usage",
    "use_safetensors", "name_or_path",
}  # fmt: skip
_HARMLESS_FORWARD = {"use_cache"}  # no cache is kept between calls either way


def _unused(kwargs: dict[str, Any], harmless: set[str], what: str) -> None:
    """Refuse the options in ``kwargs`` that are set and would change something we ignore."""
    set_ = sorted(
        k for k, v in kwargs.items() if k not in harmless and v is not None and v is not False
    )
    if set_:
        raise ConfigError(f"{what} does not take {', '.join(set_)} (an anyorder model ignores it)")


def load_device(device_map: Any, device: Any) -> torch.device:
    """The one device a model goes to from ``device_map`` (``"auto"``, a device, or a dict
    that maps every part to one device) or ``device``; default cpu.

    Raises:
        ConfigError: a map that splits the model, or something that is not a device.
    """
    spec = device if device_map is None else device_map
    if isinstance(spec, dict):
        places = {str(torch.device(v) if isinstance(v, int) else v) for v in spec.values()}
        if len(places) != 1:
            raise ConfigError(
                f"device_map puts parts of the model on {', '.join(sorted(places))}; an anyorder "
                "model runs on one device: pass device_map='auto' or one device"
            )
        spec = next(iter(spec.values()))
    if spec is None:
        return torch.device("cpu")
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec in _SPLIT_STRATEGIES:
        raise ConfigError(
            f"device_map={spec!r} splits the model over devices; an anyorder model runs on one: "
            "pass device_map='auto' or one device"
        )
    try:
        dev = torch.device(f"cuda:{spec}" if isinstance(spec, int) else spec)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"device_map={str(spec)[:40]!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device_map={str(spec)!r}: no CUDA device here; use 'cpu' or 'auto'")
    return dev


def load_dtype(dtype: Any, stored: str | None) -> torch.dtype:
    """The dtype a loaded model runs in: ``dtype`` (a torch dtype or its name), ``"auto"``
    (the dtype the export stores, ``stored``), or float32 when None (as ``anyorder.load``).

    Raises:
        ConfigError: another name or object.
    """
    if dtype is None:
        return torch.float32
    if dtype == "auto":
        return _DTYPES[stored or "float32"]
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ConfigError(
        f"dtype={str(dtype)[:40]!r} is not one an anyorder model runs in; use 'auto', "
        f"{', '.join(STORED_DTYPES)}"
    )


@dataclass
class AnyorderOutput(ModelOutput):
    """``loss`` (with ``labels``): the mean left-to-right NLL (nats) of the labelled tokens;
    ``logits`` (B, T, V), slot-aligned: slot ``t`` predicts the token at ``order[:, t]`` from
    the tokens at ``order[:, :t]`` (left to right: position ``t`` from ``0..t-1``)."""

    loss: Tensor | None = None
    logits: Tensor | None = None


class AnyorderModel(PreTrainedModel, GenerationMixin):
    """An anyorder model (gpt, aogpt, armd, mdm) as a ``transformers`` ``PreTrainedModel``:
    what ``AutoModel`` and ``AutoModelForCausalLM`` return for an export."""

    config_class = AnyorderConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(
        self,
        config: AnyorderConfig,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(config)
        if model is None:
            from anyorder.models import build_model

            model = build_model(config.to_model_config())
        self.model = model
        self.anyorder_tokenizer = tokenizer
        """anyorder's tokenizer of the export (None: it holds none), kept for
        :meth:`save_pretrained`."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """Load an export (folder or hub id) with anyorder's loader.

        ``device_map`` (``"auto"``: the GPU if there is one; a device; a dict that maps
        everything to one device) or ``device`` picks the device (default cpu); ``dtype``
        (or ``torch_dtype``): float32 (default), bfloat16, float16, or ``"auto"`` for the
        dtype the export stores. Any other option that would change something is refused.

        Raises:
            ConfigError: an option this loader cannot honour.
            CheckpointError: the folder is not a readable export.
        """
        from anyorder.interop.hub import load_any

        if args:
            raise ConfigError(f"{cls.__name__}.from_pretrained takes the folder only positionally")
        device = load_device(kwargs.pop("device_map", None), kwargs.pop("device", None))
        dtype = kwargs.pop("dtype", None)
        dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
        config = kwargs.pop("config", None)
        # with peft installed, transformers' Auto classes always pass adapter_kwargs (a
        # revision, a token); only an adapter it found is something we would ignore
        if "_adapter_model_path" in (kwargs.pop("adapter_kwargs", None) or {}):
            raise ConfigError(
                f"{cls.__name__}.from_pretrained does not load PEFT adapters; give the "
                "export folder itself"
            )
        _unused(kwargs, _HARMLESS_LOAD, f"{cls.__name__}.from_pretrained")
        loaded = load_any(str(pretrained_model_name_or_path), device=device)
        if not isinstance(config, AnyorderConfig):
            config = AnyorderConfig.from_pretrained(str(loaded.path))
        stored = _stored_dtype(loaded.path)
        model = loaded.model.to(load_dtype(dtype, stored))
        out = cls(config, model, loaded.tokenizer).eval()
        eos = getattr(loaded.tokenizer, "eos_id", None)
        if eos is not None and out.generation_config is not None:
            out.generation_config.eos_token_id = eos  # generate stops there, as anyorder's
        return out

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> AnyorderOutput | tuple:
        """Logits of ``input_ids`` (B, n) generated in ``order`` (B, T), T <= n (default left
        to right); ``blocks`` as :meth:`anyorder.models.base.AnyOrderLM.forward`.

        ``attention_mask`` must be all ones: rows are unpadded (padding would shift the
        positions the model reads). ``labels`` (B, n), in original positions, -100 for
        none, give ``loss``: the mean NLL of each labelled token given the tokens before it
        in the order (left to right by default), not shifted (the logits are slot-aligned).

        Raises:
            ConfigError: a padded mask, labels of another shape, an unsupported option.
        """
        _unused(kwargs, _HARMLESS_FORWARD, f"{type(self).__name__}.forward")
        check_mask(attention_mask, input_ids)
        vocab = self.model.cfg.vocab_size
        _check_ids(input_ids, vocab, "input_ids")
        logits = self.model(input_ids, order, blocks)
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ConfigError(
                    f"labels have shape {tuple(labels.shape)}, input_ids "
                    f"{tuple(input_ids.shape)}; give one label per token (-100 for none)"
                )
            _check_ids(labels[labels != -100], vocab, "labels")
            targets = labels if order is None else labels.gather(1, order)
            targets = targets[:, : logits.shape[1]]
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), targets.flatten().to(logits.device), ignore_index=-100
            )
        out = AnyorderOutput(loss=loss, logits=logits)
        return out.to_tuple() if return_dict is False else out

    def generate(self, input_ids: Tensor | None = None, generation_config: Any = None, **kwargs):
        """anyorder's sampler behind ``transformers``' ``generate``: see
        :func:`anyorder.hf.generation.generate`."""
        return generate(self, input_ids, generation_config, **kwargs)

    def save_pretrained(
        self,
        save_directory: str | Path,
        is_main_process: bool = True,
        state_dict: dict | None = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> None:
        """Write an export with anyorder's writer (tied weights once, the tokenizer, the
        checksum): it loads with ``anyorder.load`` and ``from_pretrained`` alike. The
        weights are written in the dtype the model runs in.

        Raises:
            ConfigError: ``state_dict`` or ``push_to_hub`` (upload the folder with
                ``anyorder.interop.hub.push_to_hub``), or another option that would change
                something.
            CheckpointError: the target exists and is something else than an export.
        """
        from anyorder.checkpoint.exporting import WEIGHT_LABELS, save_pretrained

        if push_to_hub:
            raise ConfigError(
                "save_pretrained(push_to_hub=True) is not supported; save, then upload with "
                "anyorder.interop.hub.push_to_hub(folder, repo_id)"
            )
        if state_dict is not None:
            raise ConfigError("save_pretrained writes the model's own weights; drop state_dict")
        harmless = {"safe_serialization", "max_shard_size", "variant", "token"}
        _unused(kwargs, harmless, "save_pretrained")
        if not is_main_process:
            return
        weights = getattr(self.config, "weights", None)
        step = getattr(self.config, "step", None)
        source = getattr(self.config, "source", None)
        save_pretrained(
            self.model,
            save_directory,
            self.anyorder_tokenizer,
            weights=weights if weights in WEIGHT_LABELS else "model",
            step=step if isinstance(step, int) and not isinstance(step, bool) else None,
            source=source if isinstance(source, str) else None,
        )


def _check_ids(ids: Tensor, vocab: int, name: str) -> None:
    """Token ids lie in ``0..vocab-1`` (an embedding lookup would fail with a raw error).

    Raises:
        ConfigError: an id outside.
    """
    if name == "input_ids" and ids.dim() != 2:
        raise ConfigError(f"input_ids must be (batch, length), not of shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex():
        raise ConfigError(f"{name} must be integer token ids, not {ids.dtype}")
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < vocab):
        raise ConfigError(f"{name} hold ids outside 0..{vocab - 1} (-100 marks an unscored label)")


def _stored_dtype(folder: Path) -> str | None:
    import json

    if not (folder / CONFIG_NAME).is_file():  # a training checkpoint: stored as trained
        return None
    value = json.loads((folder / CONFIG_NAME).read_text()).get("torch_dtype")
    check_stored_dtype(value, "torch_dtype", str(folder / CONFIG_NAME))
    return value
