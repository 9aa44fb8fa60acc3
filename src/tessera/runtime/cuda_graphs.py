"""CUDA graphs of a device program's segments (:mod:`tessera.runtime.segments`): captured, then replayed.

A captured graph replays fixed addresses, so each :class:`SegmentGraph` keeps, per key (micro-batch, state
instance), the storages the capture read (its static inputs) and produced (its static outputs). Before a
replay, every input buffer whose current storage is not the captured one (a step input, received bytes, an
activation an eager kernel produced) is copied into it; state is never copied (kernels write it in place), so
a state instance has graphs of its own. After the replay the produced storages become the buffers' current
ones and the frees the segment made are made. The graphs of one (micro-batch, state instance) share a memory
pool: they always replay in the order they were captured (a step or job runs a micro-batch's segments in
program order), so a later graph's temporaries may reuse an earlier one's.

Capture follows torch.cuda.graphs: warm-up runs on a side stream first (once per segment), then the capture.
A key seen before it was captured at load runs eagerly once (its warm-up) and is captured when next met.
A capture that fails (a sync or a shape the static check missed) leaves the segment eager for good, with the
error as its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera.graph.ir import KernelGraph
from tessera.program.program import Program, kernel_buffers
from tessera.runtime.segments import Segment

if TYPE_CHECKING:  # the executor (and the kernels it registers) is imported where a worker loads its phases
    from tessera.runtime.executor import Executor

WARMUP_RUNS = 2  # eager runs on a side stream before a segment's first capture


@dataclass
class Captured:
    """One capture of a segment: the graph, the storages it reads and produces, the buffers it frees."""

    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.UntypedStorage]
    outputs: dict[str, torch.UntypedStorage]
    freed: tuple[str, ...]


def _refuse(message: str) -> None:
    from tessera.runtime.executor import ExecutionError

    raise ExecutionError(message)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class SegmentGraph:
    """One segment of a phase's program on a CUDA device, replayed from its graphs (eager where it cannot be).

    ``pools``: the phase's graph memory pools by key, shared by its segments. A key is the micro-batch and the
    storage of the program's first state buffer (which tells a state instance)."""

    def __init__(self, graph: KernelGraph, program: Program, segment: Segment, pools: dict[tuple, Any]):
        self.segment = segment
        self.steps: list[tuple[bool, Any]] = [  # (is a run, kernel or buffer)
            (ins.kind == "run", ins.kernel if ins.kind == "run" else ins.buffer)
            for ins in program.instructions[segment.start: segment.stop]]
        self.buffers = set().union(*(kernel_buffers(graph, k) for k in segment.kernels))
        self.state_buffers = {b for b in self.buffers if graph.buffers[b].kind == "state"}
        self.instance_buffer = program.state[0] if program.state else None
        self.pools = pools
        self.captured: dict[tuple, Captured] = {}
        self.warm = False  # the segment's kernels ran at least once in this process
        self.seen: set[tuple] = set()  # keys run eagerly once, to be captured when next met
        self.failed: str | None = None  # why capture failed (then the segment always runs eagerly)
        self.replays = 0
        self.eager_runs = 0

    def key(self, ex: Executor) -> tuple:
        """The micro-batch and state instance the executor's current buffers belong to."""
        m = self.segment.microbatch
        if self.instance_buffer is None:
            return (m,)
        return (m, ex.storages[self.instance_buffer].data_ptr())

    def run(self, ex: Executor) -> None:
        """Run the segment on the executor's current buffers: replayed if captured for them, else eagerly
        (captured for them when next met, unless capture failed)."""
        key = self.key(ex)
        cap = self.captured.get(key)
        if cap is None and self.failed is None and key in self.seen:
            cap = self.capture(ex, key)
        if cap is None:
            self.seen.add(key)
            self.eager(ex)
            return
        self.replay(ex, cap)

    def eager(self, ex: Executor) -> None:
        """Run the segment's instructions one by one on the current stream."""
        for is_run, arg in self.steps:
            if is_run:
                ex.run_kernel(arg)
            else:
                ex.free(arg)
        self.warm = True
        self.eager_runs += 1

    def capture(self, ex: Executor, key: tuple | None = None) -> Captured | None:
        """Capture the segment on the executor's current buffers (after warm-up runs the first time, which
        leave the buffers as they found them, state aside). The buffers are then the capture's, not yet
        computed: :meth:`replay` computes them. None (reason in ``failed``) if it cannot be captured."""
        key = self.key(ex) if key is None else key
        before = dict(ex.storages)
        device = ex.device
        if not self.warm:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self.eager(ex)
                    self.eager_runs -= 1
                    ex.storages.clear()
                    ex.storages.update(before)
            torch.cuda.current_stream(device).wait_stream(side)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = torch.cuda.graph_pool_handle()
        cuda_graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(cuda_graph, pool=pool, capture_error_mode="thread_local"):
                for is_run, arg in self.steps:
                    if is_run:
                        ex.run_kernel(arg)
                    else:
                        ex.free(arg)
        except Exception as e:  # noqa: BLE001 - any capture failure leaves the segment eager, with its reason
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ex.storages.clear()
            ex.storages.update(before)
            torch.cuda.synchronize(device)
            return None
        after = ex.storages
        cap = Captured(cuda_graph,
                       inputs={b: before[b] for b in sorted(self.buffers) if b in before},
                       outputs={b: st for b, st in after.items() if before.get(b) is not st},
                       freed=tuple(b for b in before if b not in after))
        self.captured[key] = cap
        return cap

    def replay(self, ex: Executor, cap: Captured) -> None:
        """Bring the inputs into the captured storages, replay, and bind what the segment produced."""
        storages = ex.storages
        for name, static in cap.inputs.items():
            current = storages.get(name)
            if current is None:  # never written this step: eagerly it would read zeros
                _bytes(static).zero_()
            elif current.data_ptr() != static.data_ptr():
                if name in self.state_buffers:
                    _refuse(f"segment of kernels {self.segment.kernels[0]}..{self.segment.kernels[-1]}: state "
                            f"{name} is not the storage its graph was captured with")
                if current.nbytes() != static.nbytes():
                    _refuse(f"buffer {name}: {current.nbytes()} bytes, its graph captured {static.nbytes()}")
                _bytes(static).copy_(_bytes(current))
            storages[name] = static
        cap.graph.replay()
        for name in cap.freed:
            ex.free(name)
        storages.update(cap.outputs)
        self.replays += 1


@dataclass
class GraphStats:
    """What became of a phase's segments: captured graphs, replays, eager runs, and why any are eager."""

    segments: int
    captured: int
    replays: int
    eager_runs: int
    failed: dict[int, str]  # segment index -> capture error
    eager_kernels: dict[int, str]  # kernel -> why it is never captured


def graph_stats(segments: list[SegmentGraph], eager_kernels: dict[int, str]) -> GraphStats:
    """The stats of a phase's segment graphs."""
    return GraphStats(len(segments), sum(len(s.captured) for s in segments), sum(s.replays for s in segments),
                      sum(s.eager_runs for s in segments),
                      {i: s.failed for i, s in enumerate(segments) if s.failed is not None}, dict(eager_kernels))
