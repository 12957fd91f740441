"""The papers' comparisons as experiments: one function each, one command each.

``anyorder experiment NAME [--scale cpu|paper] [--minutes M] [--seeds K] [--out DIR]`` runs
one comparison of :data:`EXPERIMENTS` (``all`` runs them in turn) and writes, under
``OUT/NAME/``, ``result.json``, ``plot.png`` and ``section.md`` (the Markdown section that
``docs/results.md`` collects).

The package, by concern (imports point down this list):

* :mod:`~anyorder.experiments.runs`: :class:`Context`, the arms' model variants, the CPU
  training runs every arm shares (cached by name), statistics and helpers;
* :mod:`~anyorder.experiments.figures`: the plots;
* :mod:`~anyorder.experiments.paper`: paper scale, the ``torchrun`` command lines;
* :mod:`~anyorder.experiments.comparisons`: the training comparisons (experiments 2, 3, 5
  and 6: Findings 1 and 3, equal tokens, ARMD's progressive schedule);
* :mod:`~anyorder.experiments.likelihood`: Eq. 5 by enumeration (1) and context-order
  ensembles (4: Finding 5);
* :mod:`~anyorder.experiments.decoding`: SBP (7) and generation time and quality vs steps (8);
* :mod:`~anyorder.experiments.registry`: :data:`EXPERIMENTS` and :func:`run_experiment`.

Design choices:

* One registry, one signature: ``fn(ctx) -> dict`` with the section's Markdown under
  ``"markdown"``. The CLI, the tests and ``anyorder experiment all`` go through
  :func:`run_experiment`.
* Same code, data and token budget for every arm: each training run is the library's own
  trainer on ``builtin:pydoc`` bytes with the same model shape, batch and number of steps;
  only the model kind or the order distribution differs.
* Error bars: within a run the standard error over random orders (from the trainer or
  :func:`anyorder.evaluation.suite.likelihood_suite`); across seeds mean ± standard error
  of the seed means. Small differences get several seeds (``--seeds``).
* CPU scale is deliberately small; ``--scale paper`` does not train here: it builds the
  ``torchrun`` command lines with the paper configs and runs them (or prints them with
  ``--print-only``). A ``smoke`` context shrinks everything so that every experiment's
  whole code path is tested in seconds.
"""

from anyorder.experiments.comparisons import (
    BPB_KEYS,
    VARIANTS_NOTE,
    exp_finding1,
    exp_finding3,
    exp_four,
    exp_progressive,
    scaled_rho,
    target_position_kl,
)
from anyorder.experiments.decoding import exp_decode, exp_sbp
from anyorder.experiments.likelihood import context_order_spread, exp_eq5, exp_finding5
from anyorder.experiments.paper import PAPER_STEPS_NOTE, paper_commands, torchrun_command
from anyorder.experiments.registry import EXPERIMENTS, Experiment, run_experiment
from anyorder.experiments.runs import (
    CPU_STEPS_PER_S,
    DATA_SOURCE,
    OURS,
    OURS_FIELDS,
    OURS_LABEL,
    PUBLISHED,
    PUBLISHED_LABEL,
    ROPE_LABEL,
    ROPE_TARGET,
    Context,
    _same_config,  # noqa: F401 (tests import it)
    curve,
    estimate_training,
    final,
    fmt,
    mean_se,
    model_overrides,
    run_name,
    tokens_per_step,
    train_overrides,
    train_run,
)

__all__ = [
    "BPB_KEYS",
    "CPU_STEPS_PER_S",
    "Context",
    "DATA_SOURCE",
    "EXPERIMENTS",
    "Experiment",
    "OURS",
    "OURS_FIELDS",
    "OURS_LABEL",
    "PAPER_STEPS_NOTE",
    "PUBLISHED",
    "PUBLISHED_LABEL",
    "ROPE_LABEL",
    "ROPE_TARGET",
    "VARIANTS_NOTE",
    "context_order_spread",
    "curve",
    "estimate_training",
    "exp_decode",
    "exp_eq5",
    "exp_finding1",
    "exp_finding3",
    "exp_finding5",
    "exp_four",
    "exp_progressive",
    "exp_sbp",
    "final",
    "fmt",
    "mean_se",
    "model_overrides",
    "paper_commands",
    "run_experiment",
    "run_name",
    "scaled_rho",
    "target_position_kl",
    "tokens_per_step",
    "torchrun_command",
    "train_overrides",
    "train_run",
]
