"""Sampling: the plan, the passes, the samplers, prompt templates.

* :mod:`~anyorder.sampling.draws`: the sampling controls and float64 token draws;
* :mod:`~anyorder.sampling.schedules`: masking schedules and reveal counts (Lemma 1);
* :mod:`~anyorder.sampling.naive`: the uncached oracle sampler;
* :mod:`~anyorder.sampling.plan`: every pass of a decode, planned on the host;
* :mod:`~anyorder.sampling.passes`: the passes on the device over static caches;
* :mod:`~anyorder.sampling.graphs`: CUDA graphs of the passes;
* :mod:`~anyorder.sampling.samplers`: the public samplers and :func:`sample`;
* :mod:`~anyorder.sampling.verify` and :mod:`~anyorder.sampling.speculative`: speculative
  sampling (drafts checked against the sequential conditionals, exactly);
* :mod:`~anyorder.sampling.templates`: infilling templates and text.
"""

from anyorder.sampling.draws import (
    SampleResult,
    StepHook,
    check_controls,
    filter_logits,
    prompt_order,
    sample_logits,
)
from anyorder.sampling.graphs import compiled_passes
from anyorder.sampling.naive import naive_sample, slot_logits
from anyorder.sampling.samplers import (
    encoder_sample,
    lemma1_sample,
    sample,
    sequential_sample,
    strided_sample,
)
from anyorder.sampling.schedules import (
    REVEALS,
    SCHEDULES,
    RevealPlan,
    draw_reveals,
    masked_fraction,
    reveal_counts,
    reveal_probabilities,
)
from anyorder.sampling.speculative import SpeculativeStats, speculative_sample
from anyorder.sampling.templates import HOLE_GRAMMAR, decode_text, infill, parse_template

__all__ = [
    "HOLE_GRAMMAR",
    "REVEALS",
    "SCHEDULES",
    "RevealPlan",
    "SampleResult",
    "SpeculativeStats",
    "StepHook",
    "check_controls",
    "compiled_passes",
    "decode_text",
    "draw_reveals",
    "encoder_sample",
    "filter_logits",
    "infill",
    "lemma1_sample",
    "masked_fraction",
    "naive_sample",
    "parse_template",
    "prompt_order",
    "reveal_counts",
    "reveal_probabilities",
    "sample",
    "sample_logits",
    "sequential_sample",
    "slot_logits",
    "speculative_sample",
    "strided_sample",
]
