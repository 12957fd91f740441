"""What the demo measures: corpus words in its samples, the samples of four decoders and an
infill, and validation bits per byte (left to right, any order, and the context-order
ensemble).

Design choices:

* Samples: left-to-right continuations first, each with the share of its words that are
  words of the training corpus (:func:`corpus_word_share`): a judge-free measure of how
  much of the writing is real words. One prompt is decoded four ways (left to right, random
  order, Lemma 1, strided), with their forward passes.
* Evaluation on every validation block: bits per byte left to right (exact) and any order
  (Monte Carlo over :data:`~anyorder.demo.recipe.EVAL_ORDERS` uniform orders), and a small
  context-order ensemble against the any-order figure on the same targets. Every number a
  user compares is in bits per byte.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import Tensor

from anyorder.demo.recipe import (
    ENSEMBLE,
    ENSEMBLE_BLOCKS,
    ENSEMBLE_TARGETS,
    EVAL_ORDERS,
    INFILL_SIDE,
    NEW_BYTES,
    PROMPT_BYTES,
    PROMPTS,
    SEED,
    STREAMS,
    TEMPERATURE,
    TOP_P,
)
from anyorder.errors import ConfigError

_WORD = re.compile(r"[A-Za-z]{2,}")

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
    from anyorder.evaluation.estimators import left_to_right_nll, sequence_nll
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
    from anyorder.evaluation.corpus import corpus_ensemble

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
