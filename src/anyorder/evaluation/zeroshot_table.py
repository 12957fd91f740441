"""The zero-shot table (METHOD.md section 5): :func:`zero_shot` runs
:func:`anyorder.evaluation.suite.likelihood_suite` on each set of
:mod:`anyorder.evaluation.zeroshot`, :func:`table_markdown` writes the paper-style table.

Design choices:

* One unit per table: bits per byte for a byte-level tokenizer, perplexity otherwise; every
  ``±`` is one standard error over the blocks, the order draw's part beside it.
* The table names its protocol and the split of every row: a WikiText-2 figure on the
  train split (the ``reference`` protocol) is not a test-split figure.
* Results are written atomically (:func:`write_atomic`): never a half-written file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from anyorder.atomic import write_text
from anyorder.evaluation.zeroshot import DATASETS, PROTOCOLS, load_corpus, resolve_splits


def zero_shot(
    model: Any,
    tokenizer: Any,
    names: Sequence[str] = tuple(DATASETS),
    *,
    data_dir: str | Path | None = None,
    max_blocks: int | None = None,
    protocol: str = "ours",
    splits: dict[str, str] | None = None,
    progress: bool = True,
    echo: bool = True,
    **suite: Any,
) -> dict[str, Any]:
    """Run :func:`anyorder.evaluation.suite.likelihood_suite` on each set.

    Args:
        model: the model (its ``cfg.seq_len`` is the block length).
        tokenizer: the checkpoint's tokenizer.
        names: the sets.
        data_dir: local copies (see the module docstring); None reads the hub.
        max_blocks: evaluate only the first blocks of each set (quick runs).
        protocol: ``ours`` (every set on test) or ``reference`` (:data:`PROTOCOLS`).
        splits: per-set splits that override the protocol's, ``{"wikitext2": "test"}``.
        progress: estimates and progress bars (lines when not on a terminal).
        echo: print each set's result as it is done.
        **suite: passed to ``likelihood_suite`` (orders, ensemble, targets, seed, ...).

    Returns:
        ``{"datasets": {name: result}, "protocol", "splits", "unit", "ensemble": M, ...}``
        ready for :func:`table_markdown`; each result names its ``split``.
    """
    from anyorder.evaluation.report import format_likelihood
    from anyorder.evaluation.suite import likelihood_suite

    split_of = resolve_splits(names, protocol, splits)
    seq_len = model.cfg.seq_len
    results: dict[str, Any] = {}
    for name in names:
        split = split_of[name]
        corpus = load_corpus(name, tokenizer, seq_len, data_dir, split=split, protocol=protocol)
        blocks = corpus.blocks[:max_blocks] if max_blocks else corpus.blocks
        res = likelihood_suite(
            model, blocks, bytes_per_token=corpus.bytes_per_token, progress=progress, **suite
        )
        res.update(examples=corpus.examples, blocks_total=len(corpus.blocks), split=split_of[name])
        results[name] = res
        if echo:
            print(f"[{name}] " + format_likelihood(res), flush=True)
    return {
        "datasets": results,
        "protocol": protocol,
        "protocol_text": PROTOCOLS[protocol][0],
        "splits": split_of,
        "unit": "bits/byte" if getattr(tokenizer, "name", "") == "bytes" else "ppl",
        "ensemble": suite.get("ensemble", 1),
        "targets": suite.get("targets"),
        "seq_len": seq_len,
    }


def _cell(m: dict[str, Any] | None, unit: str) -> str:
    """``value ± se (orders ± so)`` in the table's unit; perplexity's se by the delta method
    (``d exp(x) = exp(x) dx``)."""
    if m is None:
        return "n/a"
    if unit == "ppl":
        scale, value = m["ppl"], m["ppl"]
        se, so = m.get("stderr"), m.get("stderr_orders")
    else:
        scale, value = 1.0, m["bits_per_byte"]
        se, so = m.get("bpb_stderr"), m.get("bpb_stderr_orders")
    digits = 2 if unit == "ppl" else 4
    text = f"{value:.{digits}f}"
    if se is not None and math.isfinite(se) and se > 0:
        text += f" ± {scale * se:.{digits}f}"
    if so is not None and math.isfinite(so):
        text += f" (orders ± {scale * so:.{digits}f})"
    return text


def table_rows(table: dict[str, Any]) -> list[list[str]]:
    """Header and one row per set: name, split, blocks, then left to right, any order and,
    with an ensemble, the plain value on the ensemble's targets and the ensemble's, in the
    table's one unit (``unit``: ``ppl`` or ``bits/byte``)."""
    M = table.get("ensemble", 1)
    unit = table.get("unit", "ppl")
    u = "PPL" if unit == "ppl" else "bits/byte"
    protocol = table.get("protocol", "ours")
    head = ["dataset", f"split ({protocol} protocol)", "blocks", f"{u} l2r", f"{u} any order"]
    ens_runs = [r["ensemble"] for r in table["datasets"].values() if r["ensemble"]]
    with_ens = M > 1 and any(e.get("by_size") for e in ens_runs)
    sampled = with_ens and any(e.get("targets") is not None for e in ens_runs)
    if sampled:  # the ensemble's own baseline: the plain value on the same target slots
        t = max(e["targets"] or 0 for e in ens_runs)
        head += [f"{u} any order, x1 on {t} targets", f"{u} ens x{M} on {t} targets"]
    elif with_ens:
        head += [f"{u} ens x{M}"]
    rows = [head]
    for name, r in table["datasets"].items():
        row = [name, r.get("split", "test"), str(r["blocks"]), _cell(r["l2r"], unit),
               _cell(r["any_order"], unit)]  # fmt: skip
        ens = r["ensemble"] or {}
        if sampled:
            row += [_cell(ens.get("baseline"), unit), _cell(ens or None, unit)]
        elif with_ens:
            row += [_cell(ens or None, unit)]
        rows.append(row)
    return rows


def table_markdown(table: dict[str, Any]) -> str:
    """The paper-style table as Markdown, with the protocol, the splits and the error bars
    named under it."""
    rows = table_rows(table)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    fmt.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    notes = sorted({n for r in table["datasets"].values() for n in r["notes"]})
    protocol = table.get("protocol", "ours")
    text = table.get("protocol_text") or PROTOCOLS.get(protocol, ("", {}))[0]
    tail = [
        "",
        f"Protocol: {protocol} ({text}); every figure above is on the split in its row.",
        "± is one standard error over the blocks (the text sample, order draw included); "
        "(orders ± ) is the order draw's part alone. Left to right is exact per block.",
    ]
    return "\n".join(fmt + tail + [f"- {n}" for n in notes]) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file: never a half-written file.

    Raises:
        WriteError: the file cannot be written (named, with the cause).
    """
    write_text(path, text, "another --out folder")


def write_table(table: dict[str, Any], out_dir: str | Path, stem: str = "zero_shot") -> list[Path]:
    """Write ``stem.json`` and ``stem.md`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    write_atomic(js, json.dumps(table, indent=2) + "\n")
    write_atomic(md, table_markdown(table))
    return [js, md]
