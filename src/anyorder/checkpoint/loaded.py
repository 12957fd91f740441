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
