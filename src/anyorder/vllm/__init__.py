"""Serving anyorder exports with vLLM: the plugin (``vllm.general_plugins``: :func:`register`).

With anyorder installed beside vLLM, ``vllm serve EXPORT`` and ``vllm.LLM(EXPORT)`` load gpt
and aogpt exports (and the Llama/Qwen models converted into them) with anyorder's own
modules, no code from the folder and no ``trust_remote_code``; a request may ask for any
order (:mod:`anyorder.vllm.requests`). docs/serve.md says how.

* :mod:`anyorder.vllm.requests`: the per-request order fields, checked (no vLLM import);
* :mod:`anyorder.vllm.engine`: the export's config for vLLM, the engine hook, admission;
* :mod:`anyorder.vllm.tables`: the worker's per-row order tables (a logits processor);
* :mod:`anyorder.vllm.model`: the model, anyorder's trunk over vLLM's paged attention.
"""

from __future__ import annotations

from anyorder.vllm.requests import ORDER_KEY, SEED_KEY, place, seeded_order

__all__ = ["ORDER_KEY", "SEED_KEY", "place", "register", "seeded_order"]

ARCHITECTURE = "AnyorderModel"  # the ``architectures`` entry of every export's config.json


def register() -> None:
    """vLLM's general-plugin entry point: run in every vLLM process, any number of times.

    Registers the export's config class with vLLM's config registry (and ``AutoConfig``),
    the model class (lazily, by name) and the architecture's config hook, and wraps the
    engines' request intake with anyorder's admission (:mod:`anyorder.vllm.engine`).
    """
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    from anyorder.checkpoint.exported import MODEL_TYPE
    from anyorder.vllm.engine import EngineHook, VllmAnyorderConfig, install_admission

    _CONFIG_REGISTRY[MODEL_TYPE] = VllmAnyorderConfig
    MODELS_CONFIG_MAP[ARCHITECTURE] = EngineHook  # type: ignore[assignment]
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "anyorder.vllm.model:AnyorderForVLLM")
    install_admission()
