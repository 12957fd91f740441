"""Moved to :mod:`anyorder.training`; kept until the layout merge."""

# ruff: noqa: F401  (re-exports: every name this module defined, old private names included)

from anyorder.training.bookkeeping import ESTIMATE_AFTER
from anyorder.training.distributed import (
    DIST_TIMEOUT_ENV,
    DistEnv,
    _held_stderr,
    env_rank,
    full_model_state,
    load_optimizer_state,
    optimizer_state,
    print0,
    resolve_device,
    set_full_model_state,
    setup_distributed,
)
from anyorder.training.distributed import barrier as _barrier
from anyorder.training.distributed import from_rank0 as _from_rank0
from anyorder.training.distributed import gather_objects as _gather_objects
from anyorder.training.distributed import is_fsdp as _is_fsdp
from anyorder.training.distributed import load_weights_into as _load_into
from anyorder.training.loop import _lock_run_folder, _train, train
from anyorder.training.metrics import MetricsLog, _step_of_row, read_metrics
from anyorder.training.metrics import config_yaml as _yaml
from anyorder.training.metrics import write_atomic as _write_atomic
from anyorder.training.resume import RESUME_FORCED_FREE as _RESUME_FORCED_FREE
from anyorder.training.resume import RESUME_FREE as _RESUME_FREE
from anyorder.training.resume import (
    _check_model_of,
    _early_tokenizer_vocab,
    _flat,
    check_resume_early,
    config_diff,
)
from anyorder.training.resume import find_resume as _find_resume
from anyorder.training.resume import locate_resume as _locate_resume
from anyorder.training.resume import step_of as _step_of
from anyorder.training.setup import (
    COMPILE_AUTO,
    COMPILE_KWARGS,
    DRY_RUN_DOCUMENTS,
    LossModule,
    autocast_context,
    check_config,
    compile_modules,
    make_optimizer,
    resolve_vocab,
    use_compile,
)
from anyorder.training.setup import prepare_data as _prepare_data
from anyorder.training.signals import StopSignals as _StopSignals
from anyorder.training.state import EMA, lr_at, rng_state, set_rng_state
from anyorder.training.validation import MDM_L2R_ROWS, VAL_ORDERS, VAL_SEED, validate
from anyorder.training.validation import count_evaluations as _evaluations
from anyorder.training.validation import format_val as _fmt_val
