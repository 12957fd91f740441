"""``anyorder demo``: train a tiny ARMD on Python's own docs, evaluate it, sample, report.

The whole job runs on two CPU cores in a few minutes and needs no download: the corpus is
``pydoc_data.topics`` (shipped with CPython) read as UTF-8 bytes.

Design choices:

* Time-budgeted: :func:`anyorder.train.train` gets ``time_limit_s``; after a few timed
  steps it fits ``train.steps`` (and so the cosine schedule) to the budget, and it stops at
  the limit in any case. The default budget keeps the whole demo under 10 minutes here.
* Evaluation on every validation block: bits per byte left to right (exact; error bar over
  blocks) and any order (Monte Carlo over :data:`EVAL_ORDERS` uniform orders; error bar over
  the orders, the corpus fixed), beside the unigram baseline a model must beat.
* Sampling goes through one small function, :func:`sample_tokens`: the KV-cache sequential
  sampler (one token per pass, O(1) model cost per token); swap samplers there alone.
* Threads: two by default, one when the machine is already busy (load average): with
  more runnable threads than cores, PyTorch's CPU kernels slow down several-fold.
* The report is Markdown with a PNG loss curve (matplotlib's Agg backend; skipped with a note
  when matplotlib is missing).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from anyorder.config import RunConfig, load_config
from anyorder.errors import ConfigError

DEFAULT_MINUTES = 6.5
"""Training budget of the ARMD; with the judge, evaluation and sampling the demo takes
about 9.5 minutes here (2 cores)."""
JUDGE_MINUTES = 1.5
"""Training budget of the left-to-right ``gpt`` that judges the samples (generative NLL),
standing in for gpt2-large, which cannot be downloaded here."""
ENSEMBLE = 8
"""Members of the context-order ensemble (Eq. 7) in the report."""
ENSEMBLE_TARGETS = 32
"""Target slots scored per block and order by the ensemble (a uniform random subset: an
unbiased estimate of the per-token mean at a fraction of the cost)."""
GEN_SAMPLES = 8
"""Unconditional samples per decoding mode for the generative metrics."""
EVAL_ORDERS = 8
"""Random orders for the any-order bits per byte of the report."""
PROMPT_BYTES = 64
"""Known bytes before a continuation (and on each side of an infill)."""
NEW_BYTES = 128
"""Bytes generated per continuation and per infill."""
SEED = 0

# The tiny ARMD of configs/tiny-armd.yaml, spelled out so the demo needs no file.
DEMO_OVERRIDES = [
    "model.kind=armd",
    "model.vocab_size=257",
    "model.seq_len=256",
    "model.n_layer=4",
    "model.n_head=4",
    "model.d_model=256",
    "data.source=builtin:pydoc",
    "data.tokenizer=bytes",
    "order.kind=uniform",
    "train.steps=3000",
    "train.batch_size=16",
    "train.lr=2.0e-3",
    "train.warmup_steps=30",
    "train.weight_decay=0.1",
    "train.beta2=0.99",
    "train.ema=0",
    "train.eval_every=25",
    "train.eval_batches=4",
    "train.ckpt_every=1000000",
    "train.log_every=10",
    "train.keep_last=1",
    "train.device=cpu",
    "train.dtype=bf16",
]

_MARKER = ".anyorder-demo"
_OWN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "tb", "judge")


def demo_config(out: str | Path) -> RunConfig:
    """The demo's run config, writing into ``out`` (its data cache included)."""
    out = Path(out)
    return load_config(
        None,
        [*DEMO_OVERRIDES, f"train.out_dir={out}", f"data.cache_dir={out / 'data_cache'}"],
    )


def sample_tokens(
    model: Any,
    prompt: Tensor,
    known: Tensor,
    *,
    order_mode: str = "random",
    temperature: float = 0.8,
    top_p: float | None = 0.95,
    seed: int = SEED,
) -> Tensor:
    """Fill the unknown positions of ``prompt`` (B, n) where ``known`` (B, n) is False.

    The one place the demo samples: known positions first, then the rest in ``order_mode``
    (``random`` or ``l2r``) order, by the KV-cache sequential sampler.
    """
    from anyorder.sample import prompt_order, sequential_sample

    gen = torch.Generator().manual_seed(seed)
    order = prompt_order(known, gen, order_mode)
    result = sequential_sample(
        model,
        prompt.shape[1],
        prompt=prompt,
        known=known,
        order=order,
        temperature=temperature,
        top_p=top_p,
        generator=gen,
    )
    return result.tokens


@torch.no_grad()
def evaluate_bits(model: Any, val: Tensor, bytes_per_token: float, batch: int = 16) -> dict:
    """Validation bits per byte: left to right (exact) and any order (Monte Carlo).

    Returns:
        ``l2r_bpb`` with ``l2r_se`` (over blocks) and ``ao_bpb`` with ``ao_se`` (over
        :data:`EVAL_ORDERS` orders).
    """
    from anyorder.evaluate import left_to_right_nll, sequence_nll
    from anyorder.orders import uniform

    N, n = val.shape
    scale = 1.0 / (math.log(2) * bytes_per_token * n)  # nats per sequence -> bits per byte
    l2r = torch.cat([left_to_right_nll(model, val[i : i + batch]) for i in range(0, N, batch)])
    l2r_bits = l2r.double() * scale
    gen = torch.Generator().manual_seed(SEED + 1)
    per_order = []
    for _ in range(EVAL_ORDERS):
        order = uniform(N, n, gen).order
        nll = torch.cat(
            [
                sequence_nll(model, val[i : i + batch], order[i : i + batch])
                for i in range(0, N, batch)
            ]
        )
        per_order.append(float(nll.double().mean()) * scale)
    ao = torch.tensor(per_order, dtype=torch.float64)
    return {
        "blocks": N,
        "l2r_bpb": float(l2r_bits.mean()),
        "l2r_se": float(l2r_bits.std() / math.sqrt(N)) if N > 1 else float("nan"),
        "ao_bpb": float(ao.mean()),
        "ao_se": float(ao.std() / math.sqrt(len(ao))),
        "orders": EVAL_ORDERS,
    }


@torch.no_grad()
def ensemble_bits(model: Any, val: Tensor, bytes_per_token: float) -> dict:
    """Any-order bits per byte with and without the ``ENSEMBLE``-member context-order
    ensemble, on the same orders and target slots (so their difference is paired)."""
    from anyorder.corpus import corpus_ensemble

    run = corpus_ensemble(
        model,
        val,
        num_orders=2,
        members=ENSEMBLE,
        sizes=[1, ENSEMBLE],
        targets=ENSEMBLE_TARGETS,
        seed=SEED + 3,
        progress=False,
    )
    bits = run.values.double().flatten(0, 1) / (math.log(2) * bytes_per_token)  # (N*K, 2)
    m = bits.shape[0]

    def se(x: Tensor) -> float:
        return float(x.std() / math.sqrt(m)) if m > 1 else float("nan")

    gain = bits[:, 0] - bits[:, 1]
    return {
        "members": ENSEMBLE,
        "targets": ENSEMBLE_TARGETS,
        "plain_bpb": float(bits[:, 0].mean()),
        "plain_se": se(bits[:, 0]),
        "ens_bpb": float(bits[:, 1].mean()),
        "ens_se": se(bits[:, 1]),
        "gain_bpb": float(gain.mean()),
        "gain_se": se(gain),
        "passes_per_block": run.passes_per_block,
    }


def generative_metrics(model: Any, tokenizer: Any, judge: Any, n: int) -> list[dict]:
    """Generative NLL of unconditional samples (judged by ``judge``) with their entropy, for
    the sequential, Lemma-1 (T = n/4) and strided (S = 4) samplers, plus one text each."""
    from anyorder.genppl import generative_perplexity
    from anyorder.sample import lemma1_sample, sequential_sample, strided_sample

    B = GEN_SAMPLES
    modes = [
        ("sequential, random order", lambda g: sequential_sample(model, n, batch=B, generator=g)),
        (f"Lemma 1, T={n // 4}", lambda g: lemma1_sample(model, n, n // 4, batch=B, generator=g)),
        ("strided, S=4", lambda g: strided_sample(model, n, 4, batch=B, generator=g)),
    ]
    rows = []
    for name, run in modes:
        t0 = time.perf_counter()
        res = run(torch.Generator().manual_seed(SEED + 4))
        dt = time.perf_counter() - t0
        score = generative_perplexity(res.tokens, tokenizer, judge)
        rows.append(
            {
                "mode": name,
                "forward_passes": res.forward_passes,
                "tokens_per_s": GEN_SAMPLES * n / dt,
                "gen_nll": score.nll_per_token,
                "gen_ppl": score.gen_ppl,
                "entropy": score.entropy,
                "text": tokenizer.decode(res.tokens[0, :NEW_BYTES].tolist()),
            }
        )
    return rows


def train_judge(out: Path, cfg: RunConfig, minutes: float, progress: bool) -> Any:
    """Train the small left-to-right ``gpt`` judge on the same data; return it as a judge."""
    from anyorder.genppl import ModelJudge
    from anyorder.train import train

    jcfg = load_config(
        None,
        [
            *DEMO_OVERRIDES,
            "model.kind=gpt",
            "order.kind=l2r",
            f"train.out_dir={out / 'judge'}",
            f"data.cache_dir={cfg.data.cache_dir}",
        ],
    )
    train(jcfg, resume=False, progress=progress, time_limit_s=60.0 * minutes)
    return ModelJudge(out / "judge")


def _samples(model: Any, tokenizer: Any, val: Tensor) -> list[dict[str, str]]:
    """Three continuations (left to right), one in a random order, and one infill."""
    n = PROMPT_BYTES + NEW_BYTES
    rows = val[: min(3, len(val)), :n].clone()
    B = rows.shape[0]
    known = torch.zeros(B, n, dtype=torch.bool)
    known[:, :PROMPT_BYTES] = True
    out = []
    cont = sample_tokens(model, rows, known, order_mode="l2r")
    for b in range(B):
        out.append(
            {
                "kind": "continuation, left to right",
                "prompt": tokenizer.decode(rows[b, :PROMPT_BYTES].tolist()),
                "generated": tokenizer.decode(cont[b, PROMPT_BYTES:].tolist()),
            }
        )
    anyo = sample_tokens(model, rows[:1], known[:1], order_mode="random", seed=SEED + 1)
    out.append(
        {
            "kind": "continuation, random order",
            "prompt": tokenizer.decode(rows[0, :PROMPT_BYTES].tolist()),
            "generated": tokenizer.decode(anyo[0, PROMPT_BYTES:].tolist()),
        }
    )
    m = PROMPT_BYTES + NEW_BYTES + PROMPT_BYTES
    src = val[len(val) - 1 : len(val), :m].clone()
    known = torch.ones(1, m, dtype=torch.bool)
    known[:, PROMPT_BYTES : PROMPT_BYTES + NEW_BYTES] = False
    fill = sample_tokens(model, src, known, order_mode="random", seed=SEED + 2)
    out.append(
        {
            "kind": "infill, random order",
            "prompt": tokenizer.decode(src[0, :PROMPT_BYTES].tolist()),
            "generated": tokenizer.decode(
                fill[0, PROMPT_BYTES : PROMPT_BYTES + NEW_BYTES].tolist()
            ),
            "suffix": tokenizer.decode(src[0, PROMPT_BYTES + NEW_BYTES :].tolist()),
            "original": tokenizer.decode(src[0, PROMPT_BYTES : PROMPT_BYTES + NEW_BYTES].tolist()),
        }
    )
    return out


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
        ax.plot(*zip(*train), color="0.6", lw=1, label="train loss (random orders)")
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
    fig.savefig(path)
    plt.close(fig)
    return True


def _fence(text: str) -> str:
    return text.replace("```", "`\u200b``")


def write_report(out: Path, info: dict[str, Any]) -> Path:
    """``out/report.md`` from the demo's results."""
    s, ev, cfg = info["summary"], info["eval"], info["config"]
    m, t = cfg["model"], cfg["train"]
    lines = [
        "# anyorder demo: a tiny ARMD on Python's documentation",
        "",
        f"A {s['params'] / 1e6:.2f}M-parameter ARMD ({m['n_layer']} layers x {m['d_model']}, "
        f"two-stream layers {m['l2s'] or m['n_layer'] // 2}, RoPE) trained on the UTF-8 bytes "
        f"of `pydoc_data.topics` with uniformly random generation orders, "
        f"{s['step']} steps of {t['batch_size']} x {m['seq_len']} bytes "
        f"({info['tokens_seen']:,} bytes seen), {s['tokens_per_s']:,.0f} bytes/s on "
        f"{info['threads']} CPU thread(s) (bf16 autocast).",
        "",
        "## Validation",
        "",
        f"On all {ev['blocks']} validation blocks ({ev['blocks'] * m['seq_len']:,} bytes); "
        "± is one standard error (left to right: over blocks; any order: over "
        f"{ev['orders']} random orders).",
        "",
        "| | bits per byte |",
        "|---|---|",
        f"| left to right (exact) | {ev['l2r_bpb']:.4f} ± {ev['l2r_se']:.4f} |",
        f"| any order (Monte Carlo) | {ev['ao_bpb']:.4f} ± {ev['ao_se']:.4f} |",
    ]
    if info["unigram"] is not None:
        lines.append(f"| unigram baseline (train byte frequencies) | {info['unigram']:.4f} |")
    en = info["ensemble"]
    lines += [
        "",
        f"Context-order ensemble (Eq. 7, {en['members']} members, probabilities averaged), on "
        f"{en['targets']} random target slots per block and 2 orders "
        f"({en['passes_per_block']:.0f} forward passes per block and order); ± over "
        "blocks x orders:",
        "",
        "| | bits per byte |",
        "|---|---|",
        f"| any order, same targets | {en['plain_bpb']:.4f} ± {en['plain_se']:.4f} |",
        f"| any order + ensemble x{en['members']} | {en['ens_bpb']:.4f} ± {en['ens_se']:.4f} |",
        f"| gain (paired) | {en['gain_bpb']:.4f} ± {en['gain_se']:.4f} |",
        "",
        "## Generative metrics",
        "",
        f"{GEN_SAMPLES} unconditional samples of {m['seq_len']} bytes per sampler, temperature "
        f"1; judged by a small left-to-right `gpt` trained for {info['judge_minutes']:.2g} min "
        "on the same data (gpt2-large cannot be downloaded here): generative NLL (nats/byte, up to "
        "the first EOS) beside the mean unigram entropy of each sample (nats).",
        "",
        "| sampler | forward passes | bytes/s | gen. NLL | gen. PPL | entropy |",
        "|---|---|---|---|---|---|",
    ]
    for g in info["gen"]:
        lines.append(
            f"| {g['mode']} | {g['forward_passes']} | {g['tokens_per_s']:,.0f} | "
            f"{g['gen_nll']:.3f} | {g['gen_ppl']:.2f} | {g['entropy']:.3f} |"
        )
    lines += [""]
    if info["plot"]:
        lines += ["![loss curve](loss.png)", ""]
    else:
        lines += ["(No plot: install matplotlib, `pip install 'anyorder[plot]'`.)", ""]
    lines += [
        "## Samples",
        "",
        "Sequential any-order sampler with a KV cache, temperature 0.8, top-p 0.95. "
        "The model chooses which byte to write next only through the order it is given: "
        "left to right, or a random order over the unknown positions.",
        "",
    ]
    for i, smp in enumerate(info["samples"], 1):
        lines += [f"**{i}. {smp['kind']}**", "", "```text"]
        if "suffix" in smp:
            lines.append(
                _fence(smp["prompt"]) + "⟦" + _fence(smp["generated"]) + "⟧" + _fence(smp["suffix"])
            )
            lines += ["```", "", "original middle:", "", "```text", _fence(smp["original"])]
        else:
            lines.append(_fence(smp["prompt"]) + "⟦" + _fence(smp["generated"]) + "⟧")
        lines += ["```", ""]
    for g in info["gen"]:
        lines += [f"**unconditional, {g['mode']}**", "", "```text", _fence(g["text"]), "```", ""]
    lines += [
        "Generated bytes are between ⟦ ⟧.",
        "",
        "## Timing",
        "",
        f"- training: {s['train_time_s']:.0f} s ({s['steps_run']} steps), "
        f"whole demo: {info['wall_s']:.0f} s",
        f"- seed: {t['seed']} (training); evaluation and samples: seeds {SEED}-{SEED + 2}",
        f"- data: {info['data_path']}",
        f"- checkpoint: `{s['checkpoint']}`",
        "",
        "Reproduce: `anyorder demo`; the same model from a YAML file: "
        "`anyorder train configs/tiny-armd.yaml`.",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def auto_threads(most: int = 2) -> int:
    """``most`` threads, fewer when the load average says the cores are taken."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return most
    return max(1, min(most, cores, round(cores - load)))


def demo(
    out: str | Path = "runs/demo",
    *,
    minutes: float = DEFAULT_MINUTES,
    threads: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train, evaluate, sample and write ``out/report.md``; returns what the report shows.

    Args:
        out: the run folder; a previous demo's checkpoints and metrics in it are replaced
            (a folder holding anything else is refused).
        minutes: training budget (wall clock).
        threads: CPU threads for torch (default: :func:`auto_threads`).
        progress: show the training progress bar.
    """
    wall0 = time.perf_counter()
    if minutes <= 0:
        raise ConfigError(f"--minutes={minutes} must be positive")
    out = Path(out)
    cfg = demo_config(out)
    marker = out / _MARKER
    if out.exists() and not (out.is_dir() and (marker.exists() or not any(out.iterdir()))):
        raise ConfigError(
            f"--out {out} already holds files that are not a demo's; pick an empty or new folder"
        )
    threads = auto_threads() if threads is None else max(1, threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(out, cfg, minutes, threads, progress, wall0)
    finally:
        torch.set_num_threads(before)


def _run(
    out: Path, cfg: RunConfig, minutes: float, threads: int, progress: bool, wall0: float
) -> dict[str, Any]:
    from anyorder.checkpoint import load_model
    from anyorder.data import prepare
    from anyorder.train import read_metrics, train

    marker = out / _MARKER
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text("written by anyorder demo: a new demo may replace this folder's run\n")
    for name in _OWN_FILES:  # a new demo replaces the last one's run, not its data cache
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    print(f"demo: training a tiny ARMD for up to {minutes:g} min on {threads} thread(s) -> {out}")
    summary = train(cfg, resume=False, progress=progress, time_limit_s=60.0 * minutes)
    loaded = load_model(out, weights="ema")
    model, tok = loaded.model, loaded.tokenizer
    print("demo: evaluating on the validation blocks")
    data = prepare(cfg.data, cfg.model.seq_len, progress=False)  # the cache train() made
    val = data.batch("val", range(data.num_blocks("val")))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ev = evaluate_bits(model, val, data.bytes_per_token("val"))
    print(f"demo: context-order ensemble x{ENSEMBLE}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ens = ensemble_bits(model, val, data.bytes_per_token("val"))
    print("demo: sampling")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        samples = _samples(model, tok, val)
    judge_minutes = JUDGE_MINUTES * minutes / DEFAULT_MINUTES  # the same share of any budget
    print(f"demo: training the left-to-right judge for up to {judge_minutes:.2g} min")
    judge = train_judge(out, cfg, judge_minutes, progress)
    print("demo: generative metrics")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gen = generative_metrics(model, tok, judge, cfg.model.seq_len)
    rows = read_metrics(out)
    plot = plot_curve(rows, data.bytes_per_token("train"), summary["unigram_bpb"], out / "loss.png")
    info = {
        "summary": summary,
        "eval": ev,
        "ensemble": ens,
        "gen": gen,
        "judge": judge.name,
        "judge_minutes": judge_minutes,
        "config": summary["config"],
        "unigram": summary["unigram_bpb"],
        "samples": samples,
        "plot": plot,
        "threads": threads,
        "tokens_seen": summary["step"] * cfg.train.batch_size * cfg.model.seq_len,
        "data_path": str(data.path),
    }
    info["wall_s"] = time.perf_counter() - wall0
    report = write_report(out, info)
    (out / "demo.json").write_text(
        json.dumps({k: v for k, v in info.items() if k != "summary"}, indent=2) + "\n"
    )
    print(
        f"demo: validation {ev['l2r_bpb']:.3f} bits/byte left to right, {ev['ao_bpb']:.3f} ± "
        f"{ev['ao_se']:.3f} any order, ensemble x{ENSEMBLE} gain {ens['gain_bpb']:.4f} ± "
        f"{ens['gain_se']:.4f} (unigram baseline {summary['unigram_bpb']:.3f})"
    )
    print(f"demo: report written to {report} ({info['wall_s']:.0f} s in all)")
    return info
