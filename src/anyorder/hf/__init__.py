"""``transformers``' Auto classes for exported folders, with no remote code.

``import anyorder`` arranges for :func:`register_config` to run once ``transformers`` loads
its ``AutoConfig`` (at once when it already has), and that for :func:`register_models`
once an anyorder config is built, so that

::

    import anyorder
    from transformers import AutoModelForCausalLM, pipeline

    model = AutoModelForCausalLM.from_pretrained("my-export")  # an AnyorderModel
    pipe = pipeline("text-generation", model="my-export")  # a byte export: no tokenizer=

work without ``trust_remote_code``: the classes are this package's, never code from a model
folder. ``import anyorder`` itself imports neither ``transformers`` nor this package.

* :mod:`anyorder.hf.config`: :class:`AnyorderConfig` (``model_type: anyorder``);
* :mod:`anyorder.hf.model`: :class:`AnyorderModel` (forward, loss, loading, saving);
* :mod:`anyorder.hf.generation`: ``generate`` with anyorder's samplers.

Design choices:

* ``import anyorder`` registers the config class as soon as ``transformers``' small
  ``configuration_auto`` module is loaded (``AutoTokenizer`` loads it too). The model
  class needs ``transformers``' model code (``PreTrainedModel``, ``GenerationMixin``: 3x the
  import time of ``AutoTokenizer``), so it is registered when the first anyorder config is
  built, which every Auto path does before it looks a model class up: a tokenizer-only user
  of ``transformers`` never pays for it.
* Registering twice is harmless (``exist_ok``): the hook and an explicit call may both run.
"""

from __future__ import annotations

from anyorder.checkpoint.exported import MODEL_TYPE
from anyorder.hf import config as _config


def register_config() -> None:
    """Register :class:`~anyorder.hf.config.AnyorderConfig` with ``AutoConfig``."""
    from transformers.models.auto.configuration_auto import AutoConfig

    from anyorder.hf.config import AnyorderConfig

    AutoConfig.register(MODEL_TYPE, AnyorderConfig, exist_ok=True)


def register_models() -> None:
    """Register :class:`~anyorder.hf.model.AnyorderModel` with ``AutoModel`` and
    ``AutoModelForCausalLM`` (and the config with ``AutoConfig``)."""
    from transformers.models.auto.modeling_auto import AutoModel, AutoModelForCausalLM

    from anyorder.hf.config import AnyorderConfig
    from anyorder.hf.model import AnyorderModel

    register_config()
    AutoModel.register(AnyorderConfig, AnyorderModel, exist_ok=True)
    AutoModelForCausalLM.register(AnyorderConfig, AnyorderModel, exist_ok=True)


_config.ON_FIRST_CONFIG.append(register_models)
