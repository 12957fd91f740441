"""An anyorder export as a vLLM model: anyorder's own modules, vLLM's paged attention.

The engine's sequence is anyorder's slots: slot 0 is the BOS (admission puts a token in
front of every prompt, :mod:`anyorder.vllm.engine`; the model reads slot 0 as its learned BOS
whatever the id), slot ``t`` holds the ``t``-th token of the order and predicts the next.
vLLM's positions are these slots; the positions a slot holds and predicts come from the
order tables (:mod:`anyorder.vllm.tables`), looked up by the slot and the row of the batch
each token belongs to. RoPE rotates keys at their own positions before they are cached, so
the append-only paged cache holds exactly what anyorder's own KV cache holds, and every
layer's attention is vLLM's: causal over the slots, as in anyorder.

Design choices:

* The trunk is the export's own model (:func:`anyorder.models.build_model`): only each
  block's attention core is swapped for vLLM's (:class:`PagedAttention`); norms, adaLN,
  RoPE, the MLP and the head are anyorder's code, so the logits are anyorder's.
* The weights are checked as anyorder checks them (the checksum of a local export, the
  shapes, finite values) before any is used; no code from the model folder runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention as VllmAttention

from anyorder.checkpoint.exported import WEIGHTS_NAME, read_export_config
from anyorder.checkpoint.weights import adopt_state, check_finite, fit_state
from anyorder.errors import CheckpointError
from anyorder.layers.attention import Attention
from anyorder.models import build_model
from anyorder.models.gpt import BOS
from anyorder.vllm.tables import tables_of


class PagedAttention(Attention):
    """anyorder's attention with vLLM's paged attention as its core (the projections, the
    QK-norm and RoPE are anyorder's). ``paged`` is set on each instance."""

    paged: VllmAttention

    def forward(self, x: Tensor, pos: Any, mask: Any, kv: Any = None, packing: Any = None,
                qpos: Any = None) -> Tensor:  # fmt: skip
        q, k, v = self.project(x, pos, None, qpos)  # (1, H, T, D), (1, Hkv, T, D)
        T = x.shape[1]
        flat = [t[0].transpose(0, 1).reshape(T, -1) for t in (q, k, v)]
        y = self.paged(*flat)  # (T, H * D): causal over each request's slots, cached
        return self.proj(y.view(1, T, -1))


class AnyorderForVLLM(nn.Module):
    """vLLM's model class for the ``AnyorderModel`` architecture (gpt and aogpt exports)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self.vllm_config = vllm_config
        model_config = vllm_config.model_config
        cfg = model_config.hf_config.to_model_config()
        self.model = build_model(cfg, init=False)  # every weight is loaded next
        layers = []
        for i, block in enumerate(self.model.blocks):
            attn = block.attn
            paged = VllmAttention(
                cfg.n_head,
                cfg.d_head,
                cfg.d_head**-0.5,
                num_kv_heads=cfg.kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}.paged.{i}" if prefix else f"paged.{i}",
            )
            attn.__class__ = PagedAttention
            object.__setattr__(attn, "paged", paged)  # not a second child: one weight tree
            layers.append(paged)
        self.paged = nn.ModuleList(layers)
        self._tables = None

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        raise NotImplementedError("anyorder models take token ids, not embeddings")

    def _slot_positions(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The positions each token's slot holds and predicts, from the order tables."""
        if self._tables is None:
            self._tables = tables_of(self.vllm_config)
        tables = self._tables
        slots = positions.clamp(max=tables.pos.shape[1] - 1)
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batches: one dict each
            metadata = metadata[0] if metadata else None
        if not metadata:  # a dummy pass (profiling, warm-up): row 0, left to right
            rows = torch.zeros_like(slots)
        else:
            starts = next(iter(metadata.values())).query_start_loc
            token = torch.arange(slots.shape[0], device=slots.device)
            rows = torch.searchsorted(starts[1:], token, right=True)
            rows = rows.clamp(max=starts.shape[0] - 2)
        return tables.pos[rows, slots], tables.target[rows, slots]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: Tensor | None = None,
        **_: Any,
    ) -> Tensor:
        if inputs_embeds is not None:
            raise NotImplementedError("anyorder models take token ids, not embeddings")
        m = self.model
        pos_in, target = self._slot_positions(positions)
        x_in = torch.where(positions == 0, BOS, input_ids)[None]
        pos_in, target = pos_in[None], target[None]
        h = m.inject(m.embed(x_in, pos_in), target)
        h = m.trunk(h, m.rope_positions(x_in, pos_in), None, m.condition(target), target)
        return h[0]

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.model.head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """The export's weights, checked as anyorder checks them, into the model."""
        folder = Path(self.vllm_config.model_config.model)
        where = folder / WEIGHTS_NAME
        fix = "export or download it again"
        if folder.is_dir():
            from anyorder.data.shards import sha256_file

            sha = read_export_config(folder).get("weights_sha256")
            if sha and where.is_file() and sha256_file(where) != sha:
                raise CheckpointError(f"{where} is corrupt (its SHA-256 differs); {fix}")
        state = dict(weights)
        detail = fit_state(self.model, state)
        if detail:
            raise CheckpointError(
                f"{where} does not fit the model config.json describes ({detail})"
            )
        check_finite(state, where, "export or convert it again from finite weights")
        adopt_state(self.model, state)
        self.model.to(self.vllm_config.model_config.dtype).eval()
        return {name for name, _ in self.named_parameters()}
