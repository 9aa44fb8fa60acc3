"""The figure of `tessera validate --plot`: predicted against measured times, log-log, one panel per device."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tessera.report.plots import PlotError

if TYPE_CHECKING:
    from tessera.cost.validation import Validation


def validation_scatter(result: Validation, path: str | Path, title: str = "") -> Path:
    """Write a PNG: per device, each measurement's predicted time against its measured time (log-log), coloured
    by op class, with the line of equality and the 2x band. Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    devices = list(dict.fromkeys(c.measurement.device for c in result.comparisons))
    if not devices:
        raise PlotError("no predicted measurement to plot")
    fig = Figure(figsize=(5.2 * len(devices), 5.0), dpi=110)
    FigureCanvasAgg(fig)
    classes = sorted({c.measurement.op_class for c in result.comparisons})
    colours = {cls: f"C{i % 10}" for i, cls in enumerate(classes)}
    for i, device in enumerate(devices):
        ax = fig.add_subplot(1, len(devices), i + 1)
        rows = [c for c in result.comparisons if c.measurement.device == device]
        for cls in classes:
            pts = [(c.measurement.seconds, c.predicted_s) for c in rows if c.measurement.op_class == cls]
            if pts:
                ax.scatter([m for m, _ in pts], [p for _, p in pts], s=14, alpha=0.75, color=colours[cls],
                           label=f"{cls} ({len(pts)})")
        values = [v for c in rows for v in (c.measurement.seconds, c.predicted_s) if v > 0]
        lo, hi = min(values) / 1.5, max(values) * 1.5
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=1.0)
        for k in (0.5, 2.0):
            ax.plot([lo, hi], [lo * k, hi * k], color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        s = result.overall[device]
        basis = ", ".join(sorted({c.basis for c in rows}))
        ax.set_title(f"{device} ({basis})\nmedian |err| {s.median_abs:.1%}, p90 {s.p90_abs:.1%}, n={s.count}",
                     fontsize=10)
        ax.set_xlabel("measured time (s)")
        ax.set_ylabel("predicted time (s)")
        ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
        ax.legend(fontsize=7, loc="upper left", ncol=1 if len(classes) <= 6 else 2)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)
