"""Configuration: dataclasses, named presets, YAML files and dotted overrides.

Design choices:

* Layered and strict: dataclass defaults <- YAML file <- ``key=value`` overrides. An
  unknown key or a value of the wrong type is a :class:`ConfigError` that names the key.
* Help text comes from the fields' docstrings (the string literal under each field), read
  from the source with :mod:`ast`, so the documentation lives next to the default.
* A config file may start from a preset (``model: {preset: tiny}``) and override fields.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anyorder.errors import ConfigError

MODEL_KINDS = ("gpt", "aogpt", "armd", "mdm")
_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A float in exponent notation without a dot (``1e-3``), which YAML 1.1 leaves a string."""


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
    """Attention heads per block."""
    d_model: int = 256
    """Width of the residual stream."""
    mlp: str = "gelu"
    """MLP kind: gelu (GPT-2 style, 4x) or swiglu (8/3x, rounded to a multiple of 64)."""
    mlp_ratio: float = 4.0
    """Hidden width of the gelu MLP over d_model (swiglu uses 2/3 of it)."""
    pos_emb: str = "auto"
    """Positions: learned (absolute table), rope, or auto (rope for armd as in the paper,
    learned for the others: an encoder given only [MASK]s needs absolute positions)."""
    rope_base: float = 10000.0
    """RoPE frequency base."""
    qk_norm: bool = True
    """RMS-normalise queries and keys per head before attention."""
    norm: str = "rmsnorm"
    """Normalisation layers: rmsnorm, or layernorm (GPT-2, for converted weights)."""
    bias: bool = False
    """Biases in linear layers and norms (GPT-2 has them)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output head (GPT-2 does)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
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
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "target_dim"):
            if getattr(self, name) < 1:  # first: the checks below divide by these
                raise ConfigError(f"model.{name} must be a positive integer")
        for name in ("mlp_ratio", "norm_eps", "rope_base"):
            if not getattr(self, name) > 0:  # NaN too
                raise ConfigError(f"model.{name}={getattr(self, name)} must be a positive number")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if not self.init_std >= 0:
            raise ConfigError(f"model.init_std={self.init_std} must be >= 0")
        if self.kind not in MODEL_KINDS:
            raise ConfigError(
                f"model.kind={self.kind!r} is not a model; use one of {', '.join(MODEL_KINDS)}"
            )
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                "pick a d_model that is a multiple of n_head"
            )
        if self.pos_emb not in ("auto", "learned", "rope"):
            raise ConfigError(f"model.pos_emb={self.pos_emb!r}: use learned, rope or auto")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ConfigError(f"model.norm={self.norm!r}: use rmsnorm or layernorm")
        if self.mlp not in ("gelu", "swiglu"):
            raise ConfigError(f"model.mlp={self.mlp!r}: use gelu or swiglu")
        if self.target_injection not in ("adaln", "add"):
            raise ConfigError(f"model.target_injection={self.target_injection!r}: use adaln or add")
        if self.rope_query not in ("input", "target"):
            raise ConfigError(f"model.rope_query={self.rope_query!r}: use input or target")
        if self.rope_query == "target" and (self.kind != "aogpt" or self.positional != "rope"):
            raise ConfigError(
                "model.rope_query=target rotates aogpt's queries: it needs model.kind=aogpt "
                "and model.pos_emb=rope"
            )
        if self.positional == "rope" and self.head_dim % 2:
            raise ConfigError("rope needs an even head dimension (d_model / n_head)")
        if self.gelu not in ("tanh", "exact"):
            raise ConfigError(f"model.gelu={self.gelu!r}: use tanh or exact")
        if self.adaln_init not in ("zero", "normal"):
            raise ConfigError(f"model.adaln_init={self.adaln_init!r}: use zero or normal")
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
        if self.l2s is not None and not 1 <= self.l2s <= self.n_layer:
            raise ConfigError(
                f"model.l2s={self.l2s} must be between 1 and model.n_layer={self.n_layer}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def positional(self) -> str:
        """The resolved positional encoding: ``learned`` or ``rope``."""
        if self.pos_emb != "auto":
            return self.pos_emb
        return "rope" if self.kind == "armd" else "learned"

    @property
    def table_vocab(self) -> int:
        """Rows of the token table and the output head (``padded_vocab`` or ``vocab_size``)."""
        return self.padded_vocab if self.padded_vocab is not None else self.vocab_size

    @property
    def two_stream_layers(self) -> int:
        """armd: the resolved number of two-stream layers."""
        return self.l2s if self.l2s is not None else max(1, self.n_layer // 2)


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


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a named preset (``tiny``, ``small``, ``medium``);
    ``variant=`` (see :data:`VARIANTS`) may be among the overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    return _build(ModelConfig, expand_model_values({"preset": name, **overrides}), "model")


@dataclass
class DataConfig:
    """Where the tokens come from and how they are packed."""

    source: str = "builtin:pydoc"
    """Text source: builtin:pydoc, builtin:stdlib, builtin:synthetic (a Markov chain with a
    known entropy floor), a file/folder/glob of .txt/.jsonl/.parquet, or hf:NAME[:CONFIG] for
    a Hugging Face dataset."""
    tokenizer: str = "bytes"
    """Tokenizer: bytes, gpt2, bert-base-uncased, a local tokenizer folder, or bpe:VOCAB."""
    text_field: str = "text"
    """Field that holds the text in .jsonl/.parquet/datasets records."""
    val_fraction: float = 0.05
    """Share of documents held out for validation (chosen by a hash of the document)."""
    cache_dir: str = "data_cache"
    """Folder for the packed token shards (reused when source and tokenizer match)."""
    streaming: bool = False
    """Stream a Hugging Face dataset instead of downloading it whole."""
    max_documents: int | None = None
    """Stop after this many documents (quick runs on a large corpus)."""


@dataclass
class OrderConfig:
    """The distribution of generation orders used in training."""

    kind: str = "uniform"
    """l2r, uniform, mix, fixed, progressive, strided or sbp."""
    p_l2r: float = 0.1
    """mix: probability of the left-to-right order (AO-GPT: 0.1)."""
    seed: int = 0
    """fixed: the seed of the one order used throughout."""
    i_ar: int = 0
    """progressive: last step of pure left-to-right training."""
    i_perm: int = 1
    """progressive: step at which the number of displaced tokens reaches rho."""
    rho: int = 32
    """progressive: the final number of displaced tokens."""
    streams: int = 1
    """strided: the number of streams S (must divide the sequence length)."""
    sbp_streams: tuple[int, ...] = (1, 2, 4)
    """sbp: the stream counts S drawn uniformly per step in SBP fine-tuning."""


@dataclass
class TrainConfig:
    """The optimisation loop."""

    out_dir: str = "runs/default"
    """Run folder: checkpoints, metrics and the resolved config."""
    steps: int = 1000
    """Number of optimiser steps."""
    batch_size: int = 16
    """Sequences per optimiser step (global, over all ranks and accumulation steps)."""
    grad_accum: int = 1
    """Micro-batches per optimiser step."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule as a fraction of lr."""
    warmup_steps: int = 100
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (on matrices only)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    ema: float = 0.0
    """EMA decay of the weights (0 disables; the paper presets use 0.9999)."""
    ema_warmup: bool = True
    """Ramp the EMA decay as min(ema, (1 + step) / (10 + step))."""
    eval_every: int = 200
    """Validate every this many steps (0: only at the end)."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    ckpt_every: int = 500
    """Write a checkpoint every this many steps (and at the end)."""
    keep_last: int = 2
    """Number of checkpoints kept."""
    log_every: int = 10
    """Write metrics every this many steps."""
    seed: int = 0
    """Seed of parameters, data order and generation orders."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto."""
    dtype: str = "auto"
    """Autocast dtype: auto (bf16 on CUDA, fp32 on CPU), bf16 or fp32."""
    compile: bool | str = "auto"
    """torch.compile the model and its loss: true, false, or auto (per device, as measured:
    off everywhere until a GPU measurement says otherwise; see docs/performance.md)."""
    fsdp: bool = False
    """Shard with FSDP2 fully_shard instead of DDP under torchrun."""
    skip_nonfinite: bool = False
    """Skip an optimizer step whose loss is NaN/Inf (no update) instead of stopping the run
    (which first saves the state after the last good step)."""
    init_from: str | None = None
    """Start from these weights: an exported folder (anyorder convert/export), a hub id, or a
    run/checkpoint folder; the model section is taken from it (only model.dropout may differ)."""


@dataclass
class RunConfig:
    """Everything a training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    order: OrderConfig = field(default_factory=OrderConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


# ----------------------------------------------------------------------------- loading


def to_dict(obj: Any) -> Any:
    """A dataclass as plain nested dicts/lists (tuples become lists), for YAML and JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert ints to floats and lists to tuples."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, item, key) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "2e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        # YAML 1.1 reads 1e-3 (no dot) as a string; take it as the number it plainly is.
        if isinstance(value, str) and _EXP_FLOAT.fullmatch(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:  # pragma: no cover - every field type is listed above
        return value
    raise ConfigError(
        f"config key {key!r} expects {_type_name(tp)}, got {value!r} ({type(value).__name__}); "
        f"fix the value in the file or on the command line"
    )


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """Construct dataclass ``cls`` from a dict, strictly (unknown keys are errors)."""
    if not isinstance(values, dict):
        raise ConfigError(f"config section {prefix!r} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(
                f"unknown config key {full!r}; known keys{' in ' + prefix if prefix else ''}: "
                f"{', '.join(names)}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build_section(tp, value, full)
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def _build_section(cls: type, value: Any, prefix: str) -> Any:
    if cls is ModelConfig and isinstance(value, dict):
        value = expand_model_values(value, prefix)
    return _build(cls, value, prefix)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into ``(["a", "b"], value)``; the value is parsed as YAML."""
    import yaml

    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value; write e.g. train.steps=100")
    key, _, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p.isidentifier() for p in parts):
        raise ConfigError(f"override key {key!r} is not a dotted name like train.steps")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def load_config(
    source: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Load a :class:`RunConfig`: defaults <- YAML file ``source`` <- ``overrides``.

    Args:
        source: a YAML file, or None for the defaults.
        overrides: ``key=value`` strings with dotted keys (``model.n_layer=6``).

    Raises:
        ConfigError: a missing file, bad YAML, an unknown key or a wrongly typed value.
    """
    import yaml

    values: dict[str, Any] = {}
    if source is not None:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; give a YAML file path")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ConfigError(
                f"config file {str(path)!r} is not valid YAML ({problem}{where}); fix the file"
            ) from None
        if loaded is None:  # an empty file (or only comments) is a mistake, not "defaults"
            raise ConfigError(
                f"config file {str(path)!r} is empty; write the settings to change (e.g. "
                "model: {kind: armd}), or start from a file in configs/"
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
        values = loaded
    for item in overrides:
        parts, value = parse_override(item)
        node = values
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = child
        node[parts[-1]] = value
    return config_from_dict(values)


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """A :class:`RunConfig` from a nested mapping (a saved config, or sections of one):
    fields it lacks take today's defaults, so configs saved before a field existed still
    load. Raises :class:`ConfigError` on an unknown key or a wrongly typed value."""
    if not isinstance(values, dict):
        raise ConfigError("a config must be a mapping of sections")
    try:
        return _build_run(values)
    except TypeError as e:  # a section given as a scalar, etc.
        raise ConfigError(f"bad config: {e}") from None


def _build_run(values: dict[str, Any]) -> RunConfig:
    names = [f.name for f in dataclasses.fields(RunConfig)]
    for key in values:
        if key not in names:
            raise ConfigError(f"unknown config key {key!r}; known sections: {', '.join(names)}")
    hints = typing.get_type_hints(RunConfig)
    return RunConfig(**{k: _build_section(hints[k], v, k) for k, v in values.items()})


def describe(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(key, default, help)`` for every field, for the CLI and the docs."""
    rows: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((key, repr(default), docs.get(f.name, "")))
    return rows
