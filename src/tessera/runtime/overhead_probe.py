"""Measuring what a step of Tessera's engine costs on this CPU beyond its kernels' profiled times
(:class:`~tessera.cost.host_overhead.HostOverhead`): the executor's dispatch per kernel and the bandwidth at
which a one-row GEMM reads weights from memory. Cached per host, threads, torch version and a digest of the
code they time (the executor, the worker, Tessera's kernels), so a faster executor is measured again, never
read from an old file.
"""

from __future__ import annotations

import functools
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch

from tessera.cost.host_overhead import HostOverhead, read_cached, write_cached
from tessera.errors import TesseraError
from tessera.limits import THREADS
from tessera.runtime.host_figures import LoadWatch, cached_or_measured, figures_path
from tessera.runtime.host_figures import code_digest as digest_of

_PROBE_VERSION = 3  # 2: bandwidth per weight shape; 3: cold weights' excess per shape and rows
# the code whose speed the figures are of: a change to any of these measures them again
_TIMED_SOURCES = ("runtime/executor.py", "runtime/worker.py", "runtime/overhead_probe.py", "kernels")
# one-row GEMMs over weights of these (out, in) shapes (the widths of small and mid-size LLMs' projections),
# each set cycled so that every call reads its weight from memory
_WEIGHT_SHAPES = ((1536, 576), (3072, 576), (2048, 1024), (1024, 2048))
_WEIGHT_SET_BYTES = 192 * 2**20
# GEMM row counts the cold weights' excess is measured at (a decode step's rows up to a prompt step's tokens; it
# varies little with rows here, `benchmarks/bench_cold_gemm.py`)
COLD_ROWS = (1, 16, 64)
# at most this many weights in a cold set: a tiny model's weights (kilobytes each) stay in the caches in a real
# step too, and a set of 192 MiB of them would take minutes of Python calls
_COLD_SET_MAX = 512


class OverheadProbeError(TesseraError, ValueError):
    """A host overhead probe that cannot run as asked (bad thread or pass counts)."""


def _check(threads: int, passes: int) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise OverheadProbeError(f"threads must be a whole number >= 1, got {threads!r}")
    THREADS.check(threads, "threads")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 3:
        raise OverheadProbeError(f"passes must be a whole number >= 3 (a median of timed passes), got {passes!r}")


def _tiny_decode_step():
    """The decode step of the two-layer llm test config on the CPU (Tessera's production kernels at toy
    sizes: the calls themselves cost little, the executor's work around them is what remains)."""
    from tessera.capture.build import instantiate
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import StepShape, build_model, step_for
    from tessera.capture.tiny import tiny_config

    module, values = instantiate(lambda: build_model("llm", tiny_config("llm")), "cpu")
    return step_for(resolve_model("smollm2-135m"), module, values, "decode", StepShape(batch=1, seq=1, ctx=16),
                    device="cpu")


def measure_dispatch(threads: int = 1, passes: int = 60) -> tuple[float, int]:
    """Seconds the executor spends per kernel beyond the kernel's own call, and the kernels it was measured
    over: a tiny decode step run ``passes`` times as a worker runs it (``Executor.run_kernel`` and frees, in
    program order), its median pass less the sum of its kernels' profiled medians (each kernel called alone
    on its bound arguments, as ``tessera profile`` times it), over the kernel count. Never below 0."""
    from tessera.capture.trace import trace
    from tessera.program.program import single_device_program
    from tessera.runtime.executor import Executor
    from tessera.runtime.profiler import profile_graph
    from tessera.weights import unique_state

    _check(threads, passes)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step = _tiny_decode_step()
        graph = trace(step)
        weights, _ = unique_state(step.modules)
        profiled = profile_graph(graph, weights, step.inputs, step.state, threads=threads, warmup=5, repeats=passes)
        program = single_device_program(graph, "cpu")
        ex = Executor(graph, program, weights, torch.device("cpu"))
        state = {n: t.clone() for n, t in step.state.items()}
        runs = []
        with torch.no_grad():
            for p in range(passes + 5):
                t0 = time.perf_counter()
                ex.prepare(step.inputs, state)
                for ins in program.instructions:
                    if ins.kind == "run":
                        ex.run_kernel(ins.kernel)
                    elif ins.kind == "free":
                        ex.free(ins.buffer)
                ex.release()
                if p >= 5:
                    runs.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    kernels = len(graph.kernels)
    return max(0.0, (statistics.median(runs) - profiled.total_s) / kernels), kernels


def measure_weight_bandwidth(threads: int = 1, shapes: dict[tuple[int, int], int] | None = None,
                             passes: int = 5) -> tuple[float, dict[tuple[int, int], float]]:
    """Bytes per second one-row bf16 GEMMs (``x @ W.T``) read their weights at when the weights come from
    memory. For each ``(out, in)`` weight shape of ``shapes`` (default ``_WEIGHT_SHAPES``, once each), a set
    of distinct weights of ``_WEIGHT_SET_BYTES`` (beyond the last-level cache) is called in turn, the median
    of ``passes`` passes after one untimed; the result is the shapes' bytes over their seconds, each shape
    counted as often as ``shapes`` says (a step's GEMMs read at this rate on average), and each shape's own rate."""
    _check(threads, max(passes, 3))
    shapes = shapes or {s: 1 for s in _WEIGHT_SHAPES}
    bad = [s for s in shapes if len(s) != 2 or min(s) < 1 or shapes[s] < 1]
    if bad:
        raise OverheadProbeError(f"weight shapes must be (out, in) pairs of sizes >= 1 with counts >= 1, got {bad}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    total_bytes = total_s = 0.0
    rates: dict[tuple[int, int], float] = {}
    try:
        with torch.no_grad():
            for (out_f, in_f), times in shapes.items():
                count = max(2, _WEIGHT_SET_BYTES // (out_f * in_f * 2))
                weights = [torch.randn(out_f, in_f).to(torch.bfloat16) for _ in range(count)]
                gemms = served_gemms(weights)
                x = torch.randn(1, in_f).to(torch.bfloat16)
                seconds = []
                for p in range(passes + 1):
                    t0 = time.perf_counter()
                    for gemm in gemms:
                        gemm(x)
                    if p:
                        seconds.append(time.perf_counter() - t0)
                per_call = statistics.median(seconds) / count
                rates[(out_f, in_f)] = out_f * in_f * 2 / per_call
                total_bytes += times * out_f * in_f * 2
                total_s += times * per_call
                del weights, gemms
    finally:
        torch.set_num_threads(before)
    return total_bytes / total_s, rates


def served_gemms(weights: list[torch.Tensor]) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """``x -> x @ W.T`` for each weight as the executor runs it on this host: on a packed copy where it packs
    (`tessera.kernels.prepacked`), else ``F.linear``."""
    from tessera.kernels.prepacked import PackedWeights, packable

    if weights and packable(weights[0].dtype, weights[0].device):
        packed = PackedWeights()
        return [packed.gemm((str(i),), [w]) for i, w in enumerate(weights)]
    return [functools.partial(torch.nn.functional.linear, weight=w) for w in weights]


def measure_cold_excess(threads: int = 1, shapes: dict[tuple[int, int], int] | None = None,
                        rows: tuple[int, ...] = COLD_ROWS, passes: int = 2) -> tuple[tuple[int, int, int, float], ...]:
    """(out, in, rows, seconds) for each ``(out, in)`` weight shape of ``shapes`` (default ``_WEIGHT_SHAPES``) and
    each row count of ``rows``: how much longer a bf16 GEMM (``x @ W.T``, ``x`` of that many rows) runs with its
    weight read from memory (a set of distinct weights of ``_WEIGHT_SET_BYTES``, beyond the last-level cache,
    called in turn; at most ``_COLD_SET_MAX`` of them) than with one weight called again and again, as the profiler calls a kernel; medians of
    ``passes`` passes after one untimed, never below 0."""
    _check(threads, 3)
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise OverheadProbeError(f"passes must be a whole number >= 1, got {passes!r}")
    if not rows or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in rows):
        raise OverheadProbeError(f"cold-weight row counts must be whole numbers >= 1, got {rows!r}")
    shapes = shapes or {s: 1 for s in _WEIGHT_SHAPES}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = []
    try:
        with torch.no_grad():
            for out_f, in_f in shapes:
                count = min(_COLD_SET_MAX, max(2, _WEIGHT_SET_BYTES // (out_f * in_f * 2)))
                weights = [torch.randn(out_f, in_f, dtype=torch.bfloat16) for _ in range(count)]
                gemms = served_gemms(weights)
                for r in rows:
                    x = torch.randn(r, in_f, dtype=torch.bfloat16)
                    per_call = {}
                    for cold in (False, True):
                        seconds = []
                        for p in range(passes + 1):
                            t0 = time.perf_counter()
                            for gemm in gemms:
                                (gemm if cold else gemms[0])(x)
                            if p:
                                seconds.append(time.perf_counter() - t0)
                        per_call[cold] = statistics.median(seconds) / len(weights)
                    out.append((out_f, in_f, r, max(0.0, per_call[True] - per_call[False])))
                del weights, gemms
    finally:
        torch.set_num_threads(before)
    return tuple(out)


def gemm_weight_shapes(graphs, limit: int = 8) -> dict[tuple[int, int], int]:
    """The 2-D weight shapes the GEMMs of ``graphs`` read, with how often a step reads each (the ``limit``
    shapes with the most bytes per step)."""
    from tessera.cost.features import cost_class

    counts: dict[tuple[int, int], int] = {}
    for g in graphs:
        for k in g.kernels:
            if cost_class(k) not in ("gemm", "gemv"):
                continue
            for a in g.accesses_of(k.index):
                buf = g.buffers[a.buffer]
                if buf.kind == "weight" and len(buf.shape) == 2 and a.mode == "read":
                    counts[tuple(buf.shape)] = counts.get(tuple(buf.shape), 0) + 1
    top = sorted(counts, key=lambda s: -counts[s] * s[0] * s[1])[:limit]
    return {s: counts[s] for s in top}


def code_digest() -> str:
    """A digest of the sources whose speed the figures are of (``_TIMED_SOURCES``)."""
    return digest_of(_TIMED_SOURCES)


def overhead_key(threads: int) -> dict[str, Any]:
    """What cached figures must match to be used: the probe's version, this CPU, its cores, the threads, torch
    and the timed code's digest."""
    from tessera.hardware.host import cpu_model, host_cores

    return {"version": _PROBE_VERSION, "cpu": cpu_model(), "machine": platform.machine(), "cores": host_cores(),
            "threads": threads, "torch": torch.__version__, "code": code_digest()}


def host_overhead(threads: int = 1, shapes: dict[tuple[int, int], int] | None = None,
                  log: Callable[[str], None] = lambda s: None, cache_dir: Path | None = None) -> HostOverhead:
    """This host's :class:`HostOverhead` at ``threads`` threads, weights read at the rate of GEMMs over
    ``shapes`` (:func:`gemm_weight_shapes` of a model's graphs; default a fixed set), no engine step (the
    serving engine measures its own): measured on first use for this host, code and shapes (seconds) and
    cached under ``<cache>/host/overhead-*.json``; figures measured while the host was busy with other work (a
    load average at or above its cores) are used until a use on a quiet host measures them again."""
    key = {**overhead_key(threads), "shapes": sorted([list(s), n] for s, n in (shapes or {}).items())}

    def measure(watch: LoadWatch) -> HostOverhead:
        dispatch, kernels = measure_dispatch(threads)
        bandwidth, rates = measure_weight_bandwidth(threads, shapes)
        cold = measure_cold_excess(threads, shapes)
        return HostOverhead(dispatch, bandwidth, 0.0, threads,
                            f"measured {date.today().isoformat()} at load average {watch.peak():.1f}: executor over "
                            f"a {kernels}-kernel tiny decode step against its profile; one-row bf16 GEMMs cycling "
                            f"{_WEIGHT_SET_BYTES >> 20} MiB of weights of {len(shapes or _WEIGHT_SHAPES)} shapes; "
                            f"GEMMs of {', '.join(map(str, COLD_ROWS))} rows over them cold against warm",
                            tuple((o, i, bw) for (o, i), bw in sorted(rates.items())), cold_excess=cold)

    return cached_or_measured(figures_path("overhead", threads, key, cache_dir), key, read_cached, write_cached,
                              measure, f"the executor's dispatch and weight reads on this CPU at {threads} "
                              "thread(s)", log)
