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
from anyorder.layers.linear import use_prepacked
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
    "use_prepacked",
    "__version__",
]


def load(path: str | Path, **kwargs: Any) -> Model:
    """Load a model to generate, infill and score text: see :func:`anyorder.api.load`.

    ``path`` is an exported folder, a hub id, a run folder or a checkpoint folder; returns an
    :class:`anyorder.api.Model`. (Imported on first use, so ``import anyorder`` stays light.)
    """
    from anyorder.api import load as _load

    return _load(path, **kwargs)


# -- transformers' Auto classes ----------------------------------------------------------
# An export ships no Python: its classes are registered with transformers from here, so
# AutoModelForCausalLM.from_pretrained(export) needs no trust_remote_code. transformers is
# not imported for it: the registration runs once transformers has loaded AutoConfig's
# module, at once when it already has (the model classes follow with the first anyorder
# config: anyorder.hf says why).

_AUTO_HOOKS = {"transformers.models.auto.configuration_auto": "register_config"}


def _register(module: str) -> None:
    import warnings

    try:
        import anyorder.hf as hf

        getattr(hf, _AUTO_HOOKS[module])()
    except Exception as e:  # never break the user's import of transformers
        warnings.warn(
            f"anyorder could not register its transformers classes ({type(e).__name__}: {e}); "
            "import anyorder.hf and call anyorder.hf.register_models() to see why",
            stacklevel=2,
        )


class _AfterImport:
    """A ``sys.meta_path`` finder that runs :func:`_register` after one of :data:`_AUTO_HOOKS`
    has executed; it finds nothing itself (the other finders do)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _AUTO_HOOKS:
            return None
        for finder in _sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: Any) -> None:
            run(module)
            _register(fullname)

        loader.exec_module = exec_module  # this spec's own loader instance
        return spec


def _hook_transformers() -> None:
    if not any(isinstance(f, _AfterImport) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _AfterImport())
    for module in _AUTO_HOOKS:
        if module in _sys.modules:
            _register(module)


_hook_transformers()
