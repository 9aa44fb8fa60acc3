"""Measuring what a kernel costs inside a real step of the model beyond its profiled time and the executor's
dispatch (``HostOverhead.in_step_s``). `tessera profile` times each kernel called alone, again and again, and
the dispatch probe times the executor over a tiny step whose kernels and buffers all stay in the core's
caches; in a real step the same small kernels run 20-40 us longer each (`benchmarks/README.md`, "What the
simulator leaves out of a served step"). The probe runs the model's decode step as a worker runs it (the
executor over its program, one kernel after another), times every kernel in it, profiles the same kernels
alone in the same process, and takes the median over the kernels that read no weight matrix (whose time in
a step the weight-read model does not cover) of their time in the step less their profiled time. Cached per
host, threads, model, shape and the timed code's digest; the charge is that median less ``dispatch_s``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tessera.cost.figure_cache import read_figures, write_figures
from tessera.cost.host_overhead import HostOverhead
from tessera.errors import TesseraError
from tessera.runtime.host_figures import cached_or_measured, figures_path

_PROBE_VERSION = 1
_WEIGHT_CLASSES = ("gemm", "gemv")  # kernels whose time in a step the weight-read model charges


class StepExcessProbeError(TesseraError, ValueError):
    """A step excess probe that cannot run as asked (bad counts or shapes)."""


@dataclass(frozen=True)
class StepExcess:
    """The median seconds a kernel that reads no weight matrix takes in the step beyond its profiled time
    (the executor's dispatch included), over ``kernels`` such kernels; ``step_s`` and ``profiled_s``: the
    step's median pass and its kernels' profiled sum, for the record."""

    excess_s: float
    kernels: int
    step_s: float
    profiled_s: float


def timed_passes(ex, program, inputs: dict, state: dict, passes: int, warmup: int = 2
                 ) -> tuple[dict[int, list[float]], list[float]]:
    """Run ``program`` on the executor ``ex`` ``warmup + passes`` times as a worker runs it, one kernel after
    another: each kernel's seconds per timed pass (by kernel index) and each timed pass's seconds."""
    import torch

    per: dict[int, list[float]] = {ins.kernel: [] for ins in program.instructions if ins.kind == "run"}
    passes_s = []
    with torch.no_grad():
        for p in range(warmup + passes):
            t0 = time.perf_counter()
            ex.prepare(inputs, state)
            for ins in program.instructions:
                if ins.kind == "run":
                    k0 = time.perf_counter()
                    ex.run_kernel(ins.kernel)
                    if p >= warmup:
                        per[ins.kernel].append(time.perf_counter() - k0)
                elif ins.kind == "free":
                    ex.free(ins.buffer)
            ex.release()
            if p >= warmup:
                passes_s.append(time.perf_counter() - t0)
    return per, passes_s


def measure_step_excess(model: str, threads: int = 1, batch: int = 4, ctx: int = 128, slots: int = 8,
                        passes: int = 10) -> StepExcess:
    """Run ``model``'s decode step (``batch`` rows, a cache of ``ctx`` positions and ``slots`` rows) ``passes``
    times as a worker runs it, each kernel timed, beside its kernels' profile taken in this process; see the
    module docstring for what is returned."""
    import torch

    from tessera.capture.trace import trace
    from tessera.cost.features import cost_class
    from tessera.limits import THREADS
    from tessera.program.program import single_device_program
    from tessera.runtime.executor import Executor
    from tessera.runtime.profiler import build_profile_step, profile_graph
    from tessera.weights import unique_state

    for name, v, low in (("threads", threads, 1), ("batch", batch, 1), ("ctx", ctx, 2), ("slots", slots, 1),
                         ("passes", passes, 3)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise StepExcessProbeError(f"{name} must be a whole number >= {low}, got {v!r}")
    THREADS.check(threads, "threads")
    if batch > slots:
        raise StepExcessProbeError(f"batch {batch} exceeds the cache's {slots} slots")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = build_profile_step(model, "decode", batch=batch, ctx=ctx, slots=slots)
        graph = trace(step)
        weights, _ = unique_state(step.modules)
        profiled = {t.index: t.median_s for t in profile_graph(graph, weights, step.inputs, step.state,
                                                               threads=threads, warmup=3, repeats=passes).kernels}
        program = single_device_program(graph, "cpu")
        ex = Executor(graph, program, weights, torch.device("cpu"))
        state = {n: t.clone() for n, t in step.state.items()}
        per, passes_s = timed_passes(ex, program, step.inputs, state, passes)
    finally:
        torch.set_num_threads(before)
    light = [k.index for k in graph.kernels if cost_class(k) not in _WEIGHT_CLASSES]
    excess = statistics.median(statistics.median(per[k]) - profiled[k] for k in light)
    return StepExcess(excess, len(light), statistics.median(passes_s), sum(profiled.values()))


def step_excess_key(model: str, threads: int, batch: int, ctx: int, slots: int) -> dict:
    """What a cached figure must match: the probe's version, the host overhead's key (CPU, cores, threads,
    torch, the executor's code), the model and the shape."""
    from tessera.runtime.overhead_probe import overhead_key

    return {**overhead_key(threads), "excess_probe": _PROBE_VERSION, "model": model, "shape": [batch, ctx, slots]}


def with_step_excess(overhead: HostOverhead, model: str, batch: int = 4, ctx: int = 128, slots: int = 8,
                     log: Callable[[str], None] = lambda s: None, cache_dir: Path | None = None) -> HostOverhead:
    """``overhead`` with ``in_step_s``: this host's measured excess of a kernel in ``model``'s decode step over
    its profile, less the overhead's dispatch (never below 0); measured on first use (seconds) and cached under
    ``<cache>/host/step-excess-*.json``, measured again by a use on a quiet host when measured on a busy one."""
    key = step_excess_key(model, overhead.threads, batch, ctx, slots)

    def read(path: Path, key: dict, quiet: bool) -> StepExcess | None:
        return read_figures(path, key, lambda d, _source: StepExcess(**d["figures"]), quiet)

    def write(path: Path, key: dict, figures: StepExcess, busy: bool) -> None:
        write_figures(path, {"key": key, "figures": asdict(figures)}, busy)

    figures = cached_or_measured(figures_path("step-excess", overhead.threads, key, cache_dir), key, read, write,
                                 lambda _watch: measure_step_excess(model, overhead.threads, batch, ctx, slots),
                                 f"a kernel's time inside {model}'s decode step against its profile", log)
    seconds = max(0.0, figures.excess_s - overhead.dispatch_s)
    return overhead.with_in_step(seconds, f"{seconds * 1e6:.1f} us a kernel more (the median kernel reading no "
                                 f"weight matrix in {model}'s decode step at {batch} rows ran {figures.excess_s * 1e6:.1f}"
                                 f" us over its profile, {figures.kernels} such kernels; dispatch {overhead.dispatch_s * 1e6:.1f})")
