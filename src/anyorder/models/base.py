"""The one interface every model implements.

``logits = model(tokens, order, blocks)``: ``tokens`` (B, n) in their original positions,
``order`` (B, n) a permutation, ``blocks`` (B, n) block ids or ``None`` for token level.
``logits[:, t]`` is the prediction of ``tokens[order[:, t]]`` from the tokens of blocks
before ``blocks[:, t]`` — slot-aligned, so ``loss`` is a plain cross-entropy against
``tokens.gather(1, order)``.

The forward is two halves, ``head_logits(features(tokens, order, blocks))``: the final
hidden states (B, T, d) and the vocabulary head. Likelihoods (:meth:`AnyOrderLM.token_nll`,
the ensembles of :mod:`anyorder.evaluation.estimators`) apply the head only to the slots
they score and only ``head_rows`` of them at a time: at a vocabulary of 50257 the logits of
every slot of a batch are what does not fit (a (8, 1024, 50257) fp32 tensor is 1.6 GB).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from anyorder.config import ModelConfig
from anyorder.errors import ConfigError
from anyorder.layers.blocks import Head
from anyorder.layers.head_loss import head_cross_entropy, weighted_nll

DEFAULT_MAX_TOKENS = 1 << 13
"""Default chunk of the likelihood paths: token positions per trunk call, and as many
logits elements as ``max_tokens x d_model`` per head call (see :func:`head_rows`). A
trunk call's peak is about 20 floats of width ``d_model`` per position (measured: 45 MB at
8192 positions and d_model 64; so about 0.5 GB at GPT-2 small's 768): raise it on a GPU
with memory to spare, for larger batches."""


def head_rows(cfg: ModelConfig, max_tokens: int = DEFAULT_MAX_TOKENS) -> int:
    """Rows per head call so that their logits hold no more elements than ``max_tokens``
    hidden states: ``max_tokens * d / V`` (at least 16). 8192 tokens, d = 768, V = 50257:
    125 rows, 25 MB of fp32 logits."""
    return max(16, max_tokens * cfg.d_model // max(cfg.d_model, cfg.vocab_size))


class AnyOrderLM(nn.Module):
    """Base class: config, parameter counts, the slot-aligned cross-entropy loss."""

    kind: str = ""
    compile_features: bool = True
    """Whether ``train.compile`` compiles :meth:`features` too (validation calls it): not
    where it reads values back to the host by design (a graph break at every call)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.kind != self.kind:
            raise ConfigError(f"model.kind={cfg.kind!r} given to the {self.kind} model class")
        self.cfg = cfg
        # train.activation_checkpointing (set by the training set-up): see run_block
        self.checkpoint_blocks = False

    def run_block(self, fn: Callable[..., Tensor], *args: Any, **kwargs: Any) -> Tensor:
        """``fn(*args, **kwargs)``: one block (or ARMD's two-stream layer over one block).

        Under :attr:`checkpoint_blocks`, when a graph is being recorded, through
        ``torch.utils.checkpoint`` (non-reentrant): only the block's inputs are kept and its
        forward runs again in backward, with the RNG state of the first run (the same dropout
        masks, so the same gradients). A block goes in as the module itself, called through
        its ``__call__``, so FSDP2's per-block hooks see the recomputation too (they leave
        the unshard to the pre-backward hook then).
        """
        if self.checkpoint_blocks and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return fn(*args, **kwargs)

    # -- the interface ------------------------------------------------------------------

    def forward(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        targets: Tensor | None = None,
        weights: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, T, V); with ``targets`` (B, T), the fp32 loss instead: the mean NLL of
        the targets, or ``sum(weights * NLL)`` with ``weights`` (B, T); the head's
        cross-entropy computed in chunks that keep no logits for backward
        (:func:`head_cross_entropy`; inside forward, so that DDP's and FSDP's hooks see the
        head's weight used)."""
        h = self.features(tokens, order, blocks)
        if targets is None:
            return self.head_logits(h)
        head = self.head_params()
        if head is None:
            return weighted_nll(self.head_logits(h), targets, weights)
        return head_cross_entropy(h, *head, targets, weights)

    def features(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        max_tokens: int | None = None,
    ) -> Tensor:
        """Final hidden states (B, T, d), slot-aligned: what the head reads at each slot.

        ``order`` may be a prefix of a permutation (T < n) for the decoders. ``max_tokens``
        bounds the token positions per trunk call where a model runs several (the encoder's
        masked copies); the decoders run the batch they are given.
        """
        raise NotImplementedError

    def head_logits(self, h: Tensor) -> Tensor:
        """Logits (..., V) from final hidden states (..., d)."""
        return self.head(h)

    def head_params(self) -> tuple[Tensor, Tensor | None] | None:
        """``(W, b)`` with ``head_logits(h) == F.linear(h, W, b)`` where the head is a plain
        :class:`~anyorder.layers.Head` (the first ``vocab_size`` rows of its table); None for
        any other head (peft's adapters with their dropout, a model's own ``head_logits``)."""
        head = getattr(self, "head", None)
        if type(head) is not Head or type(self).head_logits is not AnyOrderLM.head_logits:
            return None
        bias = None if head.bias is None else head.bias[: head.used]
        return head.weight[: head.used], bias

    def has_features(self) -> bool:
        """Whether this model splits its forward into :meth:`features` and the head (a test
        double that defines ``forward`` alone does not)."""
        return type(self).features is not AnyOrderLM.features

    def loss(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        prompt_len: Tensor | None = None,
    ) -> Tensor:
        """Mean negative log-likelihood per token (nats) of ``tokens`` in ``order``.

        For the decoders this is the any-order (or left-to-right) loss of Eq. 2; the
        encoder overrides it with its ELBO estimate. ``generator`` feeds methods whose
        loss is itself random (the encoder's mask level).

        ``prompt_len`` (B,): the first ``prompt_len`` positions of each row are a prompt,
        known context with no loss; the mean is over the answer's tokens of the batch (the
        order should put the prompt first: :func:`anyorder.orders.prompt_first`).
        """
        targets = self.targets(tokens, order)
        weights = None  # the mean over every slot
        if prompt_len is not None:
            answer = self.answer_slots(tokens, order, prompt_len).float()
            weights = answer / answer.sum().clamp(min=1)
        if self.has_features():  # the head's cross-entropy in chunks, inside forward
            return self(tokens, order, blocks, targets=targets, weights=weights)
        return weighted_nll(self(tokens, order, blocks), targets, weights)

    def loss_draws(
        self, tokens: Tensor, generator: torch.Generator | None, prompt_len: Tensor | None = None
    ) -> dict[str, Tensor]:
        """The random inputs of :meth:`loss`, drawn from ``generator`` ahead of it, as keyword
        arguments to pass it: a compiled loss then reads tensors only (a generator is a graph
        break). None for the decoders, whose loss is a function of the tokens and the order;
        the encoder's mask levels. ``loss(..., **draws)`` equals ``loss(..., generator=g)``
        from the same generator state."""
        return {}

    def answer_slots(self, tokens: Tensor, order: Tensor | None, prompt_len: Tensor) -> Tensor:
        """(B, n) True at the slots whose target is an answer position (``>= prompt_len``)."""
        return self.resolve_order(tokens, order) >= prompt_len.to(tokens.device)[:, None]

    def token_nll(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> Tensor:
        """Exact per-slot NLL (B, T) in nats of ``tokens[order[:, t]]`` given earlier blocks.

        The head runs on :func:`head_rows` slots at a time, so the logits never exceed that
        chunk (``max_tokens``); equal to the cross-entropy of the full forward's logits.
        """
        if not self.has_features():
            logits = self(tokens, order, blocks).float()
            targets = self.targets(tokens, order)[:, : logits.shape[1]]
            return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        h = self.features(tokens, order, blocks, max_tokens=max_tokens)  # (B, T, d)
        return self.head_nll(h, self.targets(tokens, order)[:, : h.shape[1]], max_tokens)

    def head_nll(self, h: Tensor, targets: Tensor, max_tokens: int = DEFAULT_MAX_TOKENS) -> Tensor:
        """NLL (...) in nats of ``targets`` (...) from hidden states (..., d), the head applied
        to :func:`head_rows` rows at a time (fp32 log-softmax, as the full path)."""
        flat, tgt = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        out = torch.empty(tgt.shape, dtype=torch.float32, device=h.device)
        rows = head_rows(self.cfg, max_tokens)
        for i in range(0, len(tgt), rows):
            logits = self.head_logits(flat[i : i + rows]).float()  # (rows, V)
            out[i : i + rows] = F.cross_entropy(logits, tgt[i : i + rows], reduction="none")
        return out.view(targets.shape)

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

    def prepare_decode(self, cache: Any) -> None:
        """Fill, before a decode's first pass, what its passes compute once and keep: the
        RoPE table here, a model's own tables in its override. For compiled passes
        (:func:`~anyorder.sampling.compiled_passes`): a compiled pass that fills such a
        memo compiles again once it is filled (its guards read the memo), and on CUDA that
        second compile would run while the pass's graph is recorded, which CUDA refuses."""
        if self.cfg.positional == "rope":
            from anyorder.layers.rope import positions

            positions(self.cfg, torch.zeros(1, 1, dtype=torch.long, device=self.device))
