"""``transformers`` classes for exported folders: ``AutoModel.from_pretrained(folder,
trust_remote_code=True)`` returns an :class:`AnyorderModel`.

::

    from transformers import AutoModel

    model = AutoModel.from_pretrained("my-export", trust_remote_code=True)
    logits = model(input_ids).logits                       # left to right
    logits = model(input_ids, order=order).logits          # any order (B, n) permutation

Design choices:

* Every export carries ``modeling_anyorder.py``, three lines that import these classes, and
  an ``auto_map`` in ``config.json`` naming them: the model code stays in the anyorder
  package (no copy to drift), and a machine without it gets ``transformers``' own message
  that the folder needs the package ``anyorder``.
* :meth:`AnyorderModel.from_pretrained` reads the folder with anyorder's own loader
  (:func:`anyorder.interop.hub.load_any`: checksums, tied weights, the same model class), so
  the module is exactly ``anyorder.load(folder).model`` and the logits agree bit for bit.
* Importing this module also registers the classes with ``AutoConfig``/``AutoModel`` under
  ``model_type: anyorder``, so no remote code is needed once it is imported. ``import
  anyorder`` never imports it (nor ``transformers``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from anyorder.checkpoint.exported import MODEL_TYPE, model_config_of
from anyorder.config import ModelConfig


class AnyorderConfig(PretrainedConfig):
    """The ``config.json`` of an export: the model section's fields and the export's keys."""

    model_type = MODEL_TYPE

    def to_model_config(self) -> ModelConfig:
        """The :class:`~anyorder.config.ModelConfig` these fields describe."""
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        return model_config_of({k: v for k, v in self.to_dict().items() if k in names})


@dataclass
class AnyorderOutput(ModelOutput):
    """``logits`` (B, T, V), slot-aligned: slot ``t`` predicts the token at ``order[:, t]``
    from the tokens at ``order[:, :t]`` (left to right: position ``t`` from ``0..t-1``)."""

    logits: Tensor | None = None


class AnyorderModel(PreTrainedModel):
    """An anyorder model (gpt, aogpt, armd, mdm) as a ``transformers`` ``PreTrainedModel``."""

    config_class = AnyorderConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: AnyorderConfig, model: torch.nn.Module | None = None) -> None:
        super().__init__(config)
        if model is None:
            from anyorder.models import build_model

            model = build_model(config.to_model_config())
        self.model = model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any):
        """Load an export (folder or hub id) with anyorder's loader; ``device_map`` or
        ``device`` picks the device (default cpu). Other ``transformers`` options are not
        used."""
        from anyorder.interop.hub import load_any

        device = kwargs.pop("device", None) or kwargs.pop("device_map", None) or "cpu"
        loaded = load_any(str(pretrained_model_name_or_path), device=torch.device(device))
        config = kwargs.get("config")
        if not isinstance(config, AnyorderConfig):
            config = AnyorderConfig.from_pretrained(str(loaded.path))
        return cls(config, loaded.model).eval()

    def forward(
        self,
        input_ids: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        **kwargs: Any,
    ) -> AnyorderOutput:
        """Logits of ``input_ids`` (B, n) generated in ``order`` (B, T), T <= n (default
        left to right); ``blocks`` as :meth:`anyorder.models.base.AnyOrderLM.forward`."""
        return AnyorderOutput(logits=self.model(input_ids, order, blocks))


def _register() -> None:
    try:
        AutoConfig.register(MODEL_TYPE, AnyorderConfig)
        AutoModel.register(AnyorderConfig, AnyorderModel)
    except ValueError:  # registered already (the module imported twice under two names)
        pass


_register()
