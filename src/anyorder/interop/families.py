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
* The config is read from ``config.json`` itself (``transformers`` 4 and 5 spell RoPE
  differently: ``rope_theta`` + ``rope_scaling`` or ``rope_parameters``). Every feature our
  trunk does not compute is refused by name before anything is written
  (:func:`refusals`): a wrong conversion that loads is worse than none.
"""

from __future__ import annotations

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


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", dict(_ATTN)),
    "mistral": Family("Mistral", dict(_ATTN)),
    "qwen2": Family("Qwen2", {**_ATTN, **_QKV_BIAS}, qkv_bias=True),
    "qwen3": Family("Qwen3", {**_ATTN, **_QK_NORM}, qk_norm=True),
}
"""The families ``anyorder convert`` reads, by ``config.json``'s ``model_type``."""

_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def family_of(config: dict[str, Any], source: str) -> Family:
    """The :class:`Family` of a ``config.json``.

    Raises:
        CheckpointError: a model type that is not one of :data:`FAMILIES` (nor GPT-2).
    """
    kind = config.get("model_type")
    if kind in FAMILIES:
        return FAMILIES[kind]
    known = ", ".join(["gpt2", *FAMILIES])
    if isinstance(kind, str) and kind.startswith("gemma"):
        raise CheckpointError(
            f"{source!r} is a {kind} model: Gemma's (1 + w) norms and scaled embeddings are "
            f"not anyorder's trunk; convert one of {known}"
        )
    raise CheckpointError(
        f"{source!r} holds a {kind!r} model; anyorder convert reads model_type {known}"
    )


def rope_of(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE base and scaling as :class:`ModelConfig` keys, from either spelling.

    Raises:
        CheckpointError: a scaling type our trunk does not implement, named.
    """
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    params = {**scaling, **params}
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise CheckpointError(
            f"rope scaling {kind!r} is not implemented by anyorder's trunk; it converts "
            f"{', '.join(_ROPE_TYPES)}"
        )
    out: dict[str, Any] = {"rope_base": float(base), "rope_scaling_type": _ROPE_TYPES[kind]}
    if kind in ("linear", "llama3"):
        out["rope_factor"] = float(params["factor"])
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(params["low_freq_factor"]),
            rope_high_freq_factor=float(params["high_freq_factor"]),
            rope_original_max_pos=int(params["original_max_position_embeddings"]),
        )
    return out


def _window(config: dict[str, Any]) -> int | None:
    """The shortest attention window the model uses, or None (full attention)."""
    window = config.get("sliding_window")
    types = config.get("layer_types") or []
    if config.get("model_type") in ("qwen2", "qwen3"):
        on = config.get("use_sliding_window", False) or "sliding_attention" in types
        return int(window) if on and window else None
    return int(window) if window else None


def refusals(config: dict[str, Any], seq_len: int, bos: int = 1) -> list[str]:
    """The features of ``config`` our trunk cannot compute at ``seq_len`` (empty: none).

    ``bos``: 1 when the model reads a BOS slot before the ``seq_len`` tokens (a window must
    then hold ``seq_len + 1`` slots for the last token to see the BOS)."""
    out = []
    if config.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {config['hidden_act']!r} (the SwiGLU MLP uses silu)")
    if config.get("attention_bias") and config.get("model_type") != "qwen2":
        out.append("attention_bias (a bias on the output projection too)")
    if config.get("mlp_bias"):
        out.append("mlp_bias")
    window = _window(config)
    if window is not None and window < seq_len + bos:
        slots = f"seq_len {seq_len}" + (" + the BOS" if bos else "")
        out.append(
            f"a sliding window of {window} < {slots} (pass --seq-len {window - bos} or less)"
        )
    moe = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(k)]
    if moe:
        out.append(f"mixture of experts ({moe[0]})")
    partial = config.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        out.append(f"partial rotary (partial_rotary_factor {partial})")
    return out


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
    ``max_position_embeddings`` beside the BOS, at most :data:`DEFAULT_MAX_SEQ`.

    Raises:
        CheckpointError: a family or feature our trunk does not compute, named.
        ConfigError: a bad ``seq_len``.
    """
    fam = family_of(config, source)
    shift = int(kind != "armd")
    longest = int(config.get("max_position_embeddings", 2048)) - shift
    if seq_len is None:
        seq_len = min(longest, DEFAULT_MAX_SEQ)
    if not 1 <= seq_len <= longest:
        raise ConfigError(
            f"seq_len={seq_len} must lie in 1..{longest} (the {fam.name} was trained at "
            f"{longest + shift} positions{', the BOS taking one' if shift else ''})"
        )
    bad = refusals(config, seq_len, shift)
    if bad:
        raise CheckpointError(
            f"{source!r} uses {'; '.join(bad)}: anyorder's trunk does not compute "
            f"{'it' if len(bad) == 1 else 'them'}, so it is not converted"
        )
    d = int(config["hidden_size"])
    n_head = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or d // n_head
    try:
        return ModelConfig(
            kind=kind,
            vocab_size=int(config["vocab_size"]),
            seq_len=seq_len,
            n_layer=int(config["num_hidden_layers"]),
            n_head=n_head,
            n_kv_head=int(config.get("num_key_value_heads") or n_head),
            head_dim=None if head_dim * n_head == d else int(head_dim),
            d_model=d,
            mlp="swiglu",
            intermediate_size=int(config["intermediate_size"]),
            pos_emb="rope",
            **rope_of(config),
            rope_bos_shift=bool(shift),
            qk_norm=fam.qk_norm,
            norm="rmsnorm",
            bias=False,
            qkv_bias=fam.qkv_bias,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            init_std=float(config.get("initializer_range", 0.02)),
            dropout=0.0,
            target_dim=target_dim,
            l2s=l2s if kind == "armd" else None,
        )
    except KeyError as e:
        raise CheckpointError(f"{source!r}: config.json has no {e.args[0]!r}") from None


def weight_map(family: Family, n_layer: int) -> dict[str, tuple[str, ...]]:
    """Every weight of our model that comes from the source: ``{ours: (theirs, ...)}``."""
    out = dict(family.top)
    for i in range(n_layer):
        for ours, theirs in family.layer.items():
            out[f"blocks.{i}.{ours}"] = tuple(f"model.layers.{i}.{t}" for t in theirs)
    return out
