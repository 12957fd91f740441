"""``gpt``: the left-to-right baseline, and the decoder trunk AO-GPT builds on.

Slot inputs are ``[BOS, x_0, ..., x_(n-2)]``: slot ``t`` holds the previous token at its own
position and predicts ``x_t``. BOS is a learned vector, not a vocabulary id (the id ``-1``
stands for it in :meth:`GPT.embed`), and sits at position 0 for RoPE. AO-GPT uses the same
layout over a permuted sequence, so both share :meth:`GPT.embed` and :meth:`GPT.trunk`.
With ``model.bos_pos_row`` (the AO-GPT reference's layout) the learned position table has
``seq_len + 1`` rows: BOS adds row 0 and a token at position ``p`` reads row ``p + 1``.
With ``model.rope_bos_shift`` RoPE does the same: BOS rotated at 0, a token at ``p`` at
``p + 1``, as a Hugging Face model reads ``[bos] + x`` (:meth:`GPT.rope_positions`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from anyorder.cache import KVCache
from anyorder.config import ModelConfig
from anyorder.errors import ConfigError
from anyorder.layers import (
    Block,
    Head,
    Mask,
    Packing,
    Positions,
    TargetCondition,
    init_normal,
    init_weights,
    make_norm,
    positions,
)
from anyorder.models.base import AnyOrderLM

BOS = -1  # slot-input id of the learned BOS vector
Condition = Tensor | TargetCondition | None  # what the blocks' adaLN reads


class GPT(AnyOrderLM):
    """A causal decoder over ``[BOS, x_0 .. x_(n-2)]``, left to right only."""

    kind = "gpt"
    cond_dim: int | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.table_vocab, d)
        rows = cfg.seq_len + int(cfg.bos_pos_row)  # row 0 for BOS in the reference layout
        self.bos_row = cfg.bos_pos_row and cfg.positional == "learned"
        self.pos_emb = nn.Embedding(rows, d) if cfg.positional == "learned" else None
        self.bos = nn.Parameter(torch.zeros(d))
        self.blocks = nn.ModuleList(Block(cfg, self.cond_dim) for _ in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        self.head = Head(cfg)
        self.build_extra()
        init_weights(self, cfg)
        init_normal(self.bos, cfg.init_std, cfg)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def build_extra(self) -> None:
        """Hook for subclasses' extra modules (initialised with the rest)."""

    # -- shared pieces --------------------------------------------------------------------

    def embed(self, x_in: Tensor, pos_in: Tensor) -> Tensor:
        """Slot-input embeddings: token (``BOS`` = -1: the learned BOS) at position ``pos_in``."""
        is_bos = (x_in == BOS)[..., None]
        h = self.tok_emb(x_in.clamp(min=0))
        if self.bos_row:  # BOS + row 0, a token at p + row p + 1
            h = torch.where(is_bos, self.bos.to(h.dtype), h)
            return h + self.pos_emb(torch.where(is_bos[..., 0], 0, pos_in + 1))
        if self.pos_emb is not None:
            h = h + self.pos_emb(pos_in)
        return torch.where(is_bos, self.bos.to(h.dtype), h)

    def slot_inputs(self, tokens: Tensor, order: Tensor) -> tuple[Tensor, Tensor]:
        """``([BOS, x_o0 .. x_o(n-2)], [0, o_0 .. o_(n-2)])`` for a permuted sequence."""
        B = tokens.shape[0]
        x = tokens.gather(1, order)
        bos = torch.full((B, 1), BOS, dtype=x.dtype, device=x.device)
        zero = torch.zeros((B, 1), dtype=order.dtype, device=order.device)
        return torch.cat([bos, x[:, :-1]], dim=1), torch.cat([zero, order[:, :-1]], dim=1)

    def rope_positions(self, x_in: Tensor, pos_in: Tensor) -> Tensor:
        """The positions the slots are rotated at: ``pos_in``, or under
        ``model.rope_bos_shift`` 0 for the BOS and ``p + 1`` for a token at ``p``."""
        if not self.cfg.rope_bos_shift:
            return pos_in
        return torch.where(x_in == BOS, 0, pos_in + 1)

    def condition(self, target: Tensor) -> Condition:
        """Per-slot condition from the target positions (none for the plain GPT)."""
        return None

    def decode_condition(self, cache: KVCache, target: Tensor) -> Condition:
        """:meth:`condition` for a decoding call (may keep per-decode tables in ``cache``)."""
        return self.condition(target)

    def decode_conditions(self, cache: KVCache, target: Tensor) -> list:
        """:meth:`layer_conditions` for a decoding call: ``n_layer + 1`` entries."""
        return self.layer_conditions(self.decode_condition(cache, target))

    def inject(self, h: Tensor, target: Tensor) -> Tensor:
        """Additive target injection (only AO-GPT's ``add`` ablation uses it)."""
        return h

    def trunk(
        self, h: Tensor, pos: Tensor, mask: Mask, cond: Condition, target: Tensor | None = None
    ) -> Tensor:
        """All blocks and the final norm: (B, T, d) -> (B, T, d). ``target``: the slots'
        target positions (queries are rotated there under ``model.rope_query=target``)."""
        qpos = self.query_positions(target)
        pos = positions(self.cfg, pos)  # RoPE tables once, for every layer
        *layers, final = self.layer_conditions(cond)  # adaLN once, for every layer
        for block, c in zip(self.blocks, layers):
            h = self.run_block(block, h, pos, mask, c, qpos=qpos)
        return self.final_norm(h, final)

    def layer_conditions(self, cond: Condition) -> list:
        """What each block's and the final norm's adaLN reads, worked out once per forward:
        ``n_layer + 1`` entries (all None for the plain GPT)."""
        return [cond] * (len(self.blocks) + 1)

    def query_positions(self, target: Tensor | None) -> Positions:
        """RoPE tables of the queries when they differ from the keys' (else None)."""
        if target is None or self.cfg.rope_query != "target":
            return None
        return positions(self.cfg, target + int(self.cfg.rope_bos_shift))

    def final_norm(self, h: Tensor, cond: Condition) -> Tensor:
        return self.norm_f(h)

    def check_blocks(self, blocks: Tensor | None) -> None:
        if blocks is not None and not bool((blocks.diff(dim=-1) > 0).all()):
            raise ConfigError(
                f"{self.kind} predicts one token per slot (block size 1); it gets blocks of "
                "several tokens only through the sampler's parallel prediction mask"
            )

    # -- the interface --------------------------------------------------------------------

    def features(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        max_tokens: int | None = None,
    ) -> Tensor:
        self.check_tokens(tokens)
        if order is not None and not torch.equal(order, self.resolve_order(tokens, None)):
            raise ConfigError("gpt is a left-to-right model; give order=None (or l2r)")
        self.check_blocks(blocks)
        return self._features(tokens, self.resolve_order(tokens, order))

    def _features(self, tokens: Tensor, order: Tensor) -> Tensor:
        """The trunk over the permuted slots of ``order`` (a prefix is fine): (B, T, d)."""
        x_in, pos_in = self.slot_inputs(tokens, order)
        h = self.inject(self.embed(x_in, pos_in), order)
        pos = self.rope_positions(x_in, pos_in)
        return self.trunk(h, pos, "causal", self.condition(order), order)

    # -- cached decoding (see anyorder.sample) ------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache for ``batch`` rows and up to ``capacity`` slots."""
        return KVCache(self.cfg.n_layer, batch, capacity, self.device)

    def decode(
        self,
        cache: KVCache,
        x_in: Tensor,
        pos_in: Tensor,
        target: Tensor,
        mask: Tensor | None,
        *,
        queries: int | slice | None = None,
        packing: Packing | None = None,
    ) -> Tensor:
        """Logits (B, T, V) of ``T`` new slots that read the cache: the training forward's
        computation for those slots, one slot-input each.

        Args:
            cache: the slots seen so far; the new slots' keys/values are written at
                ``[cache.length, cache.length + T)`` of every layer, and the caller keeps
                them with :meth:`KVCache.advance` (or lets the next call overwrite them).
            x_in: (B, T) slot-input tokens (``BOS`` = -1 for the learned BOS).
            pos_in: (B, T) their original positions (0 for BOS).
            target: (B, T) the positions each slot predicts (AO-GPT's adaLN condition).
            mask: (B, 1, T, cache.length + T) boolean from :meth:`KVCache.mask`, every row
                seeing at least its own slot; ``None``: every slot sees everything.
            queries: logits of the last ``queries`` slots only, (B, queries, V), or of the
                slots of a slice (the others are only written to the cache); None: all ``T``.
            packing: the real slots of a padded call (:class:`anyorder.layers.Packing`):
                only they go through the per-slot layers; the padding's logits are zeros.
        """
        # attention works on the padded (B, T) layout
        pos = positions(self.cfg, self.rope_positions(x_in, pos_in))
        qpos = self.query_positions(target)
        if packing is not None:
            x_in, pos_in, target = packing.pack(x_in), packing.pack(pos_in), packing.pack(target)
        h = self.inject(self.embed(x_in, pos_in), target)
        *layers, final = self.decode_conditions(cache, target)  # adaLN once, for every layer
        for i, (block, cond) in enumerate(zip(self.blocks, layers, strict=True)):
            h = block(h, pos, mask, cond, kv=cache.hook(i), packing=packing, qpos=qpos)
        h = self.final_norm(h, final)
        if packing is not None:
            h = packing.unpack(h)
        if isinstance(queries, int):
            queries = slice(h.shape[1] - queries, None)
        return self.head(h if queries is None else h[:, queries])
