"""The model section: :class:`ModelConfig`, its named presets (sizes) and variants (the
fields that make our trunk compute what a reference model computes).

Design choices:

* Presets set sizes, variants set everything else a reference model differs in; a config
  names at most one of each (``model: {preset: tiny, variant: aogpt-ref}``), and keys given
  beside them win (:func:`expand_model_values`); a variant given as an override sets its
  keys over the file's (:func:`anyorder.config.loading.load_config`), so no file key makes a
  hybrid under the variant's name.
* A ``tiny`` preset that trains on a laptop CPU in seconds, and the papers' sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from anyorder.errors import ConfigError, preview

MODEL_KINDS = ("gpt", "aogpt", "armd", "mdm")
ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclass
class ModelConfig:
    """The transformer and the variant built on it."""

    kind: str = "aogpt"
    """Model variant: gpt (left-to-right), aogpt (AO-GPT), armd (two-stream ARMD), mdm (encoder)."""
    vocab_size: int = 257
    """Number of token ids the model reads and predicts (the mdm adds one [MASK] id of its own)."""
    seq_len: int = 256
    """Longest sequence the model handles (positions 0..seq_len-1)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block (query heads)."""
    n_kv_head: int | None = None
    """Key/value heads per block (grouped-query attention: each serves n_head / n_kv_head
    query heads; Llama 3, Qwen, Mistral). None: n_head (plain multi-head attention)."""
    head_dim: int | None = None
    """Width of one attention head. None: d_model / n_head; Qwen3 sets it apart
    (n_head * head_dim != d_model)."""
    d_model: int = 256
    """Width of the residual stream."""
    mlp: str = "gelu"
    """MLP kind: gelu (GPT-2 style, 4x) or swiglu (8/3x, rounded to a multiple of 64)."""
    mlp_ratio: float = 4.0
    """Hidden width of the gelu MLP over d_model (swiglu uses 2/3 of it)."""
    intermediate_size: int | None = None
    """Hidden width of the MLP, given outright (swiglu: of each of its gate and up
    projections; a converted checkpoint's intermediate_size). None: from mlp_ratio."""
    pos_emb: str = "auto"
    """Positions: learned (absolute table), rope, or auto (rope for armd as in the paper,
    learned for the others: an encoder given only [MASK]s needs absolute positions; but the
    mdm learns far faster with rope, which configs/tiny-mdm.yaml uses: docs/results.md)."""
    rope_base: float = 10000.0
    """RoPE frequency base (a Hugging Face config's rope_theta)."""
    rope_scaling_type: str = "none"
    """RoPE frequency scaling: none, linear (every frequency over rope_factor) or llama3
    (Llama 3.1's: low frequencies over rope_factor, high ones kept, a smooth ramp between,
    set by rope_low_freq_factor, rope_high_freq_factor and rope_original_max_pos)."""
    rope_factor: float = 1.0
    """rope_scaling_type linear or llama3: the factor the (low) frequencies are divided by."""
    rope_low_freq_factor: float = 1.0
    """rope_scaling_type llama3: wavelengths above rope_original_max_pos / this are scaled."""
    rope_high_freq_factor: float = 4.0
    """rope_scaling_type llama3: wavelengths below rope_original_max_pos / this are kept."""
    rope_original_max_pos: int = 8192
    """rope_scaling_type llama3: the context length the model was first trained at."""
    qk_norm: bool = True
    """RMS-normalise queries and keys per head before RoPE: an RMSNorm over head_dim with one
    learned gain shared by the heads (Qwen3's q_norm and k_norm)."""
    norm: str = "rmsnorm"
    """Normalisation layers: rmsnorm, or layernorm (GPT-2, for converted weights)."""
    bias: bool = False
    """Biases in linear layers and norms (GPT-2 has them)."""
    qkv_bias: bool | None = None
    """Biases on the query, key and value projections. None: as model.bias; true with
    bias false is Qwen2's (no bias on the output projection or the MLP)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head (GPT-2 does)."""
    norm_eps: float = 1e-6
    """Epsilon of every norm (the QK-norm's too)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    dropout: float = 0.0
    """Dropout on attention and MLP outputs (the papers use none)."""
    target_dim: int = 128
    """aogpt: width of the target-position embedding that drives adaLN."""
    target_injection: str = "adaln"
    """aogpt: how the target position enters: adaln (AO-GPT) or add (sigma-GPT-style ablation)."""
    l2s: int | None = None
    """armd: number of two-stream layers at the bottom (default n_layer // 2)."""
    rope_query: str = "input"
    """aogpt with rope: where a slot's query is rotated: input (the position of the token it
    reads, like its key: AO-GPT as published) or target (the position it predicts: scores
    then depend on the offset from the target to each context token; our extension)."""
    head_bias: bool = False
    """A bias on the output head (the AO-GPT reference has one)."""
    padded_vocab: int | None = None
    """Rows of the token table and the output head when more than vocab_size (the AO-GPT
    reference pads GPT-2's 50257 ids to 50304); ids from vocab_size up are padding, never
    read, predicted or sampled. None: vocab_size rows."""
    gelu: str = "tanh"
    """The gelu MLP's activation: tanh (GPT-2's approximation) or exact (erf; the AO-GPT
    reference)."""
    init_truncate: bool = False
    """Truncate the normal initialisation of weights at 3 standard deviations (the AO-GPT
    reference)."""
    bos_pos_row: bool = False
    """gpt/aogpt with learned positions: the BOS slot adds row 0 of the position table and a
    token at position p reads row p + 1 (the AO-GPT reference's layout, seq_len + 1 rows).
    False: the BOS vector stands alone and a token at p reads row p. No effect with rope."""
    rope_bos_shift: bool = False
    """gpt/aogpt with rope: the BOS slot at RoPE position 0 and a token at position p rotated
    as p + 1, the way a Hugging Face model reads [bos] + x (converted Llama, Qwen and
    Mistral weights: docs/checkpoints.md). False: the BOS slot and x_0 share position 0."""
    adaln_gate_offset: bool = True
    """aogpt: each adaLN gate multiplies as 1 + gate, so zero modulation is the plain block
    (ours); False: as the raw gate (the AO-GPT reference, as in DiT)."""
    adaln_init: str = "zero"
    """aogpt: zero (adaLN layers start at zero, the target embedding at unit scale: ours) or
    normal (both at init_std like every other weight: the AO-GPT reference)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` on an inconsistent model config."""
        for name in (
            "vocab_size", "seq_len", "n_layer", "n_head", "d_model", "target_dim",
            "n_kv_head", "head_dim", "intermediate_size", "rope_original_max_pos",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 1:  # first: the checks below divide by these
                raise ConfigError(f"model.{name} must be a positive integer")
        for name in (
            "mlp_ratio", "norm_eps", "rope_base", "rope_factor", "rope_low_freq_factor",
            "rope_high_freq_factor",
        ):  # fmt: skip
            if not 0 < getattr(self, name) < math.inf:  # NaN too; 1e400 in a config.json
                raise ConfigError(f"model.{name}={getattr(self, name)} must be a positive number")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if not 0 <= self.init_std < math.inf:
            raise ConfigError(f"model.init_std={self.init_std} must be a finite number >= 0")
        if self.kind not in MODEL_KINDS:
            raise ConfigError(
                f"model.kind={preview(self.kind)} is not a model; use one of "
                f"{', '.join(MODEL_KINDS)}"
            )
        if self.head_dim is None and self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                "pick a d_model that is a multiple of n_head, or set model.head_dim"
            )
        if self.n_head % self.kv_heads:
            raise ConfigError(
                f"model.n_head={self.n_head} is not a multiple of model.n_kv_head="
                f"{self.n_kv_head}; every key/value head serves the same number of query heads"
            )
        if self.pos_emb not in ("auto", "learned", "rope"):
            raise ConfigError(f"model.pos_emb={preview(self.pos_emb)}: use learned, rope or auto")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ConfigError(f"model.norm={preview(self.norm)}: use rmsnorm or layernorm")
        if self.mlp not in ("gelu", "swiglu"):
            raise ConfigError(f"model.mlp={preview(self.mlp)}: use gelu or swiglu")
        if self.target_injection not in ("adaln", "add"):
            raise ConfigError(
                f"model.target_injection={preview(self.target_injection)}: use adaln or add"
            )
        if self.rope_query not in ("input", "target"):
            raise ConfigError(f"model.rope_query={preview(self.rope_query)}: use input or target")
        if self.rope_query == "target" and (self.kind != "aogpt" or self.positional != "rope"):
            raise ConfigError(
                "model.rope_query=target rotates aogpt's queries: it needs model.kind=aogpt "
                "and model.pos_emb=rope"
            )
        self._validate_rope_scaling()
        if self.positional == "rope" and self.d_head % 2:
            raise ConfigError(
                f"rope needs an even head dimension (model.head_dim, or d_model / n_head), "
                f"not {self.d_head}"
            )
        if self.gelu not in ("tanh", "exact"):
            raise ConfigError(f"model.gelu={preview(self.gelu)}: use tanh or exact")
        if self.adaln_init not in ("zero", "normal"):
            raise ConfigError(f"model.adaln_init={preview(self.adaln_init)}: use zero or normal")
        if self.padded_vocab is not None and self.padded_vocab < self.vocab_size:
            raise ConfigError(
                f"model.padded_vocab={self.padded_vocab} is below model.vocab_size="
                f"{self.vocab_size}; give at least vocab_size rows, or leave it unset"
            )
        if self.kind == "mdm" and (self.padded_vocab is not None or self.head_bias):
            raise ConfigError(
                "model.padded_vocab and model.head_bias are for the decoders (gpt, aogpt, "
                "armd); leave them unset for mdm"
            )
        if self.bos_pos_row and self.kind not in ("gpt", "aogpt"):
            raise ConfigError(
                "model.bos_pos_row places the BOS slot of gpt/aogpt in the position table; "
                "leave it off for armd and mdm"
            )
        if self.rope_bos_shift and (self.kind not in ("gpt", "aogpt") or self.positional != "rope"):
            raise ConfigError(
                "model.rope_bos_shift moves the BOS slot of gpt/aogpt under RoPE; it needs "
                "model.kind gpt or aogpt and model.pos_emb=rope (leave it off otherwise)"
            )
        if self.l2s is not None and not 1 <= self.l2s <= self.n_layer:
            raise ConfigError(
                f"model.l2s={self.l2s} must be between 1 and model.n_layer={self.n_layer}"
            )

    def _validate_rope_scaling(self) -> None:
        if self.rope_scaling_type not in ROPE_SCALINGS:
            raise ConfigError(
                f"model.rope_scaling_type={preview(self.rope_scaling_type)} is not supported; use "
                f"{', '.join(ROPE_SCALINGS)} (no other RoPE scaling is implemented)"
            )
        if self.rope_scaling_type != "none" and self.positional != "rope":
            raise ConfigError(
                f"model.rope_scaling_type={self.rope_scaling_type} scales RoPE; it needs "
                "model.pos_emb=rope"
            )
        if self.rope_scaling_type == "none" and self.rope_factor != 1.0:
            raise ConfigError(
                f"model.rope_factor={self.rope_factor} does nothing without "
                "model.rope_scaling_type; "
                "set rope_scaling_type=linear or llama3, or leave rope_factor at 1"
            )
        llama3 = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_pos")
        if self.rope_scaling_type != "llama3":
            for name in llama3:
                if getattr(self, name) != _DEFAULTS[name]:
                    raise ConfigError(
                        f"model.{name} is for model.rope_scaling_type=llama3; set that, or leave "
                        f"{name} at its default"
                    )
        elif not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ConfigError(
                f"model.rope_low_freq_factor={self.rope_low_freq_factor} must be below "
                f"model.rope_high_freq_factor={self.rope_high_freq_factor}"
            )

    @property
    def d_head(self) -> int:
        """The resolved width of one attention head (``head_dim`` or d_model / n_head)."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """The resolved number of key/value heads (``n_kv_head`` or n_head)."""
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def attn_bias(self) -> bool:
        """Whether the query/key/value projections have biases (``qkv_bias`` or bias)."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: ``intermediate_size``, else from ``mlp_ratio`` (swiglu:
        2/3 of it, rounded up to a multiple of 64)."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        if self.mlp == "swiglu":
            hidden = int(self.mlp_ratio * self.d_model * 2 / 3)
            return 64 * math.ceil(hidden / 64)
        return int(self.mlp_ratio * self.d_model)

    @property
    def rope_scale(self) -> tuple[str, float, float, float, int] | None:
        """The RoPE scaling as one hashable value (None: none), for the rotary tables."""
        if self.rope_scaling_type == "none":
            return None
        return (
            self.rope_scaling_type,
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_pos,
        )

    @property
    def rope_rows(self) -> int:
        """Rows of the RoPE tables: seq_len, one more when the BOS takes a position of its own
        (``rope_bos_shift``)."""
        return self.seq_len + int(self.rope_bos_shift)

    @property
    def positional(self) -> str:
        """The resolved positional encoding: ``learned`` or ``rope``."""
        if self.pos_emb != "auto":
            return self.pos_emb
        return "rope" if self.kind == "armd" else "learned"

    @property
    def positions(self) -> str:
        """The positional scheme in words, for the training start-up line."""
        if self.positional == "learned":
            where = ", BOS at row 0" if self.bos_pos_row and self.kind in ("gpt", "aogpt") else ""
            text = f"learned positions{where}"
        else:
            text = "rope, BOS at 0 and x_p at p + 1" if self.rope_bos_shift else "rope"
            if self.kind == "aogpt":
                text += f" (queries at their {self.rope_query}s)"
        if self.kind == "aogpt":
            text += f", target by {self.target_injection}"
        return text

    @property
    def table_vocab(self) -> int:
        """Rows of the token table and the output head (``padded_vocab`` or ``vocab_size``)."""
        return self.padded_vocab if self.padded_vocab is not None else self.vocab_size

    @property
    def two_stream_layers(self) -> int:
        """armd: the resolved number of two-stream layers."""
        return self.l2s if self.l2s is not None else max(1, self.n_layer // 2)


_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}

PRESETS: dict[str, dict[str, Any]] = {
    # Runs a training step on a laptop CPU in well under a second (byte-level vocabulary).
    "tiny": dict(vocab_size=257, seq_len=256, n_layer=4, n_head=4, d_model=256),
    # The papers' sizes: GPT-2 small and medium with the GPT-2 vocabulary.
    "small": dict(vocab_size=50257, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "medium": dict(vocab_size=50257, seq_len=1024, n_layer=24, n_head=16, d_model=1024),
}


_REF_TRUNK: dict[str, Any] = dict(
    pos_emb="learned",
    bos_pos_row=True,
    norm_eps=1e-5,
    bias=True,
    mlp="gelu",
    mlp_ratio=4.0,
    gelu="exact",
    init_std=0.02,
    dropout=0.0,
    rope_query="input",
)
VARIANTS: dict[str, dict[str, Any]] = {
    # The AO-GPT authors' model (model_AOGPT_AdaLN6_NoRep_cond_128_trunc_qknorm.py in
    # scxue/AO-GPT-MDM): RMSNorm and QK-norm at eps 1e-5, biases, an untied head with a
    # bias, raw adaLN gates, adaLN and the 128-wide target embedding at N(0, 0.02),
    # truncated-normal init, BOS at position row 0.
    "aogpt-ref": dict(
        _REF_TRUNK,
        kind="aogpt",
        norm="rmsnorm",
        qk_norm=True,
        tie_embeddings=False,
        head_bias=True,
        init_truncate=True,
        target_injection="adaln",
        target_dim=128,
        adaln_gate_offset=False,
        adaln_init="normal",
    ),
    # Their sigma-GPT (model_sigmaGPT.py): LayerNorm with biases, no QK-norm, a tied head,
    # the target position added to the input as a second d-wide table.
    "sigmagpt-ref": dict(
        _REF_TRUNK,
        kind="aogpt",
        norm="layernorm",
        qk_norm=False,
        tie_embeddings=True,
        head_bias=False,
        init_truncate=False,
        target_injection="add",
    ),
}
"""Named parameterisations (``model: {variant: aogpt-ref}``): the fields that make our trunk
compute exactly what a reference model computes. They set no sizes (use a preset for that);
keys given beside them win."""


def method_name(kind: str, target_injection: str | None = None) -> str:
    """The method a model implements, as people name it: ``GPT``, ``AO-GPT``, ``ARMD``,
    ``MDM``, or ``sigma-GPT`` for an aogpt told its target by an added table (the
    ``sigmagpt-ref`` variant: the same module class, another method)."""
    if kind == "aogpt" and target_injection == "add":
        return "sigma-GPT"
    return {"gpt": "GPT", "aogpt": "AO-GPT", "armd": "ARMD", "mdm": "MDM"}.get(kind, kind)


def expand_model_values(values: dict[str, Any], prefix: str = "model") -> dict[str, Any]:
    """Model-section values with ``preset`` and ``variant`` replaced by the fields they set
    (preset first, then variant, then the keys given beside them)."""
    values = dict(values)
    base: dict[str, Any] = {}
    name = values.pop("preset", None)
    if name is not None:
        if name not in PRESETS:
            raise ConfigError(
                f"unknown preset {name!r} in {prefix}; use one of {', '.join(PRESETS)}"
            )
        base.update(PRESETS[name])
    name = values.pop("variant", None)
    if name is not None:
        if name not in VARIANTS:
            raise ConfigError(
                f"unknown variant {name!r} in {prefix}; use one of {', '.join(VARIANTS)}"
            )
        base.update(VARIANTS[name])
    return {**base, **values}
