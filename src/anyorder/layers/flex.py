"""The optional FlexAttention backend for block masks (CUDA only).

FlexAttention skips the masked tiles that SDPA with a dense mask computes. It has no
backward on the CPU and needs torch.compile to be fast, so it is off unless asked for
(``set_attention_backend("flex")`` or ``ANYORDER_ATTENTION=flex``) and then used only on
CUDA, for heads its kernels take (:data:`FLEX_MIN_HEAD_DIM`); everywhere else the dense
SDPA path runs. The backend is process-wide state held here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from anyorder.errors import ConfigError

ATTENTION_BACKENDS = ("sdpa", "flex")
FLEX_MIN_HEAD_DIM = 16
"""The smallest head (query/key and value) dimension FlexAttention's CUDA kernels take:
inductor refuses smaller ones ("NYI: embedding dimension of the query, key, and value must
be at least 16", ``torch/_inductor/kernel/flex/flex_attention.py``, torch 2.11 to 2.13:
Triton's ``tl.dot`` needs 16). That is its only limit on the head dimension there: one not
a power of 2 is padded to the next (``SAFE_HEAD_DIM``), and grouped query heads that are
no power of 2 per key head take its general kernel instead of the decoding one."""
_backend = {"name": "sdpa"}
_FLEX: dict[str, Any] = {}  # "ops": what _load_flex found, filled once


def set_attention_backend(name: str) -> None:
    """``sdpa`` (default, every device) or ``flex`` (FlexAttention for block masks on CUDA;
    the CPU keeps SDPA)."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention backend {name!r} is unknown; use one of {', '.join(ATTENTION_BACKENDS)}"
        )
    _backend["name"] = name
    if name == "flex":
        _load_flex()  # here, not inside a compiled forward


def flex_enabled(device: torch.device, head_dim: int | None = None) -> bool:
    """Whether block masks on ``device`` for heads of ``head_dim`` go through FlexAttention:
    asked for, on CUDA, importable, and heads of at least :data:`FLEX_MIN_HEAD_DIM` (a model
    with smaller heads takes SDPA instead of failing in the compiler; ``None``: the caller
    does not know, the head dimension is not checked). A decision made from the arguments
    alone: ``torch.device("cuda")`` needs no GPU to ask."""
    return (
        _backend["name"] == "flex"
        and device.type == "cuda"
        and (head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM)
        and _load_flex() is not None
    )


def _load_flex() -> tuple[Callable, Callable, Callable] | None:
    """``(flex_attention, its compiled form, create_block_mask)``, imported once; None if
    absent. Loaded when the backend is chosen, so that a compiled model's trace only reads
    it: inside ``torch.compile`` the plain ``flex_attention`` is called (and compiled with the
    model), outside it the compiled one (FlexAttention is slow uncompiled)."""
    if "ops" not in _FLEX:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError:
            _FLEX["ops"] = None
        else:
            compiled = torch.compile(flex_attention, dynamic=False)
            _FLEX["ops"] = (flex_attention, compiled, create_block_mask)
    return _FLEX["ops"]


if os.environ.get("ANYORDER_ATTENTION") == "flex":
    set_attention_backend("flex")


def _flex_block_mask(ids: Tensor, strict: bool) -> Any:
    """FlexAttention block mask of ``B(key) <= B(query)`` (``<`` when strict) over ids (B, n)."""
    create_block_mask = _load_flex()[2]
    ids = ids.contiguous()
    B, n = ids.shape

    def visible(b, h, q, k):
        return ids[b, k] < ids[b, q] if strict else ids[b, k] <= ids[b, q]

    return create_block_mask(visible, B, None, n, n, device=ids.device)
