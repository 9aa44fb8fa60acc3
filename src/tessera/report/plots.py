"""Plots of Tessera's results, drawn with matplotlib's Agg backend (no display, no global pyplot state)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from tessera.errors import TesseraError

if TYPE_CHECKING:
    from tessera.cost.census import Census

PLOT_GROUPS = ("phase", "class", "block")
_GROUP_ATTR = {"phase": "phase", "class": "cost_class", "block": "block"}


class PlotError(TesseraError, ValueError):
    """A plot that cannot be drawn: an unknown grouping, nothing to draw, or an unwritable path."""


def census_ratio_cdf(result: Census, path: str | Path, by: str = "phase") -> Path:
    """Write a PNG of the CDF of per-kernel predicted time ratios t(second) / t(first), one curve per
    phase (``by="phase"``), cost class (``"class"``) or block (``"block"``), on a log x axis with a line at 1.

    Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if by not in PLOT_GROUPS:
        raise PlotError(f"cannot group the census plot by {by!r}; use one of {', '.join(PLOT_GROUPS)}")
    groups: dict[str, list[float]] = {}
    for p in result.pairs:
        r = p.ratio
        if 0 < r < math.inf:
            groups.setdefault(getattr(p, _GROUP_ATTR[by]), []).append(r)
    if not groups:
        raise PlotError(f"the census of {result.model} has no kernel with a positive time on both devices")
    a, b = result.device_a, result.device_b
    fig = Figure(figsize=(10.5, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    order = list(result.phases) if by == "phase" else sorted(groups, key=lambda g: -len(groups[g]))
    for name in order:
        if name not in groups:
            continue
        r = sorted(groups[name])
        n = len(r)
        faster_b = sum(x < 1 for x in r) / n
        ys = [0.0] + [(i + 1) / n for i in range(n)]
        ax.step([r[0], *r], ys, where="post", linewidth=1.6,
                label=f"{name} ({n} kernels, {faster_b:.0%} faster on {b})")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1.0)
    _log2_axis(ax, [x for r in groups.values() for x in r])
    ax.set_ylim(0, 1.0)
    ax.set_xlabel(f"predicted per-kernel time ratio t({b}) / t({a})  (log scale)")
    ax.set_ylabel("share of kernels (cumulative)")
    ax.set_title(f"{result.model}: predicted kernel time ratio, {b} vs {a}", pad=16)
    ax.text(0.97, 1.01, f"← faster on {b}  ", transform=ax.get_xaxis_transform(), ha="right", va="bottom",
            fontsize=9)
    ax.text(1.03, 1.01, f"  faster on {a} →", transform=ax.get_xaxis_transform(), ha="left", va="bottom",
            fontsize=9)
    ax.grid(True, which="major", alpha=0.25)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, title=f"by {by}", title_fontsize=8,
              frameon=False)
    fig.tight_layout()
    return save_png(fig, path, PlotError, "the plot", "pass --plot with a writable path")


def save_png(fig, path: str | Path, error: type[TesseraError], what: str, hint: str) -> Path:
    """Write ``fig`` as a PNG (no software stamp, so files are reproducible), creating the folder; a clear
    ``error`` naming ``what`` and the ``hint`` when it cannot be written."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", metadata={"Software": None})
    except OSError as e:
        raise error(f"cannot write {what} to {out}: {e.strerror}; {hint}") from e
    return out


def _log2_axis(ax, values: list[float]) -> None:
    """A log x axis spanning the values and 1/2..2 at least, ticks at powers of two printed as 1/4, 1, 4."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo = min(-1, math.floor(math.log2(min(values)) - 0.05))
    hi = max(1, math.ceil(math.log2(max(values)) + 0.05))
    ax.set_xscale("log")
    ax.set_xlim(2.0 ** lo, 2.0 ** hi)
    ax.xaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(lo, hi + 1)]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}" if x >= 1 else f"1/{1 / x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
