"""Weights files: state dicts to and from safetensors, and whether a file fits a model.

Design choices:

* Tied weights (the head sharing the embedding) are written once: the safetensors file holds
  no alias, and the loader fills the aliases from the model it builds. That keeps the files
  readable by plain ``safetensors.torch.load_file``.
* A file's tensor names and shapes are checked against the model config from its header
  alone (:func:`read_header_shapes`, :func:`header_problem`) before the model is built, so a
  wrong or hostile file never makes us allocate a model of its size.
* Used by training checkpoints and exported folders alike.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from anyorder.checkpoint.layout import _first_line
from anyorder.errors import CheckpointError


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for parameters shared under several names (a tied head).

    The canonical name is the first one ``named_parameters`` yields (``tok_emb.weight``).
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def state_digest(model: nn.Module) -> str:
    """SHA-256 of a model's state dict (names, dtypes, shapes and bytes, in name order): what
    identifies a LoRA run's base, whichever file or folder it was read from."""
    h = hashlib.sha256()
    for name, v in sorted(model.state_dict().items()):
        t = v.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(v.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_weights(
    state: Mapping[str, Tensor], path: str | Path, aliases: Mapping[str, str] | None = None
) -> None:
    """Write a state dict to safetensors, without the ``aliases`` (tied copies)."""
    from safetensors.torch import save_file

    aliases = dict(aliases or {})
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items() if k not in aliases}
    save_file(tensors, str(path), metadata={"format": "pt", "tied": json.dumps(aliases)})


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load a safetensors file written by :func:`save_weights` into ``model`` (strictly).

    Raises:
        CheckpointError: the file's tensors do not fit the model.
    """
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except Exception as e:  # removed by a prune, or not safetensors at all
        raise CheckpointError(
            f"weights file {path} cannot be read ({type(e).__name__}: {_first_line(e)})"
        ) from None
    detail = fit_state(model, state)
    if detail:
        raise CheckpointError(
            f"weights in {path} do not fit the model its config.yaml describes ({detail}); "
            "the checkpoint was altered or written by another version"
        )
    check_finite(state, path, "the run diverged before this save: use an earlier checkpoint")
    adopt_state(model, state)


def adopt_state(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Put a checked ``state`` (every key of ``model.state_dict()``, the right shapes:
    :func:`fit_state`) into ``model``, sharing storage where it can: a parameter of the
    same dtype and device takes the state's tensor as its data, the rest is copied.

    ``safetensors`` maps a file into memory (private, copy on write), so the weights are
    read in place from the page cache, as ``transformers``' ``from_pretrained`` reads them:
    no second copy at load, and where the kernel caches files in huge pages (Linux 6.x),
    the weights are read through 2 MB pages, which decoding, a matrix-vector product per
    weight per token, reads about 10% faster than a copy in 4 KB pages (a 2048 x 128256
    head, one thread: 70 ms against 80-84 ms; docs/performance.md). Training writes to a
    parameter copy the touched pages (the file never changes). Tied parameters stay one
    ``Parameter``; Windows, where a mapped file cannot be deleted, always copies.
    """
    share = os.name != "nt"
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied alias: its Parameter, once
            src = state[name]
            if share and src.dtype == param.dtype and src.device == param.device:
                param.data = src
            else:
                param.copy_(src)
        for name, buf in model.named_buffers():
            if name in state:  # persistent buffers (the rest is not saved)
                buf.copy_(state[name])


def nonfinite_problem(state: Mapping[str, Tensor]) -> str:
    """The first floating-point tensor of ``state`` holding NaN or Inf, described ("" when
    every value is finite): such weights would only fail later, deep inside sampling."""
    for name, t in state.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            nan = int(torch.isnan(t).sum())
            inf = int(torch.isinf(t).sum())
            return f"{name} holds {nan} NaN and {inf} Inf of {t.numel()} values"
    return ""


def check_finite(state: Mapping[str, Tensor], path: str | Path, fix: str) -> None:
    """Refuse weights that are not finite, naming the file and the tensor.

    Raises:
        CheckpointError: some weight is NaN or Inf.
    """
    problem = nonfinite_problem(state)
    if problem:
        raise CheckpointError(f"{path} holds weights that are not finite ({problem}); {fix}")


_MAX_HEADER = 100 * 2**20  # a safetensors header larger than this is not one of ours


def _sizes(name: str, shape: Any) -> tuple[int, ...]:
    """A header entry's ``shape``: a list of whole numbers >= 0 (JSON's 1e400 reads as
    infinity, 1.5 and "12" as nothing safetensors writes).

    Raises:
        ValueError: anything else.
    """
    ok = isinstance(shape, list) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    )
    if not ok:
        raise ValueError(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    return tuple(shape)


def read_header_shapes(path: str | Path, fix: str = "") -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a safetensors file's header (nothing else is read).

    Raises:
        CheckpointError: the file is missing or its header is malformed.
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        shapes = {k: _sizes(k, v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise CheckpointError(
            f"{path} is corrupt (its safetensors header: {_first_line(e)}){fix}"
        ) from None
    return shapes


def header_problem(model_cfg: Any, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """How a weights file's tensor shapes (its header) do not fit a model config ("" when
    they do), decided before the model is built: first the number of blocks and the
    embedding (cheap, and they bound the model's size by the file's), then every tensor of
    the model built on the meta device (no memory)."""
    from anyorder.models import build_model

    blocks = {k.split(".")[1] for k in shapes if k.startswith("blocks.") and k.count(".") > 1}
    if len(blocks) != model_cfg.n_layer:
        return f"the weights hold {len(blocks)} blocks, the config says n_layer={model_cfg.n_layer}"
    emb = shapes.get("tok_emb.weight")
    if emb is None or len(emb) != 2 or emb[1] != model_cfg.d_model:
        return f"tok_emb.weight is {emb}, the config says d_model={model_cfg.d_model}"
    with torch.device("meta"):
        model = build_model(model_cfg, init=False)  # shapes only
    aliases = tied_aliases(model)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in aliases}
    missing = sorted(set(want) - set(shapes))
    unexpected = sorted(set(shapes) - set(want) - set(aliases))
    wrong = sorted(k for k in set(want) & set(shapes) if want[k] != shapes[k])
    return "; ".join(
        f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("shape", wrong))
        if names
    )


def fit_state(model: nn.Module, state: dict[str, Tensor]) -> str:
    """Restore tied copies in ``state`` (in place) and say how it does not fit ``model``.

    Returns:
        "" when every key is there with the right shape, else a short description of the
        missing, unexpected and wrongly shaped keys (for the caller's error message).
    """
    untied = []  # a copy the file holds of a tied weight must be that weight
    for alias, canonical in tied_aliases(model).items():
        if alias not in state and canonical in state:
            state[alias] = state[canonical]
        elif canonical in state and not torch.equal(state[alias], state[canonical]):
            untied.append(alias)
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    wrong = sorted(k for k in set(want) & set(state) if want[k].shape != state[k].shape)
    # integer or bool tensors where the model has floats would be cast silently into a
    # model that computes nonsense
    kind = sorted(
        k
        for k in set(want) & set(state)
        if want[k].is_floating_point() and not state[k].is_floating_point()
    )
    return "; ".join(
        f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
        for what, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("shape", wrong),
            ("not floating point", kind),
            ("not equal to the weight the config ties them to", sorted(untied)),
        )
        if names
    )
