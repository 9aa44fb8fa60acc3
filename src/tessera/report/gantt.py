"""A Gantt chart of one traced runtime step: what each worker computed and when it waited for transfers.

The input is the runtime's trace (:class:`tessera.runtime.distributed.StepTiming` ``timelines``): per worker a
list of ``(kind, kernel_or_transfer, microbatch, start_s, end_s)`` instructions with ``kind`` one of ``run``,
``send``, ``recv``, ``free`` and times relative to that worker's step start. Each worker gets one row of
compute (consecutive kernels of one micro-batch merged into one bar, coloured by micro-batch) and a thin row
under it for its transfers: receive waits as bars (coloured like the micro-batch received), sends as ticks
(they are posted asynchronously and return at once). ``free`` instructions are not drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tessera.report.plots import PlotError, save_png

KINDS = ("run", "send", "recv", "free")
MERGE_GAP_S = 20e-6  # kernels of one micro-batch closer than this are drawn as one bar
_PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")


class GanttError(PlotError):
    """A timeline that cannot be drawn: no workers, a device list of another length, or malformed entries."""


@dataclass
class WorkerBars:
    """One worker's bars: ``compute`` and ``recv`` as (start, end, micro-batch), ``sends`` as (time, micro-batch);
    ``busy_s`` is the sum of its kernel times (before merging), ``span_s`` the end of its last instruction."""

    compute: list[tuple[float, float, int]] = field(default_factory=list)
    recv: list[tuple[float, float, int]] = field(default_factory=list)
    sends: list[tuple[float, int]] = field(default_factory=list)
    busy_s: float = 0.0
    recv_wait_s: float = 0.0
    span_s: float = 0.0
    kernels: int = 0


def _check(timelines: Sequence[Sequence[tuple]], devices: Sequence[str]) -> None:
    if not timelines:
        raise GanttError("no timelines to draw; run the step with trace=True and pass runner.last_timing.timelines")
    if len(devices) != len(timelines):
        raise GanttError(f"{len(timelines)} timelines but {len(devices)} device names; name each worker once")
    for w, tl in enumerate(timelines):
        for i, entry in enumerate(tl):
            where = f"timeline of {devices[w]}, entry {i}"
            if len(entry) != 5:
                raise GanttError(f"{where} has {len(entry)} fields; expected (kind, index, microbatch, start_s, end_s)")
            kind, _, mb, start, end = entry
            if kind not in KINDS:
                raise GanttError(f"{where} has kind {kind!r}; expected one of {', '.join(KINDS)}")
            if not (isinstance(mb, int) and mb >= 0):
                raise GanttError(f"{where} has micro-batch {mb!r}; expected a non-negative integer")
            if not (math.isfinite(start) and math.isfinite(end) and 0 <= start <= end):
                raise GanttError(f"{where} runs from {start} to {end} s; times must be finite with 0 <= start <= end")


def bars(timeline: Sequence[tuple], merge_gap_s: float = MERGE_GAP_S) -> WorkerBars:
    """One worker's timeline as bars: consecutive ``run`` entries of the same micro-batch separated by at most
    ``merge_gap_s`` (the interpreter's time between kernels) become one bar."""
    out = WorkerBars()
    for kind, _, mb, start, end in timeline:
        out.span_s = max(out.span_s, end)
        if kind == "run":
            out.busy_s += end - start
            out.kernels += 1
            last = out.compute[-1] if out.compute else None
            if last is not None and last[2] == mb and start - last[1] <= merge_gap_s:
                out.compute[-1] = (last[0], end, mb)
            else:
                out.compute.append((start, end, mb))
        elif kind == "recv":
            out.recv.append((start, end, mb))
            out.recv_wait_s += end - start
        elif kind == "send":
            out.sends.append((start, mb))
    return out


def gantt(timelines: Sequence[Sequence[tuple]], devices: Sequence[str], path: str | Path, title: str,
          merge_gap_s: float = MERGE_GAP_S) -> Path:
    """Write a PNG Gantt chart of one traced step: per worker a compute row (colour per micro-batch) and a
    thin transfer row (receive waits as bars, sends as ticks). Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    _check(timelines, devices)
    per = [bars(tl, merge_gap_s) for tl in timelines]
    span = max((b.span_s for b in per), default=0.0)
    if span <= 0:
        raise GanttError("the timelines hold no instruction with a duration; trace a step that runs kernels")
    mbs = sorted({mb for b in per for _, _, mb in [*b.compute, *b.recv]} | {mb for b in per for _, mb in b.sends})
    colour = {mb: _PALETTE[i % len(_PALETTE)] for i, mb in enumerate(mbs)}
    ms = 1e3  # draw in milliseconds

    n = len(per)
    fig = Figure(figsize=(12, 1.0 + 1.15 * n), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    compute_h, xfer_h, pitch = 0.62, 0.2, 1.15
    ticks, labels = [], []
    for w, b in enumerate(per):
        y = (n - 1 - w) * pitch  # worker 0 on top
        cy, ty = y + 0.26, y - 0.28  # centre of the compute row and of the transfer row
        for mb in mbs:
            segs = [(s * ms, (e - s) * ms) for s, e, m in b.compute if m == mb]
            if segs:
                ax.broken_barh(segs, (cy - compute_h / 2, compute_h), facecolors=colour[mb], edgecolor="none")
            waits = [(s * ms, max((e - s) * ms, span * ms * 1e-4)) for s, e, m in b.recv if m == mb]
            if waits:
                ax.broken_barh(waits, (ty - xfer_h / 2, xfer_h), facecolors=colour[mb], edgecolor="black",
                               linewidth=0.3, alpha=0.85)
        if b.sends:
            ax.vlines([t * ms for t, _ in b.sends], ty - xfer_h / 2, ty + xfer_h / 2,
                      colors=[colour[mb] for _, mb in b.sends], linewidth=0.9)
        ax.axhline(ty, color="#bbbbbb", linewidth=0.4, zorder=0)
        ticks += [cy, ty]
        labels += [f"{devices[w]} compute", "transfers"]
        ax.text(span * ms * 1.005, cy,
                f"busy {b.busy_s * ms:.1f} ms ({b.busy_s / span:.0%})\nrecv wait {b.recv_wait_s * ms:.1f} ms",
                va="center", ha="left", fontsize=7.5)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(-pitch * 0.55 - 0.1, (n - 1) * pitch + 0.75)
    ax.set_xlim(0, span * ms * 1.13)
    ax.set_xlabel("time since the worker's step start (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.25)
    handles = [Patch(facecolor=colour[mb], label=f"micro-batch {mb}") for mb in mbs]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=0.5, label="receive wait (transfer row)"))
    handles.append(Line2D([], [], color="black", linewidth=0.9, label="send posted"))
    ncol = min(len(handles), 7)
    legend_h = (0.12 + 0.24 * math.ceil(len(handles) / ncol)) / fig.get_figheight()  # figure fraction for it
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=7.5, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, legend_h, 1, 1))
    return save_png(fig, path, GanttError, "the Gantt chart", "pass a writable path")
