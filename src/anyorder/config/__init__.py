"""Configuration: dataclasses, named presets, YAML files and dotted overrides.

Design choices:

* Layered and strict: dataclass defaults <- YAML file <- ``key=value`` overrides. An
  unknown key or a value of the wrong type is a :class:`ConfigError` that names the key.
* Help text comes from the fields' docstrings (the string literal under each field), read
  from the source with :mod:`ast`, so the documentation lives next to the default.
* A config file may start from a preset (``model: {preset: tiny}``) and override fields.

Modules: :mod:`~anyorder.config.model` (:class:`ModelConfig`, presets, variants),
:mod:`~anyorder.config.run` (the data, order and train sections, :class:`RunConfig`),
:mod:`~anyorder.config.loading` (YAML, overrides, strict building, help text).
"""

from anyorder.config.loading import (  # noqa: F401 (_build: hub, convert_ref)
    _build,
    config_from_dict,
    describe,
    field_docs,
    load_config,
    parse_override,
    preset,
)
from anyorder.config.model import (
    MODEL_KINDS,
    PRESETS,
    VARIANTS,
    ModelConfig,
    expand_model_values,
    method_name,
)
from anyorder.config.run import (
    DataConfig,
    LoraConfig,
    OrderConfig,
    RunConfig,
    TrainConfig,
    to_dict,
)

__all__ = [
    "MODEL_KINDS",
    "PRESETS",
    "VARIANTS",
    "DataConfig",
    "ModelConfig",
    "LoraConfig",
    "OrderConfig",
    "RunConfig",
    "TrainConfig",
    "config_from_dict",
    "describe",
    "expand_model_values",
    "method_name",
    "field_docs",
    "load_config",
    "parse_override",
    "preset",
    "to_dict",
]
