"""A picture of a placement: which device runs each (layer, kernel class) cell, as a PNG grid.

Columns are layers in the order given (``embed``, ``0`` .. ``31``, ``head``), rows are kernel classes
(gemm, gemv, attention, ...), and each cell is coloured by the device that runs it; a cell whose time is
split between devices is split in the same shares, stacked bottom to top in the order of ``devices``.
A bar chart above the grid shows each layer's time, stacked by device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tessera.report.plots import PlotError, save_png

MAX_LABELS = 40  # at most this many layer labels on the x axis; more layers show every k-th label
_EMPTY = "#f2f2f2"  # a (layer, class) cell with no kernel


class PlacementPlotError(PlotError):
    """A placement that cannot be drawn: no cells, a device not in the device list, or bad shares or times."""


@dataclass(frozen=True)
class PlacementCell:
    """The kernels of one cost class in one layer: ``time_s`` seconds in all (per micro-batch), and the
    share of that time on each device (device name -> share; shares are normalised to sum to 1)."""

    layer: str
    cost_class: str
    device_share: dict[str, float] = field(hash=False)
    time_s: float


def _check(rows: list[PlacementCell], devices: list[str]) -> None:
    if not devices:
        raise PlacementPlotError("cannot draw a placement over no devices; pass the devices of the plan")
    if len(set(devices)) != len(devices):
        raise PlacementPlotError(f"devices {devices} name a device twice; name each device once")
    if not rows:
        raise PlacementPlotError("cannot draw a placement with no cells; pass one PlacementCell per "
                                 "(layer, kernel class) of the plan")
    known = set(devices)
    for r in rows:
        where = f"cell (layer {r.layer!r}, class {r.cost_class!r})"
        unknown = sorted(set(r.device_share) - known)
        if unknown:
            raise PlacementPlotError(f"{where} puts time on {', '.join(map(repr, unknown))}, which is not among "
                                     f"the devices {devices}; add it to the device list")
        shares = list(r.device_share.values())
        if any(not (s >= 0 and math.isfinite(s)) for s in shares) or not sum(shares) > 0:
            raise PlacementPlotError(f"{where} has shares {r.device_share}; shares must be finite, "
                                     "non-negative and not all zero")
        if not (r.time_s >= 0 and math.isfinite(r.time_s)):
            raise PlacementPlotError(f"{where} has time {r.time_s} s; a time must be finite and non-negative")


def _cells(rows: list[PlacementCell], devices: list[str]) -> dict[tuple[str, str], tuple[list[float], float]]:
    """(layer, class) -> (share per device in ``devices`` order, total time); repeated cells are merged,
    their shares weighted by their times (equally where all times are zero)."""
    weighted: dict[tuple[str, str], list[float]] = {}
    plain: dict[tuple[str, str], list[float]] = {}
    times: dict[tuple[str, str], float] = {}
    for r in rows:
        total = sum(r.device_share.values())
        key = (r.layer, r.cost_class)
        w = weighted.setdefault(key, [0.0] * len(devices))
        p = plain.setdefault(key, [0.0] * len(devices))
        for j, d in enumerate(devices):
            share = r.device_share.get(d, 0.0) / total
            w[j] += share * r.time_s
            p[j] += share
        times[key] = times.get(key, 0.0) + r.time_s
    return {key: ([x / t for x in weighted[key]] if t > 0 else [x / sum(plain[key]) for x in plain[key]], t)
            for key, t in times.items()}


def _class_order(classes: list[str]) -> list[str]:
    """Kernel classes in the cost model's order (gemm, gemv, ..., elementwise), unknown ones after."""
    from tessera.cost.features import COST_CLASSES

    rank = {c: i for i, c in enumerate(COST_CLASSES)}
    return sorted(classes, key=lambda c: (rank.get(c, len(rank)), classes.index(c)))


def _tick_positions(n: int) -> list[int]:
    """Indices of the layer labels to print: all of them up to ``MAX_LABELS``, else every k-th, with the
    first and last always shown."""
    if n <= MAX_LABELS:
        return list(range(n))
    step = math.ceil(n / MAX_LABELS)
    ticks = list(range(0, n, step))
    if n - 1 - ticks[-1] < step / 2:
        ticks[-1] = n - 1
    else:
        ticks.append(n - 1)
    return ticks


def _time_unit(seconds: float) -> tuple[str, float]:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return unit, scale
    return "ns", 1e-9


def plot_placement(rows: list[PlacementCell], devices: list[str], path: str | Path, title: str) -> Path:
    """Write a PNG grid of a placement: layers (in the order they first appear in ``rows``) across, kernel
    classes down, each cell coloured by its device (split by share where mixed), one legend entry per
    device, and the time of each layer stacked by device above the grid.

    Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    _check(rows, devices)
    cells = _cells(rows, devices)
    layers = list(dict.fromkeys(r.layer for r in rows))
    classes = _class_order(list(dict.fromkeys(r.cost_class for r in rows)))
    n, m = len(layers), len(classes)
    palette = "tab10" if len(devices) <= 10 else "tab20"
    from matplotlib import colormaps

    cmap = colormaps[palette]
    colour = {d: cmap(i % cmap.N) for i, d in enumerate(devices)}

    width = min(22.0, max(9.0, 3.0 + 0.2 * n))
    fig = Figure(figsize=(width, 2.2 + 0.42 * m + 1.6), dpi=110)
    FigureCanvasAgg(fig)
    top, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1.6, 0.42 * m], "hspace": 0.06})

    # the grid: y = m - 1 - class index so that the first class is on top
    patches, colours = [], []
    for (layer, cls), (share, _t) in cells.items():
        x, y = layers.index(layer), m - 1 - classes.index(cls)
        base = y - 0.45
        for d, s in zip(devices, share, strict=True):
            if s > 0:
                patches.append(Rectangle((x - 0.45, base), 0.9, 0.9 * s))
                colours.append(colour[d])
                base += 0.9 * s
    for x in range(n):
        for y in range(m):
            if (layers[x], classes[m - 1 - y]) not in cells:
                patches.append(Rectangle((x - 0.45, y - 0.45), 0.9, 0.9))
                colours.append(_EMPTY)
    ax.add_collection(PatchCollection(patches, facecolors=colours, edgecolors="none"))
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(-0.6, m - 0.4)
    ax.set_yticks(range(m), list(reversed(classes)))
    ticks = _tick_positions(n)
    ax.set_xticks(ticks, [layers[i] for i in ticks], rotation=90 if any(len(layers[i]) > 3 for i in ticks)
                  or len(ticks) > 24 else 0, fontsize=8)
    ax.tick_params(axis="both", length=0)
    ax.set_xlabel("layer")
    ax.set_ylabel("kernel class")
    for side in ax.spines.values():
        side.set_visible(False)

    # time per layer, stacked by device
    per_device = [[0.0] * n for _ in devices]
    for (layer, _cls), (share, t) in cells.items():
        for j, s in enumerate(share):
            per_device[j][layers.index(layer)] += s * t
    unit, scale = _time_unit(max(sum(col) for col in zip(*per_device, strict=True)) or 1.0)
    bottom = [0.0] * n
    for d, ts in zip(devices, per_device, strict=True):
        heights = [t / scale for t in ts]
        top.bar(range(n), heights, width=0.9, bottom=bottom, color=colour[d], linewidth=0)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    top.set_ylabel(f"time ({unit})")
    top.tick_params(axis="x", length=0)
    top.grid(True, axis="y", alpha=0.25)
    for side in ("top", "right"):
        top.spines[side].set_visible(False)

    handles = [Patch(color=colour[d], label=d) for d in devices] + [Patch(facecolor=_EMPTY, edgecolor="#bbbbbb", label="no kernel")]
    top.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.02), ncol=min(len(handles), 6),
               frameon=False, fontsize=9)
    top.set_title(title, pad=28)
    fig.subplots_adjust(left=0.09 if width > 12 else 0.13, right=0.98, top=0.86, bottom=0.16)
    return save_png(fig, path, PlacementPlotError, "the placement plot", "give a writable path")
