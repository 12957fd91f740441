"""The training comparisons: AO-GPT's Findings 1 and 3 (experiments 2 and 3), every model at
equal tokens (5) and ARMD's progressive schedule (6). Each trains its arms at equal steps
and compares validation bits per byte, left to right and in any order.

Design choices:

* An arm is ``label -> (model kind, overrides)``; the AO-GPT arms come in the published
  parameterization, ours and our RoPE-target extension (:func:`_variant_arms`), and
  ``--arms`` (:func:`_only`) reruns a subset.
* Error bars: across seeds mean ± standard error of the seed means; with one seed, the
  trainer's standard error over random validation orders (marked ``(orders)``).
* A diagnostic beside the curves: how much a prediction depends on its target position
  (:func:`target_position_kl`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from anyorder.errors import ConfigError
from anyorder.experiments.figures import _plot_curves
from anyorder.experiments.paper import _paper, _paper_four
from anyorder.experiments.runs import (
    OURS,
    OURS_LABEL,
    PUBLISHED,
    PUBLISHED_LABEL,
    ROPE_LABEL,
    ROPE_TARGET,
    Context,
    _budget_line,
    _load,
    _val_data,
    curve,
    estimate_training,
    final,
    fmt,
    mean_se,
    run_name,
    tokens_per_step,
    train_run,
)

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


# ============================================================================ 5. equal tokens

_MIX = ["order.kind=mix", "order.p_l2r=0.1"]
_FOUR = {
    "gpt": ("gpt", ["order.kind=l2r"]),
    f"{PUBLISHED_LABEL}, 10% l2r": ("aogpt", [*PUBLISHED, *_MIX]),
    f"{OURS_LABEL}, 10% l2r": ("aogpt", [*OURS, *_MIX]),
    "armd (progressive)": ("armd", []),  # filled in by _progressive()
    "mdm": ("mdm", ["order.kind=uniform"]),
    # the encoder with RoPE (issue 25): its queries sit at the positions they predict, so
    # attention sees target-to-context offsets; with learned positions it stays at unigram
    "mdm + RoPE": ("mdm", ["order.kind=uniform", "model.pos_emb=rope"]),
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
