"""The text of a likelihood result (:func:`anyorder.evaluation.suite.likelihood_suite`): one
unit, the error bars labelled, an ensemble beside the same-targets baseline it is compared with.

Design choices:

* One unit per report: bits per byte where the bytes per token are known (every corpus
  of a run, every zero-shot set), else nats per token. Perplexity stays in the JSON.
* Every ``±`` is the standard error over blocks (the text sample, order draw included);
  ``[orders ± x]`` beside it is the order draw's part alone, where orders are drawn.
* An ensemble is printed against its own baseline: the plain any-order value on the same
  target slots (size 1), then each size, then the paired gain with its sign spelled out.
"""

from __future__ import annotations

import math
from typing import Any


def report_unit(res: dict[str, Any]) -> str:
    """``bits/byte`` where the bytes per token are known, else ``nats/token``."""
    return "bits/byte" if res.get("bytes_per_token") else "nats/token"


def _value(m: dict[str, Any], unit: str, key: str = "") -> float | None:
    if unit == "bits/byte":
        return m.get({"": "bits_per_byte", "se": "bpb_stderr", "so": "bpb_stderr_orders"}[key])
    return m.get({"": "nats_per_token", "se": "stderr", "so": "stderr_orders"}[key])


def _fmt_metric(name: str, m: dict[str, Any] | None, unit: str, width: int = 28) -> str:
    if m is None:
        return f"  {name:{width}s} n/a"
    se, so = _value(m, unit, "se"), _value(m, unit, "so")
    line = f"  {name:{width}s} {_value(m, unit):.4f}"
    if se is not None and math.isfinite(se):
        line += f" ± {se:.4f}"
    if so is not None and math.isfinite(so):
        line += f"  [orders ± {so:.4f}]"
    return line


def format_likelihood(res: dict[str, Any]) -> str:
    """A :func:`likelihood_suite` result as a few aligned lines, in one unit."""
    unit = report_unit(res)
    bpt = res["bytes_per_token"]
    split = f", split {res['split']}" if res.get("split") else ""
    lines = [
        f"{res['model']}: {res['blocks']} blocks x {res['seq_len']} tokens "
        f"({res['tokens']:,} tokens{split})"
        + (f", {bpt:.3f} bytes/token" if bpt else "")
        + f"; {unit}, lower is better",
        f"  ± = standard error over the {res['blocks']} blocks (the text sample; it includes "
        "the order draw); [orders ± ] = the order draw's part alone",
        _fmt_metric("left to right (exact)", res["l2r"], unit),
    ]
    kind = "ELBO" if (res["any_order"] or {}).get("kind") == "elbo" else "any order"
    lines.append(_fmt_metric(f"{kind} (K={res['orders']} orders)", res["any_order"], unit))
    ens = res["ensemble"]
    if ens is not None and ens.get("noop"):
        lines.append(_fmt_metric(f"ensemble x{ens['members']} (no-op)", ens, unit))
    elif ens is not None:
        lines += _format_ensemble(res, ens, unit)
    lines += [f"  note: {note}" for note in res["notes"]]
    return "\n".join(lines)


def _format_ensemble(res: dict[str, Any], ens: dict[str, Any], unit: str) -> list[str]:
    M, t, n = ens["members"], ens["targets"], res["seq_len"]
    scope = "every target slot" if t is None else f"{t} random target slots per block and order"
    lines = [f"  context-order ensemble, on {scope} (the same slots for every size):"]
    lines.append(_fmt_metric("  x1 = plain any order", ens["baseline"], unit))
    for m, val in ens["by_size"].items():
        if int(m) != 1:
            lines.append(_fmt_metric(f"  x{m}", val, unit))
    g = ens["gain_by_size"][M]
    gain, gse = (g["bits_per_byte"], g["bpb_stderr"]) if unit == "bits/byte" else (
        g["nats"], g["stderr"])  # fmt: skip
    if gse is not None and math.isfinite(gse) and abs(gain) < 2 * gse:
        verdict = "within 2 standard errors of no difference"
    else:
        verdict = "positive: the ensemble is better" if gain > 0 else "negative: it is worse"
    lines.append(f"    gain x1 - x{M} = {gain:+.4f} ± {gse:.4f} {unit} (paired; {verdict})")
    lines.append(
        f"    cost per block and order: 1 + {M - 1}*(n+1)/2"
        + ("" if t is None else f"*{t}/n")
        + f" = {ens['passes_formula']:.1f} forward passes of n={n} tokens "
        f"(measured {ens['passes_per_block']:.1f})"
        + ("" if t is None else "; every target: --targets all")
    )
    return lines
