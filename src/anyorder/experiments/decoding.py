"""The decoding experiments: ARMD's strided generation before and after SBP fine-tuning
(experiment 7), and decoder vs encoder generation time and quality against the number of
steps (experiment 8).

Design choices:

* Samples are judged by the project's own left-to-right ``gpt`` of experiment 5
  (:class:`anyorder.evaluation.genppl.ModelJudge`), so no download is needed; the
  generative NLL is reported beside the samples' unigram entropy, with its standard error
  over samples.
* SBP gets a control at equal tokens: the same fine-tuning steps from the same base on the
  base's own final order distribution.
* Timing is wall-clock on a shared machine: ratios between rows mean more than the values.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from anyorder.experiments.comparisons import _four, _only, _progressive
from anyorder.experiments.figures import _plot_xy
from anyorder.experiments.paper import _paper
from anyorder.experiments.runs import (
    OURS,
    OURS_LABEL,
    PUBLISHED_LABEL,
    ROPE_LABEL,
    Context,
    _budget_line,
    _load,
    fmt,
    model_overrides,
    run_name,
    train_run,
)

# ============================================================================ 7. SBP


def _judge(ctx: Context) -> Any:
    from anyorder.evaluation.genppl import ModelJudge

    run = train_run(ctx, run_name("gpt", ["order.kind=l2r"]), "gpt", ["order.kind=l2r"], 0)
    return ModelJudge(run["run_dir"])


def _gen_score(model: Any, tok: Any, judge: Any, n: int, num: int, seed: int, **kw: Any) -> dict:
    from anyorder.evaluation.genppl import generative_perplexity, judge_inputs
    from anyorder.sampling.samplers import sample

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


def _decode_timing(ctx: Context) -> tuple[list[dict[str, Any]], int, int]:
    """Generation time vs steps of untrained aogpt and mdm models of the CPU-scale shape:
    ``(rows, n, batch)``."""
    from anyorder.config import load_config
    from anyorder.data import load_tokenizer
    from anyorder.models import build_model
    from anyorder.sampling.samplers import sample

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
    return timing, n, batch


def _decode_quality(ctx: Context) -> tuple[list[dict[str, Any]], list[str], int, int]:
    """Quality vs steps of the trained runs of experiment 5, judged by its gpt:
    ``(rows, arms, n, samples per cell)``."""
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
    return quality, qarms, qn, num


def exp_decode(ctx: Context) -> dict[str, Any]:
    """Decoder vs encoder: generation time vs steps, and quality vs steps at temperature 1."""
    if ctx.scale == "paper":
        return _paper(ctx, "aogpt-small-owt.yaml", {}, decode=True)
    timing, n, batch = _decode_timing(ctx)
    quality, qarms, qn, num = _decode_quality(ctx)
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
