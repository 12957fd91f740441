"""The papers' comparisons as experiments: one function each, one command each.

``anyorder experiment NAME [--scale cpu|paper] [--minutes M] [--seeds K] [--out DIR]`` runs
one comparison of :data:`EXPERIMENTS` (``all`` runs them in turn) and writes, under
``OUT/NAME/``, ``result.json``, ``plot.png`` and ``section.md`` (the Markdown section that
``docs/results.md`` collects).

Design choices:

* One registry (:data:`EXPERIMENTS`), one signature: ``fn(ctx) -> dict`` with the section's
  Markdown under ``"markdown"``. The CLI, the tests and ``anyorder experiment all`` go
  through :func:`run_experiment`.
* Same code, data and token budget for every arm: each training run is the library's own
  :func:`anyorder.train.train` on ``builtin:pydoc`` bytes with the same model shape, batch
  and number of steps; only the model kind or the order distribution differs. The
  validation curves are the trainer's (``val/l2r_bpb``, ``val/ao_bpb``; fixed validation
  orders, so every arm is scored on the same orders).
* Runs are cached by name under ``OUT/runs`` (a run with ``done.json`` is reused), so the
  aogpt/gpt/mdm/armd runs of experiment 5 serve experiments 4, 7 and 8 too.
* Error bars: within a run the standard error over random orders (from the trainer or
  :func:`anyorder.corpus.likelihood_suite`); across seeds mean ± standard error of the
  seed means. Small differences get several seeds (``--seeds``).
* CPU scale is deliberately small (2 layers, d_model 128, n = 64, batch 16, one thread):
  the comparisons are about relative effects. ``--scale paper`` does not train here: it
  builds the ``torchrun`` command lines with the paper configs (``configs/*.yaml``) plus
  the experiment's overrides and runs them (or prints them with ``--print-only``).
* A ``smoke`` context shrinks everything (1 layer, width 32, n = 16, a handful of steps) so
  that every experiment's whole code path is tested in seconds.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    from anyorder.train import read_metrics, train

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


def _plot_curves(
    series: dict[str, list[tuple[int, float]]], ylabel: str, title: str, path: Path
) -> bool:
    """Lines of (tokens, value) per label ``"arm: metric key"``: one colour per arm, one line
    style per metric (solid left to right, dashed any order); the legend sits outside the
    axes. False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = {"val/l2r_bpb": "left to right", "val/ao_bpb": "any order"}
    arms: list[str] = []
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for label, pts in series.items():
        arm, _, key = label.rpartition(": ")
        arm = arm or label
        if arm not in arms:
            arms.append(arm)
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=".",
                color=f"C{arms.index(arm) % 10}",
                linestyle="--" if key.endswith("ao_bpb") else "-",
                label=f"{arm}, {names[key]}" if key in names else label,
            )
    ax.set_xlabel("training tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_xy(
    series: dict[str, tuple[list[float], list[float], list[float] | None]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
    logx: bool = False,
) -> bool:
    """Lines with optional error bars: label -> (x, y, yerr)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (x, y, err) in series.items():
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    elif all(float(v).is_integer() for x, _, _ in series.values() for v in x):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # n = 5, 6, 7: no 5.25
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


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


# ============================================================================ 1. Eq. 5


def _toy_chain(vocab: int, seed: int) -> torch.Tensor:
    """A random first-order Markov chain (vocab, vocab) with a peaked transition table."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3.0 * torch.randn(vocab, vocab, generator=g), dim=-1)


def _toy_draw(trans: torch.Tensor, num: int, n: int, g: torch.Generator) -> torch.Tensor:
    V = trans.shape[0]
    x = torch.empty(num, n, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (num,), generator=g)
    for t in range(1, n):
        x[:, t] = torch.multinomial(trans[x[:, t - 1]], 1, generator=g).squeeze(1)
    return x


def _toy_nll(trans: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The true NLL (B,) in nats of the chain's sequences."""
    V = trans.shape[0]
    lp = math.log(1.0 / V) + torch.log(trans[x[:, :-1], x[:, 1:]]).sum(dim=1)
    return -lp.double()


@torch.no_grad()
def context_order_spread(
    model: Any, tokens: torch.Tensor, order: torch.Tensor, members: int, g: torch.Generator
) -> tuple[float, float]:
    """How much a conditional depends on the order of its context (Eq. 6).

    For every sequence and target slot ``t >= 1`` of ``order``, the target's log-probability
    given the same context set ``order[:t]`` presented in ``members`` random orders (the
    first: ``order`` itself); returns the mean over targets of the standard deviation over
    the members, with its standard error. An encoder gives 0 up to rounding.
    """
    B, n = tokens.shape
    rows, orders_, slots = [], [], []
    for b in range(B):
        for t in range(1, n):
            for m in range(members):
                ctx_perm = order[b, :t] if m == 0 else order[b, :t][torch.randperm(t, generator=g)]
                orders_.append(torch.cat([ctx_perm, order[b, t:]]))
                rows.append(b)
                slots.append(t)
    o = torch.stack(orders_)  # (B*(n-1)*M, n)
    x = tokens[torch.tensor(rows)]
    slot = torch.tensor(slots)
    logits = model(x, o)[torch.arange(len(o)), slot].float()  # (R, V)
    target = x[torch.arange(len(o)), o[torch.arange(len(o)), slot]]
    lp = logits.log_softmax(-1).gather(1, target[:, None]).squeeze(1).double()
    sd = lp.view(-1, members).std(dim=1)  # (B*(n-1),)
    return float(sd.mean()), float(sd.std() / math.sqrt(sd.numel()))


def exp_eq5(ctx: Context) -> dict[str, Any]:
    """Eq. 5 by enumeration (mdm) and the decoder's order dependence (aogpt), n = 5..7."""
    from anyorder import build_model, orders, preset
    from anyorder.evaluate import exact_any_order_nll, exact_mdm_elbo, sequence_nll

    if ctx.scale == "paper":
        return {"markdown": "Exact enumeration is a toy-scale check: it has no paper scale.\n"}
    V = 4
    lengths = [4] if ctx.smoke else [5, 6, 7]
    train_steps = 5 if ctx.smoke else 400
    members = 8
    rows = []
    for n in lengths:
        g = torch.Generator().manual_seed(100 + n)
        trans = _toy_chain(V, n)
        test = _toy_draw(trans, 4 if ctx.smoke else 16, n, g)
        models = {}
        for kind in ("mdm", "aogpt", "aogpt-ours"):
            torch.manual_seed(0)
            shape = dict(vocab_size=V, seq_len=n, n_layer=2, n_head=4, d_model=64)
            if kind == "mdm":
                cfg = preset("tiny", kind="mdm", target_dim=32, **shape)
            elif kind == "aogpt":  # the published parameterization
                cfg = preset("tiny", variant="aogpt-ref", **shape)
            else:
                cfg = preset("tiny", kind="aogpt", target_dim=32, **shape, **OURS_FIELDS)
            model = build_model(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            for _ in range(train_steps):
                x = _toy_draw(trans, 64, n, g)
                o = orders.uniform(64, n, g).order
                loss = model.loss(x, o, generator=g)
                opt.zero_grad()
                loss.backward()
                opt.step()
            models[kind] = model.eval()
        mdm, ao, ours = models["mdm"], models["aogpt"], models["aogpt-ours"]
        t0 = time.perf_counter()
        elbo = exact_mdm_elbo(mdm, test)  # (B,)
        avg = exact_any_order_nll(mdm, test)
        ao_avg = exact_any_order_nll(ao, test)
        ours_avg = exact_any_order_nll(ours, test)
        enum_s = time.perf_counter() - t0
        with torch.no_grad():
            ao_l2r = sequence_nll(ao, test, orders.l2r(len(test), n).order).double()
            ours_l2r = sequence_nll(ours, test, orders.l2r(len(test), n).order).double()
            # order dependence: one random order per sequence; every target's conditional
            # under `members` random orders of its context (member 0: the order itself)
            o = orders.uniform(len(test), n, g).order
            spread = {k: context_order_spread(m, test, o, members, g) for k, m in models.items()}
        truth = _toy_nll(trans, test)
        rows.append(
            {
                "n": n,
                "orders": math.factorial(n),
                "mask_sets": 2**n - 1,
                "true_nll": float(truth.mean()),
                "mdm_elbo": float(elbo.mean()),
                "mdm_avg_orders": float(avg.mean()),
                "max_abs_diff": float((elbo - avg).abs().max()),
                "aogpt_avg_orders": float(ao_avg.mean()),
                "aogpt_l2r": float(ao_l2r.mean()),
                "aogpt_spread": spread["aogpt"],
                "aogpt_ours_avg_orders": float(ours_avg.mean()),
                "aogpt_ours_l2r": float(ours_l2r.mean()),
                "aogpt_ours_spread": spread["aogpt-ours"],
                "mdm_spread": spread["mdm"],
                "enum_s": enum_s,
            }
        )
    md = [
        "Toy source: a random first-order Markov chain over 4 symbols; models 2 x 64 trained "
        f"{train_steps} steps (batch 64, uniform orders) per length. NLL in nats per sequence "
        "(mean over the test sequences). Spread: standard deviation of log p(target | context) "
        f"over {members} random orders of the same context set, mean over targets (± se).\n",
        "| n | orders | mdm exact ELBO | mdm avg over all orders | max abs diff | true NLL "
        "| mdm spread (nats) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['n']} | {r['orders']} | {r['mdm_elbo']:.5f} | {r['mdm_avg_orders']:.5f} | "
            f"{r['max_abs_diff']:.1e} | {r['true_nll']:.3f} | {fmt(*r['mdm_spread'], 4)} |"
        )
    md += [
        "\nThe decoder, trained the same way: the published parameterization (`model.variant="
        "aogpt-ref`, target_dim 128) and ours (gates centred on one, zero-initialised adaLN, "
        "the target embedding at unit scale, target_dim 32).\n",
        "| n | aogpt | avg over all orders | l2r | spread over context orders (nats) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        for name, key in (("published", "aogpt"), ("ours", "aogpt_ours")):
            md.append(
                f"| {r['n']} | {name} | {r[key + '_avg_orders']:.3f} | {r[key + '_l2r']:.3f} "
                f"| {fmt(*r[key + '_spread'], 4)} |"
            )
    plot = _plot_xy(
        {
            "aogpt published: spread over context orders": (
                [r["n"] for r in rows],
                [r["aogpt_spread"][0] for r in rows],
                [r["aogpt_spread"][1] for r in rows],
            ),
            "aogpt ours: spread over context orders": (
                [r["n"] for r in rows],
                [r["aogpt_ours_spread"][0] for r in rows],
                [r["aogpt_ours_spread"][1] for r in rows],
            ),
            "mdm: spread (0 by construction)": (
                [r["n"] for r in rows],
                [r["mdm_spread"][0] for r in rows],
                None,
            ),
            "|ELBO - avg over orders| (mdm, max)": (
                [r["n"] for r in rows],
                [r["max_abs_diff"] for r in rows],
                None,
            ),
        },
        "n",
        "nats",
        "Eq. 5 and order dependence",
        ctx.out / "plot.png",
    )
    return {"rows": rows, "plot": plot, "markdown": "\n".join(md) + "\n"}


# ============================================================================ helpers for 2-6


def _arms_curves(
    ctx: Context,
    arms: dict[str, tuple[str, list[str]]],
    keys: list[str],
    seeds: int,
) -> dict[str, Any]:
    """Train every arm (label -> (kind, order overrides)) for ``seeds`` seeds at equal steps;
    final values (mean ± se over seeds) of each key and the seed-0 curves."""
    tps = tokens_per_step(ctx)
    out: dict[str, Any] = {"arms": {}, "curves": {}}
    runs = [(run_name(k, o), k, o, s) for k, o in arms.values() for s in range(seeds)]
    estimate_training(ctx, runs)
    for label, (kind, order) in arms.items():
        name = run_name(kind, order)
        finals: dict[str, list[float]] = {k: [] for k in keys}
        within: dict[str, list[float]] = {k: [] for k in keys}
        for s in range(seeds):
            run = train_run(ctx, name, kind, order, s)
            for k in keys:
                finals[k].append(final(run["rows"], k))
                if k.endswith("ao_bpb"):
                    within[k].append(final(run["rows"], k + "_se"))
            if s == 0:
                for k in keys:
                    out["curves"][f"{label}: {k}"] = curve(run["rows"], k, tps)
        out["arms"][label] = {
            k: {"values": v, "mean_se": mean_se([x for x in v if math.isfinite(x)] or [math.nan]),
                "within_se": within[k]}
            for k, v in finals.items()
        }  # fmt: skip
    return out


def _arms_table(res: dict[str, Any], keys: list[str], names: list[str]) -> str:
    head = "| arm | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    body = ""
    for label, vals in res["arms"].items():
        cells = []
        for k in keys:
            m, se = vals[k]["mean_se"]
            w = [x for x in vals[k]["within_se"] if math.isfinite(x)]
            if not math.isfinite(se) and w:
                cells.append(fmt(m, w[0]) + " (orders)")
            else:
                cells.append(fmt(m, se))
        body += f"| {label} | " + " | ".join(cells) + " |\n"
    return head + body


def _seeds_note(ctx: Context, seeds: int) -> str:
    return (
        f"Final validation bits/byte after the whole budget; ± is the standard error over "
        f"{seeds} training seeds" + (" (one seed: ± is over random validation orders)."
                                     if seeds < 2 else ".")
    )  # fmt: skip


@torch.no_grad()
def target_position_kl(model: Any, blocks: torch.Tensor, seed: int = 0, slots: int = 8) -> float:
    """How much a decoder's prediction depends on *which* position it predicts.

    For each block, a uniform order and ``slots`` random slots ``t``: the predicted
    distribution at slot ``t`` (target ``order[t]``) against the one with ``order[t]`` and
    ``order[t+1]`` swapped (same context, another target position). Returns the mean KL in
    nats. A model that ignores the target position scores 0.
    """
    g = torch.Generator().manual_seed(seed)
    B, n = blocks.shape
    o = torch.stack([torch.randperm(n, generator=g) for _ in range(B)])  # (B, n)
    total, count = 0.0, 0
    for t in torch.randint(0, n - 1, (slots,), generator=g).tolist():
        o2 = o.clone()
        o2[:, t], o2[:, t + 1] = o[:, t + 1], o[:, t]
        a = model(blocks, o)[:, t].float().log_softmax(-1)  # (B, V)
        b = model(blocks, o2)[:, t].float().log_softmax(-1)
        total += float((a.exp() * (a - b)).sum(-1).sum())
        count += B
    return total / max(1, count)


def _add_target_kl(
    ctx: Context, res: dict[str, Any], arms: dict[str, tuple[str, list[str]]]
) -> str:
    """Target-position KL of each arm's seed-0 model on the validation blocks; a table."""
    data = _val_data(ctx)
    blocks = data.batch("val", range(min(4 if ctx.smoke else 32, data.num_blocks("val"))))
    md = "\n| arm | target-position KL (nats) |\n|---|---|\n"
    for label, (kind, order) in arms.items():
        loaded = _load(train_run(ctx, run_name(kind, order), kind, order, 0))
        kl = target_position_kl(loaded.model, torch.as_tensor(blocks).long())
        res["arms"][label]["target_kl"] = kl
        md += f"| {label} | {kl:.4f} |\n"
    return md


# ============================================================================ 2. Finding 1


BPB_KEYS = ["val/l2r_bpb", "val/ao_bpb"]


def _bpb_experiment(
    ctx: Context, arms: dict[str, tuple[str, list[str]]], title: str, note: str = ""
) -> dict[str, Any]:
    """Train every arm for ``ctx.seeds`` seeds; validation bits/byte (left to right and any
    order) vs tokens as a plot, and the final values as a table after the budget line and
    ``note``."""
    res = _arms_curves(ctx, arms, BPB_KEYS, ctx.seeds)
    plot = _plot_curves(res["curves"], "validation bits/byte", title, ctx.out / "plot.png")
    md = _budget_line(ctx, len(arms) * ctx.seeds) + " " + _seeds_note(ctx, ctx.seeds)
    md += note + "\n\n" + _arms_table(res, BPB_KEYS, ["l2r bits/byte", "any-order bits/byte"])
    return res | {"plot": plot, "markdown": md}


VARIANTS_NOTE = (
    "Arms: `published` is the AO-GPT authors' parameterization (`model.variant=aogpt-ref`: "
    "raw adaLN gates, adaLN and a 128-wide target embedding at N(0, 0.02), biases, an untied "
    "head, exact GELU; the model `anyorder convert --from aogpt-ref` loads); `ours` is our "
    "default AO-GPT when these runs were made (gates centred on one, zero-initialised "
    "modulation, the target embedding at unit scale, target_dim 64); `ours + RoPE queries at "
    "targets` is our extension (`model.pos_emb=rope model.rope_query=target`, experiment 5)."
)


def _variant_arms(
    orders: dict[str, list[str]], rope: bool = True
) -> dict[str, tuple[str, list[str]]]:
    """Each order setting for the published aogpt, ours and (``rope``) our RoPE-target
    extension, every variant field spelled out."""
    variants = [(PUBLISHED_LABEL, PUBLISHED), (OURS_LABEL, OURS)]
    if rope:
        variants.append((ROPE_LABEL, [*OURS, *ROPE_TARGET]))
    return {
        f"{label}, {name}": ("aogpt", [*variant, *order])
        for label, variant in variants
        for name, order in orders.items()
    }


def _only(ctx: Context, arms: dict[str, tuple[str, list[str]]]) -> dict:
    """The arms ``ctx.only`` selects (all when unset; an error when none match)."""
    if not ctx.only:
        return arms
    kept = {k: v for k, v in arms.items() if ctx.only in k}
    if not kept:
        raise ConfigError(f"--arms {ctx.only!r} matches no arm; the arms are: {', '.join(arms)}")
    return kept


def exp_finding1(ctx: Context) -> dict[str, Any]:
    """AO-GPT Finding 1: left-to-right vs uniform any-order training, same architecture."""
    arms = _variant_arms(
        {"l2r-trained": ["order.kind=l2r"], "uniform-trained": ["order.kind=uniform"]},
        rope=ctx.scale != "paper",
    )
    arms = _only(ctx, arms)
    if ctx.scale == "paper":
        return _paper(ctx, "aogpt-small-owt.yaml", arms)
    note = " " + VARIANTS_NOTE
    res = _bpb_experiment(ctx, arms, "Finding 1: l2r vs uniform-order training (aogpt)", note)
    md = res["markdown"]
    md += (
        "\nDiagnostic: mean KL between the predictions for two target positions with the same "
        "context (`target_position_kl`, 32 validation blocks x 8 slots, seed-0 models).\n"
    )
    md += _add_target_kl(ctx, res, arms)
    return res | {"markdown": md}


# ============================================================================ 3. Finding 3


def exp_finding3(ctx: Context) -> dict[str, Any]:
    """AO-GPT Finding 3: 0%, 10%, 50% left-to-right mixed into uniform orders."""
    mixes = {
        "0% l2r (uniform)": ["order.kind=uniform"],
        "10% l2r": ["order.kind=mix", "order.p_l2r=0.1"],
        "50% l2r": ["order.kind=mix", "order.p_l2r=0.5"],
    }
    arms = _only(ctx, _variant_arms(mixes, rope=ctx.scale != "paper"))
    if ctx.scale == "paper":
        return _paper(ctx, "aogpt-small-owt.yaml", arms)
    return _bpb_experiment(ctx, arms, "Finding 3: left-to-right mix", " " + VARIANTS_NOTE)


# ============================================================================ 4. Finding 5


def exp_finding5(ctx: Context) -> dict[str, Any]:
    """AO-GPT Finding 5: any-order NLL vs context-order ensemble size M."""
    from anyorder.corpus import likelihood_suite

    mix = ["order.kind=mix", "order.p_l2r=0.1"]
    # our extension too: a model of the same budget that has learnt much more about
    # uniform orders (experiment 5), so that there is order-dependent skill to average
    arms = _only(ctx, _variant_arms({"10% l2r": mix}, rope=ctx.scale != "paper"))
    if ctx.scale == "paper":
        return _paper(ctx, "aogpt-small-owt.yaml", arms, evaluate="--ensemble 16")
    sizes = [1, 2, 4] if ctx.smoke else [1, 2, 4, 8, 16]
    data = _val_data(ctx)
    nblocks = 2 if ctx.smoke else 32
    blocks = data.batch("val", range(min(nblocks, data.num_blocks("val"))))
    targets = 4 if ctx.smoke else 64  # the gains are small: enough targets to resolve them
    t0 = time.perf_counter()
    series, gains, results, paired = {}, [], {}, {}
    for label, (kind, order) in arms.items():
        loaded = _load(train_run(ctx, run_name(kind, order), kind, order))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = likelihood_suite(
                loaded.model, blocks, bytes_per_token=data.bytes_per_token("val"),
                orders=2 if ctx.smoke else 4, ensemble=sizes[-1], targets=targets,
                seed=0, batch_size=8, progress=ctx.progress, left_to_right=False,
            )  # fmt: skip
        by = res["ensemble"]["by_size"]
        ms = [m for m in sizes if m in by]
        series[label] = (
            ms,
            [by[m]["bits_per_byte"] for m in ms],
            [by[m]["bpb_stderr"] for m in ms],
        )
        ens = res["ensemble"]
        gains.append(f"{label}: {ens['gain_nats']:.4f} ± {ens['gain_stderr']:.4f}")
        by_m = ens["gain_by_size"]
        paired[label] = (ms, [by_m[m]["nats"] for m in ms], [by_m[m]["stderr"] for m in ms])
        results[label] = res
    wall = time.perf_counter() - t0
    # the absolute levels differ by 1.3 bits/byte and hide the effect: plot the paired gains
    plot = _plot_xy(
        paired,
        "ensemble size M",
        "gain over M = 1 (nats/token, paired)",
        "Finding 5: context-order ensembles",
        ctx.out / "plot.png",
        logx=True,
    )
    md = (
        _budget_line(ctx, len(arms))
        + f" Scored on {len(blocks)} validation blocks x {res['orders']} random orders, "
        f"{targets} random target slots per block and order (unbiased for the per-token mean); "
        f"± is the standard error over the blocks (the text sample, the order draw included; "
        f"paired for the gains). Gain M=1 -> M={ms[-1]} in nats/token "
        f"(paired): {'; '.join(gains)}. Evaluation took {wall:.0f} s.\n\n"
        f"| M | {' | '.join(f'{a}: any-order bits/byte | gain (nats/token)' for a in series)} "
        "| forward passes per block (formula) |\n"
        f"|---|{'---|---|' * len(series)}---|\n"
    )
    from anyorder.evaluate import ensemble_cost

    n = blocks.shape[1]
    for i, m in enumerate(ms):
        cells = " | ".join(
            f"{fmt(s[1][i], s[2][i], 4)} | {fmt(g[1][i], g[2][i], 4)}"
            for s, g in zip(series.values(), paired.values(), strict=True)
        )
        md += f"| {m} | {cells} | {ensemble_cost(n, m, targets):.1f} |\n"
    return {"suites": results, "sizes": ms, "series": series, "plot": plot, "markdown": md}


# ============================================================================ 5. equal tokens

_MIX = ["order.kind=mix", "order.p_l2r=0.1"]
_FOUR = {
    "gpt": ("gpt", ["order.kind=l2r"]),
    f"{PUBLISHED_LABEL}, 10% l2r": ("aogpt", [*PUBLISHED, *_MIX]),
    f"{OURS_LABEL}, 10% l2r": ("aogpt", [*OURS, *_MIX]),
    "armd (progressive)": ("armd", []),  # filled in by _progressive()
    "mdm": ("mdm", ["order.kind=uniform"]),
    # our extension (model.rope_query): AO-GPT with RoPE, each query rotated to its target;
    # and its control, RoPE with the queries at their inputs (as the keys)
    "aogpt ours + RoPE queries at inputs, 10% l2r": (
        "aogpt",
        [*OURS, *_MIX, "model.pos_emb=rope"],
    ),
    f"{ROPE_LABEL}, 10% l2r": ("aogpt", [*OURS, *_MIX, *ROPE_TARGET]),
}


def _progressive(ctx: Context, rho: int | None = None) -> list[str]:
    """ARMD's schedule scaled to the run: l2r for the first 5%, displaced tokens up to rho
    reached at 27% (the paper's 9K and 48K of 180K steps). ``rho`` defaults to the paper's
    32 (8 in smoke runs), which is half of our n = 64: see :func:`scaled_rho`."""
    s = ctx.steps
    rho = rho if rho is not None else (8 if ctx.smoke else 32)
    i_ar = int(0.05 * s)
    i_perm = max(i_ar + 1, int(0.27 * s))
    return ["order.kind=progressive", f"order.i_ar={i_ar}", f"order.i_perm={i_perm}",
            f"order.rho={rho}"]  # fmt: skip


def _four(ctx: Context) -> dict[str, tuple[str, list[str]]]:
    arms = dict(_FOUR)
    arms["armd (progressive)"] = ("armd", _progressive(ctx))
    return arms


def exp_four(ctx: Context) -> dict[str, Any]:
    """ARMD vs AO-GPT vs mdm vs gpt at equal tokens: bits/byte (l2r and any order) vs tokens."""
    arms = _only(ctx, _four(ctx))
    if ctx.scale == "paper":
        return _paper_four(ctx)
    note = (
        " The mdm's any-order figure is its ELBO; its left-to-right figure is on "
        "4 sequences only (one encoder pass per token). " + VARIANTS_NOTE + " The last arm's "
        "queries are rotated to the positions they predict, so that attention sees "
        "target-to-context offsets as ARMD's query stream does; the one before it is its "
        "control (RoPE, queries rotated to the positions of the tokens they read, like the keys)."
    )
    return _bpb_experiment(ctx, arms, "Equal tokens: every model", note)


# ============================================================================ 6. progressive


def scaled_rho(n: int) -> int:
    """ARMD's rho at our length: the paper displaces at most 32 of n = 1024 tokens (3.1%);
    the same fraction of ``n`` (2 at n = 64), at least 1."""
    return max(1, round(32 * n / 1024))


def exp_progressive(ctx: Context) -> dict[str, Any]:
    """ARMD's progressive permutation schedule vs uniform orders from the start, with the
    paper's rho (32, half of our n) and with rho scaled to the paper's 3% of n."""
    n = 16 if ctx.smoke else 64
    rho = 8 if ctx.smoke else 32
    arms = {
        f"armd (progressive, rho = {rho} of {n})": ("armd", _progressive(ctx)),
        f"armd (progressive, rho = {scaled_rho(n)} of {n})": (
            "armd", _progressive(ctx, scaled_rho(n)),
        ),
        "armd uniform from the start": ("armd", ["order.kind=uniform"]),
    }  # fmt: skip
    if ctx.scale == "paper":
        return _paper(ctx, "armd-small-owt.yaml", {k: arms[k] for k in list(arms)[::2]})
    note = (
        f" Progressive: `{' '.join(_progressive(ctx))}`; the second arm scales rho to the "
        f"paper's fraction of n (32 of 1024 = 3%): `order.rho={scaled_rho(n)}`."
    )
    res = _bpb_experiment(ctx, arms, "ARMD: progressive vs uniform", note)
    md = res["markdown"] + "\nDiagnostic: target-position KL as in experiment 2 (seed-0 models).\n"
    return res | {"markdown": md + _add_target_kl(ctx, res, arms)}


# ============================================================================ 7. SBP


def _judge(ctx: Context) -> Any:
    from anyorder.genppl import ModelJudge

    run = train_run(ctx, run_name("gpt", ["order.kind=l2r"]), "gpt", ["order.kind=l2r"], 0)
    return ModelJudge(run["run_dir"])


def _gen_score(model: Any, tok: Any, judge: Any, n: int, num: int, seed: int, **kw: Any) -> dict:
    from anyorder.genppl import generative_perplexity, judge_inputs
    from anyorder.sample import sample

    outs = []
    for i in range(0, num, 16):
        g = torch.Generator().manual_seed(seed + i)
        outs.append(sample(model, n, batch=min(16, num - i), generator=g, **kw).tokens)
    s = torch.cat(outs).cpu()
    score = generative_perplexity(s, tok, judge).as_dict()
    # error bar: per-sample NLL per judge token, standard error over the samples
    seqs, _, _ = judge_inputs(s, tok, judge)
    nll, cnt = judge.score(seqs)
    per = (nll / cnt.double().clamp(min=1)).double()
    se = float(per.std() / math.sqrt(len(per))) if len(per) > 1 else float("nan")
    return score | {"nll_se": se, "example": tok.decode(s[0].tolist())}


def exp_sbp(ctx: Context) -> dict[str, Any]:
    """SBP: strided generation quality for S = 1, 2, 4 before and after SBP fine-tuning."""
    arms = {"armd (progressive)": ("armd", _progressive(ctx))}
    if ctx.scale == "paper":
        return _paper(ctx, "armd-small-owt.yaml", arms, sbp=True)
    base = train_run(ctx, run_name("armd", _progressive(ctx)), "armd", _progressive(ctx), 0)
    ft_steps = max(2, ctx.steps // 3)
    init = [f"train.init_from={base['run_dir']}"]
    ft = train_run(
        ctx, "armd_sbp", "armd", ["order.kind=sbp", "order.sbp_streams=[1,2,4]"], 0,
        steps=ft_steps, extra=init,
    )  # fmt: skip
    # the control at equal tokens: the same steps from the same base, on the base's own
    # final order distribution (rho displaced tokens from the first step) instead of SBP
    rho = _progressive(ctx)[-1]
    same = ["order.kind=progressive", "order.i_ar=0", "order.i_perm=1", rho]
    control = train_run(ctx, "armd_continued", "armd", same, 0, steps=ft_steps, extra=init)
    judge = _judge(ctx)
    n = 16 if ctx.smoke else 64
    num = 4 if ctx.smoke else 64
    rows = []
    arms = (("before SBP", base), ("continued, no SBP", control), ("after SBP", ft))
    for label, run in arms:
        loaded = _load(run)
        for S in (1, 2, 4):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                sc = _gen_score(loaded.model, loaded.tokenizer, judge, n, num, 0, streams=S)
            rows.append({"model": label, "S": S} | sc)
    md = (
        _budget_line(ctx, 3)
        + f" SBP fine-tuning: {ft_steps} more steps with S drawn from {{1, 2, 4}}; the "
        f"control at equal tokens (continued, no SBP): the same {ft_steps} steps from the same "
        f"base on the base's own final orders (`{' '.join(same)}`). "
        f"{num} samples of {n} bytes per cell at temperature 1, judged by the project's own "
        "left-to-right gpt of experiment 5 (generative NLL in nats per judge token; lower is "
        "better, but watch the entropy: repetitive text scores well).\n\n"
        "| model | S | gen NLL (nats/token, ± over samples) | entropy (nats) |\n|---|---|---|---|\n"
    )
    for r in rows:
        md += (
            f"| {r['model']} | {r['S']} | {fmt(r['nll_per_token'], r['nll_se'])} | "
            f"{r['entropy']:.3f} ± {r['entropy_std'] / math.sqrt(r['samples']):.3f} |\n"
        )
    plot = _plot_xy(
        {
            lab: ([1, 2, 4], [r["nll_per_token"] for r in rows if r["model"] == lab], None)
            for lab, _ in arms
        },
        "streams S",
        "generative NLL (judge, nats/token)",
        "SBP fine-tuning",
        ctx.out / "plot.png",
        logx=True,
    )
    return {"rows": rows, "plot": plot, "markdown": md}


# ============================================================================ 8. decode time


def exp_decode(ctx: Context) -> dict[str, Any]:
    """Decoder vs encoder: generation time vs steps, and quality vs steps at temperature 1."""
    from anyorder import build_model
    from anyorder.config import load_config
    from anyorder.data import load_tokenizer
    from anyorder.sample import sample

    if ctx.scale == "paper":
        return _paper(ctx, "aogpt-small-owt.yaml", {}, decode=True)
    n = 16 if ctx.smoke else 128
    steps_list = [2, 4, 16] if ctx.smoke else [8, 16, 32, 64, 128]
    batch = 2 if ctx.smoke else 8
    vocab = load_tokenizer("bytes").vocab_size
    timing = []
    for kind in ("aogpt", "mdm"):
        ov = model_overrides(ctx, kind) + [f"model.seq_len={n}", f"model.vocab_size={vocab}"]
        ov += OURS if kind == "aogpt" else []  # timing: the variant does not matter
        torch.manual_seed(0)
        model = build_model(load_config(None, ov).model).eval()
        for T in steps_list:
            g = torch.Generator().manual_seed(0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                sample(model, n, steps=T, batch=batch, generator=g)  # warm-up
                reps = 1 if ctx.smoke else 3
                t0 = time.perf_counter()
                for _ in range(reps):
                    res = sample(model, n, steps=T, batch=batch, generator=g)
                dt = (time.perf_counter() - t0) / reps
            timing.append({"kind": kind, "steps": T, "seconds": dt, "passes": res.passes
                           if hasattr(res, "passes") else None})  # fmt: skip
        if kind == "aogpt":  # the KV-cached sequential sampler (one token per step)
            g = torch.Generator().manual_seed(0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                t0 = time.perf_counter()
                sample(model, n, batch=batch, generator=g)
                dt = time.perf_counter() - t0
            timing.append({"kind": "aogpt sequential (KV cache)", "steps": n, "seconds": dt})
    # quality vs steps: the trained runs of experiment 5, judged by its gpt
    judge = _judge(ctx)
    qn = 16 if ctx.smoke else 64
    qsteps = [2, 4, 16] if ctx.smoke else [4, 8, 16, 32, 64]
    num = 4 if ctx.smoke else 48
    quality = []
    qarms = [
        f"{PUBLISHED_LABEL}, 10% l2r",
        f"{OURS_LABEL}, 10% l2r",
        "mdm",
        "armd (progressive)",
        f"{ROPE_LABEL}, 10% l2r",
    ]
    four = _four(ctx)
    qarms = list(_only(ctx, {k: four[k] for k in qarms}))
    for label in qarms:
        kind, order = four[label]
        loaded = _load(train_run(ctx, run_name(kind, order), kind, order, 0))
        for T in qsteps:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                order_kw = {"order": "random"} if kind != "mdm" else {}
                steps_kw = None if qn == T else T
                sc = _gen_score(loaded.model, loaded.tokenizer, judge, qn, num, 0,
                                steps=steps_kw, **order_kw)  # fmt: skip
            quality.append({"model": label, "steps": T} | sc)
    md = (
        f"Timing: untrained models of the CPU-scale shape (2 x 128) with n = {n}, batch {batch}, "
        "bf16 autocast, one thread; mean of 3 runs after a warm-up. aogpt decodes with Lemma-1 "
        "steps (T passes of the decoder, each pass extends the KV cache), the mdm with T full "
        "encoder passes over all n positions. Wall-clock on a shared 2-core machine: "
        "ratios are more reliable than absolute values.\n\n"
        "| model | steps T | seconds per batch |\n|---|---|---|\n"
    )
    for r in timing:
        md += f"| {r['kind']} | {r['steps']} | {r['seconds']:.3f} |\n"
    md += (
        f"\nQuality vs steps: the trained runs of experiment 5, {num} samples of {qn} bytes at "
        "temperature 1, random order, judged by experiment 5's gpt (T = n: one token per pass, "
        "the KV-cached sequential sampler for the decoders).\n\n"
        "| model | steps T | gen NLL (nats/token, ± over samples) | entropy (nats) |\n"
        "|---|---|---|---|\n"
    )
    for r in quality:
        nll = fmt(r["nll_per_token"], r["nll_se"])
        md += f"| {r['model']} | {r['steps']} | {nll} | {r['entropy']:.3f} |\n"
    series = {}
    for kind in ("aogpt", "mdm"):
        pts = [r for r in timing if r["kind"] == kind]
        series[f"{kind}: seconds"] = ([r["steps"] for r in pts], [r["seconds"] for r in pts], None)
    plot = _plot_xy(series, "steps T", "seconds per batch", "Generation time vs steps",
                    ctx.out / "plot.png", logx=True)  # fmt: skip
    qseries = {}
    for label in qarms:
        pts = [r for r in quality if r["model"] == label]
        qseries[label] = (
            [r["steps"] for r in pts],
            [r["nll_per_token"] for r in pts],
            [r["nll_se"] for r in pts],
        )
    _plot_xy(qseries, "steps T", "generative NLL (judge)", "Quality vs steps (temperature 1)",
             ctx.out / "quality.png", logx=True)  # fmt: skip
    return {"timing": timing, "quality": quality, "plot": plot, "markdown": md}


# ============================================================================ paper scale


PAPER_STEPS_NOTE = "the paper configs' own step counts and batch sizes"


def torchrun_command(config: str, overrides: list[str], nproc: int) -> list[str]:
    """The ``torchrun`` command line that trains ``configs/CONFIG`` with ``overrides``."""
    return [
        "torchrun",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "anyorder.cli",
        "train",
        f"configs/{config}",
        "--no-progress",
        *overrides,
    ]


def paper_commands(
    config: str, arms: dict[str, tuple[str, list[str]]], nproc: int, seeds: int, root: str
) -> list[list[str]]:
    """One torchrun command per arm and seed: the paper config, the arm's kind and order."""
    cmds = []
    for label, (kind, order) in arms.items():
        name = label.replace(" ", "_").replace("%", "pct").replace("(", "").replace(")", "")
        for s in range(seeds):
            ov = [f"model.kind={kind}", *order, f"train.seed={s}",
                  f"train.out_dir={root}/{name}-s{s}"]  # fmt: skip
            cmds.append(torchrun_command(config, ov, nproc))
    return cmds


_PAPER_PROGRESSIVE = ["order.kind=progressive", "order.i_ar=9000", "order.i_perm=48000",
                      "order.rho=32"]  # fmt: skip


def _paper_arms(arms: dict[str, tuple[str, list[str]]]) -> dict[str, tuple[str, list[str]]]:
    # the CPU-scaled progressive schedule -> the paper's (9K / 48K / 32)
    return {
        k: (kind, _PAPER_PROGRESSIVE if any("progressive" in o for o in order) else order)
        for k, (kind, order) in arms.items()
    }


def _run_commands(ctx: Context, cmds: list[list[str]], note: str = "") -> dict[str, Any]:
    ctx.commands.extend(cmds)
    text = "\n".join(shlex.join(c) for c in cmds)
    if ctx.print_only:
        print(text)
    else:
        for c in cmds:
            print("+ " + shlex.join(c), flush=True)
            rc = subprocess.call(c)
            if rc:
                raise ConfigError(f"paper-scale run failed (exit code {rc}): {shlex.join(c)}")
    md = f"Paper scale ({'printed' if ctx.print_only else 'run'}):\n\n```\n{text}\n```\n{note}"
    return {"commands": [shlex.join(c) for c in cmds], "markdown": md}


def _paper(
    ctx: Context,
    config: str,
    arms: dict[str, tuple[str, list[str]]],
    *,
    evaluate: str | None = None,
    sbp: bool = False,
    decode: bool = False,
) -> dict[str, Any]:
    root = str(ctx.out / "runs")
    cmds = paper_commands(config, _paper_arms(arms), ctx.nproc, ctx.seeds, root)
    note = f"Budget: {PAPER_STEPS_NOTE}.\n"
    if evaluate:
        run_dir = cmds[0][-1].split("=", 1)[1]  # the first arm's train.out_dir
        cmds.append(["anyorder", "eval", run_dir, *evaluate.split()])
    if sbp:
        base = f"{root}/armd_progressive-s0"
        ov = ["order.kind=sbp", "order.sbp_streams=[1,2,4]", "train.steps=20000",
              f"train.init_from={base}", f"train.out_dir={root}/armd_sbp-s0"]  # fmt: skip
        cmds.append(torchrun_command(config, ov, ctx.nproc))
    if decode:
        cmds = [[sys.executable, "benchmarks/decode.py"]]
        note = "Timing on the GPU: the decode benchmark at the paper's sizes.\n"
    return _run_commands(ctx, cmds, note)


def _paper_four(ctx: Context) -> dict[str, Any]:
    cfgs = {"gpt": ("gpt-small-owt.yaml", []), "aogpt": ("aogpt-small-owt.yaml", PUBLISHED),
            "aogpt-ours": ("aogpt-small-owt.yaml", OURS),
            "armd": ("armd-small-owt.yaml", []), "mdm": ("mdm-small-owt.yaml", []),
            "aogpt-rope-target": ("aogpt-small-owt.yaml", [*OURS, *ROPE_TARGET])}  # fmt: skip
    root = str(ctx.out / "runs")
    cmds = []
    for name, (cfg, extra) in cfgs.items():
        for s in range(ctx.seeds):
            # equal tokens: every run takes ARMD's 180K steps of 512 x 1024 tokens
            ov = [f"train.seed={s}", "train.steps=180000", f"train.out_dir={root}/{name}-s{s}"]
            cmds.append(torchrun_command(cfg, ov + extra, ctx.nproc))
    return _run_commands(ctx, cmds, "Budget: 180K steps x 512 x 1024 tokens for every model.\n")


# ============================================================================ registry

Experiment = Callable[[Context], dict[str, Any]]

EXPERIMENTS: dict[str, tuple[str, Experiment]] = {
    "eq5": ("1. Eq. 5 by enumeration; aogpt's order dependence", exp_eq5),
    "decode": ("8. Decoder vs encoder: generation time and quality vs steps", exp_decode),
    "finding5": ("4. AO-GPT Finding 5: ensemble size M", exp_finding5),
    "finding1": ("2. AO-GPT Finding 1: l2r vs any-order training", exp_finding1),
    "finding3": ("3. AO-GPT Finding 3: left-to-right mix", exp_finding3),
    "four": ("5. ARMD vs AO-GPT vs mdm vs gpt at equal tokens", exp_four),
    "progressive": ("6. ARMD progressive schedule vs uniform", exp_progressive),
    "sbp": ("7. SBP: strided generation before and after fine-tuning", exp_sbp),
}
"""name -> (title, function), in the order ``all`` runs them (cheap and exact first)."""


def run_experiment(name: str, ctx: Context) -> dict[str, Any]:
    """Run one experiment; write ``result.json`` and ``section.md`` into ``ctx.out``.

    Raises:
        ConfigError: an unknown name or scale.
    """
    if name not in EXPERIMENTS:
        raise ConfigError(
            f"unknown experiment {name!r}; use one of {', '.join(EXPERIMENTS)} or all"
        )
    if ctx.scale not in ("cpu", "paper"):
        raise ConfigError(f"--scale {ctx.scale!r}: use cpu or paper")
    title, fn = EXPERIMENTS[name]
    ctx.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = fn(ctx)
    res["wall_s"] = time.perf_counter() - t0
    res["name"], res["title"], res["scale"] = name, title, ctx.scale
    (ctx.out / "result.json").write_text(json.dumps(_jsonable(res), indent=2) + "\n")
    (ctx.out / "section.md").write_text(f"## {title}\n\n{res['markdown']}")
    return res


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


__all__ = [
    "EXPERIMENTS",
    "Context",
    "paper_commands",
    "run_experiment",
    "torchrun_command",
]
