"""What loading a model gives (:class:`Loaded`), and the check every loader runs on it.

Both formats load into the same :class:`Loaded`: a training checkpoint
(:mod:`anyorder.checkpoint.load`) and an exported folder (:mod:`anyorder.checkpoint.exported`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from anyorder.config import RunConfig
from anyorder.errors import CheckpointError

if TYPE_CHECKING:
    from anyorder.data import Tokenizer
    from anyorder.models.base import AnyOrderLM


@dataclass
class Loaded:
    """A model loaded from a checkpoint, ready for sampling and evaluation."""

    model: AnyOrderLM
    """The model, in eval mode, on the requested device."""
    tokenizer: Tokenizer
    """The tokenizer the model was trained with."""
    config: RunConfig
    """The resolved config of the training run."""
    step: int
    """Optimizer steps the weights had when saved."""
    path: Path
    """The checkpoint folder."""
    weights: str = "raw"
    """Which weights were loaded: ``ema`` or ``raw``."""


def check_tokenizer_fits(tokenizer: Tokenizer | None, vocab_size: int, where: str) -> None:
    """A tokenizer must not give ids the model cannot read (fewer is fine: padded vocabularies).

    Raises:
        CheckpointError: the tokenizer has more ids than the model's ``vocab_size``.
    """
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise CheckpointError(
            f"the tokenizer of {where} has {tokenizer.vocab_size} token ids but the model reads "
            f"{vocab_size}; use the tokenizer the model was trained with"
        )


def chat_warning(loaded: Loaded) -> str | None:
    """Why a chat with ``loaded`` will not give answers, where its own run says so; else None.

    Only what the run config proves: trained here (``step > 0``) from scratch (no
    ``train.init_from``) on plain text (``order.condition=none``, ``data.format=text`` or a
    ``builtin:`` corpus). A converted model, a fine-tuned one or one trained on chat data may
    well answer: no warning."""
    cfg = loaded.config
    if loaded.step <= 0 or cfg.train.init_from or cfg.order.condition != "none":
        return None
    if not (cfg.data.format == "text" or str(cfg.data.source).startswith("builtin:")):
        return None
    return (
        f"{loaded.path} was trained on plain text (data.source={cfg.data.source}, "
        "order.condition=none), not on prompts and answers: its chat 'answer' continues the "
        "rendered prompt; fine-tune it on prompt/response data with order.condition=prompt "
        "(docs/data.md)"
    )


def warn_if_not_for_chat(loaded: Loaded) -> None:
    """A ``UserWarning`` (at the caller's caller) with :func:`chat_warning`'s reason, if any."""
    if (why := chat_warning(loaded)) is not None:
        import warnings

        warnings.warn(why, UserWarning, stacklevel=3)
