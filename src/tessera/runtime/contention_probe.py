"""Measuring how much two CPU workers on this host slow each other (:class:`~tessera.cost.contention.
HostContention`): two processes, each pinned to a core of its own at the workers' threads, each holding a
decode step and a prefill step of the model as a worker runs them (the executor over the step's program). One
times a step alone, then while the other runs a step in a loop beside it, back to back; the ratio of the two
medians is one sample. Samples alternate which process is timed and whether alone or beside comes first, over
several rounds, and the factor is their median. A step is timed by its thread's CPU seconds: what the shared
cache and memory bandwidth cost it, while the time other processes on the host take its core away (load from
other work, which a served run may or may not have) stays out; the wall-clock ratios are kept beside them.
Cached per host, threads, model, shapes and a digest of the timed code.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from tessera.cost.contention import KINDS, HostContention, read_cached, write_cached
from tessera.errors import TesseraError
from tessera.runtime.host_figures import LoadWatch, cached_or_measured, figures_path
from tessera.runtime.host_figures import code_digest as digest_of

_PROBE_VERSION = 1
_START_TIMEOUT_S = 600.0  # loading and tracing a model's two steps in each process


class ContentionProbeError(TesseraError, ValueError):
    """A contention probe that cannot run as asked (bad counts or shapes, fewer than two cores, a lost process)."""


@dataclass(frozen=True)
class ProbeShapes:
    """The steps the probe runs: decode at ``decode_rows`` rows (a cache of ``ctx`` positions, ``slots`` rows),
    prefill of one prompt of ``prompt`` tokens."""

    decode_rows: int = 4
    prompt: int = 64
    ctx: int = 128
    slots: int = 8

    def __post_init__(self) -> None:
        for name in ("decode_rows", "prompt", "ctx", "slots"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ContentionProbeError(f"probe shape {name} must be a whole number >= 1, got {v!r}")
        if self.decode_rows > self.slots:
            raise ContentionProbeError(f"probe decode_rows {self.decode_rows} exceeds its slots {self.slots}")
        if self.prompt > self.ctx:
            raise ContentionProbeError(f"probe prompt {self.prompt} exceeds its cache of {self.ctx} positions")


def _check(threads: int, rounds: int, passes: int) -> None:
    from tessera.limits import THREADS

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ContentionProbeError(f"threads must be a whole number >= 1, got {threads!r}")
    THREADS.check(threads, "threads")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ContentionProbeError(f"rounds must be a whole number >= 1, got {rounds!r}")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 3:
        raise ContentionProbeError(f"passes must be a whole number >= 3 (a median of timed passes), got {passes!r}")


def probe_cores(threads: int) -> tuple[frozenset[int], frozenset[int]]:
    """Two disjoint sets of ``threads`` cores this process may run on (the first of its allowed cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 * threads:
        raise ContentionProbeError(f"two workers of {threads} thread(s) need {2 * threads} cores; this process may "
                                   f"use {len(cores)} ({', '.join(map(str, cores))})")
    return frozenset(cores[:threads]), frozenset(cores[threads:2 * threads])


class _Step:
    """A step run as a worker runs it: the executor over its single-device program (`Executor.run`)."""

    def __init__(self, step):
        import torch

        from tessera.capture.trace import trace
        from tessera.program.program import single_device_program
        from tessera.runtime.executor import Executor
        from tessera.weights import unique_state

        graph = trace(step)
        weights, _ = unique_state(step.modules)
        self.executor = Executor(graph, single_device_program(graph, "cpu"), weights, torch.device("cpu"))
        self.inputs = step.inputs
        self.state = {n: t.clone() for n, t in step.state.items()}

    def run(self) -> tuple[float, float]:
        """One step: its wall seconds and its thread's CPU seconds."""

        t0, c0 = time.perf_counter(), time.thread_time()
        self.executor.run(self.inputs, self.state)
        self.executor.release()
        return time.perf_counter() - t0, time.thread_time() - c0


def _build_steps(model: str, shapes: ProbeShapes) -> dict[str, _Step]:
    """The decode and prefill steps of ``model`` (real weights where Tessera has them; ``tiny:FAMILY``: the
    family's two-layer test config) on the CPU."""
    from tessera.capture.phases import StepShape, step_for

    decode = StepShape(batch=shapes.decode_rows, seq=1, ctx=shapes.ctx, slots=shapes.slots)
    prefill = StepShape(batch=1, seq=shapes.prompt, ctx=shapes.ctx)
    if model.startswith("tiny:"):
        from tessera.capture.build import instantiate
        from tessera.capture.models import resolve_model
        from tessera.capture.phases import build_model
        from tessera.capture.tiny import tiny_config

        family = model.split(":", 1)[1]
        module, values = instantiate(lambda: build_model(family, tiny_config(family)), "cpu")
        spec = resolve_model("smollm2-135m")
        return {"decode": _Step(step_for(spec, module, values, "decode", decode, device="cpu")),
                "prefill": _Step(step_for(spec, module, values, "prefill", prefill, device="cpu"))}
    from tessera.runtime.profiler import build_profile_step

    return {"decode": _Step(build_profile_step(model, "decode", batch=decode.batch, ctx=shapes.ctx,
                                               slots=shapes.slots)),
            "prefill": _Step(build_profile_step(model, "prefill", batch=1, seq=shapes.prompt, ctx=shapes.ctx))}


def _probe_worker(cores: frozenset[int] | None, threads: int, model: str, shapes: ProbeShapes, conn) -> None:
    """One probe process: pinned to ``cores`` (None: where the OS puts it), it builds the steps, then times or
    loops them as told."""
    try:
        import torch

        if cores is not None:
            os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
        steps = _build_steps(model, shapes)
        for s in steps.values():  # warm: first calls allocate
            s.run()
            s.run()
        conn.send(("ready", None))
        while True:
            cmd = conn.recv()
            if cmd[0] == "time":
                conn.send(("times", [steps[cmd[1]].run() for _ in range(cmd[2])]))
            elif cmd[0] == "loop":
                conn.send(("looping", None))
                count = 0
                while not conn.poll():
                    steps[cmd[1]].run()
                    count += 1
                conn.recv()
                conn.send(("stopped", count))
            else:
                return
    except Exception as e:  # the parent reports it with the process's own words
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _reply(conn, expect: str, timeout_s: float = 120.0):
    if not conn.poll(timeout_s):
        raise ContentionProbeError(f"a contention probe process did not answer within {timeout_s:.0f} s")
    try:
        kind, value = conn.recv()
    except EOFError:
        raise ContentionProbeError("a contention probe process ended before it answered (killed, or out of "
                                   "memory)") from None
    if kind == "error":
        raise ContentionProbeError(f"a contention probe process failed: {value}")
    if kind != expect:
        raise ContentionProbeError(f"a contention probe process answered {kind!r}, expected {expect!r}")
    return value


def measure_contention(model: str, threads: int = 1, shapes: ProbeShapes | None = None, rounds: int = 3,
                       passes: int = 5, log: Callable[[str], None] = lambda s: None,
                       pin: bool = True) -> tuple[HostContention, dict[str, dict[str, list[float]]]]:
    """This host's contention factors for ``model``'s steps at ``threads`` threads per worker (``pin``: each
    process pinned to cores of its own, else placed by the OS as Tessera's workers are), and the samples
    (``{"cpu" | "wall": {"kind beside neighbour": [ratios]}}``): the factors are the medians of the CPU-time
    samples. Per round and per process timed, each kind's step is timed ``passes`` times alone and ``passes``
    times beside each kind of neighbour step (in alternating order); a sample is the ratio of the two
    medians, and a factor below 1 counts as 1."""
    import multiprocessing as mp

    _check(threads, rounds, passes)
    shapes = shapes or ProbeShapes()
    cores = probe_cores(threads)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for c in cores:
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_probe_worker, args=(c if pin else None, threads, model, shapes, theirs), daemon=True,
                            name="tessera-contention-probe")
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(mine)
        for conn in conns:
            _reply(conn, "ready", _START_TIMEOUT_S)
        wall: dict[str, list[float]] = {f"{a} beside {b}": [] for a in KINDS for b in KINDS}
        cpu: dict[str, list[float]] = {f"{a} beside {b}": [] for a in KINDS for b in KINDS}
        for r in range(rounds):
            for me in (0, 1):
                victim, other = conns[me], conns[1 - me]
                for kind in KINDS:
                    def timed(_v=victim, _k=kind):
                        _v.send(("time", _k, passes))
                        runs = _reply(_v, "times")
                        return statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)

                    for i, neighbour in enumerate(KINDS):
                        beside_first = (r + me + i) % 2 == 1
                        alone = None if beside_first else timed()
                        other.send(("loop", neighbour))
                        _reply(other, "looping")
                        with_neighbour = timed()
                        other.send(("stop",))
                        _reply(other, "stopped")
                        if alone is None:
                            alone = timed()
                        wall[f"{kind} beside {neighbour}"].append(with_neighbour[0] / alone[0])
                        cpu[f"{kind} beside {neighbour}"].append(with_neighbour[1] / alone[1])
            log(f"contention probe round {r + 1}/{rounds}: " + ", ".join(
                f"{k} x{statistics.median(v):.2f} (wall x{statistics.median(wall[k]):.2f})" for k, v in cpu.items()))
        for conn in conns:
            conn.send(("quit",))
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in conns:
            conn.close()
    factors = tuple((a, b, max(1.0, statistics.median(cpu[f"{a} beside {b}"]))) for a in KINDS for b in KINDS)
    return HostContention(factors, threads), {"cpu": cpu, "wall": wall}


_TIMED_SOURCES = ("runtime/executor.py", "runtime/contention_probe.py", "kernels")


def code_digest() -> str:
    """A digest of the sources whose speed the figures are of (``_TIMED_SOURCES``)."""
    return digest_of(_TIMED_SOURCES)


def contention_key(model: str, threads: int, shapes: ProbeShapes) -> dict[str, Any]:
    """What cached figures must match to be used: the probe's version, this CPU, its cores, the threads, torch,
    the model, the shapes and the timed code's digest."""
    import platform

    import torch

    from tessera.hardware.host import cpu_model, host_cores

    return {"version": _PROBE_VERSION, "cpu": cpu_model(), "machine": platform.machine(), "cores": host_cores(),
            "threads": threads, "torch": torch.__version__, "model": model,
            "shapes": [shapes.decode_rows, shapes.prompt, shapes.ctx, shapes.slots], "code": code_digest()}


def host_contention(model: str, threads: int = 1, shapes: ProbeShapes | None = None,
                    log: Callable[[str], None] = lambda s: None, cache_dir: Path | None = None,
                    rounds: int = 3, passes: int = 5) -> HostContention:
    """This host's :class:`HostContention` for ``model`` at ``threads`` threads per worker: measured on first
    use (tens of seconds) and cached under ``<cache>/host/contention-*.json``; figures measured while the host
    was busy (a load average at or above its cores) are used until a use on a quiet host measures them again."""
    shapes = shapes or ProbeShapes()
    key = contention_key(model, threads, shapes)

    def measure(watch: LoadWatch) -> HostContention:
        figures, samples = measure_contention(model, threads, shapes, rounds, passes, log)
        walls = ", ".join(f"{k} x{statistics.median(v):.2f}" for k, v in samples["wall"].items())
        return HostContention(figures.factors, threads,
                              f"measured {date.today().isoformat()} at load average {watch.peak():.1f}: {model} "
                              f"decode at {shapes.decode_rows} rows and prefill of {shapes.prompt} tokens, each timed "
                              f"(thread CPU seconds) alone and beside the other process's step, {rounds} rounds x 2 "
                              f"processes, median of {2 * rounds} samples; wall-clock medians {walls}")

    return cached_or_measured(figures_path("contention", threads, key, cache_dir), key, read_cached, write_cached,
                              measure, f"how two CPU workers slow each other at {threads} thread(s) each", log)
