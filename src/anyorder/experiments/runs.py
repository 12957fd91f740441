"""The run machinery of the experiments: where an experiment runs (:class:`Context`), the
arms' model variants, the CPU training runs every arm shares, and the small statistics and
helpers the sections use.

Design choices:

* Same code, data and token budget for every arm: each training run is the library's own
  :func:`anyorder.training.train` on ``builtin:pydoc`` bytes with the same model shape, batch
  and number of steps; only the model kind or the order distribution differs. The
  validation curves are the trainer's (``val/l2r_bpb``, ``val/ao_bpb``; fixed validation
  orders, so every arm is scored on the same orders).
* Runs are cached by name under ``OUT/runs`` (a run with ``done.json`` whose config matches
  is reused, :func:`train_run`), so the aogpt/gpt/mdm/armd runs of experiment 5 serve
  experiments 4, 7 and 8 too.
* Error bars across seeds: mean ± standard error of the seed means (:func:`mean_se`).
* CPU scale is deliberately small (2 layers, d_model 128, n = 64, batch 16, one thread):
  the comparisons are about relative effects. A ``smoke`` context shrinks everything (1
  layer, width 32, n = 16, a handful of steps) so that every experiment's whole code path
  is tested in seconds.
* The variants are spelled out field by field (:data:`OURS_FIELDS`, :data:`PUBLISHED`), so
  that the arms do not move with the defaults.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anyorder.config import VARIANTS
from anyorder.errors import ConfigError

DATA_SOURCE = "builtin:pydoc"
"""The CPU-scale corpus (Python's documentation as bytes, ~0.47 MB)."""


@dataclass
class Context:
    """Where and how big an experiment runs."""

    out: Path
    """Folder of this experiment's outputs (``OUT/NAME``)."""
    runs: Path
    """Shared folder of training runs (``OUT/runs``), reused across experiments."""
    scale: str = "cpu"
    """cpu (train here) or paper (torchrun command lines with the paper configs)."""
    minutes: float | None = None
    """Training budget per run in minutes (sets the steps from a measured throughput)."""
    seeds: int = 1
    """Training seeds per arm where the difference is small."""
    smoke: bool = False
    """Minimal sizes: tests the code path, the numbers mean nothing."""
    progress: bool = False
    """Progress bars and per-run messages."""
    nproc: int = 8
    """paper scale: GPUs per node for torchrun."""
    print_only: bool = False
    """paper scale: print the commands instead of running them."""
    commands: list[list[str]] = field(default_factory=list)
    """paper scale: the command lines built (and run unless print_only)."""
    only: str | None = None
    """Run only the arms whose label contains this text (re-running a changed arm; the
    section then shows those arms alone)."""

    @property
    def steps(self) -> int:
        """Optimizer steps of one CPU training run (the same for every arm)."""
        if self.smoke:
            return 4
        if self.minutes is None:
            return 1000
        return max(20, int(self.minutes * 60 * CPU_STEPS_PER_S))


CPU_STEPS_PER_S = 8.0
"""Measured steps/s of the CPU-scale model (2 x 128, n = 64, batch 16, bf16, one thread, on a
shared machine: 9-12K tokens/s), validation included."""


def model_overrides(ctx: Context, kind: str) -> list[str]:
    """The model shape shared by every arm at CPU scale (or its smoke version)."""
    if ctx.smoke:
        shape = dict(n_layer=1, n_head=2, d_model=32, seq_len=16, target_dim=16)
    else:
        shape = dict(n_layer=2, n_head=4, d_model=128, seq_len=64, target_dim=64)
    return [f"model.kind={kind}"] + [f"model.{k}={v}" for k, v in shape.items()]


def _overrides(fields: dict[str, Any]) -> list[str]:
    """``model.KEY=VALUE`` overrides spelling out ``fields`` (YAML values)."""

    def value(v: Any) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return [f"model.{k}={value(v)}" for k, v in fields.items() if k != "kind"]


OURS_FIELDS: dict[str, Any] = dict(
    pos_emb="learned",
    bos_pos_row=False,
    norm="rmsnorm",
    norm_eps=1e-6,
    qk_norm=True,
    bias=False,
    tie_embeddings=True,
    head_bias=False,
    padded_vocab=None,
    mlp="gelu",
    mlp_ratio=4.0,
    gelu="tanh",
    init_std=0.02,
    init_truncate=False,
    dropout=0.0,
    target_injection="adaln",
    adaln_gate_offset=True,
    adaln_init="zero",
    rope_query="input",
    # the trunk options of pretrained families (issue 33) came later: off, as these runs had
    n_kv_head=None,
    head_dim=None,
    intermediate_size=None,
    qkv_bias=None,
    rope_scaling_type="none",
    rope_factor=1.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_pos=8192,
    rope_bos_shift=False,
)
"""Our AO-GPT parameterization as of these experiments: adaLN gates centred on one and
zero-initialised modulation, the target embedding at unit scale, and our GPT trunk (no
biases, tied head, tanh GELU). Spelled out so that the arms do not move with the defaults."""
PUBLISHED = _overrides(VARIANTS["aogpt-ref"])
"""The AO-GPT authors' model (``model.variant=aogpt-ref``), field by field."""
OURS = _overrides(OURS_FIELDS)
ROPE_TARGET = ["model.pos_emb=rope", "model.rope_query=target"]
"""Our extension's overrides: AO-GPT with RoPE, each query rotated to its target position
(on top of :data:`OURS`)."""
PUBLISHED_LABEL = "aogpt published"
OURS_LABEL = "aogpt ours: gate offset + unit init"
ROPE_LABEL = "aogpt ours + RoPE queries at targets"
_RUN_TAGS = {"published": PUBLISHED, "ours": OURS}


def train_overrides(ctx: Context, out_dir: Path, seed: int, steps: int | None = None) -> list[str]:
    steps = ctx.steps if steps is None else steps
    every = max(1, steps // 10)
    return [
        f"data.source={DATA_SOURCE}",
        "data.tokenizer=bytes",
        f"data.cache_dir={ctx.runs / 'data_cache'}",
        f"train.out_dir={out_dir}",
        f"train.steps={steps}",
        f"train.batch_size={4 if ctx.smoke else 16}",
        "train.lr=2.0e-3",
        f"train.warmup_steps={max(1, steps // 10)}",
        "train.weight_decay=0.1",
        "train.beta2=0.99",
        "train.ema=0",
        f"train.eval_every={every}",
        f"train.eval_batches={1 if ctx.smoke else 4}",
        "train.ckpt_every=1000000",
        "train.keep_last=1",
        f"train.log_every={every}",
        "train.device=cpu",
        "train.dtype=bf16",
        f"train.seed={seed}",
    ]


def run_name(kind: str, order: list[str]) -> str:
    """A run's folder name from its model kind and overrides (a whole :data:`PUBLISHED` or
    :data:`OURS` group as one tag): identical arms of different experiments share one run."""
    rest, tags = list(order), []
    for tag, group in _RUN_TAGS.items():
        if all(o in rest for o in group):
            rest = [o for o in rest if o not in group]
            tags.append(tag)
    parts = tags + [o.split("=", 1)[1] for o in rest]
    name = "_".join([kind, *parts])
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name)


def _same_config(stored: Any, want: str) -> bool:
    """Whether a finished run's saved config is the one wanted (JSON, sorted keys). Fields
    added to the config since the run count with their defaults: a new option that is off
    by default does not make every earlier run train again."""
    from anyorder.config import config_from_dict, to_dict

    try:
        have = to_dict(config_from_dict(json.loads(json.dumps(stored))))
    except ConfigError:
        return False
    return json.dumps(have, sort_keys=True) == want


def _planned(
    ctx: Context, name: str, kind: str, order: list[str], seed: int, steps: int | None,
    extra: list[str] | None,
) -> tuple[Any, Path, str, dict[str, Any] | None]:  # fmt: skip
    """``(config, run folder, config JSON, done.json's info or None)`` of a CPU run: the
    info when a finished run of the same config can be reused."""
    from anyorder.config import load_config, to_dict

    out_dir = ctx.runs / f"{name}-s{seed}"
    overrides = [
        *model_overrides(ctx, kind),
        *order,
        *train_overrides(ctx, out_dir, seed, steps),
        *(extra or []),
    ]
    cfg = load_config(None, overrides)
    done = out_dir / "done.json"
    want = json.dumps(to_dict(cfg), sort_keys=True)
    if done.exists():
        info = json.loads(done.read_text())
        if _same_config(info.get("config"), want):
            return cfg, out_dir, want, info
    return cfg, out_dir, want, None


def estimate_training(ctx: Context, runs: list[tuple[str, str, list[str], int]]) -> None:
    """Print what training the runs ``(name, kind, order, seed)`` not yet done will cost."""
    from anyorder.progress import estimate

    todo = [r for r in runs if _planned(ctx, *r, None, None)[3] is None]
    if ctx.progress and todo:
        estimate(
            f"experiment: training {len(todo)} of {len(runs)} run(s) ({len(runs) - len(todo)} "
            "reused)",
            len(todo) * ctx.steps,
            1.0 / CPU_STEPS_PER_S,
            unit="steps",
            stream=sys.stdout,
            how="calibrated, one thread",
        )


def train_run(
    ctx: Context,
    name: str,
    kind: str,
    order: list[str],
    seed: int = 0,
    *,
    steps: int | None = None,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    """Train (or reuse) the CPU run ``name``-s``seed``; return its metrics rows and summary.

    A run folder with ``done.json`` whose config matches is reused as it is.
    """
    from anyorder.training.loop import train
    from anyorder.training.metrics import read_metrics

    cfg, out_dir, want, info = _planned(ctx, name, kind, order, seed, steps, extra)
    if info is not None:
        return info | {"rows": read_metrics(out_dir), "run_dir": str(out_dir)}
    if ctx.progress:
        print(f"experiment: training {out_dir.name} ({cfg.train.steps} steps)", flush=True)
    t0 = time.perf_counter()
    resume = False if not out_dir.exists() else "auto"
    summary = train(cfg, resume=resume, progress=ctx.progress)
    tokens = cfg.train.steps * cfg.train.batch_size * cfg.model.seq_len
    info = {
        "config": json.loads(want),
        "steps": summary["step"],
        "tokens": tokens,
        "wall_s": time.perf_counter() - t0,
        "val": summary.get("val"),
        "params": summary.get("params"),
    }
    (out_dir / "done.json").write_text(json.dumps(info, indent=2) + "\n")
    return info | {"rows": read_metrics(out_dir), "run_dir": str(out_dir)}


def curve(rows: list[dict[str, Any]], key: str, tokens_per_step: int) -> list[tuple[int, float]]:
    """(tokens, value) of every validation row that has ``key``."""
    return [(r["step"] * tokens_per_step, r[key]) for r in rows if key in r]


def final(rows: list[dict[str, Any]], key: str) -> float:
    """The last validation value of ``key`` (nan if none)."""
    vals = [r[key] for r in rows if key in r]
    return vals[-1] if vals else float("nan")


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error over seeds (se nan for a single seed)."""
    k = len(values)
    m = sum(values) / k
    if k < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (k - 1)
    return m, math.sqrt(var / k)


def fmt(m: float, se: float, digits: int = 3) -> str:
    """``m ± se`` (just ``m`` when se is nan)."""
    if not math.isfinite(m):
        return "n/a"
    if not math.isfinite(se):
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {se:.{digits}f}"


def tokens_per_step(ctx: Context) -> int:
    return (4 if ctx.smoke else 16) * (16 if ctx.smoke else 64)


def _budget_line(ctx: Context, runs: int) -> str:
    tps = tokens_per_step(ctx)
    return (
        f"Budget: {runs} run(s) x {ctx.steps} steps x {tps} tokens = {ctx.steps * tps:,} "
        f"training tokens per run; model 2 layers x 128 (n = 64), bytes of `{DATA_SOURCE}`, "
        "batch 16, bf16 autocast, one CPU thread."
    )


def _val_data(ctx: Context, kind: str = "aogpt") -> Any:
    """The validation blocks and bytes/token of the CPU corpus (the cache the runs made)."""
    from anyorder.config import load_config
    from anyorder.data import prepare

    cfg = load_config(None, model_overrides(ctx, kind) + train_overrides(ctx, ctx.runs, 0))
    from anyorder.data import load_tokenizer

    cfg.model.vocab_size = load_tokenizer("bytes").vocab_size
    data = prepare(cfg.data, cfg.model.seq_len, progress=False)
    return data


def _load(run: dict[str, Any]) -> Any:
    from anyorder.checkpoint import load_model

    loaded = load_model(run["run_dir"], weights="raw")
    loaded.model.eval()
    return loaded
