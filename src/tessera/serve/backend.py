"""What the serving engine runs steps on: a model's graphs at its static shape buckets, executed by local
worker processes under a deployment's placements (the disaggregated runtime), or replayed in this
process (the single-process reference).

Phases are named ``prefill@S`` (one request, a prompt bucket of S tokens), ``prefill@RxS`` (a prompt bucket
of R rows of S tokens: batched prompts) and ``decode@B`` (B rows), with
``:latency`` / ``:throughput`` appended when the two objectives' step plans place kernels differently.
Every graph shares one KV cache of ``slots`` rows and ``ctx`` positions; a bucket's graph has the same
kernels as the graph its step plan was solved for, so the plan's placement applies to every bucket.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph

OBJECTIVES = ("latency", "throughput")


class ServeSetupError(TesseraError):
    """A serving deployment that cannot be set up (model, buckets, plan)."""


def phase_name(phase: str, size: int, objective: str | None = None) -> str:
    """The runtime phase of a bucket: ``decode@8`` or ``decode@8:latency``."""
    return f"{phase}@{size}" + (f":{objective}" if objective else "")


def prefill_name(rows: int, seq: int) -> str:
    """The bucket phase of a prefill step of ``rows`` rows of ``seq`` tokens: ``prefill@64`` or ``prefill@4x64``."""
    return phase_name("prefill", seq) if rows == 1 else f"prefill@{rows}x{seq}"


def bucket_graphs(model: str, slots: int, ctx: int, prompts: list[tuple[int, int]],
                  rows: tuple[int, ...], log: Callable[[str], None] = lambda s: None) -> dict[str, KernelGraph]:
    """The prefill graph of every (rows, prompt) bucket and the decode graph of every row bucket, over one
    cache of ``slots`` rows and ``ctx`` positions (traced on meta)."""
    from tessera.capture.api import trace_model

    graphs = {}
    for r, s in prompts:
        name = prefill_name(r, s)
        log(f"tracing {model} {name}")
        graphs[name] = trace_model(model, "prefill", batch=r, seq=s, ctx=ctx, slots=slots if slots != r else None)
    for b in rows:
        log(f"tracing {model} decode@{b}")
        graphs[phase_name("decode", b)] = trace_model(model, "decode", batch=b, ctx=ctx,
                                                       slots=slots if slots != b else None)
    return graphs


@dataclass
class ObjectivePlacements:
    """Per objective, each bucket phase's kernel -> worker, and the runtime phase that runs it."""

    placements: dict[str, list[int]]  # runtime phase -> kernel -> worker
    phases: dict[str, dict[str, str]]  # objective -> bucket phase -> runtime phase
    differ: bool  # whether the two objectives place any bucket differently


def objective_placements(graphs: dict[str, KernelGraph], assignments: dict[str, dict[str, list[int]]]
                         ) -> ObjectivePlacements:
    """Apply each objective's per-phase assignment (``assignments[objective]["prefill" | "decode"]``) to every
    bucket graph of that phase; bucket phases whose placements agree share one runtime phase."""
    placements: dict[str, list[int]] = {}
    phases: dict[str, dict[str, str]] = {o: {} for o in assignments}
    differ = False
    for name, graph in graphs.items():
        base = name.split("@")[0]
        chosen = {}
        for objective, by_phase in assignments.items():
            a = by_phase.get(base)
            if a is None:
                raise ServeSetupError(f"the {objective} plan has no {base} step")
            if len(a) != len(graph.kernels):
                raise ServeSetupError(f"the {objective} plan places {len(a)} kernels of {base}, but bucket {name} "
                                      f"has {len(graph.kernels)}: plan for this model's serving shapes")
            chosen[objective] = list(a)
        distinct = {tuple(a) for a in chosen.values()}
        if len(distinct) == 1:
            placements[name] = next(iter(chosen.values()))
            for objective in chosen:
                phases[objective][name] = name
        else:
            differ = True
            for objective, a in chosen.items():
                placements[f"{name}:{objective}"] = a
                phases[objective][name] = f"{name}:{objective}"
    return ObjectivePlacements(placements, phases, differ)


def bucket_of(runtime_phase: str) -> str:
    """The bucket graph a runtime phase runs: ``decode@8:latency`` or ``decode@8#1`` -> ``decode@8``."""
    return runtime_phase.split(":")[0].split("#")[0]


def route_placements(graphs: dict[str, KernelGraph],
                     routes: list[tuple[str, list[str], dict[str, dict[str, list[int]]]]]) -> ObjectivePlacements:
    """The placements of an engine of several routes: for each route (its phase prefix, the bucket graphs it
    serves, and per objective each phase's kernel -> worker) every bucket placed as its phase; bucket phases
    are named with the route's prefix, and a bucket placed alike by several routes or objectives runs as one
    runtime phase (``decode@8``; others ``decode@8#1``, ...).

    Raises:
        ServeSetupError: a phase's placement has another kernel count than the bucket graphs.
    """
    placements: dict[str, list[int]] = {}
    named: dict[tuple[str, tuple[int, ...]], str] = {}
    phases: dict[str, dict[str, str]] = {o: {} for o in OBJECTIVES}
    differ = False
    for prefix, buckets, assignments in routes:
        for name in buckets:
            graph, base = graphs[name], name.split("@")[0]
            chosen = {}
            for objective in OBJECTIVES:
                a = assignments[objective][base]
                if len(a) != len(graph.kernels):
                    raise ServeSetupError(f"the plan places {len(a)} kernels of {base}, but bucket {name} of the "
                                          f"served model has {len(graph.kernels)}: the plan is for another version "
                                          "of the model; plan again")
                key = (name, tuple(a))
                if key not in named:
                    taken = sum(1 for n, _ in named if n == name)
                    named[key] = name if not taken else f"{name}#{taken}"
                    placements[named[key]] = list(a)
                chosen[objective] = named[key]
                phases[objective][prefix + name] = named[key]
            differ = differ or len(set(chosen.values())) > 1
    return ObjectivePlacements(placements, phases, differ)


class BackendLost(TesseraError):
    """The backend cannot run steps any more (its last worker is lost, or a lost worker is not re-planned
    under ``--on-failure fail``): the server must exit so that its supervisor restarts it."""


Watcher = Callable[[str, str], None]  # ("recovering" | "recovered", what happened)


class StepBackend(Protocol):
    """Runs one runtime phase on inputs and returns its outputs: the sampled ``tokens`` [rows] and the
    ``logits`` [rows, 1, vocab] they were sampled from. ``owners`` are the requests whose state the step
    writes; ``forget`` says they are over. A failed step raises; BackendLost when nothing can run any more.
    ``submit`` starts a step and returns a handle at once (``push_to``: phases whose workers get the state
    rows it writes as soon as it is done), ``wait`` gives the handles whose steps are done (waiting at most
    ``timeout_s``, None: until one is), ``result`` a step's outputs (raising as ``run`` does)."""

    def run(self, phase: str, inputs: dict[str, torch.Tensor], owners: tuple[str, ...] = ()
            ) -> dict[str, torch.Tensor]: ...

    def submit(self, phase: str, inputs: dict[str, torch.Tensor], owners: tuple[str, ...] = (),
               push_to: tuple[str, ...] = ()) -> Any: ...

    def wait(self, handles: list, timeout_s: float | None = None) -> list: ...

    def result(self, handle) -> dict[str, torch.Tensor]: ...

    def forget(self, owners: list[str]) -> None: ...

    def reset(self) -> None: ...

    def watch(self, watcher: Watcher) -> None: ...

    def restore(self) -> str | None: ...

    def busy_s(self) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class RanStep:
    """A step a synchronous backend ran when it was submitted: its outputs, or the error it raised."""

    phase: str
    outputs: dict[str, torch.Tensor] | None
    error: Exception | None


class SyncSteps:
    """``submit`` / ``wait`` / ``result`` for a backend whose ``run`` runs a step to its end (one step at a
    time: nothing to overlap)."""

    def submit(self, phase: str, inputs: dict[str, torch.Tensor], owners: tuple[str, ...] = (),
               push_to: tuple[str, ...] = ()) -> RanStep:
        """Run the step now; its outputs (or its error) wait in the handle."""
        try:
            return RanStep(phase, self.run(phase, inputs, owners), None)
        except BackendLost:
            raise
        except Exception as e:  # noqa: BLE001 - raised again by result(), as run() would
            return RanStep(phase, None, e)

    def wait(self, handles: list[RanStep], timeout_s: float | None = None) -> list[RanStep]:
        """Every handle: each step ran when it was submitted."""
        return list(handles)

    def result(self, handle: RanStep) -> dict[str, torch.Tensor]:
        """The step's outputs, or its error raised."""
        if handle.error is not None:
            raise handle.error
        return handle.outputs


class LocalBackend(SyncSteps):
    """Every phase replayed in this process on one device (the single-process reference); with
    ``batch_invariant``, GEMMs row by row (a row's results do not depend on the batch)."""

    def __init__(self, graphs: dict[str, KernelGraph], weight_files: list[str], batch_invariant: bool = False):
        from tessera.runtime.generate import ReplayRunner
        from tessera.weights import load_graph_weights

        weights: dict[str, torch.Tensor] = {}
        for g in graphs.values():
            names = [n for n, b in g.buffers.items() if b.kind == "weight" and n not in weights]
            weights.update(load_graph_weights(g, weight_files, names))
        from tessera.runtime.probe import zero_state

        state: dict[str, torch.Tensor] = {}
        for g in graphs.values():
            state.update(zero_state(g, [n for n in g.state if n not in state]))
        self.runner = ReplayRunner(graphs, weights, state, batch_invariant=batch_invariant)
        self.warm_errors = self.runner.warm()  # phases left cold, and why
        self._busy = 0.0

    def run(self, phase: str, inputs: dict[str, torch.Tensor], owners: tuple[str, ...] = ()
            ) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        out = self.runner(phase.split(":")[0], inputs)
        self._busy += time.perf_counter() - t0
        return out

    def forget(self, owners: list[str]) -> None:
        """Nothing to forget: this process holds the state itself."""

    def reset(self) -> None:
        """Nothing to reset: a failed step leaves no transfers behind."""

    def restore(self) -> str | None:
        """Nothing to restore: no worker can be lost."""
        return None

    def watch(self, watcher: Watcher) -> None:
        """Nothing to watch: no worker can be lost."""

    def busy_s(self) -> dict[str, float]:
        return {"cpu": self._busy}

    def close(self) -> None:
        pass


STEP_LOG = 4096  # steps whose worker timings a WorkerBackend keeps (the latest)


class WorkerBackend:
    """Every phase run by worker processes under its placement (gloo transfers of exact byte ranges); steps
    on disjoint workers in flight at once. ``step_log``: the latest steps' timings (phase, per worker its
    start on the host clock and seconds)."""

    def __init__(self, runner):
        self.runner = runner
        self._busy: dict[str, float] = {}
        self.step_log: deque = deque(maxlen=STEP_LOG)

    def run(self, phase: str, inputs: dict[str, torch.Tensor], owners: tuple[str, ...] = ()
            ) -> dict[str, torch.Tensor]:
        return self.result(self.submit(phase, inputs, owners))

    def submit(self, phase: str, inputs: dict[str, torch.Tensor], owners: tuple[str, ...] = (),
               push_to: tuple[str, ...] = ()):
        """Send the step to its workers; a `tessera.runtime.distributed.StepHandle`."""
        with self._lost():
            return self.runner.submit(phase, inputs, owners=set(owners), push_to=tuple(push_to))

    def wait(self, handles: list, timeout_s: float | None = None) -> list:
        """The handles whose steps are done (at least one, unless ``timeout_s`` passed first)."""
        with self._lost():
            return self.runner.wait(handles, timeout_s)

    def result(self, handle) -> dict[str, torch.Tensor]:
        """The step's outputs (its worker's error raised, BackendLost when the workers are lost)."""
        with self._lost():
            out = self.runner.result(handle)
        for timing in handle.timings:
            self.step_log.append(timing)
            for device, seconds in zip(timing.workers, timing.compute_s, strict=False):
                self._busy[device] = self._busy.get(device, 0.0) + seconds
        return out

    @contextlib.contextmanager
    def _lost(self):
        from tessera.runtime.pool import WorkerLost

        try:
            yield
        except WorkerLost as lost:  # not re-planned (--on-failure fail), or no worker left
            alive = len(self.runner.pool.alive)
            raise BackendLost(f"{lost}; {alive} worker{'s' if alive != 1 else ''} left"
                              + ("" if alive else ", nothing to re-plan onto")) from None

    def forget(self, owners: list[str]) -> None:
        """Steps of finished requests are not replayed after a lost worker."""
        self.runner.forget(owners)

    def reset(self) -> None:
        """Reconnect the workers after a failed step and rebuild their state from the steps still needed."""
        from tessera.runtime.pool import WorkerLost

        try:
            self.runner.rebuild()
        except WorkerLost as lost:
            raise BackendLost(str(lost)) from None

    def watch(self, watcher: Watcher) -> None:
        """Tell ``watcher`` when a lost worker is noticed and when the re-plan onto the survivors is done."""
        self.runner.on_lost = lambda lost: watcher("recovering", str(lost))
        self.runner.on_recovered = lambda r: watcher(
            "recovered", f"lost {r.device} ({r.how}); re-planned onto {', '.join(r.survivors)}, replayed "
                         f"{r.replayed_steps} steps in {r.seconds:.2f} s")

    def restore(self) -> str | None:
        """Start lost workers again and re-plan back onto all of them (the state of requests in flight is
        rebuilt); what happened, or None when no worker came back."""
        from tessera.runtime.pool import WorkerLost

        try:
            back = self.runner.restore()
        except WorkerLost as lost:  # a worker lost while re-planning: the next step re-plans onto the survivors
            return f"restoring failed: {lost}"
        if back is None:
            return None
        return (f"{back.device} started again; re-planned onto {', '.join(back.survivors)}, replayed "
                f"{back.replayed_steps} steps in {back.seconds:.2f} s")

    def busy_s(self) -> dict[str, float]:
        return dict(self._busy)

    def close(self) -> None:
        self.runner.pool.close()

