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
one encoder pass per masked set (the encoder's conditionals depend on the visible *set*, so
the slots of one block share a pass); only the hidden states at the slots' target positions
are kept, so the head runs once per slot (``features``), not over every position of every
copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.config import ModelConfig
from anyorder.layers import Block, init_weights, make_norm, positions
from anyorder.layers.linear import Linear, linear
from anyorder.models.base import AnyOrderLM
from anyorder.orders import inverse, prompt_first


class MDM(AnyOrderLM):
    """Bidirectional transformer denoiser ``x_t -> p(x_0 | x_t)``."""

    kind = "mdm"
    copies_per_pass = 64  # masked copies per encoder call in forward()
    compile_features = False  # its copies are grouped by values read on the host

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.d_model
        self.mask_id = cfg.vocab_size
        self.tok_emb = nn.Embedding(cfg.vocab_size + 1, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d) if cfg.positional == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        # Tied: the head is the embedding without the [MASK] row, so no head module.
        self.head = None if cfg.tie_embeddings else Linear(d, cfg.vocab_size, bias=False)
        init_weights(self, cfg)

    def denoise(self, x_t: Tensor) -> Tensor:
        """Logits (B, n, V) of ``x_0`` at every position of ``x_t`` (masked = ``mask_id``)."""
        return self.head_logits(self.denoise_features(x_t))

    def denoise_features(self, x_t: Tensor) -> Tensor:
        """Final hidden states (B, n, d) of the encoder at every position of ``x_t``."""
        B, n = x_t.shape
        pos = torch.arange(n, device=x_t.device).expand(B, n)
        h = self.tok_emb(x_t)
        if self.pos_emb is not None:
            h = h + self.pos_emb(pos)
        pos = positions(self.cfg, pos)  # RoPE tables once, for every layer
        for block in self.blocks:
            h = self.run_block(block, h, pos, None)
        return self.norm_f(h)

    def head_logits(self, h: Tensor) -> Tensor:
        weight = (
            self.tok_emb.weight[: self.cfg.vocab_size] if self.head is None else self.head.weight
        )
        return linear(h, weight)

    def visible(self, order: Tensor, blocks: Tensor | None) -> Tensor:
        """(B, n_slots, n_positions) True where a position is context for a slot."""
        B, n = order.shape
        slot_of = inverse(order)  # (B, n) slot of each position
        if blocks is None:
            return slot_of[:, None, :] < torch.arange(n, device=order.device)[None, :, None]
        block_of_pos = blocks.gather(1, slot_of)
        return block_of_pos[:, None, :] < blocks[:, :, None]

    def features(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        max_tokens: int | None = None,
    ) -> Tensor:
        """Per slot, the encoder's hidden state at the slot's target position, on a copy
        with that slot's block and later ones masked: (B, T, d) for an order of T slots (a
        prefix of a permutation is fine: the positions it leaves out stay masked).

        One encoder pass per distinct masked set, not per slot: the slots of one block see
        the same context, so they share one copy (``n / S`` copies a row for strided blocks
        of size ``S`` instead of ``n``). ``max_tokens`` positions per encoder call
        (``max_tokens // n`` copies; default :data:`copies_per_pass`).
        """
        self.check_tokens(tokens)
        order = self.resolve_order(tokens, order)
        B, n = tokens.shape
        T = order.shape[1]
        slot_of = torch.full((B, n), T, dtype=order.dtype, device=order.device)
        slot_of.scatter_(1, order, torch.arange(T, device=order.device).expand(B, T))
        if blocks is None:
            rank, own = slot_of, torch.arange(T, device=order.device).expand(B, T)
        else:
            after = blocks.max(dim=1, keepdim=True).values + 1
            rank, own = torch.cat([blocks, after], dim=1).gather(1, slot_of), blocks
        # the masked sets: one per (row, block) pair; ``group`` of each slot, flat (B*T,)
        span = int(own.max()) + 1
        rows = torch.arange(B, device=order.device)[:, None]
        keys, group = torch.unique((rows * span + own).reshape(-1), return_inverse=True)
        by_group = torch.argsort(group, stable=True)  # the slots, grouped
        starts = torch.searchsorted(
            group[by_group], torch.arange(len(keys) + 1, device=keys.device)
        )
        per = self.copies_per_pass if max_tokens is None else max(1, max_tokens // n)
        flat_order = order.reshape(-1)
        out = None  # (B*T, d), allocated once: small tensors kept between the big ones
        for g0 in range(0, len(keys), per):
            g1 = min(g0 + per, len(keys))
            b, level = keys[g0:g1] // span, keys[g0:g1] % span
            copies = torch.where(rank[b] < level[:, None], tokens[b], self.mask_id)  # (per, n)
            h = self.denoise_features(copies)  # (per, n, d)
            if out is None:  # (fragment the heap, and the peak creeps up call after call)
                out = h.new_empty(B * T, h.shape[-1])
            slots = by_group[starts[g0] : starts[g1]]  # flat slot indices of these copies
            out[slots] = h[group[slots] - g0, flat_order[slots]]
        return out.view(B, T, -1)

    def elbo_estimate(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        prompt_len: Tensor | None = None,
        mask_count: Tensor | None = None,
    ) -> Tensor:
        """One-sample ELBO estimate per sequence (B,), in nats per token (Eq. 5 form).

        ``order`` picks which tokens are masked (the last ``m`` slots); pass a uniform order
        for the ELBO proper. With ``prompt_len`` (B,) the prompt is never masked: ``m`` is
        uniform on ``1..r`` for an answer of ``r`` tokens, the masked set the answer's last
        ``m`` in ``order``, and the estimate is of the answer's conditional ELBO over ``r``.
        ``mask_count`` (B,) sets ``m`` instead of drawing it (for enumerations).
        """
        self.check_tokens(tokens)
        order = self.resolve_order(tokens, order)
        n = tokens.shape[1]
        if prompt_len is not None:
            prompt_len = prompt_len.to(tokens.device)
            order = prompt_first(order, prompt_len)
        if mask_count is None:
            mask_count = self.draw_mask_count(tokens, generator, prompt_len)
        m = mask_count.to(tokens.device)
        masked = inverse(order) >= (n - m)[:, None]  # (B, n) by position
        logits = self.denoise(torch.where(masked, self.mask_id, tokens)).float()
        nll = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")
        # (1/m) * sum over the m masked tokens is an unbiased estimate of ELBO / n.
        return (nll * masked).sum(dim=1) / m

    def draw_mask_count(
        self, tokens: Tensor, generator: torch.Generator | None, prompt_len: Tensor | None = None
    ) -> Tensor:
        """The number of masked tokens ``m`` (B,) of each row of one ELBO estimate: uniform on
        ``1..n``, or on ``1..r`` for an answer of ``r`` tokens after a ``prompt_len`` prompt;
        drawn from ``generator`` on its device, returned on the tokens' device."""
        B, n = tokens.shape
        gen_device = generator.device if generator is not None else tokens.device
        if prompt_len is None:
            m = torch.randint(1, n + 1, (B,), generator=generator, device=gen_device)
            return m.to(tokens.device)
        r = n - prompt_len.to(tokens.device)
        u = torch.rand(B, generator=generator, device=gen_device, dtype=torch.float64)
        return (u.to(tokens.device) * r).floor().long().clamp(max=r - 1) + 1  # uniform 1..r

    def loss_draws(
        self, tokens: Tensor, generator: torch.Generator | None, prompt_len: Tensor | None = None
    ) -> dict[str, Tensor]:
        """The mask levels of :meth:`loss`, drawn ahead of it (see the base class)."""
        return {"mask_count": self.draw_mask_count(tokens, generator, prompt_len)}

    def loss(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        prompt_len: Tensor | None = None,
        mask_count: Tensor | None = None,
    ) -> Tensor:
        """Monte-Carlo ELBO (nats/token), one random mask level per sequence (``mask_count``
        where given: :meth:`loss_draws`, else drawn from ``generator`` here).

        ``blocks`` is not used: the encoder is trained on mask sets, not blocks. With
        ``prompt_len`` the prompt is never masked and the mean is per answer token of the
        batch (each row's estimate weighted by its answer's length).
        """
        est = self.elbo_estimate(
            tokens, order, generator=generator, prompt_len=prompt_len, mask_count=mask_count
        )
        if prompt_len is None:
            return est.mean()
        r = (tokens.shape[1] - prompt_len.to(tokens.device)).to(est.dtype)
        return (est * r).sum() / r.sum().clamp(min=1)
