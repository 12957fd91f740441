"""``anyorder demo``: train a tiny ARMD on Python's own docs, sample, evaluate, report.

The whole job ran on two idle CPU cores in about 8-9 minutes on the machine the README names
(each run measures and reports its own time) and needs no download: the corpus is
``pydoc_data.topics`` (shipped with CPython) read as UTF-8 bytes.

Design choices:

* A fixed budget: :data:`STEPS` optimizer steps of the recipe in :data:`RECIPE`, every
  seed fixed and the torch threads pinned (:data:`THREADS`), so the same command gives the
  same model and the same ``report.md`` on any day, whatever the machine's load, but for
  the one line of this run's measured time. ``--minutes N`` trades that for a wall-clock
  budget (fitted to this machine's measured speed).
* A signal stops it within a step: the training is saved, no report is written, and the
  same command resumes it (bit for bit) and writes the report.
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
  when matplotlib is missing). Sections and wording live in :mod:`anyorder.demo.report`.

Modules: :mod:`~anyorder.demo.recipe` (the budget, the recipe, the calibrated cost),
:mod:`~anyorder.demo.measure` (samples and bits per byte), :mod:`~anyorder.demo.job` (the
job, :func:`demo`), :mod:`~anyorder.demo.report` (``report.md`` and the loss curve).
"""

from anyorder.demo.job import demo
from anyorder.demo.measure import (
    DECODERS,
    corpus_word_share,
    corpus_words,
    ensemble_bits,
    evaluate_bits,
    sample_tokens,
    samples,
)
from anyorder.demo.recipe import (
    CALIBRATED_REST_S,
    CALIBRATED_S_PER_STEP,
    ENSEMBLE,
    ENSEMBLE_BLOCKS,
    ENSEMBLE_TARGETS,
    EVAL_ORDERS,
    INFILL_SIDE,
    NEW_BYTES,
    PROMPT_BYTES,
    PROMPTS,
    RECIPE,
    SEED,
    STEPS,
    STREAMS,
    TEMPERATURE,
    THREADS,
    TOP_P,
    demo_config,
)

__all__ = [
    "CALIBRATED_REST_S",
    "CALIBRATED_S_PER_STEP",
    "DECODERS",
    "ENSEMBLE",
    "ENSEMBLE_BLOCKS",
    "ENSEMBLE_TARGETS",
    "EVAL_ORDERS",
    "INFILL_SIDE",
    "NEW_BYTES",
    "PROMPTS",
    "PROMPT_BYTES",
    "RECIPE",
    "SEED",
    "STEPS",
    "STREAMS",
    "TEMPERATURE",
    "THREADS",
    "TOP_P",
    "corpus_word_share",
    "corpus_words",
    "demo",
    "demo_config",
    "ensemble_bits",
    "evaluate_bits",
    "sample_tokens",
    "samples",
]
