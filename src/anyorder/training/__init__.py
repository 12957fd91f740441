"""Training: the loop read top to bottom, its set-up, processes, state and bookkeeping.

Modules, from the loop down:

* :mod:`~anyorder.training.loop`: :func:`train` and its phases (prepare, build, restore,
  open the run folder, step, summarise) and the bookkeeping after each step.
* :mod:`~anyorder.training.step`: one optimizer step over the global batch.
* :mod:`~anyorder.training.setup`: config checks, data, model, wrapper, optimizer, compile.
* :mod:`~anyorder.training.muon`: the optimizer of ``train.optimizer=muon``.
* :mod:`~anyorder.training.validation`: validation NLL (left to right and any order).
* :mod:`~anyorder.training.state`: the run's parts, the schedule, EMA, RNGs, save/restore.
* :mod:`~anyorder.training.resume`: which checkpoint a run continues from, and the checks.
* :mod:`~anyorder.training.distributed`: processes, DDP/FSDP wrapping, full state dicts.
* :mod:`~anyorder.training.metrics`: ``metrics.jsonl``, config and summary files.
* :mod:`~anyorder.training.signals`: SIGINT/SIGTERM save and stop.

Imports point down only: training uses the core, data, checkpoints, interop, sampling and
evaluation, never the applications.
"""

from anyorder.training.loop import train
from anyorder.training.metrics import read_metrics

__all__ = ["read_metrics", "train"]
