"""Set-up of a run: the checks, the data, and the objects a run is made of.

Design choices:

* :func:`check_config` takes everything that needs no data, so a bad setting stops the run
  before anything is read or written.
* One global batch per step whatever the number of processes: ``train.batch_size``
  sequences, split over ranks (rank ``r`` takes rows ``r::world`` of the global batch, as
  :class:`~anyorder.data.BlockSampler` hands them out) and then over ``grad_accum``
  micro-steps. The generation orders are drawn for the *global* batch on every rank with
  the same seeded generator and each rank takes its rows, so the orders a row gets do not
  depend on the number of processes either: two ranks reproduce one process. (The encoder's
  mask levels come from a per-rank generator, so an ``mdm`` run matches across world sizes
  in distribution only.)
* The loss goes through :class:`LossModule`'s ``__call__``, the one forward DDP and FSDP
  wrap (see :mod:`anyorder.training.distributed`).
* Mixed precision: ``train.dtype=auto`` is bf16 autocast on CUDA and, on the CPU, bf16
  where that CPU computes bf16 faster than fp32 (measured once: :mod:`anyorder.precision`;
  about 1.5-2x faster for the tiny models on a CPU with AMX, 7-13x slower on one with
  AVX2 only), else fp32. Losses are computed in fp32 (the models upcast the logits).
* ``torch.compile`` works in place, after wrapping (:func:`compile_modules`): on by default
  on CUDA, off on the CPU (:data:`COMPILE_AUTO`).
* Rank 0 tokenizes; the other ranks wait and read its folder. A dry run without a prepared
  cache tokenizes at most :data:`DRY_RUN_DOCUMENTS` documents into a temporary folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from anyorder import checkpoint as ckpt_mod
from anyorder.config import RunConfig
from anyorder.errors import ConfigError, preview
from anyorder.models.lora import adapter_keys, add_adapters, lora_on
from anyorder.orders import OrderSampler
from anyorder.precision import bf16_is_fast, slower_note, use_bf16
from anyorder.training.distributed import DistEnv, barrier, is_fsdp, print0, wrap_model
from anyorder.training.muon import MuonAdamW, muon_matrices
from anyorder.training.state import EMA, RunParts

if TYPE_CHECKING:
    from anyorder.data import TokenData

DRY_RUN_DOCUMENTS = 2000
"""A dry run without a prepared cache tokenizes at most this many documents (in a temp dir)."""
COMPILE_AUTO = {"cpu": False, "cuda": True}
"""What ``train.compile=auto`` means on each device type. On CUDA (with Triton, which
inductor's GPU kernels need) the loss compiles: the whole loss and its backward are one
graph for every model kind (``fullgraph=True``, tested on the CPU), and nanoGPT-style
trainers, the AO-GPT authors' among them, compile theirs; ``benchmarks/gpu_check.sh`` times
compiled beside eager (``train_step.py --compile both``). Off on the CPU: on this project's
CPU a compiled step is no faster (docs/performance.md)."""
COMPILE_KWARGS: dict[str, Any] = {}
"""Extra ``torch.compile`` arguments of a compiled run (tests use ``backend="aot_eager"``)."""


def check_config(cfg: RunConfig, world_size: int = 1) -> None:
    """Checks that need no data: run before anything is read or written.

    Raises:
        ConfigError: a batch that does not split, an order the model cannot train on, bad
            intervals or dtype.
    """
    from anyorder.models.lora import check_lora

    t, o, m = cfg.train, cfg.order, cfg.model
    _check_numbers(cfg)
    check_lora(cfg)
    OrderSampler(o, t.steps)  # unknown order kinds and bad progressive settings
    for name in ("steps", "batch_size", "grad_accum"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be a positive integer")
    for name in ("eval_every", "ckpt_every", "log_every", "warmup_steps", "eval_batches"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0")
    if t.keep_last < 1:
        raise ConfigError(f"train.keep_last={t.keep_last} must be at least 1")
    if not 0.0 < t.lr <= 1e30:  # beyond, AdamW's fp32 step size overflows
        raise ConfigError(f"train.lr={t.lr} must be a positive number (at most 1e30), e.g. 1e-3")
    if t.optimizer not in ("adamw", "muon"):
        raise ConfigError(f"train.optimizer={preview(t.optimizer)}: use adamw or muon")
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError(f"train.muon_momentum={t.muon_momentum} must be in [0, 1), e.g. 0.95")
    if t.optimizer == "muon" and t.fsdp:
        raise ConfigError(
            "train.optimizer=muon orthogonalises whole matrices, which FSDP shards over the "
            "ranks; use DDP (train.fsdp=false) or train.optimizer=adamw"
        )
    if not 0.0 <= t.ema < 1.0:
        raise ConfigError(f"train.ema={t.ema} must be in [0, 1) (0 disables)")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    per = world_size * t.grad_accum
    if t.batch_size % per:
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not split over {world_size} process(es) x "
            f"{t.grad_accum} accumulation step(s); use a multiple of {per}"
        )
    if t.dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.dtype={preview(t.dtype)}: use auto, bf16 or fp32")
    if not isinstance(t.activation_checkpointing, bool):
        raise ConfigError(
            f"train.activation_checkpointing={preview(t.activation_checkpointing)}: use true "
            "(recompute each block in backward) or false"
        )
    if not 0.0 < cfg.data.val_fraction < 1.0:  # validation runs at the end of every run
        raise ConfigError(
            f"data.val_fraction={cfg.data.val_fraction} must lie in (0, 1) for training "
            "(validation runs at the end); use e.g. 0.05"
        )
    if isinstance(t.compile, str) and t.compile != "auto":
        raise ConfigError(f"train.compile={preview(t.compile)}: use true, false or auto")
    block_orders = o.kind == "sbp" or (o.kind == "strided" and o.streams > 1)
    if block_orders and m.kind in ("gpt", "aogpt"):
        raise ConfigError(
            f"order.kind={o.kind} trains on blocks of several tokens, which only armd and mdm "
            "take; use model.kind=armd or a token-level order"
        )
    _check_condition(cfg)
    if o.kind == "strided" and m.seq_len % o.streams:
        raise ConfigError(
            f"order.streams={o.streams} does not divide model.seq_len={m.seq_len}; pick a divisor"
        )
    if o.kind == "sbp" and any(m.seq_len % s for s in o.sbp_streams):
        raise ConfigError(
            f"order.sbp_streams={list(o.sbp_streams)} must all divide model.seq_len={m.seq_len}"
        )


def _check_condition(cfg: RunConfig) -> None:
    """``data.format`` is known, and ``order.condition=prompt`` has prompt/response data
    (``data.format=auto`` resolved by the first record of a local source).

    Raises:
        ConfigError: an unknown data.format or order.condition, or a prompt condition on
            text data.
        DataError: a prompt condition on a local source that does not exist.
    """
    from anyorder.data import DATA_FORMATS, data_format, resolve_files

    if cfg.data.format not in DATA_FORMATS:
        data_format(cfg.data)  # raises the error
    if cfg.order.condition != "prompt":
        return
    source = cfg.data.source
    if cfg.data.format == "auto" and not source.startswith(("hf:", "builtin:")):
        resolve_files(source)  # a missing source is that error, not "read as text"
    if data_format(cfg.data) != "chat":
        raise ConfigError(
            f"order.condition=prompt needs prompt/response data, and data.source "
            f"{preview(source)} is read as text; give .jsonl records with prompt and "
            "response or messages (data.format=chat), or set order.condition=none"
        )


def _check_numbers(cfg: RunConfig) -> None:
    """Seeds, AdamW's coefficients and stream counts at their edges (each used to reach
    torch, or a modulo, as a traceback).

    Raises:
        ConfigError: naming the key, its range and an example.
    """
    from anyorder.bounds import MAX_SEED

    t, o = cfg.train, cfg.order
    for name, seed in (("train.seed", t.seed), ("order.seed", o.seed)):
        if not 0 <= seed <= MAX_SEED:
            shown = str(seed) if len(str(seed)) <= 30 else f"{str(seed)[:20]}... "
            raise ConfigError(
                f"{name}={shown} must be a whole number in 0..{MAX_SEED} (2**63 - 1), e.g. 0"
            )
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:  # at 1 the moment never forgets: no step
            raise ConfigError(f"train.{name}={getattr(t, name)} must be in [0, 1), e.g. 0.95")
    for name in ("weight_decay", "grad_clip"):
        if not 0.0 <= getattr(t, name) < math.inf:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be a finite number >= 0")
    if o.streams < 1:
        raise ConfigError(f"order.streams={o.streams} must be at least 1 (1: token by token)")
    if any(s < 1 for s in o.sbp_streams):
        raise ConfigError(
            f"order.sbp_streams={list(o.sbp_streams)} must all be at least 1, e.g. [1, 2, 4]"
        )


def resolve_vocab(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """The config with ``model.vocab_size`` set to the tokenizer's (under ``train.init_from``,
    a larger one of the weights is kept).

    Raises:
        ConfigError: the config asked for fewer ids than the tokenizer has.
    """
    if cfg.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{vocab_size} ids; remove the setting or set model.vocab_size={vocab_size}"
        )
    if cfg.train.init_from and cfg.model.vocab_size > vocab_size:
        # a pretrained table with rows past the tokenizer's ids (Qwen's 151,936 for 151,669
        # tokens): they never occur in the data, and the weights keep their shape
        print0(
            f"model.vocab_size {cfg.model.vocab_size} kept from train.init_from (the tokenizer "
            f"has {vocab_size} ids; the rest never occur in the data)"
        )
        return cfg
    if cfg.model.vocab_size != vocab_size:
        print0(f"model.vocab_size {cfg.model.vocab_size} -> {vocab_size} (from the tokenizer)")
    model = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    return dataclasses.replace(cfg, model=model)


def prepare_data(
    cfg: RunConfig, env: DistEnv, dry_run: bool, progress: bool, tmp: Path | None
) -> TokenData:
    """The run's tokenized data: rank 0 prepares it, the other ranks then read its folder."""
    from anyorder.data import cache_key, prepare

    data_cfg = cfg.data
    ready = data_cfg.cache_path() / cache_key(data_cfg, cfg.model.seq_len)
    prepared = (ready / "manifest.json").is_file()
    if not dry_run and not prepared:  # say where it goes
        print0(f"data: preparing {data_cfg.source} into {ready} (data.cache_dir)")
    if dry_run and not prepared:
        assert tmp is not None
        cap = DRY_RUN_DOCUMENTS
        if data_cfg.max_documents is not None:
            cap = min(cap, data_cfg.max_documents)
        data_cfg = dataclasses.replace(data_cfg, cache_dir=str(tmp), max_documents=cap)
    show = progress and env.is_main
    # Rank 0 tokenizes; the others wait and then read its folder.
    if env.is_main:
        data = prepare(data_cfg, cfg.model.seq_len, progress=show)
    barrier(env)
    if not env.is_main:
        data = prepare(data_cfg, cfg.model.seq_len, progress=False)
    return data


# ----------------------------------------------------------------------------- the pieces


def make_optimizer(model: nn.Module, cfg: RunConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices (>= 2-D) only; norms, biases, BOS undecayed. With
    ``train.optimizer=muon``, the linear layers' matrices take Muon instead (the same lr).

    In the AO-GPT reference's layout (``model.bos_pos_row``) the BOS vector is decayed: there
    it is a one-row embedding table (``wnonee``, 2-D), which their optimizer decays."""
    t = cfg.train
    muon = muon_matrices(model) if t.optimizer == "muon" else []
    taken = {id(p) for p in muon}
    rest = [(name, p) for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in taken]  # fmt: skip
    decayed = [p.dim() >= 2 or (name == "bos" and cfg.model.bos_pos_row) for name, p in rest]
    groups = [
        {"params": [p for (_, p), d in zip(rest, decayed) if d], "weight_decay": t.weight_decay},
        {"params": [p for (_, p), d in zip(rest, decayed) if not d], "weight_decay": 0.0},
    ]
    if muon:
        muon_group = {"params": muon, "weight_decay": t.weight_decay, "muon": True}
        # Newton-Schulz in bf16 (torch's) where bf16 is fast, else in fp32 (see muon.py)
        ns = torch.bfloat16 if bf16_is_fast(device, cfg.model.d_model) else torch.float32
        return MuonAdamW(
            [muon_group, *groups],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            momentum=t.muon_momentum,
            ns_dtype=ns,
        )
    # fused AdamW on CUDA; the CPU keeps the default (foreach) implementation.
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), **extra)


class LossModule(nn.Module):
    """``wrapper(tokens, order, blocks, generator, prompt_len, draws) = model.loss(...)``: the one
    forward that DDP and FSDP wrap, so their hooks run for every model kind."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        tokens: Tensor,
        order: Tensor | None,
        blocks: Tensor | None,
        generator: torch.Generator | None = None,
        prompt_len: Tensor | None = None,
        draws: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """``draws``: the loss's random inputs, drawn ahead (``model.loss_draws``), so that
        a compiled forward sees no generator."""
        extra = dict(draws or {})
        if prompt_len is not None:  # a model without the keyword (a test double) still trains
            extra["prompt_len"] = prompt_len
        return self.model.loss(tokens, order, blocks, generator=generator, **extra)


def use_compile(cfg: RunConfig, device: torch.device) -> bool:
    """Whether this run compiles: ``train.compile``, with ``auto`` resolved per device."""
    c = cfg.train.compile
    if isinstance(c, bool):
        return c
    return COMPILE_AUTO.get(device.type, False) and (device.type != "cuda" or _has_triton())


def _has_triton() -> bool:
    """Whether inductor can make GPU kernels here (Triton imports)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


def compile_modules(model: nn.Module, train_module: nn.Module, fullgraph: bool = False) -> None:
    """Compile, in place, the training entry point (the loss, so the cross-entropy over the
    vocabulary is compiled with the model) and the model itself: its ``forward`` and, for the
    models that have one, its ``features`` trunk, which validation's ``token_nll`` calls
    before the head runs in chunks.

    In place (``Module.compile``), so nothing is wrapped: parameters, ``state_dict`` keys
    (no ``_orig_mod.``), EMA and checkpoints see the plain modules. ``train_module`` is the
    outermost wrapper (DDP's, so that dynamo splits the graph at DDP's gradient buckets;
    under FSDP2 the loss module over the sharded model, whose hooks dynamo leaves to run
    eagerly). Calls of the compiled model inside the compiled loss are traced inline.

    ``fullgraph`` (one process): the loss and its backward are one graph, and a graph break
    is an error instead of a silent slowdown (DDP's and FSDP's runs break it on purpose).
    """
    model.compile(**COMPILE_KWARGS)
    if model.has_features() and model.compile_features:
        # an instance attribute: the class and state_dict are untouched
        model.features = torch.compile(model.features, **COMPILE_KWARGS)
    train_module.compile(fullgraph=fullgraph, **COMPILE_KWARGS)


def autocast_context(cfg: RunConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast where ``train.dtype`` asks for it or ``auto`` finds it faster
    (:func:`anyorder.precision.use_bf16`); fp32 otherwise."""
    dtype = cfg.train.dtype
    if dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.dtype={preview(dtype)}: use auto, bf16 or fp32")
    if not use_bf16(dtype, device, cfg.model.d_model):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def enable_tf32(device: torch.device) -> None:
    """TF32 matmuls and convolutions on CUDA (fp32 stays fp32 on the CPU)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def build_parts(
    cfg: RunConfig, env: DistEnv, data: TokenData, resume_from: Path | None
) -> RunParts:
    """Model, wrapper, optimizer, EMA, generators and data cursor, identical on every rank but
    for the per-rank generators; the weights come from ``train.init_from`` unless resumed."""
    from anyorder.data import BlockSampler
    from anyorder.models import build_model

    t, device = cfg.train, env.device
    if t.dtype == "bf16" and device.type == "cpu":
        note = slower_note("train.dtype", cfg.model.d_model)
        if note:
            print0(note)
    torch.manual_seed(t.seed)
    model = build_model(cfg.model).to(device)
    model.checkpoint_blocks = t.activation_checkpointing  # before FSDP's wrapping and compile
    base, keys = None, None
    # start from converted or exported weights; a LoRA run's base comes from there on resume
    if t.init_from and (resume_from is None or lora_on(cfg)):
        from anyorder.interop.hub import init_weights_from

        path = init_weights_from(model, t.init_from).path
        print0(f"weights from {path}")
        if lora_on(cfg):
            base = {"path": str(Path(path).resolve()), "sha256": ckpt_mod.state_digest(model)}
    if lora_on(cfg):
        add_adapters(model, t.lora)  # in place; the base frozen
        keys = adapter_keys(model)
    aliases = ckpt_mod.tied_aliases(model)
    n_params = model.num_params()
    train_module = wrap_model(model, LossModule(model), cfg, env)
    if use_compile(cfg, device):  # after wrapping: see compile_modules
        compile_modules(model, train_module, fullgraph=not env.distributed)
    opt = make_optimizer(model, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    ema = EMA(params, t.ema, t.ema_warmup) if t.ema > 0 else None
    order_sampler = OrderSampler(cfg.order, t.steps)
    # The order generator is the same on every rank (global-batch orders); the loss
    # generator (the encoder's mask levels) is per rank.
    order_gen = torch.Generator().manual_seed(t.seed)
    loss_gen = torch.Generator().manual_seed(t.seed * 1_000_003 + 7919 * (env.rank + 1))
    torch.manual_seed(t.seed + 1000 * env.rank)  # dropout differs between ranks
    sampler = BlockSampler(data.num_blocks("train"), t.batch_size, t.seed, env.rank, env.world_size)
    return RunParts(
        cfg=cfg,
        env=env,
        data=data,
        model=model,
        train_module=train_module,
        opt=opt,
        params=params,
        ema=ema,
        order_sampler=order_sampler,
        order_gen=order_gen,
        loss_gen=loss_gen,
        sampler=sampler,
        autocast=autocast_context(cfg, device),
        fsdp=is_fsdp(cfg, env),
        aliases=aliases,
        n_params=n_params,
        micro=t.batch_size // env.world_size // t.grad_accum,
        base=base,
        adapters=keys,
    )
