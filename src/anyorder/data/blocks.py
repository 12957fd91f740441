"""Blocks for training and evaluation: the seeded block sampler and in-order eval batches.

Design choices:

* Training batches come from :class:`BlockSampler`, a seeded permutation per epoch whose
  whole state is ``(epoch, position)``: resume is exact, and ranks take strided shares of
  one global batch, so the data a run sees does not depend on the number of processes.
* Evaluation reads the first blocks of a split in order (:func:`iter_eval_blocks`), rank
  ``r`` taking every ``world_size``-th, so the ranks together cover each block once.
* ``torch`` is imported only where a batch is made.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from anyorder.data.shards import TokenData
from anyorder.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch


class BlockSampler:
    """Global batches of block indices from a seeded permutation per epoch, for exact resume.

    The global batch is ``batch_size`` consecutive entries of the epoch's permutation
    (continuing into the next epoch's permutation when one runs out); rank ``r`` gets
    ``global[r::world_size]``. The state is ``(epoch, position)`` in global indices, so a
    run resumes exactly, even on another number of ranks.

    Args:
        num_blocks: blocks in the split.
        batch_size: global batch size, a multiple of ``world_size``.
        seed: seed of the permutations (epoch ``e`` uses ``default_rng([seed, e])``).
        rank: this process's rank.
        world_size: number of processes.

    Raises:
        ConfigError: batch_size not divisible by world_size, or a bad size or rank.
    """

    def __init__(
        self, num_blocks: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        if num_blocks < 1:
            raise DataError("the split has no blocks to sample; use a larger corpus")
        if batch_size < 1 or world_size < 1:
            raise ConfigError("batch_size and world_size must be positive")
        if batch_size % world_size:
            raise ConfigError(
                f"train.batch_size={batch_size} is not divisible by world_size={world_size}; "
                "use a multiple of the number of processes"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} must be in [0, world_size={world_size})")
        self.num_blocks = num_blocks
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)
        self.last_batch = np.empty(0, dtype=np.int64)
        """The global batch of the last :meth:`next_indices` (every rank's rows)."""

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of block indices in ``epoch``."""
        if epoch != self._perm_epoch:
            # SeedSequence takes only non-negative entries; the mask keeps any int seed valid.
            rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, epoch])
            self._perm = rng.permutation(self.num_blocks)
            self._perm_epoch = epoch
        return self._perm

    def next_indices(self) -> np.ndarray:
        """This rank's share of the next global batch, (batch_size // world_size,) int64."""
        out = np.empty(self.batch_size, dtype=np.int64)
        filled = 0
        while filled < self.batch_size:
            perm = self.permutation(self.epoch)
            take = min(self.batch_size - filled, self.num_blocks - self.position)
            out[filled : filled + take] = perm[self.position : self.position + take]
            filled += take
            self.position += take
            if self.position == self.num_blocks:
                self.epoch += 1
                self.position = 0
        self.last_batch = out
        return out[self.rank :: self.world_size]

    def state_dict(self) -> dict[str, int]:
        """The position in the stream of global indices (same on every rank)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_blocks": self.num_blocks,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from :meth:`state_dict`.

        Raises:
            DataError: the state belongs to data with another number of blocks or seed.
        """
        if (
            int(state.get("num_blocks", self.num_blocks)) != self.num_blocks
            or int(state.get("seed", self.seed)) != self.seed
        ):
            raise DataError(
                f"sampler state is for {state.get('num_blocks')} blocks and seed "
                f"{state.get('seed')}, not {self.num_blocks} and {self.seed}; resume with the "
                "same data and train.seed"
            )
        position = int(state["position"])
        if not 0 <= position < self.num_blocks:
            raise DataError(f"sampler state has position {position} outside the epoch")
        self.epoch = int(state["epoch"])
        self.position = position


def iter_eval_blocks(
    data: TokenData,
    split: str = "val",
    max_blocks: int | None = None,
    *,
    batch_size: int = 8,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[torch.Tensor]:
    """The first ``max_blocks`` blocks of a split, in order, as (B, seq_len) LongTensors.

    Rank ``r`` of ``world_size`` gets blocks ``r, r + world_size, ...`` of those, so the
    ranks together cover each block once.

    Raises:
        DataError: the split has no blocks (validation with val_fraction=0).
    """
    n = data.num_blocks(split)
    if n == 0:
        raise DataError(f"the {split} split has no blocks; set data.val_fraction > 0")
    if max_blocks is not None:
        n = min(n, max_blocks)
    idx = np.arange(rank, n, world_size)
    for start in range(0, len(idx), batch_size):
        yield data.batch(split, idx[start : start + batch_size])
