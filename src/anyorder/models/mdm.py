"""``mdm``: the encoder-only masked diffusion baseline (RADD/MDLM-style, no time input).

A bidirectional trunk reads ``x_t`` — masked tokens replaced by the model's own ``[MASK]``
id (``vocab_size``, one row past the vocabulary) — and predicts ``x_0`` at masked slots.
The mask token is never predicted.

The loss is the ELBO in the form of Eq. 5 (AO-GPT): draw ``m ~ U{1..n}``, mask the last
``m`` slots of a uniform order (a uniform subset of size ``m``), and score
``(1/m) * sum of their NLL``. Its expectation is the continuous-time ELBO with weight
``1/t`` per token (the two agree exactly: the integral of ``(1/t) Binom(m; n, t)`` is
``1/m``), with far less variance near ``t = 0``.

``forward(tokens, order, blocks)`` keeps the common interface: for every slot it runs the
encoder on a copy with the positions of that slot's block and later ones masked. That is
one encoder pass per slot (the encoder's conditionals depend on the visible *set*).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.config import ModelConfig
from anyorder.layers import Block, init_weights, make_norm, positions
from anyorder.models.base import AnyOrderLM
from anyorder.orders import inverse


class MDM(AnyOrderLM):
    """Bidirectional transformer denoiser ``x_t -> p(x_0 | x_t)``."""

    kind = "mdm"
    copies_per_pass = 64  # masked copies per encoder call in forward()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.d_model
        self.mask_id = cfg.vocab_size
        self.tok_emb = nn.Embedding(cfg.vocab_size + 1, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d) if cfg.positional == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        # Tied: the head is the embedding without the [MASK] row, so no head module.
        self.head = None if cfg.tie_embeddings else nn.Linear(d, cfg.vocab_size, bias=False)
        init_weights(self, cfg)

    def denoise(self, x_t: Tensor) -> Tensor:
        """Logits (B, n, V) of ``x_0`` at every position of ``x_t`` (masked = ``mask_id``)."""
        B, n = x_t.shape
        pos = torch.arange(n, device=x_t.device).expand(B, n)
        h = self.tok_emb(x_t)
        if self.pos_emb is not None:
            h = h + self.pos_emb(pos)
        pos = positions(self.cfg, pos)  # RoPE tables once, for every layer
        for block in self.blocks:
            h = block(h, pos, None)
        h = self.norm_f(h)
        weight = (
            self.tok_emb.weight[: self.cfg.vocab_size] if self.head is None else self.head.weight
        )
        return F.linear(h, weight)

    def visible(self, order: Tensor, blocks: Tensor | None) -> Tensor:
        """(B, n_slots, n_positions) True where a position is context for a slot."""
        B, n = order.shape
        slot_of = inverse(order)  # (B, n) slot of each position
        if blocks is None:
            return slot_of[:, None, :] < torch.arange(n, device=order.device)[None, :, None]
        block_of_pos = blocks.gather(1, slot_of)
        return block_of_pos[:, None, :] < blocks[:, :, None]

    def forward(
        self, tokens: Tensor, order: Tensor | None = None, blocks: Tensor | None = None
    ) -> Tensor:
        self.check_tokens(tokens)
        order = self.resolve_order(tokens, order)
        B, n = tokens.shape
        vis = self.visible(order, blocks)  # (B, n, n)
        copies = torch.where(vis, tokens[:, None, :], self.mask_id).flatten(0, 1)  # (B*n, n)
        target_pos = order.flatten()  # position each copy predicts
        out = []
        for i in range(0, B * n, self.copies_per_pass):
            logits = self.denoise(copies[i : i + self.copies_per_pass])
            idx = target_pos[i : i + self.copies_per_pass]
            out.append(logits[torch.arange(len(idx), device=idx.device), idx])
        return torch.cat(out).view(B, n, -1)

    def elbo_estimate(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """One-sample ELBO estimate per sequence (B,), in nats per token (Eq. 5 form).

        ``order`` picks which tokens are masked (the last ``m`` slots); pass a uniform order
        for the ELBO proper.
        """
        self.check_tokens(tokens)
        order = self.resolve_order(tokens, order)
        B, n = tokens.shape
        gen_device = generator.device if generator is not None else tokens.device
        m = torch.randint(1, n + 1, (B,), generator=generator, device=gen_device).to(tokens.device)
        masked = inverse(order) >= (n - m)[:, None]  # (B, n) by position
        logits = self.denoise(torch.where(masked, self.mask_id, tokens)).float()
        nll = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
        # (1/m) * sum over the m masked tokens is an unbiased estimate of ELBO / n.
        return (nll * masked).sum(dim=1) / m

    def loss(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Monte-Carlo ELBO (nats/token), one random mask level per sequence.

        ``blocks`` is not used: the encoder is trained on mask sets, not blocks.
        """
        return self.elbo_estimate(tokens, order, generator=generator).mean()
