"""The demo's fixed budget and recipe: the constants the job and its report share, the run
config (:func:`demo_config`) and the planning rate of ``--minutes``.

Design choices:

* A fixed budget: :data:`STEPS` optimizer steps of the recipe in :data:`RECIPE`, every
  seed fixed and the torch threads pinned (:data:`THREADS`), so the same command gives the
  same model and the same ``report.md`` on any day, whatever the machine's load.
* The recipe is the one that learnt fastest at this budget among those measured
  (docs/results.md, "The demo's recipe"): its shape, batch, learning rate and schedule, the
  order schedule and bf16 autocast are chosen by measurement, not by the paper presets.
"""

from __future__ import annotations

from pathlib import Path

from anyorder.config import RunConfig, load_config

THREADS = 2
"""torch threads of the demo (pinned, not taken from the load: results then do not depend
on how busy the machine is)."""
STEPS = 4500
"""Optimizer steps of the default demo (about 8 minutes in all on 2 idle cores of the
machine the README names, in fp32, 8.9 with its kernels limited to AVX2; the demo measures and
reports its own time on every run)."""
CALIBRATED_S_PER_STEP = 0.101
"""Wall seconds per training step on 2 idle cores of that machine, validations included:
only ``--minutes`` uses it, to plan the schedules before ``train`` has measured this
machine's speed on its first steps (it then fits the steps to the budget)."""
CALIBRATED_REST_S = 25.0
"""Wall seconds of everything but training on that machine (start-up, data, evaluation,
samples): what ``--minutes`` keeps back from its budget."""
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
    "train.dtype=fp32",  # bf16 gains nothing at this width (configs/demo.yaml)
    "train.seed=0",
]


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
