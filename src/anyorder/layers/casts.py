"""The weights a decode reads under autocast, cast once for the whole decode.

Under bf16 autocast with fp32 weights (``anyorder sample`` and ``serve`` on CUDA by
default, ``decode.py --dtype bf16``) every product casts its weight to bf16 first. Eager,
autocast keeps the casts of weights that require a gradient in a cache, so a decode pays
them once; a CUDA graph must be recorded with that cache off (a cached cast is freed when
autocast exits, under a graph that would still read it), so every replay of a captured
pass cast every weight again: at the tiny size 17 of a gpt pass's 208 kernels and 8 more
for the QK-norm gains, at paper size (12 x 768, vocabulary 50,257) some 60 kernels that
read the 124M fp32 weights and write them as bf16, six bytes a weight a pass where the
products read two. Weights that require no gradient were cast at every product eagerly too.

:class:`Casts` makes each of the model's floating-point parameters in autocast's dtype
once, when a decode begins (``sampling/passes.py``), and within :func:`reading` the layers
read those copies: :func:`~anyorder.layers.linear.linear` its weight and bias, RMSNorm its
gain, the padded head and ARMD's query-only and key-value-only projections the rows they
take of theirs. A copy is ``weight.to(dtype)``, the very cast autocast makes (round to
nearest), so the products and the logits are those of autocast's own casts, bit for bit
(tested). The
copies live as long as the decode (its graphs read them) and cost at most half of the fp32
weights' memory while it runs (token tables and AO-GPT's adaLN are not copied: no pass
casts them), what autocast's cache holds in an eager decode; a device too full for them
decodes with autocast's casts as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


class Casts:
    """``model``'s floating-point parameters in ``dtype``, keyed by the parameter: those a
    pass may read, not the ones only a token table (``nn.Embedding``: a lookup, never cast)
    or a module marked ``decode_casts = False`` holds (AO-GPT's adaLN: its products fill a
    table once per decode)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.copies: dict[int, tuple[Tensor, Tensor]] = {}  # id(param) -> (param, copy)
        with torch.no_grad():
            for p in _read_by_passes(model):
                if p.is_floating_point() and p.dtype != dtype:
                    self.copies[id(p)] = (p, p.detach().to(dtype))

    def of(self, t: Tensor | None) -> Tensor | None:
        """The copy of the parameter ``t``, or ``t`` itself where none was made (a view
        of a parameter is not looked up: take the copy of the parameter, then the view, as
        the padded head and ARMD's query-only projection do)."""
        if not isinstance(t, nn.Parameter):  # views and products: never copied (and a
            return t  # compiled pass cannot take the id of a tensor it made)
        entry = self.copies.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else t


def _read_by_passes(model: nn.Module) -> list[Tensor]:
    """The parameters some module other than a token table or a table-filling one holds
    (a tied head's weight is its token table's too)."""
    skipped: set[int] = set()
    for mod in model.modules():
        if getattr(mod, "decode_casts", True) is False:
            skipped |= {id(p) for p in mod.parameters()}
    read: dict[int, Tensor] = {}
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            continue
        for p in mod.parameters(recurse=False):
            if id(p) not in skipped:
                read[id(p)] = p
    return list(read.values())


def for_decode(model: nn.Module) -> Casts | None:
    """The casts a decode of ``model`` reads: autocast's dtype where autocast is on for the
    model's device and the weights are in another; None otherwise, or where the device has
    no room for them (autocast then casts as before)."""
    first = next(model.parameters(), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return None
    dtype = torch.get_autocast_dtype(first.device.type)
    if first.dtype == dtype:
        return None
    try:
        return Casts(model, dtype)
    except torch.OutOfMemoryError:
        return None


class _Here(threading.local):
    def __init__(self) -> None:  # in each thread's own dict from the start: a compiled
        self.casts: Casts | None = None  # pass guards on it, and would compile again


_here = _Here()


@contextmanager
def reading(casts: Casts | None) -> Iterator[None]:
    """Within, in this thread, the layers read ``casts`` (None: the parameters)."""
    before, _here.casts = _here.casts, casts
    try:
        yield
    finally:
        _here.casts = before


def current() -> Casts | None:
    """The casts this thread's layers read now."""
    return _here.casts


def cast(t: Tensor | None) -> Tensor | None:
    """The copy of the parameter ``t`` this thread's decode reads, or ``t``."""
    casts = _here.casts
    return t if casts is None else casts.of(t)


def gain(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """A norm's gain in ``dtype``: the decode's copy where it has one in that dtype."""
    copy = cast(weight)
    return copy if copy.dtype == dtype else weight.to(dtype)
