"""The serving engine: a request queue, continuous batching by the shared Scheduler, KV slots, sampling,
and the online monitor's plan switches, on a step backend (the disaggregated runtime's workers, or the
single-process reference).

One engine thread runs the steps, on its lanes (`tessera.serve.lanes`): steps on disjoint workers (under
prefill-decode, a prefill and a decode) are in flight at once, steps sharing a worker take turns. Before
starting steps it admits new requests, drops
cancelled ones (freeing their slots) and, when a monitor window is over, lets the monitor pick the
objective whose step plans the next steps use: the latency plans serve the low-load bucket (at most
``latency_rows`` requests in flight, the rest wait), the throughput plans every slot. A prefill step writes
the prompts but their last tokens of the requests it holds into their KV slots, one row each (batched
prompts: the requests ready for a prefill and the waiting ones admitted into free slots, up to every slot
and ``max_context`` tokens a step, see `serving_scheduler`; prompts padded to the longest one's bucket, rows
to a rows bucket by repeating the last request); decode steps run every ready request as one row
each, at its own position and slot (rows padded to a bucket by repeating the last request); the step's sampler
kernel picks each row's next token with the request's own temperature, top-p and per-token seed. Tokens are detokenised incrementally; stop strings
are held back until they cannot start a stop any more. Events go to each request's callback (called on
the engine thread): ``("token", text)``, then ``("done", finish_reason)`` or ``("error", message)`` (a
``ServerFault`` message when the server, not the request, is at fault).

No one request can stop the engine: a step that fails fails the requests it ran (the backend is reset) and
the others go on. A lost worker is re-planned by the backend onto the survivors, which replays the steps of
the requests in flight (the engine forgets finished requests, so that replay stays bounded), while
``status`` says ``recovering``; when the backend cannot go on (``BackendLost``) every request gets an
error, ``error`` is set and ``on_fatal`` is called so the server can exit for its supervisor to restart
it. ``close_admission`` and ``abort`` let a server drain on shutdown.
"""

from __future__ import annotations

import bisect
import dataclasses
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.errors import TesseraError
from tessera.runtime.generate import Sampling, sampling_inputs
from tessera.sched.monitor import Monitor
from tessera.sched.scheduler import Buckets, Request, ScheduledStep, Scheduler, stages_for
from tessera.serve.backend import BackendLost, ObjectivePlacements, StepBackend, phase_name, prefill_name
from tessera.serve.detokenize import IncrementalDetokenizer
from tessera.serve.lanes import Lane, LaneRunner, lanes_of

EventSink = Callable[[str, Any], None]


class RequestError(TesseraError, ValueError):
    """A request the engine cannot serve (empty or too long a prompt, bad sampling options)."""


class EngineUnavailable(TesseraError):
    """The engine takes no new requests (it is draining for shutdown, or it has failed)."""


class EngineBusy(TesseraError):
    """The engine's queue is full: the request is refused now, to be retried (HTTP 429)."""


class ServerFault(str):
    """The message of a request that failed through no fault of its own (a failed step, a lost backend, a
    shutdown): the server's error, not the client's."""


class QueueTimeout(ServerFault):
    """The message of a request that waited longer than the queue's deadline for a slot (HTTP 503)."""


@dataclass(frozen=True)
class GenerationParams:
    """How one request generates: at most ``max_tokens`` tokens, greedy unless ``temperature`` > 0,
    nucleus ``top_p``, a ``seed`` for sampling, and ``stop`` strings that end it."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(eq=False)
class Generation:
    """One request being served."""

    id: str
    prompt_ids: list[int]
    params: GenerationParams
    sink: EventSink
    sched: Request
    sampling: Sampling
    detok: IncrementalDetokenizer
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # detokenised so far (cut at a stop string)
    cut: bool = False  # the text ends at a stop string: nothing more joins it
    sent: int = 0  # characters of text already emitted
    finish_reason: str | None = None
    cancelled: bool = False
    route: int = 0  # the engine route it takes (its index in Engine.routes)


TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RESTORE_RETRY_S = 10.0  # a lost worker that could not be started again is tried again after this long


@dataclass
class Histogram:
    """Observations counted into buckets (``counts[i]``: at most ``bounds[i]`` and above the bound before;
    the last count: above every bound), with their sum: constant memory however long the server runs."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class EngineStats:
    """Counters for /metrics."""

    tokens: int = 0
    completed: int = 0
    steps: int = 0
    prefill_steps: int = 0
    prefilled: int = 0  # requests whose prompts ran in those prefill steps (several a step: batched prompts)
    failed: int = 0  # requests ended by a server-side failure (failed step, lost backend, shutdown)
    failed_steps: int = 0
    recoveries: int = 0  # lost workers re-planned onto the survivors
    restores: int = 0  # lost workers started again and re-planned back onto (--on-failure respawn)
    refused: int = 0  # requests refused with 429: the queue was full (--max-queue)
    expired: int = 0  # requests failed with 503: no slot within the queue's deadline (--queue-timeout)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))  # seconds to a request's first token
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))  # seconds per later token, per request
    step_s: dict[str, float] = field(default_factory=dict)  # seconds in steps, per objective
    tokens_by: dict[str, int] = field(default_factory=dict)  # tokens generated, per objective


@dataclass(frozen=True)
class RouteSpec:
    """One route of an engine: its name, its rows of the KV cache (``slots``), its shape buckets and the share
    of the requests it takes."""

    name: str
    slots: int
    buckets: Buckets
    share: float = 1.0
    latency_s: float | None = None  # its planned request latency (None: not known)


@dataclass
class EngineRoute:
    """A route the engine serves (see `Engine`): its own scheduler over its rows of the KV cache (cache row
    ``offset + slot``), and the prefix of its bucket phases in the placements (``r1/decode@4``; none for an
    engine of one route)."""

    spec: RouteSpec
    scheduler: Scheduler
    offset: int
    prefix: str


def route_prefix(index: int, routes: int) -> str:
    """The prefix of route ``index``'s bucket phases: none for an engine of one route, else ``r{index}/``."""
    return "" if routes == 1 else f"r{index}/"


def serving_scheduler(slots: int, buckets: Buckets, max_context: int) -> Scheduler:
    """The engine's scheduler: ``slots`` requests in flight; batched prompts of up to every slot and at most
    ``max_context`` tokens a prefill step (rows bucket x prompt bucket: the longest prompt fits alone)."""
    return Scheduler(stages_for("llm"), slots, buckets, max_context, prompt_rows=slots, prompt_tokens=max_context)


class Engine:
    """Continuous batching over a step backend (see the module docstring).

    With ``routes`` (a plan's routes: a route mix, request-dist's replicas) the engine serves several engines
    on one backend and one KV cache: each route has its own scheduler over its own rows (in route order), its
    bucket phases prefixed ``r{i}/`` in the placements, and its own lanes; requests are dealt to the routes as
    the router deals them (``shares``: auto, throughput or latency, see `tessera.serve.dealing`), and the steps
    of routes whose lanes share a worker take whole turns (see `tessera.serve.lanes`)."""

    def __init__(self, backend: StepBackend, placements: ObjectivePlacements, tokenizer, slots: int,
                 buckets: Buckets, max_context: int, monitor: Monitor | None = None,
                 log: Callable[[str], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                 latency_rows: int | None = None, max_queued: int | None = None,
                 queue_timeout_s: float | None = None, respawn: bool = False,
                 routes: list[RouteSpec] | None = None, shares: str = "auto", share_cooldown_s: float = 1.0):
        from tessera.serve.dealing import DealtRoute, RouteDealer

        self.backend = backend
        self.placements = placements
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        specs = routes or [RouteSpec("", slots, buckets)]
        if sum(r.slots for r in specs) != slots:
            raise ValueError(f"the routes' slots {[r.slots for r in specs]} do not add up to the engine's {slots}")
        self.routes: list[EngineRoute] = []
        for i, spec in enumerate(specs):
            self.routes.append(EngineRoute(spec, serving_scheduler(spec.slots, spec.buckets, max_context),
                                           sum(r.slots for r in specs[:i]), route_prefix(i, len(specs))))
        self.scheduler = self.routes[0].scheduler  # an engine of one route: its scheduler
        self.slots = slots
        self.dealer = RouteDealer([DealtRoute(r.share, r.latency_s, r.slots) for r in specs], shares,
                                  share_cooldown_s, clock)
        self.max_context = max_context
        # the latency plan serves the low-load bucket: at most this many requests in flight while it is active
        self.rows = {"latency": min(slots, latency_rows or slots), "throughput": slots}
        self.monitor = monitor or Monitor(enabled=False)
        self.max_queued = max_queued  # requests waiting for a slot beyond which submit refuses (None: no bound)
        self.queue_timeout_s = queue_timeout_s  # how long a request may wait for its first slot (None: forever)
        self.respawn = respawn  # start lost workers again and re-plan back onto all of them, between steps
        self._restore_at = 0.0  # the next try (a failed one waits RESTORE_RETRY_S)
        self.log = log or (lambda text: print(text, file=sys.stderr))
        self.clock = clock
        self.stats = EngineStats()
        self._incoming: queue.Queue[Generation] = queue.Queue()
        self._by_request: dict[int, Generation] = {}
        self._finished_in_window: list[Request] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._count = 0
        self.error: BaseException | None = None  # what stopped the engine for good (the backend is lost)
        self.status = "ready"  # ready | recovering | degraded | draining | failed | stopped
        self.degraded = ""  # what the engine lost, while it serves on fewer workers than it started with
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._admitting = True
        self._abort: str | None = None  # end every request with this message (shutdown after draining)
        watch = getattr(backend, "watch", None)
        if watch is not None:
            watch(self._backend_event)
        self._lanes: dict[str, list[Lane]] = {}
        self.lanes = LaneRunner(self._current_lanes, self._next_step, self._start_step, self._end_step,
                                lambda handles, timeout_s: self.backend.wait(handles, timeout_s),
                                frozenset(r.prefix + s.phase for r in self.routes for s in r.scheduler.stages
                                          if s.batched))

    def _current_lanes(self) -> list[Lane]:
        objective = self.monitor.objective
        if objective not in self._lanes:
            self._lanes[objective] = lanes_of(self.placements, objective)
        return self._lanes[objective]

    def _next_step(self, now: float, phases: set[str]) -> ScheduledStep | None:
        """The next step among a lane's ``phases`` (a lane's phases are one route's)."""
        for route in self.routes:
            mine = {p[len(route.prefix):] for p in phases if p.startswith(route.prefix) and "/" not in
                    p[len(route.prefix):]}
            if mine:
                return route.scheduler.next_step(now, mine, max_rows=self.rows[self.monitor.objective])
        return None

    def _route_of(self, gen: Generation) -> EngineRoute:
        return self.routes[gen.route]

    def _deal(self) -> int:
        """The route the next request takes (one route: that one), by the requests queued and in flight."""
        if len(self.routes) == 1:
            return 0
        queued, running = self.queue_depth()
        return self.dealer.pick(queued + running)

    def _backend_event(self, kind: str, detail: str) -> None:
        """The backend lost a worker ("recovering") or finished re-planning onto the survivors ("recovered")."""
        if kind == "recovering":
            self.status = "recovering"
            self.log(f"worker lost while serving, recovering: {detail}")
        else:
            self.stats.recoveries += 1
            self.status = "draining" if not self._admitting else "degraded"  # on fewer workers than it started with
            self.degraded = detail
            self.log(f"recovered: {detail}")

    # -------------------------------------------------------------------------------------------------
    def start(self) -> Engine:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the engine thread (requests still queued get an error) and close the backend."""
        if self.error is None:
            self.status = "stopped"
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.backend.close()

    def close_admission(self) -> None:
        """Take no new requests (submit raises EngineUnavailable); those admitted go on."""
        self._admitting = False
        if self.status in ("ready", "degraded"):
            self.status = "draining"

    def abort(self, message: str) -> None:
        """End every request queued or in flight with ``message`` (a ServerFault) before the next step."""
        self._abort = message
        self._wake.set()

    def idle(self) -> bool:
        """Whether no request is queued or in flight."""
        return self._incoming.empty() and not self._by_request and not any(r.scheduler.waiting for r in self.routes)

    @property
    def running(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, prompt_ids: list[int], params: GenerationParams, sink: EventSink) -> Generation:
        """Queue a request; errors in it raise RequestError at once, EngineUnavailable when the engine takes no
        requests."""
        if self.error is not None or not self._admitting or self._stop.is_set():
            raise EngineUnavailable("the server is shutting down" if self.error is None else
                                    "the engine has failed; the server is exiting for its supervisor to restart it")
        queued, running = self.queue_depth()
        waiting = queued - max(0, self.slots - running)  # those a free slot will not take at once
        if self.max_queued is not None and waiting >= self.max_queued:
            self.stats.refused += 1
            raise EngineBusy(f"{waiting} requests already wait for one of the {self.slots} slots, the "
                             f"queue's limit (--max-queue {self.max_queued}); retry shortly")
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if params.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1 (got {params.max_tokens})")
        vocab = len(self.tokenizer)
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if params.seed is not None and not -(2**63) <= params.seed < 2**64:
            raise RequestError(f"seed must fit in 64 bits (got {params.seed})")
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                               f"longer than the context of {self.max_context} tokens")
        try:
            sampling = Sampling(params.temperature, params.top_p, params.seed if params.seed is not None else 0)
        except TesseraError as e:
            raise RequestError(str(e).replace("--", "")) from None
        with self._lock:
            self._count += 1
            rid = f"req-{self._count}"
        req = Request(rid, self.clock(), len(prompt_ids), params.max_tokens)
        with self._lock:
            route = self._deal()
        gen = Generation(rid, list(prompt_ids), params, sink, req, sampling,
                         IncrementalDetokenizer(self.tokenizer), route=route)
        self._incoming.put(gen)
        self._wake.set()
        return gen

    def cancel(self, gen: Generation) -> None:
        """Stop a request (its client went away): its slot is freed before the next step."""
        gen.cancelled = True
        self._wake.set()

    @property
    def objective(self) -> str:
        return self.monitor.objective

    def queue_depth(self) -> tuple[int, int]:
        """(queued, in flight) requests."""
        return (sum(len(r.scheduler.waiting) for r in self.routes) + self._incoming.qsize(),
                sum(len(r.scheduler.running) for r in self.routes))

    # -------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._admit()
                if self._abort is not None:
                    self._abort_all(self._abort)
                now = self.clock()
                if self.respawn and self.status == "degraded" and now >= self._restore_at:
                    self._restore(now)
                if self.monitor.due(now):
                    self._close_window(now)
                if not self.lanes.turn(now, self.monitor.window_s):  # windows close while a step runs
                    self._wake.wait(timeout=self.monitor.window_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - the backend is gone: tell every request, then the server
            self.error = e
            self.status = "failed"
            self._admitting = False
            self.log(f"engine stopped: {type(e).__name__}: {e}")
            what = "lost its workers" if isinstance(e, BackendLost) else "failed"
            self._abort_all(f"the server {what} and is exiting for its supervisor to restart it")
            if self.on_fatal is not None:
                self.on_fatal(e)
        finally:
            self._abort_all("the server is shutting down")

    def _abort_all(self, message: str) -> None:
        """End every queued and running request with ``message`` as a server fault."""
        now = self.clock()
        while not self._incoming.empty():
            gen = self._incoming.get()
            self.stats.failed += 1
            self._emit(gen, "error", ServerFault(message))
        for gen in list(self._by_request.values()):
            self._fail(gen, message, now)

    def _admit(self) -> None:
        while not self._incoming.empty():
            gen = self._incoming.get()
            if not self._route_of(gen).scheduler.submit(gen.sched):
                self._emit(gen, "error", gen.sched.rejected)
                continue
            self._by_request[id(gen.sched)] = gen
        for gen in [g for g in self._by_request.values() if g.cancelled and not g.sched.in_step]:
            self._finish(gen, "cancelled", self.clock())
        if self.queue_timeout_s is not None:
            self._expire(self.clock())

    def _expire(self, now: float) -> None:
        """Fail the requests that have waited past the queue's deadline without ever getting a slot."""
        for gen in [g for g in self._by_request.values() if g.sched.slot is None and not g.tokens
                    and now - g.sched.arrival_s > self.queue_timeout_s]:
            self.stats.expired += 1
            self._fail(gen, QueueTimeout(f"the request waited {now - gen.sched.arrival_s:.1f} s for a slot, past "
                                         f"the queue's deadline (--queue-timeout {self.queue_timeout_s:g} s): the "
                                         "server is overloaded; retry later"), now)

    def _restore(self, now: float) -> None:
        """Start the lost workers again and re-plan back onto all of them (requests in flight wait)."""
        restore = getattr(self.backend, "restore", None)
        self.status = "recovering"
        detail = restore() if restore is not None else None
        if detail is not None and not detail.startswith("restoring failed"):
            self.status, self.degraded = ("ready" if self._admitting else "draining"), ""
            self.stats.restores += 1
            self.log(f"restored: {detail}")
        else:
            self.status = "degraded" if self._admitting else "draining"
            self._restore_at = now + RESTORE_RETRY_S
            self.log(f"could not restore the lost workers ({detail or 'none came back'}); trying again in "
                     f"{RESTORE_RETRY_S:g} s")

    def _close_window(self, now: float) -> None:
        switch = self.monitor.close_window(now, [q for r in self.routes for q in r.scheduler.waiting],
                                           [q for r in self.routes for q in r.scheduler.running],
                                           self._finished_in_window)
        self._finished_in_window = []
        if switch is not None:
            self.log(f"plan switch: {switch.before} -> {switch.after} (latency / execution = {switch.ratio:.2f}, "
                     f"beta {self.monitor.beta})")

    def _step_route(self, step: ScheduledStep) -> EngineRoute:
        return self._route_of(self._by_request[id(step.requests[0])])

    def _phase(self, step: ScheduledStep) -> str:
        name = prefill_name(step.rows, step.seq) if step.phase == "prefill" else phase_name(step.phase, step.rows)
        return self.placements.phases[self.monitor.objective][self._step_route(step).prefix + name]

    def _inputs(self, step: ScheduledStep) -> dict[str, torch.Tensor]:
        gens = [self._by_request[id(r)] for r in step.requests]
        if step.phase == "prefill":
            # padding rows repeat the last request: the same prompt into the same slot writes the same cache
            rows = gens + [gens[-1]] * (step.rows - len(gens))
            ids = [g.prompt_ids[:-1] + [self.pad] * (step.seq - len(g.prompt_ids) + 1) for g in rows]
            return {"input_ids": torch.tensor(ids), "slots": torch.tensor([self._row(g) for g in rows]),
                    **sampling_inputs([Sampling().inputs(0)] * step.rows)}  # prefill's tokens are not used
        tokens, positions, slots, sampling = [], [], [], []
        for gen in gens:
            tokens.append(gen.tokens[-1] if gen.tokens else gen.prompt_ids[-1])
            positions.append(gen.sched.input + gen.sched.generated - 1)
            slots.append(self._row(gen))
            sampling.append(gen.sampling.inputs(len(gen.tokens)))
        # padding rows repeat the last request (its token at its position into its slot: the same cache write, an
        # output nobody reads), so no free slot is needed (the latency cap can leave more requests in flight than
        # rows in its step) and the step's furthest position stays a request's (a CPU's decode attention reads
        # the cache up to it), and the step reads no slot but its requests' (another slot's KV may be on its way
        # from a prefill still running on another lane)
        for _ in range(step.rows - len(gens)):
            tokens.append(tokens[-1])
            positions.append(positions[-1])
            slots.append(slots[-1])
            sampling.append(Sampling().inputs(0))
        return {"input_ids": torch.tensor(tokens)[:, None], "positions": torch.tensor(positions),
                "slots": torch.tensor(slots), **sampling_inputs(sampling)}

    def _row(self, gen: Generation) -> int:
        """The KV-cache row of a request: its slot among its route's rows."""
        return self._route_of(gen).offset + gen.sched.slot

    def _push_to(self, step: ScheduledStep) -> tuple[str, ...]:
        """Where a prefill's KV goes on to at once: the workers of the decode steps (of the largest bucket; all
        buckets of a phase share a placement)."""
        if step.phase != "prefill":
            return ()
        route = self._step_route(step)
        decode = self.placements.phases[self.monitor.objective].get(
            route.prefix + phase_name("decode", route.scheduler.buckets.batch[-1]))
        return (decode,) if decode is not None else ()

    def _start_step(self, step: ScheduledStep) -> tuple[Any, tuple[list[Generation], float]]:
        """Submit ``step`` to the backend; its handle (None: it failed at once, the error in the context) and
        what finishing it needs."""
        gens = [self._by_request[id(r)] for r in step.requests]
        t0 = self.clock()
        try:
            inputs = self._inputs(step)
            handle = self.backend.submit(self._phase(step), inputs, tuple(g.id for g in gens), self._push_to(step))
        except BackendLost:
            raise
        except Exception as e:  # noqa: BLE001 - failed before it started: finished (failed) as any step
            return None, (gens, t0, e)
        return handle, (gens, t0, None)

    def _end_step(self, step: ScheduledStep, handle: Any, context: tuple) -> None:
        """Take a step's result: tokens to its requests, the scheduler advanced (requests that ended while it
        was in flight are left out)."""
        gens, t0, failed = context
        route = self._route_of(gens[0])
        try:
            if failed is not None:
                raise failed
            tokens = self.backend.result(handle)["tokens"].tolist()
        except BackendLost:
            raise
        except Exception as e:  # noqa: BLE001 - this step's requests fail; the others go on
            self._step_failed(step, gens, e)
            return
        t1 = self.clock()
        self.stats.steps += 1
        objective = self.monitor.objective
        self.stats.step_s[objective] = self.stats.step_s.get(objective, 0.0) + t1 - t0
        if step.phase == "decode":
            self.stats.tokens_by[objective] = self.stats.tokens_by.get(objective, 0) + len(step.requests)
        else:
            self.stats.prefill_steps += 1
            self.stats.prefilled += len(step.requests)
        stopped: list[tuple[Generation, str]] = []
        if step.phase == "decode":
            for row, gen in enumerate(gens):
                if gen.finish_reason is not None:  # ended while its step was in flight (an abort)
                    continue
                try:
                    reason = self._take(gen, tokens[row])
                except Exception as e:  # noqa: BLE001 - e.g. a token the detokenizer cannot take: this request fails
                    self.log(f"request {gen.id} failed: {type(e).__name__}: {e}")
                    self._fail(gen, f"the server failed on this request ({type(e).__name__})", t1)
                    continue
                if reason is not None:
                    stopped.append((gen, reason))
        ended = {id(gen): reason for gen, reason in stopped}
        for req in step.requests:
            req.in_step = req.in_step and id(req) in self._by_request
        live = [r for r in step.requests if id(r) in self._by_request]
        for req in route.scheduler.complete(dataclasses.replace(step, requests=live), t0, t1):  # reached max_tokens (or EOS on the last one)
            gen = self._by_request.get(id(req))
            if gen is not None and gen.finish_reason is None:
                self._done(gen, ended.get(id(gen), "length"), t1)
        for gen, reason in stopped:
            if gen.finish_reason is None:
                self._finish(gen, reason, t1)

    def _step_failed(self, step: ScheduledStep, gens: list[Generation], error: Exception) -> None:
        """A step failed: its requests fail with a server error, the backend is reset for the others."""
        self.stats.failed_steps += 1
        self.log(f"a {step.phase} step of {len(gens)} request(s) failed: {type(error).__name__}: {error}")
        now = self.clock()
        for gen in gens:
            self._fail(gen, f"the {step.phase} step serving this request failed ({type(error).__name__}); "
                            "other requests go on", now)
        self.backend.reset()

    def _fail(self, gen: Generation, message: str, now: float) -> None:
        """End a request with a server-side error."""
        if gen.finish_reason is not None:
            return
        gen.finish_reason = "error"
        self.stats.failed += 1
        if gen.sched.finish_s is None:
            self._route_of(gen).scheduler.finish(gen.sched, now)
        self._forget(gen)
        self._emit(gen, "error", message if isinstance(message, ServerFault) else ServerFault(message))

    def _forget(self, gen: Generation) -> None:
        self._by_request.pop(id(gen.sched), None)
        self._finished_in_window.append(gen.sched)
        self.backend.forget([gen.id])

    def _take(self, gen: Generation, token: int) -> str | None:
        """Account a new token; returns "stop" when it ends the request (EOS or a stop string)."""
        now = self.clock()
        if not gen.tokens:
            self.stats.ttft.observe(now - gen.sched.arrival_s)
        self.stats.tokens += 1
        gen.tokens.append(token)
        if token == self.eos:  # the text ends before it
            self._complete_text(gen)
            self._flush(gen, final=True)
            return "stop"
        new = gen.detok.add(token)
        gen.text = gen.detok.text
        for stop in gen.params.stop:  # a stop can only end in the new text
            at = gen.text.find(stop, max(0, len(gen.text) - len(new) - len(stop) + 1))
            if at >= 0:
                gen.text, gen.cut = gen.text[:at], True
                self._flush(gen, final=True)
                return "stop"
        self._flush(gen, final=False)
        return None

    def _complete_text(self, gen: Generation) -> None:
        """The text of every token, including those that end inside a character (unless cut at a stop)."""
        if not gen.cut:
            gen.detok.finish()
            gen.text = gen.detok.text

    def _flush(self, gen: Generation, final: bool) -> None:
        """Emit the text not sent yet, holding back a tail that could still become a stop string (or half a
        character)."""
        hold = 0 if final else max((len(s) - 1 for s in gen.params.stop), default=0)
        end = len(gen.text) - hold
        if not final and gen.text.endswith("\ufffd"):
            end = min(end, len(gen.text) - 1)
        if end > gen.sent:
            self._emit(gen, "token", gen.text[gen.sent:end])
            gen.sent = end

    def _finish(self, gen: Generation, reason: str, now: float) -> None:
        self._route_of(gen).scheduler.finish(gen.sched, now)
        self._done(gen, reason, now)

    def _done(self, gen: Generation, reason: str, now: float) -> None:
        gen.finish_reason = reason
        self._forget(gen)
        if reason != "cancelled":
            self._complete_text(gen)
            self._flush(gen, final=True)
            self.stats.completed += 1
            first = gen.sched.first_output_s
            if first is not None and len(gen.tokens) > 1:
                self.stats.tpot.observe((now - first) / (len(gen.tokens) - 1))
        self._emit(gen, "done", reason)

    def _emit(self, gen: Generation, kind: str, payload: Any) -> None:
        try:
            gen.sink(kind, payload)
        except Exception as e:  # a broken client must not take the engine down
            self.log(f"request {gen.id}: dropping its events ({type(e).__name__}: {e})")
            gen.cancelled = True
