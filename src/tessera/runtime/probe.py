"""Measuring what the simulator needs to know about a pool of workers: the link between two workers, the
driver's round trip, and kernel times as a step really runs them (alone, and with another worker computing).

These are the inputs of :mod:`tessera.sim.programs` for a local CPU cluster, measured on the real pool with
the runtime's own code paths, so a simulated step can be compared with a measured one
(``benchmarks/bench_sim_fidelity.py``):

- :func:`measure_link`: ping-pong between two workers over their gloo process group, receives posted first
  and messages packed and unpacked as step transfers are; one-way seconds per size, as
  ``latency + bytes / bandwidth`` (a :class:`~tessera.hardware.cluster.Link`).
- :func:`measure_messages`: a worker's own CPU time per message (posting a receive, sending, taking an
  arrived message), which the runtime spends outside kernels and the link
  (:class:`tessera.sim.programs.MessageCosts`).
- :func:`measure_sends`: what a send call costs inside real steps of a message-heavy calibration placement,
  with every other worker waiting and with another one working (on a host with as many cores as workers, the
  second is several times the first: gloo's I/O thread then waits for a core).
- :func:`measure_round_trip`: a command to workers and their replies carrying step-sized outputs through the
  same channel as step outputs (pipe + shared-memory arena), plus the driver's concatenation of
  micro-batch outputs: the fixed cost ``DistributedRunner.step`` adds to a step, and the ``feedback_s`` of
  :func:`tessera.sim.programs.simulate_stream` (a job's outputs back, the next job queued).
- :func:`measure_program_times`: every kernel of a step's device programs timed as the runtime's executor
  runs it inside the step (program order, ``Executor.run_kernel`` with its argument binding, activations
  freed, messages skipped): in a step a weight is read once per micro-batch, after the rest of the segment
  went through the caches, so these times differ from a profile's (:mod:`tessera.runtime.profiler`), which
  repeats each kernel on warm caches. Each device's program runs alone on a worker, then all at once: the
  difference is what workers sharing the host's cores, caches and memory cost each other.
  :func:`measure_kernel_times` does the same for a whole graph on one device.

:class:`tessera.sim.pool_model.PoolModel` runs the simulator with these inputs. The driver's side of each
probe sends the workers commands of :mod:`tessera.runtime.commands`; their side (:func:`ping_pong`,
:func:`message_burst`, :func:`time_program`) runs in :class:`tessera.runtime.worker.Worker`.

Nothing here is cached: each figure is a few seconds of measurement and depends on the machine's load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.hardware.cluster import Link
from tessera.kernels.sample import with_sampling_defaults
from tessera.program.program import Piece
from tessera.runtime.commands import Connect, Echo, MessageTimes, ProbeLink, ProbeMessages, TimeProgram
from tessera.runtime.wire import pack, unpack

LINK_SIZES = (64, 4096, 65536, 1 << 20, 4 << 20)  # bytes per message in the link probe
PROBE_TAG = 1 << 24  # message tags of the probes (step transfers use small tags)


class ProbeError(TesseraError):
    """A probe that cannot run as asked (too few workers, a bad size)."""


# ------------------------------------------------------------------------------------------------------------
# the link between two workers


@dataclass
class LinkProbe:
    """One-way seconds per message size between two workers, and the fitted link."""

    sizes: list[int]
    one_way_s: list[float]  # median over the round trips, halved
    link: Link

    def describe(self) -> str:
        lk = self.link
        each = ", ".join(f"{_size(n)} {t * 1e6:.0f} us" for n, t in zip(self.sizes, self.one_way_s, strict=True))
        return f"{lk.latency_s * 1e6:.0f} us per message + {lk.bandwidth / 1e9:.2f} GB/s ({each})"


def ping_pong(pg, peer: int, sizes: list[int], repeats: int, lead: bool, timeout) -> list[float]:
    """Worker side of :func:`measure_link`: for each size one untimed and ``repeats`` timed round trips with
    rank ``peer`` of ``pg`` (the lead sends first). As in a step, every receive is posted before its message
    is sent and waited for with the transfer timeout, and messages are packed from a buffer and unpacked
    into one (:func:`tessera.runtime.wire.pack` / ``unpack``). Returns the lead's median round trip per
    size (the other side returns zeros)."""
    out = []
    src = {"x": torch.zeros(max(sizes), dtype=torch.uint8).untyped_storage()}
    dst = {"x": torch.zeros(max(sizes), dtype=torch.uint8).untyped_storage()}
    cpu = torch.device("cpu")
    for i, n in enumerate(sizes):
        pieces = (Piece("x", ((0, n),)),)
        tag = PROBE_TAG + i * (repeats + 2)

        def post(r: int, n: int = n, tag: int = tag):
            flat = torch.empty(n, dtype=torch.uint8)
            return pg.recv([flat], peer, tag + r), flat

        times = []
        pending = None if lead else post(0)  # the other side's receive of round 0 is posted up front
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            if lead:
                pending = post(r)  # the reply's receive, before the request goes out
                pg.send([pack(src, pieces)], peer, tag + r).wait(timeout)
                work, flat = pending
                work.wait(timeout)
                unpack(dst, pieces, flat, cpu)
            else:
                work, flat = pending
                work.wait(timeout)
                unpack(dst, pieces, flat, cpu)
                if r < repeats:
                    pending = post(r + 1)  # the next request's receive, before this reply goes out
                pg.send([pack(src, pieces)], peer, tag + r).wait(timeout)
            if r:
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times) if lead else 0.0)
    return out


@dataclass
class MessageProbe:
    """CPU seconds a worker spends per message, outside the wire: posting a receive (a step posts all of its
    receives before its first instruction), sending (packing the bytes and handing them to gloo) and taking a
    message that has arrived (the wait returns, the bytes are unpacked)."""

    nbytes: int
    post_s: float
    send_s: float
    recv_s: float

    def describe(self) -> str:
        return (f"{_size(self.nbytes)} messages: post a receive {self.post_s * 1e6:.0f} us, send "
                f"{self.send_s * 1e6:.0f} us, take an arrived message {self.recv_s * 1e6:.0f} us")


def message_burst(pg, peer: int, count: int, nbytes: int, timeout) -> MessageTimes:
    """Worker side of :func:`measure_messages` (both workers run it at once, as in a step messages flow both
    ways): post ``count`` receives (timed), tell the peer and wait for its word, send ``count`` messages back
    to back (timed, each packed as step transfers are) and one more; once the peer's last message is here,
    the others have arrived: take them all (timed). Seconds per message of each part."""
    storages = {"x": torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()}
    pieces = (Piece("x", ((0, nbytes),)),)
    cpu = torch.device("cpu")
    tag = PROBE_TAG + (1 << 20)
    t0 = time.perf_counter()
    posted = [(pg.recv([flat], peer, tag + i), flat)
              for i, flat in enumerate(torch.empty(nbytes, dtype=torch.uint8) for _ in range(count))]
    post_s = (time.perf_counter() - t0) / count
    last = pg.recv([torch.empty(1, dtype=torch.uint8)], peer, tag + count)
    ready = pg.recv([torch.empty(1, dtype=torch.uint8)], peer, tag + count + 1)
    pg.send([torch.zeros(1, dtype=torch.uint8)], peer, tag + count + 1).wait(timeout)
    ready.wait(timeout)  # the peer has posted its receives too
    t0 = time.perf_counter()
    works = [pg.send([pack(storages, pieces)], peer, tag + i) for i in range(count)]
    send_s = (time.perf_counter() - t0) / count
    works.append(pg.send([torch.zeros(1, dtype=torch.uint8)], peer, tag + count))
    for w in works:
        w.wait(timeout)
    last.wait(timeout)
    t0 = time.perf_counter()
    for work, flat in posted:
        work.wait(timeout)
        unpack(storages, pieces, flat, cpu)
    return MessageTimes(post_s, send_s, (time.perf_counter() - t0) / count)


def measure_messages(pool, a: int = 0, b: int = 1, count: int = 200, nbytes: int = 4096,
                     rounds: int = 5) -> MessageProbe:
    """Per-message CPU costs between pool workers ``a`` and ``b``: ``rounds`` bursts of ``count`` messages of
    ``nbytes`` each way at once (:func:`message_burst`); medians over both workers and the rounds (after
    one untimed round). Forms a new process group."""
    if a == b:
        raise ProbeError("the message probe needs two different workers")
    members = connect(pool)
    ra, rb = members.index(a), members.index(b)
    got: dict[str, list[float]] = {"post_s": [], "send_s": [], "recv_s": []}
    for r in range(rounds + 1):
        replies = pool.call({a: ProbeMessages(rb, count, nbytes), b: ProbeMessages(ra, count, nbytes)}, 120.0)
        for reply in replies.values():
            for k in got:
                if r:
                    got[k].append(getattr(reply, k))
    return MessageProbe(nbytes, *(statistics.median(got[k]) for k in ("post_s", "send_s", "recv_s")))


@dataclass
class SendProbe:
    """Seconds per send call inside real steps, by what the other workers were doing when it began: all of
    them waiting for a message or done (``idle_s``), or one of them working (``busy_s``: in a kernel, a send,
    posting receives). Where workers share a host's cores the second costs more: gloo's I/O thread, which
    the sender waits for, then has to wait for a core itself."""

    idle_s: float
    busy_s: float
    idle_count: int
    busy_count: int

    def describe(self) -> str:
        return (f"a send while the other workers wait {self.idle_s * 1e6:.0f} us ({self.idle_count} sends), "
                f"while another works {self.busy_s * 1e6:.0f} us ({self.busy_count} sends)")


def classify_sends(timelines: list[list[tuple]], started_s: list[float]) -> tuple[list[float], list[float]]:
    """The durations of the send calls in one traced step (``StepTiming.timelines`` / ``started_s`` of
    workers on one host): (those while every other worker waited for a message or was done, the others)."""
    import bisect

    waits, ends = [], []
    for events, t0 in zip(timelines, started_s, strict=True):
        waits.append(sorted((t0 + s, t0 + e) for kind, _, _, s, e in events if kind == "recv"))
        ends.append(t0 + max((e for *_, e in events), default=0.0))

    def working(o: int, t: float) -> bool:
        i = bisect.bisect_right(waits[o], (t, float("inf")))
        return t < ends[o] and not (i and waits[o][i - 1][1] > t)

    idle, busy = [], []
    for w, (events, t0) in enumerate(zip(timelines, started_s, strict=True)):
        for kind, _, _, s, e in events:
            if kind == "send":
                crowded = any(working(o, t0 + s) for o in range(len(timelines)) if o != w)
                (busy if crowded else idle).append(e - s)
    return idle, busy


def measure_sends(runner, phase: str, inputs: list[dict[str, torch.Tensor]]) -> SendProbe:
    """Send costs as the runtime pays them: one traced step of ``runner``'s ``phase`` per entry of ``inputs``,
    every send call classed by :func:`classify_sends`; means over all steps. The runner's workers must share
    this host (their clocks are compared) and its placement must send messages both ways."""
    idle: list[float] = []
    busy: list[float] = []
    for step_inputs in inputs:
        runner.step(phase, step_inputs, trace=True)
        timing = runner.last_timing
        a, b = classify_sends(timing.timelines, timing.started_s)
        idle += a
        busy += b
    if not idle or not busy:
        raise ProbeError(f"the send probe saw {len(idle)} sends while the other workers waited and {len(busy)} "
                         "while one worked; it needs both: use a placement with messages both ways (e.g. random)")
    return SendProbe(statistics.fmean(idle), statistics.fmean(busy), len(idle), len(busy))


def connect(pool) -> list[int]:
    """A fresh process group of the pool's live workers (ranks in worker order, as ``DistributedRunner``
    forms them); returns the members. A runner made afterwards forms its own group again."""
    members = list(pool.alive)
    pool.epoch += 1
    pool.call({w: Connect(pool.epoch, members) for w in members}, 60.0)
    return members


def measure_link(pool, a: int = 0, b: int = 1, sizes: tuple[int, ...] = LINK_SIZES,
                 repeats: int = 20) -> LinkProbe:
    """The link between pool workers ``a`` and ``b``: ping-pong over gloo at each size; one-way = half the
    median round trip; bandwidth from the smallest and largest sizes' times, latency = the smallest
    message's one-way time less its bytes at that bandwidth (step transfers of a decode step are small, so
    their time is mostly this latency). Forms a new process group (:func:`connect`)."""
    if a == b:
        raise ProbeError("the link probe needs two different workers")
    if min(sizes) < 1:
        raise ProbeError(f"message sizes must be at least one byte, got {min(sizes)}")
    members = connect(pool)
    ra, rb = members.index(a), members.index(b)
    replies = pool.call({a: ProbeLink(rb, list(sizes), repeats, lead=True),
                         b: ProbeLink(ra, list(sizes), repeats, lead=False)}, 120.0)
    one_way = [t / 2 for t in replies[a].round_trip_s]
    # bandwidth from the largest and smallest messages; latency: the smallest message's time less its bytes
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    lo, hi = order[0], order[-1]
    per_byte = (one_way[hi] - one_way[lo]) / (sizes[hi] - sizes[lo]) if sizes[hi] > sizes[lo] else 0.0
    per_byte = max(per_byte, 1e-12)
    latency = max(one_way[lo] - sizes[lo] * per_byte, 0.0)
    return LinkProbe(list(sizes), one_way, Link("loopback", 1.0 / per_byte, latency))


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} kB" if n >= 1 << 10 else f"{n} B"


# ------------------------------------------------------------------------------------------------------------
# the driver's round trip


def measure_round_trip(pool, workers: list[int], output_bytes: int = 0, micro_batches: int = 1,
                       holder: int | None = None, repeats: int = 20) -> float:
    """Median seconds of one command to each of ``workers`` and their replies, where ``holder`` (default: the
    last of them) returns ``micro_batches`` outputs of ``output_bytes`` each as step outputs come back
    (through its shared-memory arena for local workers) and the driver concatenates them as
    ``DistributedRunner.step`` does. The cost of a step outside the workers' programs, or (one micro-batch,
    one worker) the time from a streamed job's end to the next job's start."""
    if not workers:
        raise ProbeError("the round-trip probe needs at least one worker")
    holder = workers[-1] if holder is None else holder
    times = []
    for r in range(repeats + 2):
        t0 = time.perf_counter()
        replies = pool.call({w: Echo(output_bytes, micro_batches) if w == holder else Echo() for w in workers},
                            60.0)
        outs = replies[holder].outputs
        if len(outs) > 1:
            torch.cat([o["echo"] for o in outs])
        if r >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------------------
# kernel times inside a step


def time_program(graph: KernelGraph, program, weights: Mapping[str, torch.Tensor],
                 inputs: list[Mapping[str, torch.Tensor]], state: list[Mapping[str, torch.Tensor]], passes: int,
                 warmup: int = 1, min_seconds: float = 0.0,
                 device: str = "cpu", pause_s: float = 0.0) -> dict[tuple[int, int], list[float]]:
    """Seconds of every (kernel, micro-batch) of one device ``program`` of ``graph`` in each timed pass, run as
    a worker runs it (``Executor.run_kernel`` timed around the call as the worker times compute, micro-batch
    instances selected, activations freed), its messages skipped (a received buffer holds zeros). ``warmup``
    untimed passes, then timed ones until there are ``passes`` and ``min_seconds`` have gone by (to keep this
    worker busy while another runs a longer program). ``state`` (one mapping per micro-batch) is updated in
    place, as steps would."""
    from tessera.runtime.executor import Executor

    ex = Executor(graph, program, weights, torch.device(device))
    out: dict[tuple[int, int], list[float]] = {}
    clock = time.perf_counter
    began = None
    done = 0
    with torch.no_grad():
        while done < warmup + passes or clock() - began < min_seconds:
            if done == warmup:
                began = clock()
            ex.prepare_microbatches(list(inputs), list(state), program.inputs, program.state)
            current = 0
            for ins in program.instructions:
                if ins.microbatch != current:
                    ex.select(ins.microbatch)
                    current = ins.microbatch
                if ins.kind == "run":
                    t0 = clock()
                    ex.run_kernel(ins.kernel)
                    if done >= warmup:
                        out.setdefault((ins.kernel, ins.microbatch), []).append(clock() - t0)
                elif ins.kind == "free":
                    ex.free(ins.buffer)
                elif ins.kind == "recv" and pause_s:
                    time.sleep(pause_s)
            ex.release()
            done += 1
    return out


@dataclass
class ProgramTimes:
    """Per-device seconds of each (kernel, micro-batch) of one step's programs (median over passes): each
    device's program alone on a worker, and all of them at once, each on its own worker. ``wake``: per
    device, the extra kernel seconds after one wait for a message of each of ``wake_pauses_s`` (a worker
    that slept resumes slower: on this kind of host its core was taken or clocked down meanwhile); other
    waits are interpolated (from nothing for no wait; no more than the longest pause's cost beyond it)."""

    alone: list[dict[tuple[int, int], float]]
    together: list[dict[tuple[int, int], float]]
    wake: list[list[float]] = field(default_factory=list)
    wake_pauses_s: tuple[float, ...] = ()

    def wake_cost(self, d: int, wait_s: float) -> float:
        """Device ``d``'s extra kernel seconds after waiting ``wait_s`` for a message."""
        if not self.wake or wait_s <= 0:
            return 0.0
        lo_p, lo_c = 0.0, 0.0
        for p, c in zip(self.wake_pauses_s, self.wake[d], strict=True):
            if wait_s <= p:
                return lo_c + (c - lo_c) * (wait_s - lo_p) / (p - lo_p)
            lo_p, lo_c = p, c
        return lo_c

    @staticmethod
    def mean(runs: list[ProgramTimes]) -> ProgramTimes:
        """The mean of several measurements of the same programs (e.g. before and after a run, which this
        host's drifting speed makes worth bracketing)."""
        def avg(which: str) -> list[dict[tuple[int, int], float]]:
            per = [getattr(r, which) for r in runs]
            return [{key: statistics.fmean(p[d][key] for p in per) for key in per[0][d]} for d in range(len(per[0]))]

        wakes = [r.wake for r in runs if r.wake]
        wake = [[statistics.fmean(w[d][i] for w in wakes) for i in range(len(wakes[0][d]))]
                for d in range(len(wakes[0]))] if wakes else []
        return ProgramTimes(avg("alone"), avg("together"), wake, runs[0].wake_pauses_s)


def measure_program_times(pool, sp, graph: KernelGraph, weights_path: str | list[str],
                          inputs: list[Mapping[str, torch.Tensor]], workers: list[int] | None = None,
                          passes: int = 5, warmup: int = 2, together: bool = True,
                          wake_pauses_s: tuple[float, ...] = ()) -> ProgramTimes:
    """The kernel times of ``sp`` (the programs of one step of ``graph``; ``inputs``: each micro-batch's step
    inputs) inside steps as they run (:func:`time_program`): device d's program on pool worker
    ``workers[d]`` (default: the pool's live workers in order), each alone, then (``together``) all devices
    with work at the same time, each for as long as the longest takes ``passes`` times (zero state; each
    worker loads its program's weights from ``weights_path``). ``wake_pauses_s`` (increasing): also run each
    program that receives messages alone with a sleep of each of these at each receive (fewer passes), for
    :attr:`ProgramTimes.wake`: the extra kernel time per receive (never less for a longer pause)."""
    if list(wake_pauses_s) != sorted(set(wake_pauses_s)) or any(p <= 0 for p in wake_pauses_s):
        raise ProbeError(f"wake pauses must be positive and increasing seconds, got {tuple(wake_pauses_s)}")
    workers = list(pool.alive) if workers is None else list(workers)
    used = [d for d, p in enumerate(sp.programs) if any(i.kind == "run" for i in p.instructions)]
    if len(workers) < len(sp.programs):
        raise ProbeError(f"{len(sp.programs)} device programs but {len(workers)} workers")

    # callers may leave the sampler's inputs out (greedy)
    inputs = [with_sampling_defaults(graph.inputs, mb, mb[graph.inputs[0]].shape[0]) for mb in inputs]

    def cmd(d: int, min_s: float, pause_s: float = 0.0) -> TimeProgram:
        return TimeProgram(graph, sp.programs[d], weights_path,
                           [{n: mb[n] for n in sp.programs[d].inputs} for mb in inputs],
                           max(2, passes // 2) if pause_s else passes, 1 if pause_s else warmup, min_s, pause_s)

    def medians(reply) -> dict[tuple[int, int], float]:
        return {key: statistics.median(v) for key, v in reply.seconds.items()}

    alone = [{} for _ in sp.programs]
    for d in used:
        alone[d] = medians(pool.call({workers[d]: cmd(d, 0.0)}, 600.0)[workers[d]])
    both = [dict(t) for t in alone]
    if together and len(used) > 1:
        longest = max(sum(alone[d].values()) for d in used) * passes
        replies = pool.call({workers[d]: cmd(d, longest) for d in used}, 600.0)
        both = [medians(replies[workers[d]]) if d in used else {} for d in range(len(sp.programs))]
    wake = [[0.0] * len(wake_pauses_s) for _ in sp.programs]
    for d in used:
        receives = sum(i.kind == "recv" for i in sp.programs[d].instructions)
        cost = 0.0
        for i, pause in enumerate(wake_pauses_s if receives else ()):
            slept = medians(pool.call({workers[d]: cmd(d, 0.0, pause)}, 600.0)[workers[d]])
            cost = max(cost, (sum(slept.values()) - sum(alone[d].values())) / receives)
            wake[d][i] = cost
    return ProgramTimes(alone, both, wake if wake_pauses_s else [], tuple(wake_pauses_s))


def measure_kernel_times(pool, workers: list[int], graph: KernelGraph, weights_path: str | list[str],
                         inputs: Mapping[str, torch.Tensor], passes: int = 5, warmup: int = 2) -> list[list[float]]:
    """Every kernel of ``graph`` on one device (its single-device program), timed inside steps
    (:func:`time_program`) on each of ``workers`` at the same time: one worker: alone on the host; several:
    while the others run the same step. Returns per worker the seconds of each kernel (median over passes)."""
    from tessera.program.program import single_device_program

    program = single_device_program(graph)
    cmd = TimeProgram(graph, program, weights_path, [dict(inputs)], passes, warmup)
    replies = pool.call(dict.fromkeys(workers, cmd), 600.0)
    out = []
    for w in workers:
        times = [0.0] * len(graph.kernels)
        for (k, _), v in replies[w].seconds.items():
            times[k] = statistics.median(v)
        out.append(times)
    return out


def zero_state(graph: KernelGraph, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Zeroed buffers of ``graph``: its state (what a worker starts with), or the buffers ``names`` (a step's
    dummy inputs, for a warm pass)."""
    from tessera.graph.codec import dtype_from_name

    return {name: torch.zeros(graph.buffers[name].shape, dtype=dtype_from_name(graph.buffers[name].dtype))
            for name in (graph.state if names is None else names)}
