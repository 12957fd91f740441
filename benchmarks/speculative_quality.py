"""Sample quality on ``builtin:synthetic`` (known source): speculative, Lemma 1, confidence.

For a model trained on the synthetic Markov chain (``anyorder.data.synthetic``), each
sampler draws ``--samples`` unconditional blocks; every document of a block (63 symbols and
an EOS) is scored under the true chain:

* ``nll``: bits per symbol of the possible transitions (the source's own samples average the
  chain's entropy rate);
* ``impossible``: the fraction of transitions the chain cannot make (a successor outside
  the context's four, or a byte outside the alphabet);
* ``passes/token`` and the CPU seconds per batch (side by side, one thread).

Rows: sequential (one token per pass, random order); speculative ``K = 2, 4, 8`` (the same
law as sequential: their figures should agree within two standard errors); Lemma 1 at the
passes of speculative ``K = 4`` (the reference's constant counts); confidence order at the
same passes, alone and with speculative verification (``K = 4``).

    python benchmarks/speculative_quality.py RUN --samples 64
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from anyorder.checkpoint import load_model
from anyorder.data import synthetic
from anyorder.sample import lemma1_sample, sequential_sample
from anyorder.sampling.confidence import confidence_sample
from anyorder.sampling.speculative import speculative_sample


def score(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: bits per possible transition, and the fraction of impossible ones."""
    ch = synthetic.chain()
    index = {ord(c): i for i, c in enumerate(synthetic.ALPHABET)}
    K = len(synthetic.ALPHABET)
    doc = synthetic.DOC_BYTES + 1
    nll, bad = [], []
    for row in tokens:
        bits, count, wrong, total = 0.0, 0, 0, 0
        for start in range(0, len(row) - doc + 1, doc):
            sym = [index.get(int(t), -1) for t in row[start : start + synthetic.DOC_BYTES]]
            for a, b in zip(sym[:-1], sym[1:]):
                total += 1
                if a < 0 or b < 0:
                    wrong += 1
                    continue
                state = a % (K**synthetic.ORDER)
                hit = np.flatnonzero(ch.next_symbols[state] == b)
                if len(hit) == 0:
                    wrong += 1
                    continue
                bits -= math.log2(ch.probs[state, hit[0]])
                count += 1
        nll.append(bits / max(count, 1))
        bad.append(wrong / max(total, 1))
    return np.array(nll), np.array(bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.run).model
    n, B = args.length, args.samples

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(args.seed)

    rows = [("sequential", lambda: sequential_sample(model, n, batch=B, generator=gen()))]
    for K in (2, 4, 8):
        spec = lambda K=K: speculative_sample(model, n, K, batch=B, generator=gen())  # noqa: E731
        rows.append((f"speculative K={K}", spec))
    results = {}
    with torch.autocast("cpu", torch.bfloat16):
        for label, fn in rows:
            t = time.process_time()
            out = fn()
            results[label] = (out, time.process_time() - t)
        stats = results["speculative K=4"][0].extra["speculative"]
        per = max(1, round(n / stats.passes.mean()))
        more = [
            (f"lemma1 {per}/pass", lambda: lemma1_sample(model, n, n // per, reveal="reference",
                                                         batch=B, generator=gen())),
            (f"confidence {per}/pass", lambda: confidence_sample(model, n, per, batch=B,
                                                                 generator=gen())),
            ("confidence spec K=4", lambda: confidence_sample(model, n, speculative=4, batch=B,
                                                              generator=gen())),
        ]  # fmt: skip
        for label, fn in more:
            t = time.process_time()
            out = fn()
            results[label] = (out, time.process_time() - t)
    floor = synthetic.entropy_rate_bits()
    print(f"\n{args.run}: {B} samples of {n} tokens; the chain's entropy rate {floor:.3f} bits")
    print(f"{'sampler':24s} {'passes/token':>12s} {'cpu s':>7s} {'nll bits':>14s} "
          f"{'impossible':>18s}")  # fmt: skip
    for label, (out, sec) in results.items():
        spec = out.extra.get("speculative")
        passes = spec.passes.mean() if spec is not None else out.forward_passes
        nll, bad = score(out.tokens.cpu().numpy())
        se = lambda x: x.std(ddof=1) / math.sqrt(len(x))  # noqa: E731
        print(f"{label:24s} {passes / n:12.3f} {sec:7.1f} {nll.mean():7.3f} ± {se(nll):.3f} "
              f"{bad.mean():10.4f} ± {se(bad):.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
