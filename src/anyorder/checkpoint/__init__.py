"""Checkpoints: training checkpoints (atomic, checksummed, resumable) and exported models.

* :mod:`~anyorder.checkpoint.layout`: what a training checkpoint is on disk: folder names,
  finding a run's checkpoints, the manifest and :func:`verify`;
* :mod:`~anyorder.checkpoint.weights`: state dicts to and from safetensors (tied copies once),
  and whether a file's tensors fit a model config;
* :mod:`~anyorder.checkpoint.save`: :func:`save_checkpoint` (atomic), :func:`prune`, and the
  lock a reader holds (:func:`reading`);
* :mod:`~anyorder.checkpoint.loaded`: :class:`Loaded`, what every loader returns;
* :mod:`~anyorder.checkpoint.load`: reading a checkpoint's parts, and :func:`load_model` for
  everyone else (run folders, checkpoint folders and exported folders);
* :mod:`~anyorder.checkpoint.exported`: the exported (Hugging Face style) folder and
  :func:`load_exported`;
* :mod:`~anyorder.checkpoint.exporting`: :func:`save_pretrained` and :func:`export`.

Imports point one way: layout <- weights <- save, loaded <- exported <- load <- exporting.
Hub downloads and uploads, and converting other formats, live above in :mod:`anyorder.interop`.
"""

from anyorder.checkpoint.adapters import base_of, check_base, read_adapters
from anyorder.checkpoint.exported import is_exported, load_exported, read_export_config
from anyorder.checkpoint.exporting import export, save_pretrained
from anyorder.checkpoint.layout import (
    _NAME as _NAME,  # train.py reads step numbers of checkpoint folders with it
)
from anyorder.checkpoint.layout import (
    CHECKPOINTS,
    CONFIG_FILE,
    EMA_FILE,
    FORMAT_VERSION,
    MANIFEST,
    MODEL_FILE,
    STATE_FILE,
    TOKENIZER_DIR,
    WEIGHTS,
    checkpoint_name,
    is_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    manifest_problem,
    read_manifest,
    resolve_checkpoint,
    verify,
)
from anyorder.checkpoint.load import (
    load_model,
    read_config,
    read_state,
    read_tokenizer,
    weights_file,
)
from anyorder.checkpoint.loaded import Loaded, check_tokenizer_fits
from anyorder.checkpoint.save import apply_umask, make_temp_dir, prune, reading, save_checkpoint
from anyorder.checkpoint.weights import (
    adopt_state,
    fit_state,
    header_problem,
    load_weights,
    read_header_shapes,
    save_weights,
    state_digest,
    tied_aliases,
)

__all__ = [
    "CHECKPOINTS",
    "CONFIG_FILE",
    "EMA_FILE",
    "FORMAT_VERSION",
    "MANIFEST",
    "MODEL_FILE",
    "STATE_FILE",
    "TOKENIZER_DIR",
    "WEIGHTS",
    "Loaded",
    "apply_umask",
    "base_of",
    "check_base",
    "check_tokenizer_fits",
    "checkpoint_name",
    "export",
    "fit_state",
    "header_problem",
    "is_checkpoint",
    "is_exported",
    "latest_checkpoint",
    "list_checkpoints",
    "load_exported",
    "load_model",
    "load_weights",
    "adopt_state",
    "make_temp_dir",
    "manifest_problem",
    "prune",
    "read_config",
    "read_adapters",
    "read_export_config",
    "read_header_shapes",
    "read_manifest",
    "read_state",
    "read_tokenizer",
    "reading",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_pretrained",
    "save_weights",
    "state_digest",
    "tied_aliases",
    "verify",
    "weights_file",
]
