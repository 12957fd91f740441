"""``anyorder demo``: train a tiny ARMD on Python's own docs, sample, evaluate, report.

The whole job runs on two CPU cores in about 8 minutes and needs no download: the corpus is
``pydoc_data.topics`` (shipped with CPython) read as UTF-8 bytes.

Design choices:

* A fixed budget: :data:`STEPS` optimizer steps of the recipe in :data:`RECIPE`, every
  seed fixed and the torch threads pinned (:data:`THREADS`), so the same command gives the
  same model and the same ``report.md`` on any day, whatever the machine's load (only the
  time it takes changes; timings go to the console and ``timing.json``, not the report).
  ``--minutes N`` trades that for a wall-clock budget (the steps the calibration fits into
  it, cut short where the machine is slower).
* The recipe is the one that learnt fastest at this budget among those measured
  (docs/results.md, "The demo's recipe"): its shape, batch, learning rate and schedule, the
  order schedule and bf16 autocast are chosen by measurement, not by the paper presets.
* Samples come first in the report, left-to-right continuations first, each with the share
  of its words that are words of the training corpus (:func:`corpus_word_share`): a
  judge-free measure of how much of the writing is real words. One prompt is then decoded
  four ways (left to right, random order, Lemma 1, strided), with their forward passes.
* Evaluation on every validation block: bits per byte left to right (exact) and any order
  (Monte Carlo over :data:`EVAL_ORDERS` uniform orders), beside the unigram baseline, and a
  small context-order ensemble against the any-order figure on the same targets. Every
  number a user compares is in bits per byte.
* The report is Markdown with a PNG loss curve (matplotlib's Agg backend; skipped with a note
  when matplotlib is missing). Sections and wording live in :mod:`anyorder.demo_report`.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from anyorder.config import RunConfig, load_config
from anyorder.errors import ConfigError

THREADS = 2
"""torch threads of the demo (pinned, not taken from the load: results then do not depend
on how busy the machine is)."""
STEPS = 4500
"""Optimizer steps of the default demo (calibrated: at most about 8 minutes in all on 2 idle
cores; see :data:`CALIBRATED_S_PER_STEP`)."""
CALIBRATED_S_PER_STEP = 0.105
"""Wall seconds per training step on 2 idle cores, validations included: the CPU seconds of
one thread (measured), i.e. no gain assumed from the second thread, so the estimate is an
upper bound (for the up-front estimate)."""
CALIBRATED_REST_S = 25.0
"""Wall seconds of everything but training (start-up, data, evaluation, samples)."""
ENSEMBLE = 4
"""Members of the context-order ensemble (Eq. 7) in the report."""
ENSEMBLE_BLOCKS = 32
"""Validation blocks the ensemble scores (the first ones)."""
ENSEMBLE_TARGETS = 16
"""Target slots scored per block and order by the ensemble (a uniform random subset: an
unbiased estimate of the per-token mean at a fraction of the cost)."""
EVAL_ORDERS = 8
"""Random orders for the any-order bits per byte of the report."""
PROMPTS = 8
"""Validation passages continued per decoder (the word shares are over all of them)."""
PROMPT_BYTES = 48
"""Known bytes before a continuation."""
NEW_BYTES = 80
"""Bytes generated per continuation and per infill (prompt + new bytes = one block)."""
INFILL_SIDE = 24
"""Known bytes on each side of the infill."""
TEMPERATURE = 0.8
TOP_P = 0.95
STREAMS = 4
"""Streams of the strided decoder (ARMD's S)."""
SEED = 0

# The recipe, spelled out so the demo needs no file (configs/demo.yaml holds the same).
RECIPE = [
    "model.kind=armd",
    "model.vocab_size=257",
    "model.seq_len=128",
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=128",
    "data.source=builtin:pydoc",
    "data.tokenizer=bytes",
    # left to right first, then more and more displaced tokens, uniform from 70% of the
    # steps (rho = n): ARMD's progressive schedule, ending where any-order training ends
    "order.kind=progressive",
    "order.rho=128",
    "train.batch_size=16",
    "train.lr=2.0e-3",
    "train.min_lr_ratio=0.1",
    "train.weight_decay=0.1",
    "train.beta2=0.99",
    "train.ema=0",
    "train.eval_every=500",
    "train.eval_batches=4",
    "train.ckpt_every=1000000",
    "train.log_every=25",
    "train.keep_last=1",
    "train.device=cpu",
    "train.dtype=bf16",
    "train.seed=0",
]

_MARKER = ".anyorder-demo"
_OWN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "tb", "judge")
_WORD = re.compile(r"[A-Za-z]{2,}")


def demo_config(out: str | Path, steps: int = STEPS) -> RunConfig:
    """The demo's run config, writing into ``out`` (its data cache included). The order
    schedule scales with ``steps``: left to right for the first 10%, uniform from 70%; the
    learning rate warms up over the first 5%."""
    out = Path(out)
    return load_config(
        None,
        [
            *RECIPE,
            f"order.i_ar={steps // 10}",
            f"order.i_perm={max(steps // 10 + 1, 7 * steps // 10)}",
            f"train.warmup_steps={max(1, steps // 20)}",
            f"train.steps={steps}",
            f"train.out_dir={out}",
            f"data.cache_dir={out / 'data_cache'}",
        ],
    )


# ----------------------------------------------------------------------------- words


def corpus_words(data: Any) -> set[str]:
    """The words (runs of two or more ASCII letters) of the training split."""
    text = bytes(data.split("train").astype("uint8").ravel()).decode("latin-1")
    return set(_WORD.findall(text))


def corpus_word_share(prompt: str, generated: str, words: set[str]) -> tuple[int, int]:
    """``(hits, total)``: the words a sample wrote that are words of the corpus.

    A word counts when it overlaps the generated text (so a word the prompt began and the
    model finished counts) and does not run into the end of the text (it may be cut there).
    """
    text = prompt + generated
    hits = total = 0
    for m in _WORD.finditer(text):
        if m.end() <= len(prompt) or m.end() == len(text):
            continue
        total += 1
        hits += m.group() in words
    return hits, total


# ----------------------------------------------------------------------------- sampling


def sample_tokens(
    model: Any,
    prompt: Tensor,
    known: Tensor,
    *,
    decoder: str = "l2r",
    temperature: float = TEMPERATURE,
    top_p: float | None = TOP_P,
    seed: int = SEED,
) -> tuple[Tensor, int]:
    """Fill the unknown positions of ``prompt`` (B, n) where ``known`` (B, n) is False.

    The one place the demo samples. ``decoder``: ``l2r`` or ``random`` (the KV-cached
    sequential sampler, one token per pass), ``lemma1`` (Lemma 1 in a quarter as many
    steps as unknown tokens) or ``strided`` (:data:`STREAMS` streams, a prefix prompt).

    Returns:
        The tokens and the number of forward passes.
    """
    from anyorder.sample import lemma1_sample, prompt_order, sequential_sample, strided_sample

    gen = torch.Generator().manual_seed(seed)
    n = prompt.shape[1]
    kw = dict(prompt=prompt, known=known, temperature=temperature, top_p=top_p, generator=gen)
    if decoder in ("l2r", "random"):
        order = prompt_order(known, gen, decoder)
        res = sequential_sample(model, n, order=order, **kw)
    elif decoder == "lemma1":
        unknown = int((~known[0]).sum())
        res = lemma1_sample(model, n, max(1, unknown // 4), **kw)
    elif decoder == "strided":
        res = strided_sample(model, n, STREAMS, **kw)
    else:
        raise ConfigError(f"decoder {decoder!r}: use l2r, random, lemma1 or strided")
    return res.tokens, res.forward_passes


DECODERS = {
    "l2r": "left to right",
    "random": "random order",
    "lemma1": f"Lemma 1, {NEW_BYTES // 4} steps",
    "strided": f"strided, S = {STREAMS}",
}


def samples(model: Any, tok: Any, val: Tensor, words: set[str]) -> dict[str, Any]:
    """Continuations of :data:`PROMPTS` validation passages by each decoder, and an infill."""
    n = PROMPT_BYTES + NEW_BYTES
    step = max(1, len(val) // PROMPTS)
    rows = val[::step][:PROMPTS, :n].clone()  # passages spread over the validation split
    known = torch.zeros_like(rows, dtype=torch.bool)
    known[:, :PROMPT_BYTES] = True
    decoders = []
    for i, (name, label) in enumerate(DECODERS.items()):
        out, passes = sample_tokens(model, rows, known, decoder=name, seed=SEED + i)
        texts, hits, total = [], 0, 0
        for b in range(len(rows)):
            prompt = tok.decode(rows[b, :PROMPT_BYTES].tolist())
            gen = tok.decode(out[b, PROMPT_BYTES:].tolist())
            h, t = corpus_word_share(prompt, gen, words)
            hits, total = hits + h, total + t
            texts.append({"prompt": prompt, "generated": gen, "hits": h, "words": t})
        decoders.append(
            {"decoder": name, "label": label, "passes": passes, "hits": hits, "words": total,
             "texts": texts}
        )  # fmt: skip
    m = 2 * INFILL_SIDE + NEW_BYTES
    src = val[len(val) // 2 : len(val) // 2 + 1, :m].clone()
    mid = slice(INFILL_SIDE, INFILL_SIDE + NEW_BYTES)
    known = torch.ones(1, m, dtype=torch.bool)
    known[:, mid] = False
    fill, _ = sample_tokens(model, src, known, decoder="random", seed=SEED + 9)
    infill = {
        "prefix": tok.decode(src[0, : mid.start].tolist()),
        "generated": tok.decode(fill[0, mid].tolist()),
        "suffix": tok.decode(src[0, mid.stop :].tolist()),
        "original": tok.decode(src[0, mid].tolist()),
    }
    return {"decoders": decoders, "infill": infill}


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_bits(model: Any, val: Tensor, bytes_per_token: float, batch: int = 32) -> dict:
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
    ensemble, on the same blocks, orders and target slots (so their difference is paired)."""
    from anyorder.corpus import corpus_ensemble

    blocks = val[:ENSEMBLE_BLOCKS]
    run = corpus_ensemble(
        model,
        blocks,
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
        "blocks": len(blocks),
        "targets": ENSEMBLE_TARGETS,
        "plain_bpb": float(bits[:, 0].mean()),
        "plain_se": se(bits[:, 0]),
        "ens_bpb": float(bits[:, 1].mean()),
        "ens_se": se(bits[:, 1]),
        "gain_bpb": float(gain.mean()),
        "gain_se": se(gain),
        "passes_per_block": run.passes_per_block,
    }


# ----------------------------------------------------------------------------- the job


def _busy_hint(threads: int) -> str | None:
    """A line for a machine whose cores are taken: more runnable threads than cores slow
    PyTorch's CPU kernels many-fold (measured: 11 s per step with 2 threads at a load of 14
    on 2 cores, 0.7 s with 1). Fewer threads give the same report: the result does not
    depend on the number of threads (tests/test_demo.py)."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    if threads < 2 or load + threads <= cores + 0.5:
        return None
    return (
        f"demo: this machine is busy (load {load:.1f} on {cores} cores): {threads} threads may "
        "run many times slower than usual; --threads 1 writes the same report"
    )


def estimate_s(steps: int) -> float:
    """The demo's wall seconds on 2 idle cores (calibrated), for ``steps`` training steps."""
    return steps * CALIBRATED_S_PER_STEP + CALIBRATED_REST_S


def demo(
    out: str | Path = "runs/demo",
    *,
    steps: int = STEPS,
    minutes: float | None = None,
    threads: int = THREADS,
    progress: bool = True,
) -> dict[str, Any]:
    """Train, evaluate, sample and write ``out/report.md``; returns what the report shows.

    Args:
        out: the run folder; a previous demo's checkpoints and metrics in it are replaced
            (a folder holding anything else is refused).
        steps: optimizer steps (the default is the calibrated budget).
        minutes: a wall-clock budget for the whole demo instead: the steps the calibration
            fits into it, cut short by a time limit where this machine is slower (the result
            then depends on the machine).
        threads: torch threads (pinned for the run).
        progress: progress lines (a bar on a terminal).
    """
    wall0, cpu0 = time.perf_counter(), time.process_time()
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--minutes={minutes} must be positive")
    if steps < 1:
        raise ConfigError(f"--steps={steps} must be positive")
    if threads < 1:
        raise ConfigError(f"--threads={threads} must be positive")
    out = Path(out)
    marker = out / _MARKER
    if out.exists() and not (out.is_dir() and (marker.exists() or not any(out.iterdir()))):
        raise ConfigError(
            f"--out {out} already holds files that are not a demo's; pick an empty or new folder"
        )
    limit = None
    if minutes is not None:
        # The steps the calibration fits into the budget (so the schedules are planned for
        # them), cut short by the time limit where this machine is slower.
        limit = max(10.0, 60.0 * minutes - CALIBRATED_REST_S)
        steps = max(10, int(limit / CALIBRATED_S_PER_STEP))
    cfg = demo_config(out, steps)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(out, cfg, limit, threads, progress, wall0, cpu0)
    finally:
        torch.set_num_threads(before)


def _run(
    out: Path,
    cfg: RunConfig,
    limit: float | None,
    threads: int,
    progress: bool,
    wall0: float,
    cpu0: float,
) -> dict[str, Any]:
    from anyorder.checkpoint import load_model
    from anyorder.data import prepare
    from anyorder.demo_report import plot_curve, write_report
    from anyorder.progress import estimate, format_duration
    from anyorder.train import read_metrics, train

    out.mkdir(parents=True, exist_ok=True)
    (out / _MARKER).write_text("written by anyorder demo: a new demo may replace its run\n")
    for name in _OWN_FILES:  # a new demo replaces the last one's run, not its data cache
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    m = cfg.model
    busy = _busy_hint(threads)
    if busy:
        print(busy, flush=True)
    if limit is None:
        steps = cfg.train.steps
        print(
            f"demo: a tiny ARMD ({m.n_layer} layers x {m.d_model}), {steps:,} steps on "
            f"{threads} thread(s) -> {out}",
            flush=True,
        )
        estimate(
            "demo (training, evaluation, samples)",
            steps,
            estimate_s(steps) / steps,
            unit="steps",
            how="calibrated on 2 idle cores",
            stream=sys.stdout,
        )
    else:
        print(f"demo: a tiny ARMD, trained for up to {format_duration(limit)} -> {out}")
    phases: dict[str, float] = {}
    t = time.perf_counter()
    summary = train(cfg, resume=False, progress=progress, time_limit_s=limit)
    phases["train"] = time.perf_counter() - t
    loaded = load_model(out, weights="ema")
    model, tok = loaded.model, loaded.tokenizer
    data = prepare(cfg.data, cfg.model.seq_len, progress=False)  # the cache train() made
    val = data.batch("val", range(data.num_blocks("val")))
    bpt = data.bytes_per_token("val")
    t = time.perf_counter()
    print(f"demo: evaluating on {len(val)} validation blocks", flush=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ev = evaluate_bits(model, val, bpt)
        print(f"demo: context-order ensemble x{ENSEMBLE} on {ENSEMBLE_BLOCKS} blocks", flush=True)
        ens = ensemble_bits(model, val, bpt)
    phases["evaluate"] = time.perf_counter() - t
    t = time.perf_counter()
    print(f"demo: sampling ({len(DECODERS)} decoders x {PROMPTS} prompts, and an infill)")
    words = corpus_words(data)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        smp = samples(model, tok, val, words)
    phases["sample"] = time.perf_counter() - t
    rows = read_metrics(out)
    plot = plot_curve(rows, data.bytes_per_token("train"), summary["unigram_bpb"], out / "loss.png")
    l2r = smp["decoders"][0]
    info = {
        "eval": ev,
        "ensemble": ens,
        "samples": smp,
        "word_share": l2r["hits"] / max(1, l2r["words"]),
        "unigram": summary["unigram_bpb"],
        "params": summary["params"],
        "step": summary["step"],
        "config": summary["config"],
        "tokens_seen": summary["step"] * cfg.train.batch_size * cfg.model.seq_len,
        "plot": plot,
        "threads": threads,
        "time_limited": limit is not None,
    }
    report = write_report(out, info)
    timing = {
        "wall_s": time.perf_counter() - wall0,
        "cpu_s": time.process_time() - cpu0,
        "phases_s": phases,
        "train_tokens_per_s": summary["tokens_per_s"],
        "threads": threads,
    }
    (out / "demo.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    print(
        f"demo: validation {ev['l2r_bpb']:.3f} bits/byte left to right, {ev['ao_bpb']:.3f} ± "
        f"{ev['ao_se']:.3f} any order (unigram baseline {summary['unigram_bpb']:.3f}); "
        f"{info['word_share']:.0%} of the words written left to right are corpus words"
    )
    print(
        f"demo: report written to {report} ({format_duration(timing['wall_s'])} in all, "
        f"{format_duration(timing['cpu_s'])} of CPU)"
    )
    return info | {"timing": timing}
