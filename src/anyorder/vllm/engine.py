"""What the engine learns of an anyorder export before it serves: its config, its limits,
and the admission of each request.

* :class:`VllmAnyorderConfig`: the export's ``config.json`` with the names vLLM reads
  (``hidden_size``, ``num_attention_heads``...), as read-only views of anyorder's fields.
* :class:`EngineHook`: vLLM's per-architecture config hook (``verify_and_update_config``):
  refuses what cannot be served exactly (armd, mdm, the V2 model runner, speculative
  decoding, sharded layers, quantization, prompt embeddings) in one line, counts the BOS slot
  in ``max_model_len``, adds the worker's order tables (:mod:`anyorder.vllm.tables`) and
  runs the model without CUDA graphs.
* :func:`admit`: every request, before the engine takes it: the BOS slot put in front of the
  prompt (a converted model's tokenizer puts its BOS there already: that one is the slot),
  the order fields checked against the prompt (vLLM's 400, naming the field), and a
  prefix-cache salt per order. vLLM has no per-model hook that sees a request's prompt and
  its parameters together before admission, so :func:`install_admission` (run by the
  plugin in every vLLM process) wraps the engine's ``InputProcessor.process_inputs``, and
  :func:`admit` runs for the engines whose config is an anyorder export's only: several
  engines in one process, anyorder's and others', each get their own rules.
"""

from __future__ import annotations

from typing import Any

from anyorder.checkpoint.exported import MODEL_TYPE
from anyorder.hf.config import AnyorderConfig
from anyorder.vllm.requests import (
    ADMITTED_KEY,
    RequestError,
    cache_salt,
    resolve_order,
)

SERVED_KINDS = ("gpt", "aogpt")
TABLES = "anyorder.vllm.tables:OrderTables"
BOS_ID = 0
"""The token id the BOS slot holds in the engine when the export names no ``bos_token_id``:
any id in the vocabulary would do, the model reads slot 0 as its learned BOS whatever the
id."""


class VllmAnyorderConfig(AnyorderConfig):
    """:class:`~anyorder.hf.config.AnyorderConfig` with the attribute names vLLM reads
    (``head_dim`` is one of anyorder's fields already)."""

    def _model(self):
        return self.to_model_config()

    @property
    def hidden_size(self) -> int:
        return self._model().d_model

    @property
    def num_attention_heads(self) -> int:
        return self._model().n_head

    @property
    def num_key_value_heads(self) -> int:
        return self._model().kv_heads

    @property
    def num_hidden_layers(self) -> int:
        return self._model().n_layer


def refusal(vllm_config: Any) -> str | None:
    """Why this engine cannot serve the export exactly, or None."""
    kind = vllm_config.model_config.hf_config.kind
    if kind == "armd":
        return (
            "armd cannot be served by vLLM: its query stream reads the content stream's keys "
            "and values with a second set of activations per slot, and vLLM's paged attention "
            "keeps one stream per layer; serve it with `anyorder serve`, or serve a gpt or "
            "aogpt export"
        )
    if kind not in SERVED_KINDS:
        return (
            f"{kind} cannot be served by vLLM: the engine's KV cache is causal and {kind} is "
            "not; serve gpt or aogpt exports (or use `anyorder serve`)"
        )
    if vllm_config.use_v2_model_runner:
        return (
            "anyorder models run on vLLM's V1 model runner (their order tables are a V1 "
            "logits processor): set VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if vllm_config.speculative_config is not None:
        return "anyorder models take no speculative config in vLLM yet: drop it"
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        return (
            "anyorder models run whole on one device per engine in vLLM (their layers are "
            "not sharded): drop --tensor-parallel-size/--pipeline-parallel-size (data "
            "parallelism, one whole copy per engine, works)"
        )
    model_config = vllm_config.model_config
    if model_config.quantization is not None:
        return (
            f"anyorder models take no quantization in vLLM ({model_config.quantization}): drop it"
        )
    if model_config.enable_prompt_embeds:
        return "anyorder models take token prompts, not embeddings: drop --enable-prompt-embeds"
    return None


class EngineHook:
    """vLLM's config hook for the ``AnyorderModel`` architecture (``MODELS_CONFIG_MAP``)."""

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        return None

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        why = refusal(vllm_config)
        if why:
            raise ValueError(why)
        model_config = vllm_config.model_config
        seq_len = model_config.hf_config.seq_len
        # the BOS slot and seq_len tokens (the last one sampled only); vLLM derived seq_len
        if model_config.max_model_len == seq_len:
            model_config.max_model_len = seq_len + 1
        elif model_config.max_model_len > seq_len + 1:
            raise ValueError(
                f"max_model_len {model_config.max_model_len} is over what the model holds "
                f"({seq_len} positions and the BOS slot: {seq_len + 1}); pass "
                f"--max-model-len {seq_len + 1} or less"
            )
        processors = list(model_config.logits_processors or [])
        if TABLES not in processors:
            model_config.logits_processors = [*processors, TABLES]
        _eager(vllm_config)


def _eager(vllm_config: Any) -> None:
    """No CUDA graphs: the model reads the order tables by the batch's rows, which a captured
    graph would bake in (not measured on a GPU: exactness first)."""
    from vllm.config.compilation import CUDAGraphMode

    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE


def install_admission() -> None:
    """Wrap vLLM's ``InputProcessor.process_inputs`` with :func:`admit` for the engines that
    serve an anyorder export (each engine's own config decides; once per process)."""
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor.process_inputs
    if getattr(original, "_anyorder", False):
        return

    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *a, **kw):
        config = self.vllm_config
        if getattr(config.model_config.hf_config, "model_type", None) == MODEL_TYPE:
            admit(prompt, params, config)
        return original(self, request_id, prompt, params, *a, **kw)

    process_inputs._anyorder = True  # type: ignore[attr-defined]
    InputProcessor.process_inputs = process_inputs  # type: ignore[method-assign]


def admit(processed_inputs: Any, params: Any, vllm_config: Any) -> None:
    """One request, before the engine takes it (see the module's text).

    Raises:
        VLLMValidationError: the order fields cannot be served (vLLM answers 400).
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    if not isinstance(params, SamplingParams):
        return
    if not isinstance(processed_inputs, dict) or "prompt_token_ids" not in processed_inputs:
        raise VLLMValidationError(
            "anyorder models take token prompts, or text their tokenizer renders (vLLM's "
            "LLM.generate and its server do): pass TokensPrompt(prompt_token_ids=...)"
        )
    ids = list(processed_inputs["prompt_token_ids"])
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    bos = getattr(hf, "bos_token_id", None)  # a converted model's: its tokenizer adds it
    bos = bos if isinstance(bos, int) and not isinstance(bos, bool) else None
    if bos is not None and ids[:1] == [bos]:
        ids = ids[1:]  # the tokenizer's BOS is the BOS slot (anyorder never encodes one)
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = model_config.max_model_len - 1 - len(ids)
    try:
        order = resolve_order(
            params.extra_args,
            prompt_len=len(ids),
            max_tokens=max_tokens,
            seq_len=hf.seq_len,
            kind=hf.kind,
            ignore_eos=params.ignore_eos,
            stops=bool(params.stop or params.stop_token_ids),
        )
    except RequestError as e:
        raise VLLMValidationError(str(e), parameter=e.parameter) from None
    processed_inputs["prompt_token_ids"] = [BOS_ID if bos is None else bos, *ids]
    if order is not None:  # a user's salt kept, ours beside it
        salt = processed_inputs.get("cache_salt")
        processed_inputs["cache_salt"] = cache_salt(order) + (f"|{salt}" if salt else "")
    params.extra_args = {**(params.extra_args or {}), ADMITTED_KEY: True}
