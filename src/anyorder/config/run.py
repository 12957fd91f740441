"""The other sections of a run config (data, order, train) and :class:`RunConfig`, which
holds all four; :func:`to_dict` turns any of them into plain dicts for YAML and JSON.

Every field carries its help text as the string literal under it (read by
:func:`anyorder.config.loading.field_docs` for ``anyorder info --config-keys`` and
docs/configs.md).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anyorder.config.model import ModelConfig
from anyorder.errors import ConfigError


def to_dict(obj: Any) -> Any:
    """A dataclass as plain nested dicts/lists (tuples become lists), for YAML and JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


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
    cache_dir: str = "auto"
    """Folder for the packed token shards (reused when source and tokenizer match); auto:
    $ANYORDER_CACHE/data, else $XDG_CACHE_HOME/anyorder/data, else ~/.cache/anyorder/data
    (never the current folder)."""
    streaming: bool = False
    """Stream a Hugging Face dataset instead of downloading it whole."""
    max_documents: int | None = None
    """Stop after this many documents (quick runs on a large corpus)."""
    format: str = "auto"
    """text (documents packed into blocks), chat (prompt/response or messages records, one
    example a block: docs/data.md), or auto: chat for .jsonl whose first record holds
    prompt and response or messages, text otherwise (hf: datasets need chat said)."""

    def cache_path(self) -> Path:
        """The folder ``cache_dir`` names (``auto``: the cache home, see the field's help).

        Raises:
            ConfigError: an empty value (an unset shell variable).
        """
        if not self.cache_dir.strip():
            raise ConfigError(
                "data.cache_dir is empty (an unset shell variable?); leave it out for the "
                "cache home (~/.cache/anyorder/data), or name a folder"
            )
        if self.cache_dir != "auto":
            return Path(self.cache_dir).expanduser()
        return cache_home() / "data"


def cache_home() -> Path:
    """Where anyorder keeps what it can rebuild: ``$ANYORDER_CACHE``, else
    ``$XDG_CACHE_HOME/anyorder``, else ``~/.cache/anyorder``."""
    if os.environ.get("ANYORDER_CACHE"):
        return Path(os.environ["ANYORDER_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "anyorder"


@dataclass
class OrderConfig:
    """The distribution of generation orders used in training."""

    kind: str = "uniform"
    """l2r, uniform, mix, fixed, progressive, strided or sbp."""
    p_l2r: float = 0.1
    """mix: probability of the left-to-right order (AO-GPT: 0.1)."""
    seed: int = 0
    """fixed: the seed of the one order used throughout."""
    i_ar: int | str = 0
    """progressive: last step of pure left-to-right training; a step, or a share of
    train.steps such as '10%' (then it follows train.steps when that is overridden)."""
    i_perm: int | str = 1
    """progressive: step at which the number of displaced tokens reaches rho; a step or a
    share of train.steps such as '70%'."""
    rho: int = 32
    """progressive: the final number of displaced tokens."""
    streams: int = 1
    """strided: the number of streams S (must divide the sequence length)."""
    sbp_streams: tuple[int, ...] = (1, 2, 4)
    """sbp: the stream counts S drawn uniformly per step in SBP fine-tuning."""
    condition: str = "none"
    """none: every order covers the whole block, the loss every token. prompt (needs
    prompt/response data, data.format=chat): the prompt's positions come first in every
    order as known context, the answer's follow in the order kind's distribution, and the
    loss covers the answer only (gpt: left to right; mdm: the prompt never masked)."""


@dataclass
class LoraConfig:
    """LoRA adapters (through peft) on a frozen base: train.lora.r > 0 turns them on."""

    r: int = 0
    """The adapters' rank (0: off, every weight trains). With r > 0 only the adapters
    train; the base comes from train.init_from and stays frozen."""
    alpha: float = 16.0
    """The adapters' scale is alpha / r (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1) (peft's lora_dropout). ARMD's query
    projections and AO-GPT's joined adaLN read the layers' weights without calling them and
    see the adapters without this dropout."""
    targets: tuple[str, ...] = ("attn",)
    """The layers that get adapters: qkv (the fused query/key/value projection), attn_out
    (the attention's output projection), attn (both), mlp_in, mlp_out, mlp (both), adaln
    (aogpt's adaLN linears), query_mlp (armd's query-position MLP)."""


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
    optimizer: str = "adamw"
    """adamw, or muon: Muon on the linear layers' matrices and AdamW on the rest (tables,
    head, norms, biases), at the same lr (Muon's steps are scaled to AdamW's size). Under
    train.lora, Muon takes the adapters' A and B of those layers (r x d and d x r matrices;
    on a small fine-tune as good as AdamW at each one's best lr, training/muon.py) and AdamW
    those of the adaLN linears; either may be left with none."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    weight_decay: float = 0.1
    """Weight decay (decoupled; on matrices only)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    ema: float = 0.0
    """EMA decay of the weights (0 disables; the paper presets use 0.9999)."""
    ema_warmup: bool = True
    """Ramp the EMA decay as the AO-GPT reference does: min(ema, (1 + u) / (10 + u)) at the
    u-th update (u = 1, 2, ...; from 2/11)."""
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
    """Autocast dtype: auto (bf16 on CUDA and on a CPU that computes bf16 faster than fp32,
    measured once per CPU; else fp32), bf16 or fp32."""
    compile: bool | str = "auto"
    """torch.compile the model and its loss: true, false, or auto (on on CUDA where Triton
    imports, off on the CPU, where a compiled step is no faster; see docs/performance.md).
    In one process the loss and its backward compile as one graph (fullgraph); the first
    step pays for the compilation and says how long it took."""
    fsdp: bool = False
    """Shard with FSDP2 fully_shard instead of DDP under torchrun."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of keeping its activations
    (torch.utils.checkpoint per block): a step keeps about one d-wide tensor per token and
    layer instead of a dozen, for one more forward of the blocks (about a third more
    compute). The same gradients, dropout included; for models that do not fit otherwise."""
    skip_nonfinite: bool = False
    """Skip an optimizer step whose loss is NaN/Inf (no update) instead of stopping the run
    (which first saves the state after the last good step)."""
    init_from: str | None = None
    """Start from these weights: an exported folder (anyorder convert/export), a hub id, or a
    run/checkpoint folder; the model section is taken from it (only model.dropout may differ)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the init_from weights (see the train.lora.* keys)."""


@dataclass
class RunConfig:
    """Everything a training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    order: OrderConfig = field(default_factory=OrderConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)
