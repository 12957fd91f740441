"""Figures from evaluation results: PNG files, matplotlib's Agg backend, imported lazily.

* :func:`plot_ensemble_curve`: the any-order figure against the context-order ensemble size,
  one line per dataset, the left-to-right one dashed (the shape of AO-GPT's Figure 3), in
  the unit of the table it goes with: bits per byte for a run's own data and byte-level
  models, perplexity for the papers' token-level zero-shot table.
* :func:`plot_gen_sweep`: generative perplexity against decoding steps or temperature, the
  unigram entropy on a second axis (the two belong together).

Error bars are one standard error over blocks (the text sample; delta method for perplexity:
``d exp(x) = exp(x) dx``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anyorder.atomic import write_errors
from anyorder.errors import ConfigError


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib; pip install 'anyorder[plot]'") from None
    matplotlib.use("Agg", force=True)  # files only, no display, safe on a server
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")  # no half-written PNG on error
    try:
        with write_errors(path, "another --out folder"):
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(tmp, dpi=150, bbox_inches="tight")
            tmp.replace(path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return path


def plot_ensemble_curve(
    results: Mapping[str, Mapping[str, Any]],
    path: str | Path,
    *,
    title: str | None = None,
    unit: str = "bits/byte",
) -> Path:
    """The any-order figure vs ensemble size for each corpus with an ensemble run.

    Args:
        results: ``{name: likelihood_suite result}`` (a zero-shot table's ``datasets``).
        path: the PNG to write.
        title: the figure title.
        unit: ``bits/byte`` or ``ppl`` (the unit of the table beside the plot).

    Raises:
        ConfigError: no result holds an ensemble curve, or a unit the results lack.
    """
    if unit not in ("bits/byte", "ppl"):
        raise ConfigError(f"unit={unit!r}: plot in bits/byte or ppl")
    curves = {
        k: r for k, r in results.items() if r.get("ensemble") and r["ensemble"].get("by_size")
    }
    if not curves:
        raise ConfigError("no ensemble results to plot; run with --ensemble M (M > 1)")
    if unit == "bits/byte" and any(r.get("bytes_per_token") is None for r in curves.values()):
        raise ConfigError("these results have no bytes per token: plot them with unit='ppl'")

    def value(m: Mapping[str, Any]) -> tuple[float, float]:  # (value, one standard error)
        if unit == "ppl":
            return m["ppl"], m["ppl"] * (m["stderr"] or 0.0)
        return m["bits_per_byte"], m["bpb_stderr"] or 0.0

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in curves.items():
        # JSON turns the integer sizes into strings: accept both
        by = {int(m): v for m, v in r["ensemble"]["by_size"].items()}
        sizes = sorted(by)
        ys, se = zip(*(value(by[m]) for m in sizes), strict=True)
        line = ax.errorbar(sizes, ys, yerr=se, marker="o", capsize=3, label=name)
        if r.get("l2r"):
            y = value(r["l2r"])[0]
            ax.axhline(y, ls="--", lw=1, color=line[0].get_color(), alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(m) for m in sizes])
    ax.set_xlabel("ensemble size M (context orders per target; same target slots for every M)")
    ax.set_ylabel("bits per byte (lower is better)" if unit == "bits/byte" else "perplexity")
    what = "bits per byte" if unit == "bits/byte" else "perplexity"
    ax.set_title(title or f"Any-order {what} vs context-order ensemble (dashed: left to right)")
    ax.legend()
    ax.grid(alpha=0.3)
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_gen_sweep(
    rows: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    x: str = "steps",
    title: str | None = None,
) -> Path:
    """Generative perplexity (and entropy, right axis) against ``steps`` or ``temperature``.

    Rows that share the other setting form one line each.

    Raises:
        ConfigError: ``x`` is not steps or temperature, or there are no rows.
    """
    if x not in ("steps", "temperature"):
        raise ConfigError(f"x={x!r}: plot against steps or temperature")
    if not rows:
        raise ConfigError("no generation results to plot")
    other = "temperature" if x == "steps" else "steps"
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r[other], []).append(r)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax2 = ax.twinx()
    for key, group in sorted(groups.items()):
        group = sorted(group, key=lambda r: r[x])
        xs = [r[x] for r in group]
        line = ax.plot(xs, [r["gen_ppl"] for r in group], marker="o", label=f"{other} {key:g}")
        ax2.plot(xs, [r["entropy"] for r in group], marker="x", ls=":", color=line[0].get_color())
    if x == "steps":
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel("generative perplexity (solid)")
    ax2.set_ylabel("unigram entropy, nats (dotted)")
    ax.set_title(title or f"Generative perplexity vs {x}")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    try:
        return _save(fig, path)
    finally:
        plt.close(fig)
