"""The experiments' plots: validation curves per arm (:func:`_plot_curves`) and lines with
error bars (:func:`_plot_xy`).

Design choices: matplotlib is optional and imported when a plot is drawn (the Agg
backend, no display); without it a plot is skipped (the functions return False) and the
rest of the result is written.
"""

from __future__ import annotations

from pathlib import Path


def _plot_curves(
    series: dict[str, list[tuple[int, float]]], ylabel: str, title: str, path: Path
) -> bool:
    """Lines of (tokens, value) per label ``"arm: metric key"``: one colour per arm, one line
    style per metric (solid left to right, dashed any order); the legend sits outside the
    axes. False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = {"val/l2r_bpb": "left to right", "val/ao_bpb": "any order"}
    arms: list[str] = []
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for label, pts in series.items():
        arm, _, key = label.rpartition(": ")
        arm = arm or label
        if arm not in arms:
            arms.append(arm)
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=".",
                color=f"C{arms.index(arm) % 10}",
                linestyle="--" if key.endswith("ao_bpb") else "-",
                label=f"{arm}, {names[key]}" if key in names else label,
            )
    ax.set_xlabel("training tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_xy(
    series: dict[str, tuple[list[float], list[float], list[float] | None]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: Path,
    logx: bool = False,
) -> bool:
    """Lines with optional error bars: label -> (x, y, yerr)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, (x, y, err) in series.items():
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    elif all(float(v).is_integer() for x, _, _ in series.values() for v in x):
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # n = 5, 6, 7: no 5.25
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
