"""The GPU targets of issue 14 in one table, read from the JSON the benchmarks wrote.

``benchmarks/gpu_check.sh`` runs the GPU tests and the paper-size benchmarks into one folder
and then this script, which prints one row per target: the bound, the measured value and a
verdict, or why the row was not measured (a benchmark timed out, failed, or wrote no such
row). Figures measured at other sizes than the targets' (the CPU dry run at tiny sizes)
are printed with the verdict ``n/a``: the table's logic is checked, no claim is made.

    python benchmarks/gpu_targets.py --dir benchmarks/results/cuda
    python benchmarks/gpu_targets.py --dir DIR --json DIR/targets.json

The rows (H200, bf16, 12 x 768, n = 1024; docs/performance.md has the "before"):

* decoding, aogpt sequential T = 1024, batch 8: <= 2.1 s per batch;
* decoding, aogpt Lemma 1 T = 256, batch 8: <= 0.77 s per batch;
* ARMD strided decoding, batch 1, S = 1 / 2 / 4: <= 1.2 / 0.6 / 0.32 s per sample;
* aogpt speculative K = 4 over sequential decoding, batch 1: <= 0.5 of the time (issue 41),
  with captured rounds (``decode.json``) and with compiled passes (``decode_compiled.json``);
* training, gpt: >= 40% of 790 TFLOP/s (eager and compiled);
* training, aogpt / gpt and armd / gpt time ratio <= 1.10 x its FLOP ratio (both modes);
* ``train.compile=auto`` (on on CUDA): compiled / eager step time of each model (below 1:
  compile wins), and the compile's cost, the first compiled step: <= 90 s per model;
* our compiled aogpt's tokens/s >= the AO-GPT authors' compiled trainer's, same GPU and
  shape (``vs_reference_trainer.py``; needs their repository in ``.ref/``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PEAK_TFLOPS = 790.0  # a plain bf16 matmul on the H200 (the measurement)
PAPER_N = 1024


def load(path: Path) -> tuple[dict | None, str]:
    """``(payload, "")`` or ``(None, why not)``."""
    if not path.is_file():
        return None, f"no {path.name} (the benchmark did not finish: see its log)"
    try:
        return json.loads(path.read_text()), ""
    except (OSError, json.JSONDecodeError) as e:
        return None, f"{path.name} unreadable ({e.__class__.__name__})"


def row(target: str, bound: str, value, ok: bool | None, note: str = "") -> dict:
    """A table row; ``ok`` None = not judged (not measured, or not at the targets' size)."""
    if value is None:
        verdict = "not measured"
    elif ok is None:
        verdict = "n/a"
    else:
        verdict = "met" if ok else "NOT met"
    return dict(target=target, bound=bound, measured=value, verdict=verdict, note=note)


# ----------------------------------------------------------------------------- decoding


def _seconds(r: dict) -> float | None:
    """Seconds per sampled batch of a decode row (``ms_per_token`` is per position)."""
    for key in ("seconds_per_batch", "s_per_batch", "seconds"):
        if isinstance(r.get(key), (int, float)):
            return float(r[key])
    if isinstance(r.get("ms_per_token"), (int, float)) and r.get("n"):
        return r["ms_per_token"] * r["n"] / 1000
    return None


def _label(r: dict) -> str:
    return str(r.get("sampler", r.get("label", ""))).lower()


def find_decode(rows: list[dict], batch: int, kind: str, what: str, value: int) -> dict | None:
    """The decode row of ``kind`` at ``batch``: ``what`` = seq / lemma1 (T = value; T = n/4
    at another n than the targets') / strided (S = value)."""
    for r in rows:
        label = _label(r)
        if r.get("batch") != batch or not label.startswith(kind):
            continue
        if what == "seq" and re.search(r"\bseq", label):
            return r
        steps = value if r.get("n", PAPER_N) == PAPER_N else r["n"] // 4  # dry run: T = n/4
        if what == "lemma1" and "lemma" in label and re.search(rf"t={steps}\b", label):
            return r
        if what == "strided" and re.search(rf"\bs={value}\b", label):
            return r
        if what == "spec" and re.search(rf"^{kind} spec k={value}\b", label):
            return r
    return None


def decode_rows(dec: dict | None, why: str, dve: dict | None) -> list[dict]:
    rows_in = dec.get("rows", []) if dec else []
    specs = [
        ("decoding aogpt sequential T=1024, batch 8 (s/batch)", 8, "aogpt", "seq", 0, 2.1),
        ("decoding aogpt Lemma 1 T=256, batch 8 (s/batch)", 8, "aogpt", "lemma1", 256, 0.77),
    ]
    specs += [
        (f"ARMD strided S={s}, batch 1 (s/sample)", 1, "armd", "strided", s, bound)
        for s, bound in ((1, 1.2), (2, 0.6), (4, 0.32))
    ]
    out = []
    for target, batch, kind, what, value, bound in specs:
        r = find_decode(rows_in, batch, kind, what, value)
        sec = _seconds(r) if r else None
        n = r.get("n") if r else None
        if sec is None and what == "lemma1":  # the Figure-4 benchmark has the same point
            sec, n = _dve_point(dve, batch, value)
        if sec is None:
            note = why or "no such row in decode.json"
            out.append(row(target, f"<= {bound}", None, None, note))
            continue
        paper = n == PAPER_N
        note = "" if paper else f"measured at n={n}, not the target's size"
        out.append(row(target, f"<= {bound}", sec, sec <= bound if paper else None, note))
    out.append(_speculative_row(rows_in, why))
    return out


def _speculative_row(rows_in: list[dict], why: str, how: str = "") -> dict:
    """Speculative K = 4 over sequential decoding of the same model (aogpt, batch 1), both
    from the same run of decode.py (captured rounds where it ran with ``--graphs``). ``how =
    "compiled"``: the speculative row's compiled twin (``decode_compiled.json``) over the
    faster sequential row beside it, compiled or not."""
    target = "aogpt speculative K=4 / sequential, batch 1 (time ratio)"
    twins = [r for r in rows_in if _label(r).endswith(" compiled")]
    plain = [r for r in rows_in if not _label(r).endswith(" compiled")]
    spec = find_decode(twins if how else plain, 1, "aogpt", "spec", 4)
    seqs = [
        find_decode(rows, 1, "aogpt", "seq", 0) for rows in ((twins, plain) if how else (plain,))
    ]
    seqs = [r for r in seqs if r is not None and _seconds(r)]
    seq = min(seqs, key=_seconds) if seqs else None
    if how:
        target = target.replace(" (", f", {how} passes (")
    a, b = (_seconds(r) if r else None for r in (spec, seq))
    if a is None or not b:
        return row(target, "<= 0.5", None, None, why or "no aogpt spec K=4 / seq row at batch 1")
    paper = spec.get("n", PAPER_N) == PAPER_N
    note = "" if paper else f"measured at n={spec.get('n')}, not the target's size"
    return row(target, "<= 0.5", a / b, a / b <= 0.5 if paper else None, note)


def _dve_point(dve: dict | None, batch: int, steps: int) -> tuple[float | None, int | None]:
    """The decoder's seconds (per-row counts) at T = ``steps`` in decoder_vs_encoder.json."""
    for r in (dve or {}).get("rows", []):
        if steps == r.get("steps", r.get("T")) and r.get("batch") == batch and "decoder_s" in r:
            return float(r["decoder_s"]), r.get("n")
    return None, None


# ----------------------------------------------------------------------------- training


def training_rows(payloads: list[tuple[dict | None, str]]) -> list[dict]:
    """Rows of the training targets, eager and compiled, from the eager run's and the
    compiled run's train_step JSON, in that order (the compiled run's eager rows are used
    only where the eager run has none)."""
    seen: dict[tuple[str, bool], tuple[dict, dict]] = {}
    (_, why_eager), (_, why_compiled) = payloads
    for payload, _ in payloads:
        if not payload:
            continue
        for r in payload.get("rows", []):
            seen.setdefault((r["model"], bool(r.get("compiled"))), (r, payload.get("meta", {})))
    out = []
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        why = why_compiled if compiled else why_eager
        gpt = seen.get(("gpt", compiled))
        bound = 0.40 * PEAK_TFLOPS
        if gpt is None:
            out.append(row(f"training gpt TFLOP/s ({mode})", f">= {bound:.0f}", None, None, why))
        else:
            r, meta = gpt
            paper = _paper_train(meta)
            note = f"{r['ms_per_step']:.1f} ms/step, {100 * r['tflops'] / PEAK_TFLOPS:.0f}% of peak"
            if not paper:
                note += "; not the target's size"
            ok = r["tflops"] >= bound if paper else None
            out.append(
                row(f"training gpt TFLOP/s ({mode})", f">= {bound:.0f}", r["tflops"], ok, note)
            )
        models = sorted({m for m, c in seen if c == compiled and m != "gpt"}) or ["aogpt", "armd"]
        for model in models:
            limit = 1.10  # issue 42: time over gpt within 1.1x the FLOP ratio, every model
            target = f"training {model}/gpt time over FLOP ratio ({mode})"
            hit = seen.get((model, compiled))
            if hit is None:
                out.append(row(target, f"<= {limit}", None, None, why or "not in the JSON"))
                continue
            r, meta = hit
            note = f"time x {r['time_ratio']:.3f}, FLOP x {r['flop_ratio']:.3f}"
            paper = _paper_train(meta)
            value = r["time_over_flop"]
            out.append(row(target, f"<= {limit}", value, value <= limit if paper else None, note))
    for (model, compiled), (r, meta) in sorted(seen.items()):
        if compiled and r.get("vs_eager") is not None:
            out.append(
                row(
                    f"compile decision: {model} compiled / eager step time",
                    "< 1: compile wins",
                    r["vs_eager"],
                    None,
                    "train.compile=auto compiles on CUDA (COMPILE_AUTO in training/setup.py)",
                )
            )
        if compiled and r.get("first_step_s") is not None:
            first, paper = r["first_step_s"], _paper_train(meta)
            out.append(
                row(
                    f"compile time: {model}, first compiled step (s)",
                    "<= 90",
                    first,
                    first <= 90 if paper else None,
                    "" if paper else "not the target's size",
                )
            )
    return out


def head_loss_rows(head: dict | None, why: str) -> list[dict]:
    """The head's cross-entropy in chunks against the plain path (``head_loss.py``): no
    target of its own, the figures the loss's default rests on."""
    target = "head loss in chunks: time over the plain path (8 x 1024 x 50,257)"
    rows = [r for r in (head or {}).get("rows", []) if r.get("V") == 50257]
    if not rows:
        return [row(target, "informational", None, None, why or "no 50,257-id row")]
    r = rows[-1]
    note = f"kept for backward {r['saved_bytes']['chunked'] / 2**20:.0f} MB against "
    note += f"{r['saved_bytes']['plain'] / 2**20:.0f} MB"
    if r.get("peak_bytes"):
        p = r["peak_bytes"]
        note += f"; peak {p['chunked'] / 2**20:.0f} MB against {p['plain'] / 2**20:.0f} MB"
    return [row(target, "informational", r["time_ratio"], None, note)]


def reference_rows(ref: dict | None, why: str) -> list[dict]:
    """Our compiled aogpt's tokens/s over the AO-GPT authors' compiled trainer's, same GPU
    and shape (``benchmarks/vs_reference_trainer.py``)."""
    target = "training aogpt compiled tokens/s over the authors' compiled trainer"
    got = (ref or {}).get("results", {}).get("compiled")
    if got is None:
        return [row(target, ">= 1", None, None, why or "no compiled row in the JSON")]
    shape = (ref or {}).get("shape", {})
    paper = shape.get("n_layer") == 12 and shape.get("seq_len") == PAPER_N
    note = f"ours {got['ours_tokens_s']:,.0f}, theirs {got['theirs_tokens_s']:,.0f} tokens/s"
    value = got["ours_over_theirs"]
    return [row(target, ">= 1", value, value >= 1 if paper else None, note)]


def _paper_train(meta: dict) -> bool:
    shape = meta.get("shape", {})
    return shape.get("n_layer") == 12 and shape.get("seq_len") == PAPER_N


# ----------------------------------------------------------------------------- tests, table


def test_row(path: Path) -> dict:
    """The pytest summary line of the GPU tests' log."""
    target = "GPU tests (pytest -m gpu)"
    if not path.is_file():
        return row(target, "all pass", None, None, f"no {path.name}")
    lines = [ln for ln in path.read_text().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    if not lines:
        return row(target, "all pass", None, None, "no pytest summary (timed out?)")
    summary = lines[-1].strip("= ").strip()
    bad = re.search(r"\d+ (failed|error)", summary)
    return row(target, "all pass", summary, not bad)


def build(folder: Path) -> list[dict]:
    dec, why = load(folder / "decode.json")
    dve, _ = load(folder / "decoder_vs_encoder.json")
    trains = [load(folder / "train_step.json"), load(folder / "train_compile.json")]
    ref, why_ref = load(folder / "vs_reference.json")
    compiled, why_compiled = load(folder / "decode_compiled.json")
    return [
        test_row(folder / "gpu_tests.txt"),
        *decode_rows(dec, why, dve),
        _speculative_row((compiled or {}).get("rows", []), why_compiled, "compiled"),
        *training_rows(trains),
        *reference_rows(ref, why_ref),
        *head_loss_rows(*load(folder / "head_loss.json")),
    ]


def show(rows: list[dict]) -> None:
    def cell(v) -> str:
        return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))

    header = ["target", "bound", "measured", "verdict", "note"]
    cells = [[cell(r[k]) for k in header] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print("\nissue 14 GPU targets")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
    missing = [r["target"] for r in rows if r["verdict"] == "not measured"]
    if missing:
        print(f"\nnot measured ({len(missing)}): " + "; ".join(missing))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", type=Path, default=Path("benchmarks/results/cuda"))
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    rows = build(args.dir)
    show(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
