"""The worker's order tables: per row of vLLM's persistent batch, what each slot holds and
predicts.

vLLM's V1 model runner tells its logits processors which request sits in which row of the
batch (added, removed, moved) before every forward pass, and lays the pass's tokens out in
that row order. :class:`OrderTables` is such a processor: it changes no logits and keeps two
tables, ``(max_num_seqs, max_model_len)``, on the model's device:

* ``pos[r, t]``: the position of the token that slot ``t`` of row ``r`` holds (0 for the BOS
  slot ``t = 0``);
* ``target[r, t]``: the position slot ``t`` predicts (AO-GPT's adaLN condition).

Left to right they are ``[0, 0, 1, 2, ...]`` and ``[0, 1, 2, ...]``; a request with an order
``o`` gets ``[0, o_0, .., o_(L-2)]`` and ``o``. The model (:mod:`anyorder.vllm.model`)
finds the tables of its engine by the engine's config and reads them by row and slot.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

from anyorder.vllm.requests import ADMITTED_KEY, resolve_order

_LIVE: dict[int, OrderTables] = {}


def tables_of(vllm_config: Any) -> OrderTables:
    """The tables of the engine ``vllm_config`` configures.

    Raises:
        RuntimeError: there are none (the engine was configured without anyorder's hook).
    """
    found = _LIVE.get(id(vllm_config))
    if found is None:
        raise RuntimeError(
            "anyorder's order tables are missing from this engine: its config did not pass "
            "anyorder's vLLM hook (is the anyorder plugin installed in the engine's "
            "environment?)"
        )
    return found


class OrderTables(LogitsProcessor):
    """A logits processor that changes nothing and keeps the rows' order tables."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        rows = vllm_config.scheduler_config.max_num_seqs
        width = vllm_config.model_config.max_model_len
        hf = vllm_config.model_config.hf_config
        self.kind, self.seq_len = hf.kind, hf.seq_len
        slots = torch.arange(width).clamp(max=self.seq_len - 1)
        self.l2r_pos = (slots - 1).clamp(min=0)
        self.l2r_target = slots
        self.pos = self.l2r_pos.repeat(rows, 1).to(device)
        self.target = self.l2r_target.repeat(rows, 1).to(device)
        _LIVE[id(vllm_config)] = self

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index, params, prompt_ids, _ in batch_update.added:
            self._set_row(index, params, prompt_ids)
        for a, b, how in batch_update.moved:
            if how == MoveDirectionality.SWAP:
                for t in (self.pos, self.target):
                    t[[a, b]] = t[[b, a]]
            else:
                self.pos[b] = self.pos[a]
                self.target[b] = self.target[a]

    def _set_row(self, index: int, params: Any, prompt_ids: list[int] | None) -> None:
        args = params.extra_args if params is not None else None
        if not (args or {}).get(ADMITTED_KEY):
            raise RuntimeError(
                "a request reached an anyorder model without passing anyorder's admission "
                "(no BOS slot in its prompt): serve anyorder exports through `vllm serve` or "
                "`vllm.LLM` with the anyorder plugin installed"
            )
        prompt_len = len(prompt_ids or []) - 1  # the BOS slot aside
        order = resolve_order(
            args,
            prompt_len=prompt_len,
            max_tokens=params.max_tokens,
            seq_len=self.seq_len,
            kind=self.kind,
            ignore_eos=params.ignore_eos,
            stops=bool(params.stop or params.stop_token_ids),
        )
        pos, target = self.l2r_pos.clone(), self.l2r_target.clone()
        if order is not None:
            o = torch.tensor(order)
            target[: len(order)] = o
            pos[1 : len(order)] = o[:-1]
        self.pos[index] = pos.to(self.pos.device)
        self.target[index] = target.to(self.target.device)
