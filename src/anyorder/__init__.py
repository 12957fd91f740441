"""anyorder: decoder-only masked diffusion language models.

AO-GPT (arXiv 2506.19935) and ARMD (arXiv 2601.16971) with a left-to-right GPT and an
encoder-only masked diffusion baseline, sharing one transformer trunk. Importing this
package touches no GPU and downloads nothing.
"""

from __future__ import annotations

import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    # OpenMP threads that wait for work sleep instead of spinning, so a busy machine does not
    # collapse torch's CPU kernels: with spinning, a thread waiting at a barrier burns the
    # core its partner needs (the demo's training step at a load of 17 on 2 cores: 3.9 s
    # with 2 threads, 0.42 s with 1, 0.19 s with 2 passive; docs/performance.md, "Under
    # load"). OpenMP reads this once, when torch loads it; a value the user set is kept.
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyorder.config import ModelConfig, RunConfig, load_config, preset
from anyorder.errors import AnyorderError
from anyorder.models import build_model
from anyorder.version import __version__

if TYPE_CHECKING:
    from anyorder.api import Model

__all__ = [
    "AnyorderError",
    "ModelConfig",
    "RunConfig",
    "build_model",
    "load",
    "load_config",
    "preset",
    "__version__",
]


def load(path: str | Path, **kwargs: Any) -> Model:
    """Load a model to generate, infill and score text: see :func:`anyorder.api.load`.

    ``path`` is an exported folder, a hub id, a run folder or a checkpoint folder; returns an
    :class:`anyorder.api.Model`. (Imported on first use, so ``import anyorder`` stays light.)
    """
    from anyorder.api import load as _load

    return _load(path, **kwargs)
