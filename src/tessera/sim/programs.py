"""Kernel-level simulation of the runtime's own programs: a discrete-event run of every device's
instruction list with given kernel times and links.

The semantics are the runtime's (:mod:`tessera.runtime.worker`): each device executes its instructions
in order; ``run`` takes the kernel's time; ``send`` posts a message and returns at once; the message
occupies its directed link for ``bytes / bandwidth`` after the link's previous message (one message at a
time per direction) and arrives ``latency`` later; ``recv`` waits until its message has arrived;
``free`` takes no time. The step ends when every device has finished. This is the level the cluster
simulator builds on, and what the runtime benchmark uses for a schedule's bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.errors import TesseraError
from tessera.hardware.cluster import Link
from tessera.program.program import StepPrograms

KernelTime = Callable[[int, int, int], float]  # (device, kernel, micro-batch) -> seconds
LinkOf = Callable[[int, int], Link]  # (src device, dst device) -> the link carrying messages between them


class SimulationError(TesseraError):
    """Programs that cannot run to the end (a receive whose message is never sent)."""


@dataclass
class ProgramTimeline:
    """The simulated step: when each device finished, its time inside kernels, each directed link's busy
    time, and every instruction's (device, kind, kernel or transfer, micro-batch, start, end)."""

    makespan_s: float
    finish_s: list[float]
    busy_s: list[float]
    link_busy_s: dict[tuple[int, int], float]
    events: list[tuple[int, str, int | str | None, int, float, float]] = field(default_factory=list)

    @property
    def bottleneck_s(self) -> float:
        """The busiest device's kernel time: no schedule of these kernels is shorter."""
        return max(self.busy_s, default=0.0)


def simulate_programs(sp: StepPrograms, kernel_time: KernelTime, link: LinkOf | None = None,
                      record: bool = False) -> ProgramTimeline:
    """Run ``sp``'s programs with ``kernel_time`` per (device, kernel, micro-batch) and ``link`` per device
    pair (None: transfers are free and instant); ``record`` keeps every instruction's start and end."""
    n = len(sp.programs)
    clock = [0.0] * n
    busy = [0.0] * n
    pos = [0] * n
    arrival: dict[int, float] = {}
    link_free: dict[tuple[int, int], float] = {}
    link_busy: dict[tuple[int, int], float] = {}
    events: list[tuple] = []
    progress = True
    while progress:
        progress = False
        for d, prog in enumerate(sp.programs):
            while pos[d] < len(prog.instructions):
                ins = prog.instructions[pos[d]]
                start = clock[d]
                if ins.kind == "run":
                    t = kernel_time(d, ins.kernel, ins.microbatch)
                    clock[d] += t
                    busy[d] += t
                elif ins.kind == "send":
                    tr = sp.transfers[ins.transfer]
                    if link is None:
                        arrival[ins.transfer] = clock[d]
                    else:
                        lk = link(tr.src, tr.dst)
                        key = (tr.src, tr.dst)
                        begin = max(clock[d], link_free.get(key, 0.0))
                        wire = tr.nbytes / lk.bandwidth
                        link_free[key] = begin + wire
                        link_busy[key] = link_busy.get(key, 0.0) + wire
                        arrival[ins.transfer] = begin + wire + lk.latency_s
                elif ins.kind == "recv":
                    if ins.transfer not in arrival:
                        break
                    clock[d] = max(clock[d], arrival[ins.transfer])
                if record:
                    what = ins.kernel if ins.kind == "run" else ins.buffer if ins.kind == "free" else ins.transfer
                    events.append((d, ins.kind, what, ins.microbatch, start, clock[d]))
                pos[d] += 1
                progress = True
    stuck = [sp.devices[d] for d in range(n) if pos[d] < len(sp.programs[d].instructions)]
    if stuck:
        raise SimulationError(f"the programs cannot finish: {', '.join(stuck)} wait for messages never sent")
    return ProgramTimeline(max(clock, default=0.0), clock, busy, link_busy, events)
