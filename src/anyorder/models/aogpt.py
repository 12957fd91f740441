"""``aogpt``: AO-GPT, a causal decoder trained on any order (arXiv 2506.19935).

Slot ``t`` holds ``x_o(t-1)`` at its own position (BOS at ``t=0``) and predicts ``x_o(t)``;
the target position ``o(t)`` enters every block through adaLN: ``c_t = E_tgt[o_t]``
(width ``target_dim``, 128 in the paper), ``Linear(SiLU(c)) -> 6d`` per block and ``-> 2d``
for the final norm. ``target_injection: add`` is the sigma-GPT-style ablation: a second
position table added to the input instead.
"""

from __future__ import annotations

from torch import Tensor, nn

from anyorder.layers import AdaLN, modulate
from anyorder.models.gpt import GPT


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
            self.final_ada = AdaLN(cfg.target_dim, cfg.d_model, 2)
        else:
            self.tgt_emb = nn.Embedding(cfg.seq_len, cfg.d_model)

    def condition(self, target: Tensor) -> Tensor | None:
        return self.tgt_emb(target) if self.cfg.target_injection == "adaln" else None

    def inject(self, h: Tensor, target: Tensor) -> Tensor:
        return h + self.tgt_emb(target) if self.cfg.target_injection == "add" else h

    def final_norm(self, h: Tensor, cond: Tensor | None) -> Tensor:
        if cond is None:
            return self.norm_f(h)
        shift, scale = self.final_ada(cond)
        return modulate(self.norm_f(h), shift, scale)

    def forward(
        self, tokens: Tensor, order: Tensor | None = None, blocks: Tensor | None = None
    ) -> Tensor:
        self.check_tokens(tokens)
        self.check_blocks(blocks)
        return self._forward(tokens, self.resolve_order(tokens, order))
