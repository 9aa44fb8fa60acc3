"""Which kernels of a device program a CUDA graph can hold: the program cut into capturable segments.

A segment is a maximal run of one micro-batch's ``run`` and ``free`` instructions with no transfer in between
(a send reads bytes the kernels before it wrote, a receive writes bytes the kernels after it read) and no kernel
that cannot be captured: one that reads a tensor on the host (a sync, which a capturing stream refuses), whose
output shape depends on the data, or that branches on the data in Python. Such a kernel runs eagerly between
segments, for the reason :func:`capture_blocker` gives. Shapes are static otherwise: every graph is traced at
one bucket's shapes, so each phase (bucket) has its own segments.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.graph.ir import KernelGraph
from tessera.program.program import Program

_SYNC = "host sync"
_DYNAMIC = "dynamic shape"
# op packet (namespace.name) -> why a CUDA graph cannot capture it
BLOCKED_OPS: dict[str, str] = {
    "tessera.sample": f"{_SYNC}: reads the rows' temperatures and seeds on the host and draws with a host "
                      "generator per row (data-dependent control flow)",
    "tessera.moe_gemm": f"{_SYNC}: reads the experts' row counts on the host to loop over the experts "
                        "(data-dependent control flow)",
    "tessera.moe_mxfp4_gemm": f"{_SYNC}: reads the experts' row counts on the host to loop over the experts "
                              "(data-dependent control flow)",
    "tessera.segment_attention": f"{_SYNC}: copies the segment lengths from the host and repeats by them "
                                 "(repeat_interleave without an output size)",
    "aten._local_scalar_dense": f"{_SYNC}: a tensor read as a Python number",
    "aten.item": f"{_SYNC}: a tensor read as a Python number",
    "aten.equal": f"{_SYNC}: returns a Python bool",
    "aten.is_nonzero": f"{_SYNC}: returns a Python bool",
    "aten.allclose": f"{_SYNC}: returns a Python bool",
    "aten.nonzero": f"{_DYNAMIC}: the number of rows depends on the data",
    "aten.masked_select": f"{_DYNAMIC}: the output length depends on the data",
    "aten.unique": f"{_DYNAMIC}: the output length depends on the data",
    "aten._unique": f"{_DYNAMIC}: the output length depends on the data",
    "aten._unique2": f"{_DYNAMIC}: the output length depends on the data",
    "aten.unique_dim": f"{_DYNAMIC}: the output length depends on the data",
    "aten.unique_consecutive": f"{_DYNAMIC}: the output length depends on the data",
    "aten.repeat_interleave": f"{_DYNAMIC}: the output length depends on the repeats (read on the host)",
}


def capture_blocker(graph: KernelGraph, kernel: int) -> str | None:
    """Why kernel ``kernel`` of ``graph`` cannot be captured into a CUDA graph, or None if it can."""
    op = graph.kernels[kernel].op
    reason = BLOCKED_OPS.get(op.rpartition(".")[0])
    return None if reason is None else f"{op}: {reason}"


@dataclass(frozen=True)
class Segment:
    """Instructions ``start`` up to (not including) ``stop`` of a program: micro-batch ``microbatch``'s kernels
    ``kernels`` with the frees between and after them, none of them a transfer or a blocked kernel."""

    microbatch: int
    start: int
    stop: int
    kernels: tuple[int, ...]


@dataclass(frozen=True)
class SegmentPlan:
    """A device program's capturable segments in program order, and the kernels that run eagerly with why."""

    segments: tuple[Segment, ...]
    eager: dict[int, str]

    def captured_kernels(self) -> set[int]:
        """Every kernel inside some segment."""
        return {k for s in self.segments for k in s.kernels}


def graph_segments(graph: KernelGraph, program: Program) -> SegmentPlan:
    """``program`` (of ``graph``) cut into CUDA-graph segments (see the module docstring)."""
    if program.graph_hash != graph.hash:
        raise ValueError(f"program was built for graph {program.graph_hash}, not {graph.hash}")
    segments: list[Segment] = []
    eager: dict[int, str] = {}
    start, mb, kernels = -1, -1, []

    def close(stop: int) -> None:
        nonlocal start, kernels
        if kernels:
            segments.append(Segment(mb, start, stop, tuple(kernels)))
        start, kernels = -1, []

    for i, ins in enumerate(program.instructions):
        if ins.microbatch != mb:
            close(i)
            mb = ins.microbatch
        if ins.kind == "run":
            reason = capture_blocker(graph, ins.kernel)
            if reason is not None:
                close(i)
                eager[ins.kernel] = reason
                continue
            if start < 0:
                start = i
            kernels.append(ins.kernel)
        elif ins.kind == "free":
            continue  # inside a segment it is part of it; outside, it stays a plain instruction
        else:  # a transfer
            close(i)
    close(len(program.instructions))
    return SegmentPlan(tuple(segments), eager)
