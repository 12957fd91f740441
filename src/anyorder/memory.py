"""What a model and a training step take, against this machine's memory, before any of it is
allocated.

Design choices:

* The estimates are lower bounds: fp32 weights, gradients and AdamW's two moments (16 bytes a
  parameter, +4 with an EMA), the matrices of the trunk (12 d^2 a layer) and the tables, and
  the activations a micro-batch must keep for its backward pass (a few d-wide tensors per
  token and layer, the logits). A run refused by them cannot fit; one they pass may still
  not, and then the allocator's error is the answer, as before.
* The machine's memory is the device's (a GPU's total) or the host's (physical memory, or a
  cgroup limit when lower).
* Nothing here builds a model or touches torch's allocator, so a size of 10**6 is refused
  in microseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

from anyorder.config import ModelConfig, RunConfig
from anyorder.errors import ConfigError

ACT_BYTES_PER_LAYER_TOKEN = 16
"""Bytes per layer, token and unit of width a backward pass keeps at least (four fp32
d-wide tensors: the block's input, the attention output, the MLP's input and its hidden
layer, the last 4x wide counted as one)."""


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


def param_estimate(d_model: int, n_layer: int, vocab: int, seq_len: int) -> int:
    """A lower bound on the parameters of any of the models: 12 d^2 a layer (attention and
    MLP), the token table and the position table (the head may be tied)."""
    return 12 * d_model * d_model * n_layer + (vocab + seq_len) * d_model


def check_model_memory(cfg: ModelConfig) -> None:
    """Refuse a model whose fp32 weights and tables alone cannot fit in this machine's
    memory, before it is built: a config's size (say a ``seq_len`` of 10**15 in a damaged
    or hand-edited config.json) would otherwise surface as an allocator error far from its
    cause, or as an out-of-memory blamed on the request.

    Raises:
        ConfigError: the estimate, the machine's memory and the fields that set it.
    """
    have = machine_memory("cpu")
    params = param_estimate(cfg.d_model, cfg.n_layer, cfg.vocab_size, cfg.seq_len)
    if have is None or 4 * params <= have:
        return
    raise ConfigError(
        f"the model's config asks for at least {params:,} parameters ({format_bytes(4 * params)}"
        f" in fp32: {cfg.n_layer} layers x {cfg.d_model}, vocabulary {cfg.vocab_size:,}, "
        f"context {cfg.seq_len:,}), more than this machine's {format_bytes(have)}; check "
        "model.seq_len, model.d_model, model.n_layer and model.vocab_size"
    )


def training_bytes(
    cfg: RunConfig, world_size: int = 1, max_rows: int | None = None
) -> tuple[int, int, int]:
    """``(total, parameters, micro-batch rows)`` of one training step of ``cfg`` on one rank:
    a lower bound (see the module notes). The vocabulary may not be known yet (the tokenizer
    sets it), so the byte-level one (256) stands in where the config says more. ``max_rows``
    caps the micro-batch (a dry run takes at most 2 rows); a LoRA run (``train.lora``) keeps
    no gradient or optimizer state for its frozen weights."""
    m, t = cfg.model, cfg.train
    vocab = min(m.vocab_size, 256)
    params = param_estimate(m.d_model, m.n_layer, vocab, m.seq_len)
    # weights, gradients and AdamW's two moments (and EMA's copy); with LoRA adapters only
    # the frozen weights (the adapters, a few per cent, are left out of this lower bound)
    per_param = 4 if t.lora.r > 0 else 16 + (4 if t.ema > 0 else 0)
    shards = world_size if t.fsdp else 1
    rows = max(1, t.batch_size // max(1, world_size * t.grad_accum))
    rows = rows if max_rows is None else min(rows, max_rows)
    tokens = rows * m.seq_len
    acts = tokens * (m.n_layer * m.d_model * ACT_BYTES_PER_LAYER_TOKEN + vocab * 4)
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
