"""The ``transformers`` config class of an export (``model_type: anyorder``).

Kept apart from :mod:`anyorder.hf.model` because it needs only ``transformers``'
configuration module: ``AutoConfig`` gets it as soon as that module is loaded, without the
cost of ``transformers``' model code, which the model classes load only once the first
anyorder config is built (:data:`ON_FIRST_CONFIG`, :mod:`anyorder.hf`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from transformers import PretrainedConfig

from anyorder.checkpoint.exported import MODEL_TYPE, STORED_DTYPES
from anyorder.config import ModelConfig
from anyorder.errors import ConfigError

__all__ = ["STORED_DTYPES", "AnyorderConfig"]

ON_FIRST_CONFIG: list = []
"""Called (and dropped) when the first :class:`AnyorderConfig` is built: :mod:`anyorder.hf`
puts the model classes' registration here, so that they, and ``transformers``' model code
they import, load only once an anyorder config is read (a list, not an import of
:mod:`anyorder.hf.model`, which imports this module)."""


class AnyorderConfig(PretrainedConfig):
    """The ``config.json`` of an export: the model section's fields and the export's keys.

    ``torch_dtype`` (or ``dtype``), the dtype the weights are stored in, must name one of
    :data:`~anyorder.checkpoint.exported.STORED_DTYPES`: ``transformers`` would look any
    other name up as an attribute of ``torch`` (an ``AttributeError``, or a module).
    """

    model_type = MODEL_TYPE

    def __init__(self, **kwargs: Any) -> None:
        for key in ("torch_dtype", "dtype"):
            _check_dtype(kwargs.get(key), key)
        super().__init__(**kwargs)
        while ON_FIRST_CONFIG:
            ON_FIRST_CONFIG.pop()()

    def to_model_config(self) -> ModelConfig:
        """The :class:`~anyorder.config.ModelConfig` these fields describe."""
        from anyorder.checkpoint.exported import model_config_of

        names = {f.name for f in dataclasses.fields(ModelConfig)}
        return model_config_of({k: v for k, v in self.to_dict().items() if k in names})


def _check_dtype(value: Any, key: str) -> None:
    """``value`` is None, a stored dtype or its name. The config's fields and the options
    of ``from_pretrained`` arrive here mixed (``transformers`` merges them), so the message
    names both.

    Raises:
        ConfigError: anything else.
    """
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if value is not None and value not in STORED_DTYPES:
        raise ConfigError(
            f"{key}={json.dumps(value, default=str)[:40]} is not a dtype of anyorder weights "
            f"({', '.join(STORED_DTYPES)}): fix {key} in config.json, or the dtype given to "
            "from_pretrained"
        )
