"""Which checkpoint a run continues from, checked before anything is written.

Design choices:

* ``resume="auto"`` continues the latest checkpoint of the run folder when its config
  matches; only bookkeeping keys (:data:`RESUME_FREE`: steps, intervals, device, ...) may
  differ. ``--resume`` (``True`` or a path) also allows the optimisation settings
  (``train.*``, ``order.*``) to change; the model and data sections never may.
* The model kind and the tokenizer's vocabulary are checked twice: early, from the config
  alone (:func:`check_resume_early`, before any data is prepared, so a mismatch leaves no
  files), and once the tokenizer is loaded (:func:`find_resume`).
* Step folders without a readable manifest are damaged checkpoints, not a new run: a fresh
  start would delete ``metrics.jsonl`` and overwrite them, so it must be asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anyorder import checkpoint as ckpt_mod
from anyorder.config import RunConfig, to_dict
from anyorder.errors import CheckpointError, ConfigError

# Keys that may differ between a run folder's checkpoint and the config it is resumed with.
# auto-resume: only bookkeeping; --resume: also the optimisation settings.
RESUME_FREE = {
    "train.out_dir",
    "train.steps",
    "train.eval_every",
    "train.eval_batches",
    "train.ckpt_every",
    "train.keep_last",
    "train.log_every",
    "train.device",
    "train.compile",
    "train.skip_nonfinite",
    "data.cache_dir",
    "data.streaming",
}
RESUME_FORCED_FREE = {"train.", "order."}
"""Prefixes that ``--resume`` lets change, except ``train.optimizer``: another optimizer
cannot take the saved optimizer's state."""


def _flat(prefix: str, d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(key + ".", v))
        else:
            out[key] = v
    return out


def config_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted keys whose values differ between two configs."""
    fa, fb = _flat("", to_dict(a)), _flat("", to_dict(b))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def _check_model_of(found: Path, old: RunConfig, cfg: RunConfig, vocab: int | None) -> None:
    """A checkpoint to resume must hold the config's model kind and the tokenizer's vocabulary.

    Raises:
        CheckpointError: another kind, or ``vocab`` (the run's tokenizer) of another size.
    """
    if old.model.kind != cfg.model.kind:
        raise CheckpointError(
            f"{found} holds model.kind={old.model.kind} but the config asks for "
            f"model.kind={cfg.model.kind}; set model.kind={old.model.kind} to resume it, or pick "
            "another train.out_dir"
        )
    if vocab is not None and vocab != old.model.vocab_size:
        raise CheckpointError(
            f"data.tokenizer={cfg.data.tokenizer!r} has {vocab} token ids but {found} was "
            f"trained with {old.model.vocab_size} ({old.data.tokenizer!r}); use the run's "
            f"tokenizer, e.g. data.tokenizer={found / ckpt_mod.TOKENIZER_DIR}"
        )


def _early_tokenizer_vocab(cfg: RunConfig, unless: str | None = None) -> int | None:
    """The vocabulary size of ``data.tokenizer`` when it loads without the corpus (not
    ``bpe:N``, which is trained on it) and differs from ``unless``; else None."""
    spec = cfg.data.tokenizer
    if spec == unless or spec.startswith("bpe:"):
        return None
    from anyorder.data import load_tokenizer

    return load_tokenizer(spec).vocab_size


def check_resume_early(cfg: RunConfig, resume: bool | str) -> None:
    """Before any data is prepared: the checkpoint to resume (or ``train.init_from``) holds
    the config's model kind and the tokenizer's vocabulary, so a mismatch leaves no files.

    Raises:
        CheckpointError / ConfigError: as :func:`find_resume`, or a model of another kind,
            or a tokenizer of another vocabulary size.
    """
    run_dir = Path(cfg.train.out_dir).expanduser()
    found = locate_resume(resume, run_dir)
    if found is not None:
        old = ckpt_mod.read_config(found)
        _check_model_of(found, old, cfg, _early_tokenizer_vocab(cfg, unless=old.data.tokenizer))
        return
    if cfg.train.init_from:  # the model section came from init_from (init_model_config)
        vocab = _early_tokenizer_vocab(cfg)
        # fewer ids than the weights read is fine: a pretrained table may have spare rows
        if vocab is not None and vocab > cfg.model.vocab_size:
            raise CheckpointError(
                f"train.init_from={cfg.train.init_from!r} reads {cfg.model.vocab_size} token "
                f"ids but data.tokenizer={cfg.data.tokenizer!r} has {vocab}; set "
                "data.tokenizer to the tokenizer init_from was made with (its folder)"
            )


def locate_resume(resume: bool | str, run_dir: Path) -> Path | None:
    """The checkpoint ``resume`` names, or None for a fresh start (no config checks)."""
    if resume is False:
        if ckpt_mod.latest_checkpoint(run_dir) is not None:
            raise ConfigError(
                f"{run_dir} already holds checkpoints; resume it (--resume), or pick another "
                "train.out_dir"
            )
        return None
    if isinstance(resume, str) and resume != "auto":
        found: Path | None = ckpt_mod.resolve_checkpoint(resume)
    else:
        found = ckpt_mod.latest_checkpoint(run_dir)
    if found is None and resume is True:
        raise CheckpointError(
            f"nothing to resume: {run_dir} holds no checkpoint; drop --resume to start"
        )
    if found is None:
        # Step folders without a readable manifest: damaged checkpoints, not a new run. A
        # fresh start would delete metrics.jsonl and overwrite them, so it must be asked for.
        root = run_dir / ckpt_mod.CHECKPOINTS
        broken = sorted(p.name for p in root.glob("step_*") if p.is_dir()) if root.is_dir() else []
        if broken:
            raise CheckpointError(
                f"{root} holds {len(broken)} checkpoint folder(s) without a manifest.json "
                f"({broken[-1]}...); restore them, delete them, or start over with --fresh"
            )
    return found


def find_resume(cfg: RunConfig, resume: bool | str, run_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start.

    Raises:
        CheckpointError / ConfigError: nothing to resume, a model of another kind or
            vocabulary, or a run folder of another config.
    """
    found = locate_resume(resume, run_dir)
    if found is None:
        return None
    old = ckpt_mod.read_config(found)
    _check_model_of(found, old, cfg, cfg.model.vocab_size)
    diff = config_diff(old, cfg)
    forced = resume is not False and resume != "auto"
    if "train.optimizer" in diff:  # never free, not even with --resume
        was, now = old.train.optimizer, cfg.train.optimizer
        raise ConfigError(
            f"{found} was trained with train.optimizer={was}, not {now}, and its saved state "
            f"is that optimizer's; resume with train.optimizer={was}, or start a new run from "
            f"its weights (train.init_from={found} with another train.out_dir)"
        )
    bad = [
        k
        for k in diff
        if k not in RESUME_FREE and not (forced and k.startswith(tuple(RESUME_FORCED_FREE)))
    ]
    if bad:
        how = "" if forced else " (--resume also allows other train.* and order.* changes)"
        raise ConfigError(
            f"{found} was trained with another config (differs in {', '.join(bad)}); use the "
            f"same settings to resume{how}, or pick another train.out_dir"
        )
    return found


def step_of(ckpt: Path | None) -> int | None:
    """The step of a checkpoint folder (``step_0000012``), or None."""
    m = ckpt_mod._NAME.match(ckpt.name) if ckpt is not None else None
    return int(m.group(1)) if m else None
