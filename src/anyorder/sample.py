"""The samplers' historical home: every public name of :mod:`anyorder.sampling`, re-exported.

Code and users import ``anyorder.sample``; the samplers live in the :mod:`anyorder.sampling`
package, split by concern (the plan, the passes, the samplers, prompt templates).
"""

from anyorder.sampling import (
    HOLE_GRAMMAR,
    REVEALS,
    SCHEDULES,
    RevealPlan,
    SampleResult,
    StepHook,
    check_controls,
    decode_text,
    draw_reveals,
    encoder_sample,
    filter_logits,
    infill,
    lemma1_sample,
    masked_fraction,
    naive_sample,
    parse_template,
    prompt_order,
    reveal_counts,
    reveal_probabilities,
    sample,
    sample_logits,
    sequential_sample,
    slot_logits,
    strided_sample,
)

__all__ = [
    "HOLE_GRAMMAR",
    "REVEALS",
    "SCHEDULES",
    "RevealPlan",
    "SampleResult",
    "StepHook",
    "check_controls",
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
    "strided_sample",
]
