"""The demo's ``report.md`` and loss curve, from what :mod:`anyorder.demo` measured
(:mod:`anyorder.demo.measure`).

Design choices:

* The report opens with what the budget buys (one sentence) and with samples, left-to-right
  continuations first; tables come after, one unit each, bits per byte wherever a user
  compares likelihoods.
* Every figure in it is measured on this run, the time included: one line, "This run", says
  the steps done of those planned and the wall and CPU time they took here (summed over the
  sessions of a demo that was stopped and resumed). The rest does not depend on the
  machine's speed, so the same demo twice writes the same file but for that line.
* What the model has learnt is said from the measured share of corpus words, never assumed
  from the budget.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from anyorder.atomic import write_text
from anyorder.config import OrderConfig
from anyorder.demo.recipe import (
    ENSEMBLE_BLOCKS,
    EVAL_ORDERS,
    NEW_BYTES,
    PROMPT_BYTES,
    PROMPTS,
    SEED,
    STEPS,
    TEMPERATURE,
    TOP_P,
)
from anyorder.orders import OrderSampler
from anyorder.progress import format_duration

LARGER_RUN = (
    "A larger run buys fluent text: the papers train GPT-2-size models (124M-355M "
    "parameters) on GPUs for about 10,000 times more tokens, and AO-GPT's samples then score "
    "a generative perplexity of 4.6-6.1 under GPT-2 large (`configs/armd-small-owt.yaml` "
    "and `configs/aogpt-small-owt.yaml` are those recipes)."
)


LEARNT_SHARE = 0.5
"""The share of corpus words from which the report says the model has learnt to spell."""


def expectation(info: dict[str, Any]) -> str:
    """The sentence on what this run's training bought, from what was measured."""
    head = (
        f"**What to expect.** {info['step']:,} training steps ({info['tokens_seen'] / 1e6:.1f}M "
        f"bytes of text seen) gave a {info['params'] / 1e6:.1f}M-parameter model: "
        f"{info['word_share']:.0%} of the words it writes left to right are words of the corpus "
        f"(left to right {info['eval']['l2r_bpb']:.2f} bits/byte"
        + (f", the unigram baseline {info['unigram']:.2f}" if info["unigram"] is not None else "")
        + "); "
    )
    if info["word_share"] >= LEARNT_SHARE:
        body = (
            "it has learnt the spelling, the common words and the layout of Python's "
            "documentation, not what the words mean, and its sentences do not make sense."
        )
    else:
        body = (
            "most of what it writes is not yet words; more steps teach it to spell (the "
            f"demo's budget is {STEPS:,})."
        )
    return f"{head}{body} {LARGER_RUN}"


def this_run(info: dict[str, Any]) -> str:
    """The run's measured cost: steps done of those planned, wall and CPU time, threads."""
    sessions = info["training"]
    train_wall = sum(s["wall_s"] for s in sessions)
    train_cpu = sum(s["cpu_s"] for s in sessions)
    t = info["timing"]
    done, planned = info["step"], info["planned"]
    steps = f"{done:,} of {planned:,} planned training steps"
    if done < planned:
        steps += " (stopped at the --minutes time limit)"
    resumed = f", in {len(sessions)} sessions (stopped and resumed)" if len(sessions) > 1 else ""
    if not sessions:  # a demo trained before its sessions were recorded, only re-measured
        return f"**This run** (measured here): {steps}; its training time was not recorded."
    return (
        f"**This run** (measured here): {steps} took {format_duration(train_wall)} of wall "
        f"time (start-up and data included) and {format_duration(train_cpu)} of CPU time "
        f"on {info['threads']} thread(s)"
        f"{resumed}; evaluation and samples took {format_duration(t['phases_s']['evaluate'])} "
        f"and {format_duration(t['phases_s']['sample'])}."
    )


def plot_curve(rows: list[dict[str, Any]], bpt: float, unigram: float | None, path: Path) -> bool:
    """Training loss and validation bits per byte against the step; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    to_bpb = 1.0 / (math.log(2) * bpt)
    train = [(r["step"], r["loss"] * to_bpb) for r in rows if "loss" in r]
    l2r = [(r["step"], r["val/l2r_bpb"]) for r in rows if "val/l2r_bpb" in r]
    ao = [
        (r["step"], r["val/ao_bpb"], r.get("val/ao_bpb_se", 0.0)) for r in rows if "val/ao_bpb" in r
    ]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train), color="0.6", lw=1, label="training loss (its orders)")
    if l2r:
        ax.plot(*zip(*l2r), "o-", color="C0", ms=3, label="validation, left to right")
    if ao:
        s, v, e = zip(*ao)
        ax.errorbar(
            s,
            v,
            yerr=[1.96 * x for x in e],
            fmt="s-",
            color="C1",
            ms=3,
            capsize=2,
            label="validation, any order (95% CI)",
        )
    if unigram is not None:
        ax.axhline(unigram, color="C3", ls="--", lw=1, label=f"unigram baseline {unigram:.2f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("bits per byte")
    ax.set_title("Tiny ARMD on pydoc topics (bytes)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return True


def _fence(text: str) -> str:
    return text.replace("```", "`\u200b``")


def _share(hits: int, total: int) -> str:
    return f"{hits}/{total} ({hits / total:.0%})" if total else "0/0"


def _sample_block(title: str, prompt: str, generated: str, suffix: str = "") -> list[str]:
    body = _fence(prompt) + "⟦" + _fence(generated) + "⟧" + _fence(suffix)
    return [title, "", "```text", body, "```", ""]


def _samples_section(info: dict[str, Any]) -> list[str]:
    smp = info["samples"]
    l2r, *others = smp["decoders"]
    lines = [
        "## Samples",
        "",
        f"Validation passages: the first {PROMPT_BYTES} bytes are given, the model writes the "
        f"next {NEW_BYTES} (between ⟦ ⟧); temperature {TEMPERATURE}, top-p {TOP_P}. *Corpus "
        "words*: the words (two or more letters) it wrote that occur in the training text.",
        "",
        f"### Left to right: {_share(l2r['hits'], l2r['words'])} corpus words over "
        f"{len(l2r['texts'])} passages",
        "",
    ]
    for i, t in enumerate(l2r["texts"][:3], 1):
        title = f"**{i}.** corpus words {_share(t['hits'], t['words'])}"
        lines += _sample_block(title, t["prompt"], t["generated"])
    lines += [
        "### One prompt, four decoders",
        "",
        "The first passage again, decoded in other orders and with fewer forward passes "
        "(random order: one byte per pass, KV cache; Lemma 1: a quarter as many passes, "
        "several bytes predicted per pass; strided: 4 streams written 4 bytes per pass). "
        f"Corpus words are counted over all {len(l2r['texts'])} passages.",
        "",
        "| decoder | forward passes | corpus words |",
        "|---|---|---|",
    ]
    for d in smp["decoders"]:
        lines.append(f"| {d['label']} | {d['passes']} | {_share(d['hits'], d['words'])} |")
    lines.append("")
    for d in [l2r, *others]:
        t = d["texts"][0]
        lines += _sample_block(f"**{d['label']}**", t["prompt"], t["generated"])
    fill = smp["infill"]
    lines += _sample_block(
        "### Infill (random order, both sides given)", fill["prefix"], fill["generated"],
        fill["suffix"],
    )  # fmt: skip
    lines += ["original middle:", "", "```text", _fence(fill["original"]), "```", ""]
    return lines


def _validation_section(info: dict[str, Any]) -> list[str]:
    ev, en, m = info["eval"], info["ensemble"], info["config"]["model"]
    lines = [
        "## Validation (bits per byte)",
        "",
        f"On all {ev['blocks']} validation blocks ({ev['blocks'] * m['seq_len']:,} bytes); "
        "± is one standard error (left to right: over blocks; any order: over "
        f"{ev['orders']} random orders).",
        "",
        "| | bits per byte |",
        "|---|---|",
        f"| left to right (exact) | {ev['l2r_bpb']:.3f} ± {ev['l2r_se']:.3f} |",
        f"| any order (Monte Carlo) | {ev['ao_bpb']:.3f} ± {ev['ao_se']:.3f} |",
    ]
    if info["unigram"] is not None:
        lines.append(f"| unigram baseline (train byte frequencies) | {info['unigram']:.3f} |")
    lines += [
        "",
        f"Context-order ensemble (Eq. 7, {en['members']} members, probabilities averaged) on "
        f"the first {ENSEMBLE_BLOCKS} blocks, {en['targets']} random target slots per block "
        f"and 2 orders ({en['passes_per_block']:.0f} forward passes per block and order), "
        "against the plain any-order figure on the *same* targets (a subset, so it differs "
        "from the table above); a positive gain means the ensemble helps. ± over blocks x "
        "orders.",
        "",
        "| | bits per byte |",
        "|---|---|",
        f"| any order, same targets | {en['plain_bpb']:.4f} ± {en['plain_se']:.4f} |",
        f"| any order + ensemble x{en['members']} | {en['ens_bpb']:.4f} ± {en['ens_se']:.4f} |",
        f"| gain (paired) | {en['gain_bpb']:.4f} ± {en['gain_se']:.4f} |",
        "",
    ]
    if info["plot"]:
        lines += ["![loss curve](loss.png)", ""]
    else:
        lines += ["(No plot: install matplotlib, `pip install 'anyorder[plot]'`.)", ""]
    return lines


# what the recipe line says of train.dtype: the run's own setting, never a constant
_PRECISION = {
    "fp32": "fp32 (no autocast)",
    "bf16": "bf16 autocast",
    "auto": "bf16 autocast only where this CPU computes it faster (train.dtype=auto)",
}


def _recipe_section(info: dict[str, Any]) -> list[str]:
    c = info["config"]
    m, t, o = c["model"], c["train"], c["order"]
    order = OrderSampler(OrderConfig(**o), t["steps"]).describe()
    l2s = m["l2s"] or max(1, m["n_layer"] // 2)
    return [
        "## Recipe",
        "",
        f"- model: ARMD, {m['n_layer']} layers x {m['d_model']} ({m['n_head']} heads, "
        f"{l2s} two-stream), RoPE, {info['params'] / 1e6:.2f}M parameters, "
        f"{m['seq_len']}-byte blocks",
        f"- data: the UTF-8 bytes of `pydoc_data.topics` ({c['data']['source']})",
        f"- training: {info['step']:,} steps of {t['batch_size']} x {m['seq_len']} bytes "
        f"({info['tokens_seen']:,} bytes seen), AdamW lr {t['lr']:g} (warm-up "
        f"{t['warmup_steps']} steps, cosine to {t['min_lr_ratio']:g} x), beta2 {t['beta2']}, "
        f"weight decay {t['weight_decay']}, {_PRECISION[t['dtype']]} (the number of threads "
        "does not change the result)",
        f"- generation orders in training: {order}",
        f"- seeds: training {t['seed']}, evaluation and samples {SEED}+; "
        f"{EVAL_ORDERS} validation orders, {PROMPTS} passages per decoder",
        "",
        'Why this recipe: docs/results.md, "The demo\'s recipe". Reproduce: `anyorder demo` '
        "(the same report, byte for byte but for the line of this run's time); the same run "
        "from a file: "
        "`anyorder train configs/demo.yaml`.",
        "",
    ]


def write_report(out: Path, info: dict[str, Any]) -> Path:
    """``out/report.md`` from the demo's results."""
    lines = ["# anyorder demo: a tiny ARMD on Python's documentation", "", this_run(info), ""]
    lines += [expectation(info), ""]
    if info["time_limited"]:
        lines += ["(Trained to a time limit: another machine or load gives another model.)", ""]
    lines += _samples_section(info)
    lines += _validation_section(info)
    lines += _recipe_section(info)
    path = out / "report.md"
    write_text(path, "\n".join(lines))
    return path
