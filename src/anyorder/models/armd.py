"""``armd``: the two-stream, strictly causal, permutation-equivariant ARMD (arXiv 2601.16971).

Slot ``t`` of the permuted sequence holds ``x_o(t)`` at position ``o(t)`` (no shift).

* Content stream ``h``: token embeddings, block-causal self-attention (a slot sees its own
  block and earlier ones).
* Query stream ``g``: starts from *prefix aggregation* (METHOD.md, our choice for the cut
  Eq. 6): ``g0_t = MLP(sinusoid(o_t)) + mean(h0 over blocks before t)`` — an O(n) normalised
  prefix sum, invariant to the order inside the prefix and strictly causal. Its queries
  read the content stream's keys and values of **earlier blocks only**; the streams share
  every weight (W_q, W_k, W_v, W_o, the MLP and the norms), as ARMD App. B.2 states.
* ``l2s`` two-stream layers, then ``n_layer - l2s`` ordinary block-causal layers over ``g``;
  the head reads ``g``. RoPE at the original positions in every attention.

A composition of one strictly causal layer with causal ones is strictly causal, so the
prediction at slot ``t`` depends on the tokens of blocks ``< B(t)`` only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.cache import ARMDCache
from anyorder.config import ModelConfig
from anyorder.layers import (
    Block,
    Head,
    Mask,
    Positions,
    PreparedMask,
    StreamPacking,
    block_visibility,
    init_weights,
    make_norm,
    positions,
    prepare_mask,
    sinusoidal,
    slice_positions,
)
from anyorder.layers.linear import Linear
from anyorder.models.base import AnyOrderLM


def prefix_mean(h0: Tensor, blocks: Tensor | None) -> Tensor:
    """Mean of ``h0`` (B, n, d) over the slots of earlier blocks (zero where there are none).

    ``blocks=None`` means token level: slot ``t`` averages slots ``< t``.
    """
    B, n, d = h0.shape
    csum = torch.cat([h0.new_zeros(B, 1, d), h0.cumsum(dim=1)], dim=1)  # (B, n+1, d)
    if blocks is None:
        start = torch.arange(n, device=h0.device).expand(B, n)
    else:  # first slot of each slot's block = number of slots in earlier blocks
        start = torch.searchsorted(blocks.contiguous(), blocks.contiguous(), side="left")
    total = csum.gather(1, start[..., None].expand(B, n, d))
    return total / start.clamp(min=1)[..., None].to(h0.dtype)


class ARMD(AnyOrderLM):
    """Two-stream strictly causal stack, then ordinary layers over the query stream."""

    kind = "armd"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        d = cfg.d_model
        self.l2s = cfg.two_stream_layers
        self.tok_emb = nn.Embedding(cfg.table_vocab, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d) if cfg.positional == "learned" else None
        self.query_mlp = nn.Sequential(Linear(d, d // 4), nn.GELU(), Linear(d // 4, d))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = make_norm(cfg)
        self.head = Head(cfg)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    # -- pieces shared with the cached decoder --------------------------------------------

    def embed_content(self, x: Tensor, pos: Tensor) -> Tensor:
        """Content-stream input: token embeddings at their positions (B, T, d)."""
        h = self.tok_emb(x)
        return h + self.pos_emb(pos) if self.pos_emb is not None else h

    def query_table(self) -> Tensor:
        """``MLP(sinusoid(p))`` of every position p: (seq_len, d)."""
        weight = self.tok_emb.weight
        pos = torch.arange(self.cfg.seq_len, device=weight.device)
        # in the weights' dtype: float32 under autocast, bf16/fp16 for weights cast to it
        return self.query_mlp(sinusoidal(pos, self.cfg.d_model).to(weight.dtype))

    def embed_query(self, target: Tensor, prefix: Tensor, table: Tensor | None = None) -> Tensor:
        """Query-stream input from the target positions and the prefix aggregate.

        The positional part depends on the position alone: with many slots it is computed
        once per position (``table``, or :meth:`query_table`) and looked up.
        """
        if table is None and target.numel() >= self.cfg.seq_len:
            table = self.query_table()
        if table is not None:
            return F.embedding(target, table).to(prefix.dtype) + prefix
        return self.query_mlp(sinusoidal(target, self.cfg.d_model).to(prefix.dtype)) + prefix

    def two_stream_layer(
        self, block: Block, x: Tensor, pos: Positions, mask_c: Mask, mask_q: Mask, last: bool
    ) -> Tensor:
        """One shared-weight layer over both streams, stacked as one batch ``x = [h; g]``
        (2B, n, d): the norms, the output projection and the MLP run once for both streams
        (half the kernel launches of running them apart; the same numbers row by row).
        ``last`` skips the content update nobody reads and returns ``g`` alone (B, n, d)."""
        attn = block.attn
        hn, gn = block.norm1(x).chunk(2)  # views; one join of their gradients in backward
        qg = attn.project_q(gn, pos)
        if last:
            k, v = attn.project_kv(hn, pos)
            g = x.chunk(2)[1] + attn.attend(qg, k, v, mask_q)
            return g + block.mlp(block.norm2(g))
        q, k, v = attn.project(hn, pos)
        y_h = attn.attend(q, k, v, mask_c, project=False)  # (B, n, d) each
        y_g = attn.attend(qg, k, v, mask_q, project=False)
        x = x + attn.proj(torch.cat([y_h, y_g]))
        return x + block.mlp(block.norm2(x))

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
        order = self.resolve_order(tokens, order)
        n = order.shape[1]  # an order prefix is fine: slots never see later slots
        x = tokens.gather(1, order)
        h = self.embed_content(x, order)
        g = self.embed_query(order, prefix_mean(h, blocks))
        # masks and RoPE tables once, for every layer
        mask_c = block_visibility(blocks, n, False, tokens.device, self.cfg.d_head)
        mask_q = block_visibility(blocks, n, True, tokens.device, self.cfg.d_head)
        pos = positions(self.cfg, order)
        x = torch.cat([h, g])  # (2B, n, d): the content stream, then the query stream
        for i, block in enumerate(self.blocks):
            if i < self.l2s:  # the last one returns the query stream alone
                last = i == self.l2s - 1
                x = self.run_block(self.two_stream_layer, block, x, pos, mask_c, mask_q, last)
            else:
                x = self.run_block(block, x, pos, mask_c)
        return self.norm_f(x)

    # -- cached decoding (see anyorder.sample) ------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> ARMDCache:
        """An empty cache for ``batch`` rows and up to ``capacity`` slots per stream."""
        cfg = self.cfg
        return ARMDCache.empty(self.l2s, cfg.n_layer, batch, capacity, cfg.d_model, self.device)

    def decode(
        self,
        cache: ARMDCache,
        content: Tensor,
        content_pos: Tensor,
        target: Tensor,
        *,
        content_mask: Tensor | None = None,
        query_content_mask: Tensor | None = None,
        query_mask: Tensor | None = None,
        keep_content: Tensor | None = None,
        packing: StreamPacking | None = None,
        prefix: Callable[[Tensor], Tensor] | None = None,
        two_stream_mask: PreparedMask | None = None,
        queries: slice | None = None,
        row_pos: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, G, V) of ``G`` query-stream slots, after adding ``C`` decided tokens.

        The training forward's computation, split at the cache: the new tokens run through
        the content stream of the two-stream layers (their keys/values are cached and the
        prefix aggregate grows by their embeddings); the query slots read all cached content
        and the new content their mask allows, then the ordinary layers over the query
        stream, whose keys/values are written at ``[cache.query.length, +G)``: the caller
        keeps them with ``cache.query.advance`` or lets the next call overwrite them.

        Args:
            cache: what earlier calls kept.
            content: (B, C) the newly decided tokens (C may be 0).
            content_pos: (B, C) their positions.
            target: (B, G) the positions the query slots predict.
            content_mask: (B, 1, C, Lc + C) which content each new token's content slot sees
                (``cache.content.mask``); None: all.
            query_content_mask: (B, 1, G, Lc + C) which content each query slot sees; also
                what its prefix aggregate averages. None: all.
            query_mask: (B, 1, G, Lg + G) which query-stream slots each query slot sees in
                the ordinary layers, at least itself; None: all.
            keep_content: (B, C) False at padding tokens (not kept, not aggregated).
            packing: the real rows of a padded call (:class:`anyorder.layers.StreamPacking`):
                only they go through the per-row layers; the padding's logits are zeros.
            prefix: the prefix aggregate of the query slots from the new content embeddings,
                ``prefix(h0 (B, C, d)) -> (B, G, d)``, for a cache that keeps the embeddings
                itself; None: the running sum and count in ``cache``, updated here.
            two_stream_mask: the mask of the two-stream rows (content, then query) over the
                content keys, prepared already (in place of ``content_mask`` and
                ``query_content_mask``).
            queries: logits of these query slots only; None: all ``G``.
            row_pos: (B, C + G) ``content_pos`` then ``target``, joined already (or None).
        """
        B, C = content.shape
        G = target.shape[1]
        Lc = cache.content.length
        h0 = self.embed_content(content, content_pos)  # (B, C, d)
        if prefix is not None:
            mean = prefix(h0)
        else:
            mean = self._running_prefix_mean(cache, h0, query_content_mask, G, Lc)
        g = self.embed_query(target, mean, self._cached_query_table(cache))
        # The two-stream layers run the C content rows and the G query rows as one batch of
        # C + G rows: one matmul per weight and one attention call per layer (the query rows
        # read the content keys/values under their own mask, as the training forward does).
        x = torch.cat([h0, g], dim=1)  # (B, C + G, d)
        if row_pos is None:
            row_pos = torch.cat([content_pos, target], dim=1)
        pos = positions(self.cfg, row_pos)
        if two_stream_mask is not None:
            mask = two_stream_mask
            empty_g = None if mask.empty is None else mask.empty[:, :, C:]
            additive = {dt: m[:, :, C:] for dt, m in mask.additive.items()}
            mask_g = PreparedMask(mask.dense[:, :, C:], empty_g, additive=additive)
        else:
            mask, mask_g = self._two_stream_masks(content_mask, query_content_mask, B, C, G, Lc)
        g = self._decode_layers(cache, x, pos, C, G, mask, mask_g, query_mask, packing)
        cache.content.advance(C, keep_content, content_pos)
        if prefix is None:
            kept = h0 if keep_content is None else h0 * keep_content[..., None].to(h0.dtype)
            cache.prefix_sum += kept.sum(dim=1).to(cache.prefix_sum.dtype)
            cache.prefix_count += (
                C if keep_content is None else keep_content.sum(dim=1).to(cache.prefix_count.dtype)
            )
        g = g if packing is None else packing.query.unpack(g)
        return self.head(g if queries is None else g[:, queries])

    @staticmethod
    def _running_prefix_mean(
        cache: ARMDCache, h0: Tensor, query_content_mask: Tensor | None, G: int, Lc: int
    ) -> Tensor:
        """The query slots' prefix aggregate (B, G, d): the cache's running sum and count
        plus the new content embeddings ``h0`` (B, C, d) each slot sees."""
        B, C = h0.shape[:2]
        if query_content_mask is None:
            vis = h0.new_ones(B, G, C)
        else:
            vis = query_content_mask[:, 0, :, Lc:].to(h0.dtype)  # (B, G, C)
        total = cache.prefix_sum[:, None].to(h0.dtype) + vis @ h0  # (B, G, d)
        count = cache.prefix_count[:, None].to(h0.dtype) + vis.sum(dim=-1)  # (B, G)
        return total / count.clamp(min=1)[..., None]

    def prepare_decode(self, cache: ARMDCache) -> None:
        super().prepare_decode(cache)
        self._cached_query_table(cache)

    def _cached_query_table(self, cache: ARMDCache) -> Tensor:
        """:meth:`query_table`, once per decode (kept only when no graph is recorded)."""
        aux = cache.content.aux
        table = aux.get("query_pe")
        if table is None:
            table = self.query_table()
            if not torch.is_grad_enabled():
                aux["query_pe"] = table
        return table

    def _decode_layers(
        self,
        cache: ARMDCache,
        x: Tensor,
        pos: Positions,
        C: int,
        G: int,
        mask: Mask,
        mask_g: Mask,
        query_mask: Tensor | None,
        packing: StreamPacking | None,
    ) -> Tensor:
        """The layers of a decoding call over ``x`` (B, C + G, d), content rows first: the
        two-stream layers write the content keys/values to the cache and update both
        streams, the last one the query rows only; the ordinary layers run the query stream
        with its own cache. Returns the normed query rows (B, G, d), or packed."""
        pos_c, pos_g = slice_positions(pos, 0, C), slice_positions(pos, C, C + G)
        # with a packing, x holds the real rows only, (1, N, d), content first; attention
        # unpacks to the padded layout its masks and the cache need
        P = packing
        nc, rows_pk = (C, None) if P is None else (P.n_content, P.rows)
        if P is not None:
            x = P.rows.pack(x)
        for i, block in enumerate(self.blocks):
            if i >= self.l2s:  # the query stream alone (sliced out by the last 2-stream layer)
                q_pk = None if P is None else P.query
                x = block(x, pos_g, query_mask, kv=cache.query.hook(i - self.l2s), packing=q_pk)
                continue
            attn = block.attn
            xn = block.norm1(x)
            last = i == self.l2s - 1  # the last content update is never read: query rows only
            q = None
            if P is None:  # every row's projection at once (one product, one rotation), the
                # content rows' keys and values taken from it (the GPU's passes: launch-bound)
                q, k, v = attn.project(xn, pos)
                k, v = k[:, :, :C], v[:, :, :C]
                q = q[:, :, C:] if last else q
            else:
                k, v = attn.project_kv(xn[:, :nc], pos_c, P.content)
            k, v = cache.content.write(i, k, v)  # (B, H, Lc + C, D)
            if last:
                x, xn, rows_pos, rows_mask = x[:, nc:], xn[:, nc:], pos_g, mask_g
                rows_pk = None if P is None else P.query
            else:
                rows_pos, rows_mask = pos, mask
            if k.shape[2] > 0:
                q = attn.project_q(xn, rows_pos, rows_pk) if q is None else q
                x = x + attn.attend(q, k, v, rows_mask, packing=rows_pk)
            elif attn.proj.bias is not None:  # nothing to read: the projection of zeros
                x = x + attn.proj.bias.to(x.dtype)
            x = x + block.mlp(block.norm2(x))
        return self.norm_f(x)  # (B, G, d), or the packed query rows

    @staticmethod
    def _two_stream_masks(
        content_mask: Tensor | None,
        query_content_mask: Tensor | None,
        B: int,
        C: int,
        G: int,
        Lc: int,
    ) -> tuple[PreparedMask | None, PreparedMask | None]:
        """Masks of the batched two-stream rows over the content keys (B, 1, C + G, Lc + C),
        and of the query rows alone (B, 1, G, Lc + C); None where every key is visible.

        Content rows always see themselves; query rows may see nothing (zero output).
        """
        if content_mask is None and query_content_mask is None:
            return None, None
        device = (content_mask if content_mask is not None else query_content_mask).device
        if content_mask is None:
            content_mask = torch.ones(B, 1, C, Lc + C, dtype=torch.bool, device=device)
        if query_content_mask is None:
            query_content_mask = torch.ones(B, 1, G, Lc + C, dtype=torch.bool, device=device)
        both = prepare_mask(torch.cat([content_mask, query_content_mask], dim=2))
        rows = PreparedMask(both.dense[:, :, C:], both.empty[:, :, C:])
        return both, rows
