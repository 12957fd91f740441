"""Corpus statistics: the unigram baseline, and the ``anyorder data`` command.

Design choices:

* The unigram entropy of the train split, divided by its bytes per token, is the baseline
  in bits/byte a trained model must beat to have learnt anything beyond token frequencies.
  It is counted over the kept blocks, a bounded chunk at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from anyorder.config import DataConfig
from anyorder.data.build import prepare
from anyorder.data.shards import SPLITS, TokenData


def unigram_entropy(data: TokenData, split: str = "train") -> float:
    """Entropy in bits/token of the split's unigram distribution (over the kept blocks)."""
    blocks = data.split(split)
    counts = np.zeros(data.vocab_size, dtype=np.int64)
    rows = max(1, (1 << 24) // data.seq_len)  # ~16M tokens at a time: bounded memory
    for start in range(0, blocks.shape[0], rows):
        chunk = np.asarray(blocks[start : start + rows]).ravel()
        counts += np.bincount(chunk, minlength=data.vocab_size)[: data.vocab_size]
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def unigram_bits_per_byte(data: TokenData) -> float:
    """The unigram baseline in bits/byte: train unigram entropy / train bytes_per_token.

    A trained model's bits/byte must come out below this to have learnt anything beyond
    token frequencies.
    """
    return unigram_entropy(data, "train") / data.bytes_per_token("train")


def data_main(cfg: DataConfig, seq_len: int) -> dict[str, Any]:
    """Prepare the data and print its statistics (the ``anyorder data`` command).

    Returns:
        path, reused, source, tokenizer, vocab_size, seq_len, dtype, per split documents,
        tokens, blocks, bytes and bytes_per_token, and the unigram baseline in bits/token
        and bits/byte.
    """
    data = prepare(cfg, seq_len, progress=True)
    m = data.manifest
    bits_token = unigram_entropy(data, "train")
    stats: dict[str, Any] = {
        "path": str(data.path),
        "reused": data.reused,
        "source": m["source"],
        "tokenizer": m["tokenizer"],
        "vocab_size": m["vocab_size"],
        "seq_len": m["seq_len"],
        "dtype": m["dtype"],
        "unigram_bits_per_token": bits_token,
        "unigram_bits_per_byte": bits_token / data.bytes_per_token("train"),
    }
    for split in SPLITS:
        s = m["splits"][split]
        keys = ("documents", "tokens", "blocks", "bytes", "bytes_per_token")
        stats[split] = {k: s[k] for k in keys}
    print(f"data: {stats['path']} ({'reused' if data.reused else 'prepared'})")
    print(
        f"  source {stats['source']}, tokenizer {stats['tokenizer']} "
        f"(vocab {stats['vocab_size']}, {stats['dtype']}), seq_len {stats['seq_len']}"
    )
    for split in SPLITS:
        s = stats[split]
        print(
            f"  {split:5s} {s['documents']:>9,} docs {s['tokens']:>13,} tokens "
            f"{s['blocks']:>9,} blocks {s['bytes_per_token']:.3f} bytes/token"
        )
    print(
        f"  unigram baseline: {bits_token:.3f} bits/token = "
        f"{stats['unigram_bits_per_byte']:.3f} bits/byte"
    )
    return stats
