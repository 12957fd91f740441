"""``aogpt``: AO-GPT, a causal decoder trained on any order (arXiv 2506.19935).

Slot ``t`` holds ``x_o(t-1)`` at its own position (BOS at ``t=0``) and predicts ``x_o(t)``;
the target position ``o(t)`` enters every block through adaLN: ``c_t = E_tgt[o_t]``
(width ``target_dim``, 128 in the paper), ``Linear(SiLU(c)) -> 6d`` per block and ``-> 2d``
for the final norm. ``target_injection: add`` is the sigma-GPT-style ablation: a second
position table added to the input instead.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from anyorder.cache import KVCache
from anyorder.layers import (
    AdaLN,
    Modulation,
    TargetCondition,
    adaln_offset,
    adaln_rows,
    adaln_stack,
    adaln_table,
)
from anyorder.models.gpt import GPT, Condition


class AOGPT(GPT):
    """GPT trunk + target-position conditioning; any order, one token per slot."""

    kind = "aogpt"

    @property
    def cond_dim(self) -> int | None:  # type: ignore[override]
        return self.cfg.target_dim if self.cfg.target_injection == "adaln" else None

    def build_extra(self) -> None:
        cfg = self.cfg
        if cfg.target_injection == "adaln":
            self.tgt_emb = nn.Embedding(cfg.seq_len, cfg.target_dim)
            zero = cfg.adaln_init == "zero"
            if zero:
                # Our choice: unit scale. At GPT-2's 0.02, SiLU(c) ~ 0.01 and the zero-initialised
                # modulation grows so slowly that a small model barely uses the target position
                # (measured: any-order 3.09 vs 3.01 nats/token after 400 steps, 2 x 128 model).
                # The reference (adaln_init=normal) has both at 0.02.
                self.tgt_emb.init_std = 1.0
            self.final_ada = AdaLN(cfg.target_dim, cfg.d_model, 2, ones=(1,), zero=zero)
            # the 1 + of every scale (and gate), for the joined adaLN of layer_conditions
            offset = adaln_offset(self.adas())
            self.register_buffer("ada_offset", offset, persistent=False)
        else:
            self.tgt_emb = nn.Embedding(cfg.seq_len, cfg.d_model)

    def condition(self, target: Tensor) -> Condition:
        if self.cfg.target_injection != "adaln":
            return None
        if target.numel() < self.tgt_emb.num_embeddings:  # fewer slots than positions
            return self.tgt_emb(target)
        # adaLN of a target depends on its position only: one table row per position
        return TargetCondition(target, self.tgt_emb.weight)

    def adas(self) -> list[AdaLN]:
        """Every adaLN of the model: one per block, then the final norm's."""
        return [b.ada for b in self.blocks] + [self.final_ada]

    def layer_conditions(self, cond: Condition) -> list:
        if cond is None:
            return [None] * (len(self.blocks) + 1)
        return adaln_stack(self.adas(), cond, self.ada_offset)

    def decode_condition(self, cache: KVCache, target: Tensor) -> Condition:
        if self.cfg.target_injection != "adaln":
            return None
        # the tables of every AdaLN, computed on the first decoding call and kept in the cache
        return TargetCondition(target, self.tgt_emb.weight, cache.aux.setdefault("adaln", {}))

    def prepare_decode(self, cache: KVCache) -> None:
        super().prepare_decode(cache)
        if self.cfg.target_injection == "adaln" and "adaln_table" not in cache.aux:
            table = adaln_table(self.adas(), self.tgt_emb.weight, self.ada_offset)
            cache.aux["adaln_table"] = table

    def decode_conditions(self, cache: KVCache, target: Tensor) -> list:
        if self.cfg.target_injection != "adaln" or torch.is_grad_enabled():
            return super().decode_conditions(cache, target)
        # the joined table of every adaLN once per decode (kept in the cache), then each
        # call's rows for every layer in one lookup
        table = cache.aux.get("adaln_table")
        if table is None:
            table = adaln_table(self.adas(), self.tgt_emb.weight, self.ada_offset)
            cache.aux["adaln_table"] = table
        return adaln_rows(self.adas(), table, target)

    def inject(self, h: Tensor, target: Tensor) -> Tensor:
        return h + self.tgt_emb(target) if self.cfg.target_injection == "add" else h

    def final_norm(self, h: Tensor, cond: Condition) -> Tensor:
        if cond is None:
            return self.norm_f(h)
        m = cond if isinstance(cond, Modulation) else Modulation(self.final_ada(cond))
        return m.modulate(0, self.norm_f(h))  # shift, mul = 1 + scale

    def features(
        self,
        tokens: Tensor,
        order: Tensor | None = None,
        blocks: Tensor | None = None,
        *,
        max_tokens: int | None = None,
    ) -> Tensor:
        self.check_tokens(tokens)
        self.check_blocks(blocks)
        return self._features(tokens, self.resolve_order(tokens, order))
