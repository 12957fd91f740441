"""Modern left-to-right families as tables: Llama, Qwen2, Qwen3, Mistral -> our trunk.

A family is one :class:`Family`: where each of our weights comes from in the source's
state dict (one name, or several joined along the rows), and which trunk options its
config turns on. :func:`anyorder.interop.streaming.convert_family` copies the tensors
through the table; nothing here reads weights.

Design choices:

* One weight-name map per family, the decoder layer's names given once per layer
  (litgpt's ``convert_hf_checkpoint`` and torchtitan's state-dict adapters keep per-family
  conversion flat the same way). A new family is a new :class:`Family` entry.
* Our attention holds ``[q | k | v]`` in one linear (``qkv``) and the SwiGLU MLP
  ``[gate | up]`` in one (``fc``); the sources keep them apart, so those are joined along the
  output rows. Heads are laid out the same way (head ``h`` is rows ``h*D..(h+1)*D``), query
  head ``h`` reads key/value head ``h // (n_head / n_kv_head)`` in both, and both rotate
  the half-split layout, so no row is permuted.
* The config is read from ``config.json`` itself, as ``transformers`` reads it: RoPE from
  ``rope_scaling`` or ``rope_parameters`` by its precedence (:func:`rope_parameters`), a
  sliding window where its layers slide (``Family.window``), the defaults its config
  classes fill in. Every feature our trunk does not compute, and every value of the wrong
  kind, is refused by name before anything is written (:func:`refusals`): a wrong
  conversion that loads is worse than none.
* The export's EOS is the id the source's ``generate`` stops a chat at
  (:func:`source_eos_ids`, :func:`ending_at`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from anyorder.config import ModelConfig
from anyorder.errors import CheckpointError, ConfigError

DEFAULT_MAX_SEQ = 4096
"""Longest default context: a model trained at 128K positions converts at 4096 unless
``--seq-len`` asks for more (AO-GPT keeps a table row per target position)."""

_ATTN = {
    "norm1.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "norm2.weight": ("post_attention_layernorm.weight",),
    "mlp.fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.proj.weight": ("mlp.down_proj.weight",),
}
_QKV_BIAS = {
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
}
_QK_NORM = {
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
}
_TOP = {
    "tok_emb.weight": ("model.embed_tokens.weight",),
    "norm_f.weight": ("model.norm.weight",),
    "head.weight": ("lm_head.weight",),
}


@dataclass(frozen=True)
class Family:
    """One source family: its weight names and the trunk options it implies."""

    name: str
    layer: dict[str, tuple[str, ...]]
    """Our block's weights (under ``blocks.{i}.``) from the source layer's (under
    ``model.layers.{i}.``); several names are joined along the rows."""
    qkv_bias: bool = False
    """q/k/v biases without an output bias (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys, before RoPE (Qwen3)."""
    top: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(_TOP))
    max_positions: int = 2048
    """``max_position_embeddings`` when config.json has none (the config class's default)."""
    window: Callable[[dict[str, Any]], int | None] = lambda config: None
    """The shortest attention window any layer uses, as ``transformers`` reads the config
    (None: every layer attends to the whole prefix)."""


def _mistral_window(config: dict[str, Any]) -> int | None:
    """Mistral: every layer slides by ``sliding_window``; ``MistralConfig`` fills in 4096
    when config.json has no such key (null: full attention)."""
    return whole_number(config, "sliding_window", 4096, none=True)


def _qwen_window(config: dict[str, Any]) -> int | None:
    """Qwen2/Qwen3: ``sliding_window`` counts only with ``use_sliding_window``, and only in
    the layers ``layer_types`` marks ``sliding_attention`` (when config.json gives none:
    layers ``max_window_layers`` and up, as ``Qwen2Config`` fills them in)."""
    on = bool(config.get("use_sliding_window", False))
    window = whole_number(config, "sliding_window", 4096, none=True) if on else None
    types = config.get("layer_types")
    if types is None:
        n_layer = whole_number(config, "num_hidden_layers")
        first = whole_number(config, "max_window_layers", 28, least=0)
        slides = [window is not None and i >= first for i in range(n_layer)]
        types = ["sliding_attention" if s else "full_attention" for s in slides]
    elif not isinstance(types, list):
        raise CheckpointError(f"config.json's layer_types is {types!r}, not a list of layer types")
    if "sliding_attention" not in types:
        return None
    if window is None:  # transformers itself cannot run this model (no window for the mask)
        raise CheckpointError(
            "config.json's layer_types names sliding_attention layers but use_sliding_window "
            "is off or sliding_window is null; set both, or make every layer full_attention"
        )
    return window


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", dict(_ATTN)),
    "mistral": Family("Mistral", dict(_ATTN), max_positions=131072, window=_mistral_window),
    "qwen2": Family(
        "Qwen2", {**_ATTN, **_QKV_BIAS}, qkv_bias=True, max_positions=32768, window=_qwen_window
    ),
    "qwen3": Family(
        "Qwen3", {**_ATTN, **_QK_NORM}, qk_norm=True, max_positions=32768, window=_qwen_window
    ),
}
"""The families ``anyorder convert`` reads, by ``config.json``'s ``model_type``."""

_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def family_of(config: dict[str, Any], source: str) -> Family:
    """The :class:`Family` of a ``config.json``.

    Raises:
        CheckpointError: a model type that is not one of :data:`FAMILIES` (nor GPT-2).
    """
    kind = config.get("model_type")
    known = ", ".join(["gpt2", *FAMILIES])
    if not isinstance(kind, str):
        said = "names no model_type" if kind is None else f"has model_type {_shown(kind)}"
        raise CheckpointError(
            f"{source!r}: config.json {said}; anyorder convert reads model_type {known} "
            "(a string, as save_pretrained writes it): fix config.json"
        )
    if kind in FAMILIES:
        return FAMILIES[kind]
    if kind.startswith("gemma"):
        raise CheckpointError(
            f"{source!r} is a {kind} model: Gemma's (1 + w) norms and scaled embeddings are "
            f"not anyorder's trunk; convert one of {known}"
        )
    raise CheckpointError(
        f"{source!r} holds a {kind!r} model; anyorder convert reads model_type {known}"
    )


MAX_SEQ = 131072
"""The longest context ``anyorder convert`` writes (Llama 3.1's 128K positions), whatever
``max_position_embeddings`` claims: a converted model keeps tables per position (RoPE's,
AO-GPT's target embedding) and a sampler a cache per position, which outgrow a machine
long before the weights do."""

_MISSING: Any = object()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def whole_number(
    config: dict[str, Any], key: str, default: Any = _MISSING, *, none: bool = False, least: int = 1
) -> Any:
    """``config[key]`` as an int of at least ``least``, ``default`` when the key is absent
    (and when it is null, with ``none``).

    Raises:
        CheckpointError: an absent key without a default, or a value that is not a
            positive whole number (``transformers``' strict configs refuse ``64.0`` too).
    """
    value = config.get(key)
    if value is None and (key not in config or none):
        if default is _MISSING:
            raise CheckpointError(
                f"config.json has no {key!r}; give the config.json saved with the weights"
            )
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = "a positive whole number" if least == 1 else f"a whole number >= {least}"
        raise CheckpointError(
            f"config.json's {key} is {_shown(value)}; it must be {what} (an integer, as "
            "transformers writes it): fix config.json"
        )
    return value


def bos_of(
    config: dict[str, Any],
    bos_id: int | None,
    vocab: int,
    family: str,
    *,
    default: int | None = None,
    fix: str = "an id of the model's vocabulary",
) -> int:
    """The BOS id: ``bos_id`` (``--bos-id``), else the config's ``bos_token_id`` (the first
    of a list), else ``default``.

    Raises:
        ConfigError: no id, an id that is not a whole number, or one outside the vocabulary.
    """
    if bos_id is None:
        bos_id = config.get("bos_token_id")
        if isinstance(bos_id, list):
            bos_id = bos_id[0] if bos_id else None
        if bos_id is None:
            bos_id = default
    if bos_id is None:
        raise ConfigError(
            f"the {family} config names no bos_token_id; pass --bos-id with the token the "
            "model starts from (Qwen: its end-of-text id)"
        )
    if isinstance(bos_id, bool) or not isinstance(bos_id, int):
        raise ConfigError(
            f"the {family} config's bos_token_id is {bos_id!r}, not a token id; pass --bos-id "
            "with the token the model starts from"
        )
    if not 0 <= bos_id < vocab:
        raise ConfigError(
            f"BOS id {bos_id} is outside the vocabulary (0..{vocab - 1}); pass --bos-id with {fix}"
        )
    return int(bos_id)


def _number(params: dict[str, Any], key: str, where: str) -> float:
    """A positive finite number of ``params`` (``where`` names the dict in the message)."""
    if key not in params:
        raise CheckpointError(f"config.json's {where} has no {key!r}; add it to config.json")
    where = "" if where == "config" else f"{where} "
    value = params[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and value > 0):
        raise CheckpointError(
            f"config.json's {where}{key} is {_shown(value)}; it must be a positive number: "
            "fix config.json"
        )
    return float(value)


def _rope_object(config: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = config.get(key)
    if value is None or isinstance(value, dict):
        return value
    raise CheckpointError(
        f"config.json's {key} is {_shown(value)}; it must be an object such as "
        '{"rope_type": "linear", "factor": 2.0}, or null: fix config.json'
    )


def rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The RoPE parameters ``transformers`` computes with, and the key they came from.

    ``transformers`` 5 (``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict``) takes
    ``rope_scaling`` whole when it is a non-empty object, else ``rope_parameters``, and
    fills in what they leave out: ``rope_theta`` from the top level (else 10000),
    ``rope_type`` from its older name ``type`` (else default) and, for llama3, the
    original context from a top-level ``original_max_position_embeddings``, else
    ``max_position_embeddings``. ``transformers`` 4 read ``rope_scaling`` beside a top-level
    ``rope_theta`` and knew no ``rope_parameters``, which agrees. So a ``save_pretrained``
    of transformers 5 (``rope_parameters: {rope_type: default, rope_theta: ...}``) with an
    older ``rope_scaling`` added runs scaled, at the default base.
    """
    scaling = _rope_object(config, "rope_scaling")
    key = "rope_scaling" if scaling else "rope_parameters"
    params = dict(scaling or _rope_object(config, "rope_parameters") or {})
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise CheckpointError(
            f"config.json's {key} gives RoPE per layer type ({nested[0]}); anyorder's trunk "
            "rotates every layer alike, so it is not converted"
        )
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if "original_max_position_embeddings" in config:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            family = FAMILIES.get(config.get("model_type"))  # type: ignore[arg-type]
            longest = family.max_positions if family is not None else 2048
            params.setdefault(
                "original_max_position_embeddings", config.get("max_position_embeddings", longest)
            )
    return params, key


def rope_of(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE base and scaling as :class:`ModelConfig` keys, read as :func:`rope_parameters`.

    Raises:
        CheckpointError: a scaling type our trunk does not implement, named; a malformed
            value, named.
    """
    params, key = rope_parameters(config)
    kind = params["rope_type"]
    if not isinstance(kind, str) or kind not in _ROPE_TYPES:
        raise CheckpointError(
            f"rope scaling {kind!r} is not implemented by anyorder's trunk; it converts "
            f"{', '.join(_ROPE_TYPES)}"
        )
    out: dict[str, Any] = {
        "rope_base": _number(params, "rope_theta", key),
        "rope_scaling_type": _ROPE_TYPES[kind],
    }
    if kind in ("linear", "llama3"):
        out["rope_factor"] = _number(params, "factor", key)
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=_number(params, "low_freq_factor", key),
            rope_high_freq_factor=_number(params, "high_freq_factor", key),
            rope_original_max_pos=whole_number(params, "original_max_position_embeddings"),
        )
    return out


def refusals(config: dict[str, Any], seq_len: int, bos: int = 1) -> list[str]:
    """The features of ``config`` our trunk cannot compute at ``seq_len`` (empty: none).

    ``bos``: 1 when the model reads a BOS slot before the ``seq_len`` tokens (a window must
    then hold ``seq_len + 1`` slots for the last token to see the BOS)."""
    out = []
    if config.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {_shown(config['hidden_act'])} (the SwiGLU MLP uses silu)")
    if config.get("attention_bias") and config.get("model_type") != "qwen2":
        out.append("attention_bias (a bias on the output projection too)")
    if config.get("mlp_bias"):
        out.append("mlp_bias")
    family = FAMILIES.get(config.get("model_type"))  # type: ignore[arg-type]
    window = family.window(config) if family is not None else None
    if window is not None and window < seq_len + bos:
        slots = f"seq_len {seq_len}" + (" + the BOS" if bos else "")
        out.append(
            f"a sliding window of {window} < {slots} (pass --seq-len {window - bos} or less)"
        )
    moe = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)]
    if moe:
        out.append(f"mixture of experts ({moe[0]})")
    params, _ = rope_parameters(config)
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        out.append(f"partial rotary (partial_rotary_factor {_shown(partial)})")
    return out


def positive_number(config: dict[str, Any], key: str, default: float) -> float:
    """``config[key]`` as a positive finite float (``default`` when absent), refused by
    name otherwise."""
    if key not in config:
        return default
    return _number(config, key, "config")


def model_config_from_hf(
    config: dict[str, Any],
    kind: str,
    *,
    seq_len: int | None = None,
    l2s: int | None = None,
    target_dim: int = 128,
    source: str = "the source",
) -> ModelConfig:
    """Our :class:`ModelConfig` for a Llama / Qwen2 / Qwen3 / Mistral ``config.json``.

    gpt and aogpt rotate the BOS at position 0 and ``x_p`` at ``p + 1``
    (``rope_bos_shift``), as the source reads ``[bos] + x``; armd has no BOS slot and keeps
    ``x_p`` at ``p``. The default ``seq_len`` is what fits the source's
    ``max_position_embeddings`` beside the BOS, at most :data:`DEFAULT_MAX_SEQ`; no
    ``seq_len`` beyond those positions or :data:`MAX_SEQ` is written.

    Raises:
        CheckpointError: a family or feature our trunk does not compute, or a malformed
            config value, named.
        ConfigError: a bad ``seq_len``.
    """
    fam = family_of(config, source)
    shift = int(kind != "armd")
    positions = whole_number(config, "max_position_embeddings", fam.max_positions, least=1 + shift)
    longest = min(positions - shift, MAX_SEQ)
    if seq_len is None:
        seq_len = min(longest, DEFAULT_MAX_SEQ)
    if not 1 <= seq_len <= longest:
        if seq_len > MAX_SEQ >= longest:
            why = f"anyorder convert writes at most {MAX_SEQ} positions"
        else:
            why = f"the {fam.name} was trained at {positions} positions"
            why += ", the BOS taking one" if shift else ""
        raise ConfigError(f"seq_len={seq_len} must lie in 1..{longest} ({why})")
    d = whole_number(config, "hidden_size")
    n_head = whole_number(config, "num_attention_heads")
    head_dim = whole_number(config, "head_dim", None, none=True) or d // n_head
    sizes = {
        k: whole_number(config, k) for k in ("vocab_size", "num_hidden_layers", "intermediate_size")
    }
    n_kv_head = whole_number(config, "num_key_value_heads", None, none=True) or n_head
    rope = rope_of(config)
    bad = refusals(config, seq_len, shift)
    if bad:
        raise CheckpointError(
            f"{source!r} uses {'; '.join(bad)}: anyorder's trunk does not compute "
            f"{'it' if len(bad) == 1 else 'them'}, so it is not converted"
        )
    return ModelConfig(
        kind=kind,
        vocab_size=sizes["vocab_size"],
        seq_len=seq_len,
        n_layer=sizes["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=n_kv_head,
        head_dim=None if head_dim * n_head == d else head_dim,
        d_model=d,
        mlp="swiglu",
        intermediate_size=sizes["intermediate_size"],
        pos_emb="rope",
        **rope,
        rope_bos_shift=bool(shift),
        qk_norm=fam.qk_norm,
        norm="rmsnorm",
        bias=False,
        qkv_bias=fam.qkv_bias,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm_eps=positive_number(config, "rms_norm_eps", 1e-6),
        init_std=positive_number(config, "initializer_range", 0.02),
        dropout=0.0,
        target_dim=target_dim,
        l2s=l2s if kind == "armd" else None,
    )


def weight_map(family: Family, n_layer: int) -> dict[str, tuple[str, ...]]:
    """Every weight of our model that comes from the source: ``{ours: (theirs, ...)}``."""
    out = dict(family.top)
    for i in range(n_layer):
        for ours, theirs in family.layer.items():
            out[f"blocks.{i}.{ours}"] = tuple(f"model.layers.{i}.{t}" for t in theirs)
    return out


# ----------------------------------------------------------------------------- end of text


def source_eos_ids(config: dict[str, Any], generation: Any, vocab: int) -> list[int]:
    """The ids the source's ``generate`` stops on, in its order.

    ``transformers`` generates with ``generation_config.json`` (``generation``, None when
    the folder has none; Qwen's instruct models list ``<|im_end|>`` there before
    ``<|endoftext|>``), else with the ``eos_token_id`` of ``config.json``; either may be
    one id or a list. A ``generation_config.json`` that names none leaves ``config.json``'s.

    Raises:
        CheckpointError: an id that is not an integer of the vocabulary.
    """
    stops: list[int] = []
    if not isinstance(generation, dict):
        generation = {}
    for where, holder in (("config.json", config), ("generation_config.json", generation)):
        ids = holder.get("eos_token_id")
        ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
        for i in ids:  # both checked: transformers refuses either malformed
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab:
                raise CheckpointError(
                    f"{where}'s eos_token_id holds {_shown(i)}, not an id of the vocabulary "
                    f"(0..{vocab - 1}); fix {where}"
                )
        stops = ids or stops  # generation_config.json's, when it names any
    return list(stops)


def ending_at(tok: Any, stops: list[int]) -> Any:
    """``tok`` with its EOS where the source's ``generate`` stops (:func:`source_eos_ids`).

    anyorder stops at one id: the tokenizer's own EOS token when the source stops there
    (a chat model's end of turn: Qwen's ``<|im_end|>``, Llama 3's ``<|eot_id|>``), else
    the first the source stops on. (A tokenizer left alone would end at
    ``<|endoftext|>`` when its vocabulary has one, which Qwen starts from as its BOS.)
    """
    raw = getattr(tok, "tok", None)
    if raw is None or not stops:
        return tok
    own = getattr(raw, "eos_token_id", None)
    want = own if own in stops else stops[0]
    if want == tok.eos_id or not 0 <= want < tok.vocab_size:
        return tok
    return type(tok)(raw, name=tok.name, spec=tok.spec, eos_id=want)
