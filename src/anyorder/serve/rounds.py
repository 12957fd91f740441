"""The ``round`` events of a speculative decode, and a token's text in the events."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def piece(tok: Any, token: int) -> str:
    return tok.decode([token])


class Rounds:
    """The ``round`` events of a speculative decode, from the sampler's ``on_round`` hook
    (called before ``on_step`` in the same pass)."""

    def __init__(self, tok: Any, n: int) -> None:
        self.tok, self.n = tok, n
        self.totals = {"passes": 0, "drafted": 0, "accepted": 0, "tokens": 0}
        self.rows: list[dict[str, Any]] | None = None

    def hook(self, r: dict[str, Tensor]) -> None:
        """``on_round``: per row, the verified drafts, how many were accepted (a prefix) and
        the closing token; a finished row has no drafts and no closing token."""
        D = r["positions"].shape[1]
        closing = [r[k].long()[:, None] for k in ("accepted", "position", "token")]
        # one copy to the host: (B, 2D + 3) = drafts' positions, their tokens, m, closing
        table = torch.cat([r["positions"].long(), r["tokens"].long(), *closing], 1).tolist()
        rows = []
        for line in table:
            pr, tr, (m, p, t) = line[:D], line[D : 2 * D], line[2 * D :]
            drafts = [[q, y, piece(self.tok, y)] for q, y in zip(pr, tr) if q < self.n]
            if p >= self.n:  # finished before this pass
                rows.append({"drafts": [], "accepted": 0, "closing": None, "replaced": False})
                continue
            rows.append(
                {
                    "drafts": drafts,
                    "accepted": m,
                    "closing": [p, t, piece(self.tok, t)],
                    "replaced": m < len(drafts),  # a rejection, else a bonus draw
                }
            )
            for key, add in (("passes", 1), ("drafted", len(drafts)), ("accepted", m)):
                self.totals[key] += add
            self.totals["tokens"] += m + 1
        self.rows = rows

    def event(self, step: int, passes: int) -> dict[str, Any]:
        """The ``round`` event of the pass that just ran (then forgotten)."""
        rows, self.rows = self.rows, None
        return {"step": step, "pass": passes, "rows": rows, **self.totals}
