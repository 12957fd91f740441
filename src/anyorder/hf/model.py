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

from anyorder.checkpoint.exported import CONFIG_NAME, check_stored_dtype, is_exported
from anyorder.errors import ConfigError
from anyorder.hf.config import AnyorderConfig
from anyorder.hf.generation import check_mask, generate
from anyorder.hf.loading import (
    HARMLESS,
    HUB_OPTIONS,
    load_device,
    load_dtype,
    load_folder,
    unused,
)

_HARMLESS_FORWARD = {"use_cache"}  # no cache is kept between calls either way


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
        dtype the export stores. ``subfolder``, and for a hub id ``revision``, ``cache_dir``
        and ``local_files_only``, are honoured (:mod:`anyorder.hf.loading`). Options at their
        defaults are accepted (``transformers``' loaders pass them all); any other option that
        would change something is refused.

        Raises:
            ConfigError: an option this loader cannot honour.
            CheckpointError: the folder is not a readable export.
        """
        from anyorder.interop.hub import load_any

        if args:
            raise ConfigError(f"{cls.__name__}.from_pretrained takes the folder only positionally")
        device = load_device(kwargs.pop("device_map", None), kwargs.pop("device", None))
        dtype = _one_dtype(kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None))
        config = kwargs.pop("config", None)
        # with peft installed, transformers' Auto classes always pass adapter_kwargs (a
        # revision, a token); only an adapter it found is something we would ignore
        if "_adapter_model_path" in (kwargs.pop("adapter_kwargs", None) or {}):
            raise ConfigError(
                f"{cls.__name__}.from_pretrained does not load PEFT adapters; give the "
                "export folder itself"
            )
        load_dtype(dtype, None)  # a bad dtype is refused before anything is read
        hub = {k: kwargs.pop(k) for k in HUB_OPTIONS if k in kwargs}
        unused(kwargs, HARMLESS, f"{cls.__name__}.from_pretrained")
        folder = load_folder(pretrained_model_name_or_path, hub)
        loaded = load_any(folder, device=device)
        config = _config_of(config, loaded)
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
        unused(kwargs, _HARMLESS_FORWARD, f"{type(self).__name__}.forward")
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
        unused(kwargs, harmless, "save_pretrained")
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


def _one_dtype(dtype: Any, torch_dtype: Any) -> Any:
    """``dtype``, or ``torch_dtype`` (its older name) when it is None.

    Raises:
        ConfigError: both, naming different dtypes.
    """
    same = str(dtype).removeprefix("torch.") == str(torch_dtype).removeprefix("torch.")
    if dtype is None or torch_dtype is None or same:
        return torch_dtype if dtype is None else dtype
    raise ConfigError(
        f"dtype={str(dtype)!r} and torch_dtype={str(torch_dtype)!r} differ; give one (dtype)"
    )


def _config_of(config: Any, loaded: Any) -> AnyorderConfig:
    """The config of a loaded model: ``config`` as given (an :class:`AnyorderConfig`, or a
    folder or file to read one from), else the export's own (a training checkpoint's: its
    model's). Its model fields must be the weights' (``from_pretrained(folder,
    n_layer=...)`` lands in the config; ``dropout`` too: the model is built with the
    weights' own).

    Raises:
        ConfigError: another kind of config, or one that contradicts the weights.
    """
    from anyorder.config import to_dict

    if config is None and is_exported(loaded.path):
        config = loaded.path
    elif config is None:  # a training checkpoint: its config.json is the run's, nested
        config = AnyorderConfig(**to_dict(loaded.model.cfg))
    if isinstance(config, (str, Path)):
        config = AnyorderConfig.from_pretrained(str(config))
    if not isinstance(config, AnyorderConfig):
        raise ConfigError(
            f"config is a {type(config).__name__}, not an AnyorderConfig; leave config out "
            "(the export's config.json is read)"
        )
    ours, cfg = config.to_model_config(), loaded.model.cfg
    theirs = to_dict(cfg)
    diff = [k for k, v in to_dict(ours).items() if v != theirs[k]]
    if diff:
        shown = ", ".join(f"{k}={getattr(ours, k)!r}" for k in diff[:3])
        raise ConfigError(
            f"the config sets {shown}, but the weights in {str(loaded.path)!r} have "
            f"{', '.join(f'{k}={getattr(cfg, k)!r}' for k in diff[:3])}; the model is "
            "built as its weights were saved: drop these options"
        )
    return config


def _stored_dtype(folder: Path) -> str | None:
    import json

    if not (folder / CONFIG_NAME).is_file():  # a training checkpoint: stored as trained
        return None
    value = json.loads((folder / CONFIG_NAME).read_text()).get("torch_dtype")
    check_stored_dtype(value, "torch_dtype", str(folder / CONFIG_NAME))
    return value
