"""The one interface every model implements.

``logits = model(tokens, order, blocks)``: ``tokens`` (B, n) in their original positions,
``order`` (B, n) a permutation, ``blocks`` (B, n) block ids or ``None`` for token level.
``logits[:, t]`` is the prediction of ``tokens[order[:, t]]`` from the tokens of blocks
before ``blocks[:, t]`` — slot-aligned, so ``loss`` is a plain cross-entropy against
``tokens.gather(1, order)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.config import ModelConfig
from anyorder.errors import ConfigError


class AnyOrderLM(nn.Module):
    """Base class: config, parameter counts, the slot-aligned cross-entropy loss."""

    kind: str = ""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.kind != self.kind:
            raise ConfigError(f"model.kind={cfg.kind!r} given to the {self.kind} model class")
        self.cfg = cfg

    # -- the interface ------------------------------------------------------------------

    def forward(
        self, tokens: Tensor, order: Tensor | None = None, blocks: Tensor | None = None
    ) -> Tensor:
        raise NotImplementedError

    def loss(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Mean negative log-likelihood per token (nats) of ``tokens`` in ``order``.

        For the decoders this is the any-order (or left-to-right) loss of Eq. 2; the
        encoder overrides it with its ELBO estimate. ``generator`` feeds methods whose
        loss is itself random (the encoder's mask level).
        """
        logits = self(tokens, order, blocks)
        return F.cross_entropy(logits.flatten(0, 1).float(), self.targets(tokens, order).flatten())

    def token_nll(
        self, tokens: Tensor, order: Tensor | None = None, blocks: Tensor | None = None
    ) -> Tensor:
        """Exact per-slot NLL (B, n) in nats of ``tokens[order[:, t]]`` given earlier blocks."""
        logits = self(tokens, order, blocks).float()
        targets = self.targets(tokens, order)
        return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")

    # -- helpers ------------------------------------------------------------------------

    def check_tokens(self, tokens: Tensor) -> None:
        n = tokens.shape[-1]
        if n > self.cfg.seq_len:
            raise ConfigError(
                f"sequence of {n} tokens is longer than the model's context "
                f"(model.seq_len={self.cfg.seq_len}); shorten it"
            )

    @staticmethod
    def targets(tokens: Tensor, order: Tensor | None) -> Tensor:
        """The tokens in slot order: the prediction targets."""
        return tokens if order is None else tokens.gather(1, order)

    @staticmethod
    def resolve_order(tokens: Tensor, order: Tensor | None) -> Tensor:
        if order is not None:
            return order
        B, n = tokens.shape
        return torch.arange(n, device=tokens.device).expand(B, n)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; ``non_embedding`` leaves out token and position tables."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            for name in ("tok_emb", "pos_emb"):
                mod = getattr(self, name, None)
                if isinstance(mod, nn.Embedding):
                    n -= mod.weight.numel()
            head = getattr(self, "head", None)
            if isinstance(head, nn.Linear) and not self.cfg.tie_embeddings:
                n -= head.weight.numel()
        return n

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device
