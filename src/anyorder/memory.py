"""What a model and a training step take, against this machine's memory, before any of it is
allocated.

Design choices:

* The estimates are lower bounds: fp32 weights, gradients and AdamW's two moments (16 bytes a
  parameter, +4 with an EMA) of the exact parameter count (:func:`param_estimate`), and the
  activations a micro-batch must keep for its backward pass (:func:`activation_bytes`: the
  inputs of each block's four matrix products, or only the blocks' inputs when they are
  recomputed, and the logits). A run refused by them cannot fit; one they pass may still
  not, and then the allocator's error is the answer, as before.
* The machine's memory is the device's (a GPU's total) or the host's (physical memory, or a
  cgroup limit when lower).
* Nothing here builds a model or touches torch's allocator, so a size of 10**6 is refused
  in microseconds.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from anyorder.config import ModelConfig, RunConfig
from anyorder.errors import ConfigError


def format_bytes(n: float) -> str:
    """``1.5 GB``, ``300 MB``: decimal units, as ``free -h`` shows them roughly."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 1e3:,.0f} kB"


def machine_memory(device: str = "cpu") -> int | None:
    """Bytes of memory on ``device``: a CUDA device's total, or the host's (its physical
    memory or the cgroup's limit, the lower). None where it cannot be read."""
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return int(total)


def available_memory() -> int:
    """Bytes the host could hand out now without swapping: ``MemAvailable`` (free memory plus
    what the kernel can reclaim, page cache included), within a cgroup's limit; the physical
    memory's half where that cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
        else:
            raise OSError("no MemAvailable")
    except (OSError, ValueError, IndexError):
        return (machine_memory() or 0) // 2
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = Path("/sys/fs/cgroup/memory.current").read_text().strip()
        if limit.isdigit() and used.isdigit():
            avail = min(avail, max(0, int(limit) - int(used)))
    except OSError:
        pass
    return avail


def param_estimate(cfg: ModelConfig) -> int:
    """The number of parameters of the model ``cfg`` builds, from its fields alone (equal
    to ``sum(p.numel() for p in build_model(cfg).parameters())``, a tied head counted once):
    grouped-query attention, ``head_dim``, ``intermediate_size``, biases, QK-norm, an
    untied or biased head, the position tables and each kind's own parts."""
    d, L = cfg.d_model, cfg.n_layer
    learned = cfg.positional == "learned"
    tables = cfg.table_vocab * d  # the token table (the head's weight when tied)
    if cfg.kind == "mdm":  # one [MASK] row more, an unbiased head over the vocabulary
        tables = (cfg.vocab_size + 1) * d + (0 if cfg.tie_embeddings else d * cfg.vocab_size)
    else:
        tables += (0 if cfg.tie_embeddings else tables) + (cfg.table_vocab if cfg.head_bias else 0)
    rows = cfg.seq_len + (int(cfg.bos_pos_row) if cfg.kind in ("gpt", "aogpt") else 0)
    tables += rows * d if learned else 0
    block = _block_params(cfg)
    extra = 0
    if cfg.kind in ("gpt", "aogpt"):
        extra += d  # the BOS vector
    if cfg.kind == "aogpt" and cfg.target_injection == "adaln":
        c = cfg.target_dim
        extra += cfg.seq_len * c + (c + 1) * 2 * d  # the target table, the final norm's adaLN
        block += (c + 1) * 6 * d  # each block's adaLN
    elif cfg.kind == "aogpt":
        extra += cfg.seq_len * d  # the added target table (sigma-GPT)
    if cfg.kind == "armd":
        extra += (d + 1) * (d // 4) + (d // 4 + 1) * d  # the query stream's position MLP
    return tables + L * block + _norm_params(cfg, d) + extra


def _norm_params(cfg: ModelConfig, dim: int) -> int:
    return dim * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def _block_params(cfg: ModelConfig) -> int:
    """One block: two norms, attention (fused q/k/v, output, QK-norm gains), the MLP."""
    d, q, kv = cfg.d_model, cfg.n_head * cfg.d_head, cfg.kv_heads * cfg.d_head
    hidden, up = cfg.mlp_hidden, 2 if cfg.mlp == "swiglu" else 1
    attn = d * (q + 2 * kv) + q * d
    attn += (q + 2 * kv if cfg.attn_bias else 0) + (d if cfg.bias else 0)
    attn += 2 * cfg.d_head if cfg.qk_norm else 0
    mlp = d * up * hidden + hidden * d + ((up * hidden + d) if cfg.bias else 0)
    return 2 * _norm_params(cfg, d) + attn + mlp


def rope_table_bytes(cfg: ModelConfig) -> int:
    """Bytes of the RoPE tables a model of ``cfg`` computes at its first forward
    (:func:`anyorder.layers.rope.positions`): cos and sin of every position, and the two
    joined, in fp32. They grow with ``seq_len`` alone (the weights do not); 0 without RoPE."""
    return 16 * cfg.rope_rows * cfg.d_head if cfg.positional == "rope" else 0


def check_model_memory(cfg: ModelConfig) -> None:
    """Refuse a model whose fp32 weights and tables (RoPE's too) alone cannot fit in this
    machine's memory, before it is built: a config's size (say a ``seq_len`` of 10**15 in a
    damaged or hand-edited config.json) would otherwise surface as an allocator error far
    from its cause, or as an out-of-memory blamed on the request. The message names the RoPE
    tables where they are the larger part.

    Raises:
        ConfigError: the estimate, the machine's memory and the fields that set it.
    """
    have = machine_memory("cpu")
    params = param_estimate(cfg)
    rope = rope_table_bytes(cfg)
    need = 4 * params + rope
    if have is None or need <= have:
        return
    tables = f" and RoPE tables for {cfg.rope_rows:,} positions" if rope > 4 * params else ""
    raise ConfigError(
        f"the model's config asks for at least {params:,} parameters{tables} "
        f"({format_bytes(need)} in fp32: {cfg.n_layer} layers x {cfg.d_model}, vocabulary "
        f"{cfg.vocab_size:,}, context {cfg.seq_len:,}), more than this machine's "
        f"{format_bytes(have)}; check model.seq_len, model.d_model, model.n_layer and "
        "model.vocab_size"
    )


def activation_bytes(
    cfg: ModelConfig, tokens: int, *, checkpointing: bool = False, half: bool = False
) -> int:
    """Bytes of activations a training step on ``tokens`` tokens keeps for its backward pass,
    at least.

    A block keeps the inputs of its four matrix products (the weights' gradients need them):
    ``d`` (q/k/v), ``n_head * head_dim`` (the output projection), ``d`` (the MLP's first)
    and its hidden width, in bf16 under autocast (``half``) and fp32 otherwise; ARMD's
    two-stream layers keep them for both streams (the last one's q/k/v input only). With
    ``checkpointing`` a block keeps only its fp32 input, and one block at a time is
    recomputed in backward. The fp32 logits come on top.
    """
    d, q = cfg.d_model, cfg.n_head * cfg.d_head
    size = 2 if half else 4
    per_layer = (2 * d + q + cfg.mlp_hidden) * size  # bytes per token and stream
    layers = cfg.n_layer
    if cfg.kind == "armd":  # the two-stream layers: twice, the last one's q/k/v input only
        l2s = cfg.two_stream_layers
        layers += l2s - 1
        per_layer_block = 2 * per_layer
        extra = d * size
    else:
        per_layer_block, extra = per_layer, 0
    # recomputed: each block's fp32 input, and one block's own activations at a time
    kept = layers * d * 4 + per_layer_block if checkpointing else layers * per_layer
    kept += extra
    return tokens * (kept + 4 * cfg.vocab_size)


def training_bytes(
    cfg: RunConfig, world_size: int = 1, max_rows: int | None = None
) -> tuple[int, int, int]:
    """``(total, parameters, micro-batch rows)`` of one training step of ``cfg`` on one rank:
    a lower bound (see the module notes). The vocabulary may not be known yet (the tokenizer
    sets it), so the byte-level one (256) stands in where the config says more, unless the
    model comes from ``train.init_from`` (its vocabulary is the weights'). ``max_rows`` caps
    the micro-batch (a dry run takes at most 2 rows); a LoRA run (``train.lora``) keeps no
    gradient or optimizer state for its frozen weights."""
    m, t = cfg.model, cfg.train
    if not t.init_from and m.vocab_size > 256:
        m = dataclasses.replace(m, vocab_size=256)
    params = param_estimate(m)
    # weights, gradients and AdamW's two moments (and EMA's copy); with LoRA adapters only
    # the frozen weights (the adapters, a few per cent, are left out of this lower bound)
    per_param = 4 if t.lora.r > 0 else 16 + (4 if t.ema > 0 else 0)
    shards = world_size if t.fsdp else 1
    rows = max(1, t.batch_size // max(1, world_size * t.grad_accum))
    rows = rows if max_rows is None else min(rows, max_rows)
    half = t.dtype != "fp32"  # bf16 under autocast is possible: count its half-size inputs
    acts = activation_bytes(
        m, rows * m.seq_len, checkpointing=t.activation_checkpointing, half=half
    )
    return params * per_param // shards + acts, params, rows


def check_training_memory(
    cfg: RunConfig, world_size: int = 1, device: str = "cpu", max_rows: int | None = None
) -> None:
    """Refuse a run whose step cannot fit in the device's memory, before anything is built.

    Raises:
        ConfigError: the estimate, the machine's memory and what to lower.
    """
    have = machine_memory(device)
    need, params, rows = training_bytes(cfg, world_size, max_rows)
    if have is None or need <= have:
        return
    m = cfg.model
    where = "this GPU" if str(device).startswith("cuda") else "this machine"
    raise ConfigError(
        f"the model ({params:,} parameters, {m.n_layer} layers x {m.d_model}) and one "
        f"training step ({rows} rows of {m.seq_len} tokens) need at least "
        f"{format_bytes(need)}, more than {where}'s {format_bytes(have)}; lower "
        "model.d_model, model.n_layer, model.seq_len or train.batch_size (or raise "
        "train.grad_accum)"
    )
