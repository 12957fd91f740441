"""builtin:synthetic: a Markov-chain corpus whose entropy floor is known exactly."""

from __future__ import annotations

import math

import numpy as np

from anyorder.config import DataConfig
from anyorder.data import iter_documents, prepare, synthetic


def _log2_prob(doc: str) -> float:
    """log2 p(doc) under the chain: the stationary law of the first ORDER symbols, then
    the transitions."""
    c = synthetic.chain()
    K = len(synthetic.ALPHABET)
    sym = [synthetic.ALPHABET.index(ch) for ch in doc]
    state = 0
    for s in sym[: synthetic.ORDER]:
        state = state * K + s
    total = math.log2(c.stationary[state])
    for s in sym[synthetic.ORDER :]:
        (j,) = np.flatnonzero(c.next_symbols[state] == s)  # a successor of the state
        total += math.log2(c.probs[state, j])
        state = (state * K + s) % c.states
    return total


def test_the_floor_is_the_documents_mean_information() -> None:
    c = synthetic.chain()
    assert abs(c.stationary.sum() - 1) < 1e-12 and (c.stationary >= 0).all()
    docs = list(synthetic.documents(4000))
    assert all(len(d) == synthetic.DOC_BYTES and set(d) <= set(synthetic.ALPHABET) for d in docs)
    bits = np.array([-_log2_prob(d) / synthetic.DOC_BYTES for d in docs])
    floor = synthetic.floor_bits_per_byte()
    # the Monte Carlo mean of -log2 p per byte estimates the exact floor
    assert abs(bits.mean() - floor) < 4 * bits.std() / math.sqrt(len(bits)), (bits.mean(), floor)
    assert 1.0 < floor < synthetic.unigram_bits() < math.log2(len(synthetic.ALPHABET))


def test_documents_are_fixed_and_blocks_start_at_documents(tmp_path) -> None:
    first = next(iter_documents("builtin:synthetic"))
    assert first == next(synthetic.documents(1))
    assert first.startswith("'mpbai-w'qze tw'mkpze")  # the same corpus on every machine
    cfg = DataConfig(source="builtin:synthetic", cache_dir=str(tmp_path), max_documents=600)
    data = prepare(cfg, 128, progress=False)
    eos = data.tokenizer.eos_id
    for split in ("train", "val"):
        blocks = np.asarray(data.split(split))
        assert (blocks[:, 63] == eos).all() and (blocks[:, 127] == eos).all()
        assert (blocks[:, :63] != eos).all()
