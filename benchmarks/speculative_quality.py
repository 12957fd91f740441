"""Speculative sampling, Lemma 1 and confidence order: passes, speed and quality, one table.

For each run folder given, every sampler draws ``--samples`` unconditional blocks of
``--length`` tokens (default: the model's ``seq_len``) in one batch, one thread, bf16
autocast. For a model trained on ``builtin:synthetic`` (the Markov chain of
``anyorder.data.synthetic``, whose entropy rate is known) every document of a block (63
symbols and an EOS) is scored under the true chain:

* ``nll``: bits per symbol of the possible transitions (the source's own samples average the
  chain's entropy rate);
* ``impossible``: the fraction of transitions the chain cannot make (a successor outside
  the context's four, or a byte outside the alphabet);

both as mean ± standard error over the samples. Other corpora (the demo's Python docs) have
no known source: those columns read "—".

With ``--timing 1,16`` every sampler is then timed at each of those batch sizes,
round-robin against sequential decoding in one run (``_bench.round_robin``: one warm-up
round, then ``--repeats`` rounds), with ``--threads`` threads (default 1: on a loaded
machine two threads' rounds varied 2-5x), bf16 autocast. The table gives the speed of each
row over sequential's (above 1: faster), the median over rounds of the round's ratio, on the
CPU clock and, in brackets, the wall clock (``--clock``; with one thread the CPU time is the
work done, the wall time of a quiet machine; with two it adds both threads' time, so read
the wall clock; the JSON keeps every round). Under the table: each row's gap to sequential
in combined standard errors. ``--time-length`` shortens the timed sequences (default:
``--length``); ``--table JSON...`` prints the table of saved runs again.

Rows: sequential (one token per pass, random order); speculative ``K = 2, 4, 8`` (the same
law as sequential: their quality figures should agree within two standard errors); Lemma 1
at the passes of speculative ``K = 4`` (the reference's constant counts, ``n / r`` steps of
``r`` tokens with ``r`` the tokens per pass of speculative ``K = 4``, rounded); confidence
order at ``r`` per pass (the same passes as Lemma 1); confidence order with speculative
verification (``K = 4``). Passes per token: the mean over rows of each row's passes
(speculative rows), or the batch's forward passes over ``n``.

    python benchmarks/speculative_quality.py runs/demo runs/syn-armd runs/syn-aogpt \\
        --samples 64 --timing 1,16            # docs/results.md, issue 26's table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

import numpy as np
import torch

from _bench import machine, round_robin, write_json
from anyorder.checkpoint import load_model
from anyorder.data import synthetic
from anyorder.sample import lemma1_sample, sequential_sample
from anyorder.sampling.confidence import confidence_sample
from anyorder.sampling.speculative import speculative_sample

SPEC_KS = (2, 4, 8)
MATCH_K = 4  # Lemma 1 and confidence order run at the passes of speculative K = 4


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


def samplers(model, n: int, B: int, per: int | None, seed: int) -> dict:
    """``{label: () -> SampleResult}``; the Lemma-1 and confidence rows need ``per``."""

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    fns = {"sequential any order": lambda: sequential_sample(model, n, batch=B, generator=gen())}
    for K in SPEC_KS:
        fns[f"speculative K = {K}"] = lambda K=K: speculative_sample(
            model, n, K, batch=B, generator=gen()
        )
    if per is not None:
        fns[f"Lemma 1, {per} per pass (as speculative K = {MATCH_K})"] = lambda: lemma1_sample(
            model, n, n // per, reveal="reference", batch=B, generator=gen()
        )
        fns[f"confidence order, {per} per pass"] = lambda: confidence_sample(
            model, n, per, batch=B, generator=gen()
        )
        fns[f"confidence order, speculative K = {MATCH_K}"] = lambda: confidence_sample(
            model, n, speculative=MATCH_K, batch=B, generator=gen()
        )
    return fns


def passes_per_token(out, n: int) -> float:
    spec = out.extra.get("speculative")
    return float(spec.passes.mean() if spec is not None else out.forward_passes) / n


def quality(model, n: int, B: int, seed: int, known_source: bool) -> tuple[dict, int]:
    """One batch of ``B`` per sampler: ``({label: row dict}, per)``."""
    rows = {}

    def run(fns: dict) -> None:
        for label, fn in fns.items():
            out = fn()
            row = {"passes_per_token": passes_per_token(out, n)}
            if known_source:
                nll, bad = score(out.tokens.cpu().numpy())
                for name, x in (("nll", nll), ("impossible", bad)):
                    row[name] = float(x.mean())
                    row[name + "_se"] = float(x.std(ddof=1) / math.sqrt(len(x)))
            rows[label] = row
            print(f"  {label}: {row}", flush=True)

    run(samplers(model, n, B, None, seed))
    per = max(1, round(1 / rows[f"speculative K = {MATCH_K}"]["passes_per_token"]))
    all_fns = samplers(model, n, B, per, seed)
    run({k: v for k, v in all_fns.items() if k not in rows})
    return rows, per


def timing(model, n: int, B: int, per: int, args) -> dict:
    """Round-robin at batch ``B``: the seconds of every round on both clocks, and the load."""
    load0 = os.getloadavg()
    fns = samplers(model, n, B, per, args.seed)
    times, _ = round_robin(fns, args.repeats, torch.device("cpu"))
    raw = dict(batch=B, n=n, seconds=times, load_before=load0, load_after=os.getloadavg())
    print(f"  batch {B}, n {n}: load {load0} -> {raw['load_after']}")
    for clock in ("wall", "cpu"):
        print(
            f"    {clock}: " + ", ".join(f"{k} {x:.2f}x" for k, x in speeds(times, clock).items())
        )
    return raw


def speeds(times: dict, clock: str) -> dict:
    """``{label: speed over sequential}``: the median over rounds of each round's ratio.

    The sides of a ratio ran within one round (seconds to a minute apart), so a change of
    the machine's load between rounds cancels; the best round of each side (``_bench``'s
    ``min``) instead paired sequential's quietest moment with the others' busier ones.
    """
    seq = times["sequential any order"][clock]
    return {k: statistics.median(s / x for s, x in zip(seq, t[clock])) for k, t in times.items()}


def fmt(row: dict, name: str, digits: int) -> str:
    if name not in row:
        return "—"
    return f"{row[name]:.{digits}f} ± {row[name + '_se']:.{digits}f}"


def print_table(payload: dict, clock: str) -> None:
    """The markdown table of every run in ``payload`` (what :func:`measure` collected)."""
    runs = {k: v for k, v in payload.items() if isinstance(v, dict) and "rows" in v}
    batches = sorted({t["batch"] for v in runs.values() for t in v["timing"]})
    heads = ["passes per token", *(f"speed vs sequential, batch {B}" for B in batches)]
    heads += ["bits per transition", "impossible transitions"]
    what = "CPU clock (wall clock)" if clock == "both" else f"{clock} clock"
    print(f"\nspeeds on the {what}; the chain's entropy rate "
          f"{synthetic.entropy_rate_bits():.3f} bits")  # fmt: skip
    print("| model | sampler | " + " | ".join(heads) + " |")
    print("|---|---|" + "---|" * len(heads))
    for run_dir, entry in runs.items():
        name = Path(run_dir).name + (f" ({entry['kind']})" if "kind" in entry else "")
        for label, row in entry["rows"].items():
            cells = [f"{row['passes_per_token']:.3f}"]
            cells += [speed_cell(entry["timing"], B, label, clock) for B in batches]
            cells += [fmt(row, "nll", 3), fmt(row, "impossible", 4)]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |")
    for run_dir, entry in runs.items():
        if "nll" in entry["rows"]["sequential any order"]:
            print_checks(run_dir, entry["rows"])


def speed_cell(timing: list, B: int, label: str, clock: str) -> str:
    """``1.50x``, or ``1.50x (1.45x)`` for ``clock="both"`` (CPU, then wall); "—" if untimed."""
    t = next((t for t in timing if t["batch"] == B), None)
    if t is None:
        return "—"
    if clock != "both":
        return f"{speeds(t['seconds'], clock)[label]:.2f}x"
    cpu, wall = (speeds(t["seconds"], c)[label] for c in ("cpu", "wall"))
    return f"{cpu:.2f}x ({wall:.2f}x)"


def print_checks(run_dir: str, rows: dict) -> None:
    """Each row's gap to sequential in combined standard errors; confidence over Lemma 1."""
    seq = rows["sequential any order"]
    print(f"\n{run_dir}: gap to sequential in combined standard errors (nll, impossible)")
    for label, row in rows.items():
        gaps = [
            (row[m] - seq[m]) / math.hypot(row[m + "_se"], seq[m + "_se"])
            for m in ("nll", "impossible")
        ]
        print(f"  {label}: {gaps[0]:+.2f}, {gaps[1]:+.2f}")
    lemma = next(r for k, r in rows.items() if k.startswith("Lemma 1"))
    conf = next(r for k, r in rows.items() if k.startswith("confidence order,") and "per" in k)
    gap = (conf["impossible"] - lemma["impossible"]) / math.hypot(
        conf["impossible_se"], lemma["impossible_se"]
    )
    print(f"  confidence order / Lemma 1 at equal passes, impossible transitions: "
          f"{conf['impossible'] / lemma['impossible']:.2f}x ({gap:+.1f} se)")  # fmt: skip


def measure(run_dir: str, batches: list[int], args) -> dict:
    """Quality at ``--samples``, then the timing at each of ``batches``, of one run folder."""
    loaded = load_model(run_dir)
    model = loaded.model
    n = args.length or model.cfg.seq_len
    known = str(loaded.config.data.source) == "builtin:synthetic"
    print(f"{run_dir}: {model.kind}, n {n}, source {loaded.config.data.source}", flush=True)
    torch.set_num_threads(1)
    with torch.autocast("cpu", torch.bfloat16):
        rows, per = quality(model, n, args.samples, args.seed, known)
        torch.set_num_threads(args.threads)
        raw = [timing(model, args.time_length or n, B, per, args) for B in batches]
    return dict(rows=rows, timing=raw, n=n, kind=model.kind)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="*", help="run folders")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--length", type=int, default=None, help="default: the model's seq_len")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing", default="", help="batch sizes to time, e.g. 1,16")
    ap.add_argument("--time-length", type=int, default=None, help="default: --length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="threads of the timed runs")
    ap.add_argument("--clock", choices=["cpu", "wall", "both"], default="both")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/speculative.json"))
    ap.add_argument("--table", type=Path, nargs="+", help="only print the table of these JSONs")
    args = ap.parse_args()
    if args.table:
        payload = {}
        for path in args.table:
            payload.update(json.loads(path.read_text()))
        print_table(payload, args.clock)
        return
    batches = [int(b) for b in args.timing.split(",") if b]
    payload = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    for run_dir in args.runs:
        payload[run_dir] = measure(run_dir, batches, args)
    print_table(payload, args.clock)
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
