"""Kernel-level simulation of the runtime's own programs: a discrete-event run of every device's
instruction list with given kernel times and links.

The semantics are the runtime's (:mod:`tessera.runtime.worker`): each device executes its instructions
in order; ``run`` takes the kernel's time; ``send`` posts a message and returns at once; the message
occupies its directed link for ``bytes / bandwidth`` after the link's previous message (one message at a
time per direction) and arrives ``latency`` later; ``recv`` waits until its message has arrived;
``free`` takes no time. The step ends when every device has finished. This is the level the cluster
simulator builds on, and what the runtime benchmark uses for a schedule's bound.

Optionally (:class:`MessageCosts`), messages also cost their devices CPU time, as the runtime's workers spend
it: every receive of a step (or streamed job) is posted before its first instruction, a send packs its bytes
and hands them to the transport before the message leaves (longer while another device is working: on a
host whose cores the workers share, the transport's thread then waits for a core), and a receive unpacks
its bytes once they have arrived (measured on local workers by :func:`tessera.runtime.probe.measure_messages`
and :func:`tessera.runtime.probe.measure_sends`).
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


@dataclass(frozen=True)
class MessageCosts:
    """A device's own seconds per message (not the link's): posting one receive (all of a step's receives
    are posted before its first instruction), sending one message (packing it and handing it over) and
    taking one that has arrived (unpacking it). ``send_busy_s``: sending while another device is working
    (in a kernel or a send, not waiting for a message): where workers share a host's cores, the transport's
    own thread then waits for a core while the sender waits for it (None: ``send_s`` always)."""

    post_s: float = 0.0
    send_s: float = 0.0
    recv_s: float = 0.0
    send_busy_s: float | None = None


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


def _send(tr, now: float, link: LinkOf | None, link_free: dict, link_busy: dict) -> float:
    """Put a message on its directed link at ``now`` (after the link's previous message); its arrival time."""
    if link is None:
        return now
    lk = link(tr.src, tr.dst)
    pair = (tr.src, tr.dst)
    begin = max(now, link_free.get(pair, 0.0))
    wire = tr.nbytes / lk.bandwidth
    link_free[pair] = begin + wire
    link_busy[pair] = link_busy.get(pair, 0.0) + wire
    return begin + wire + lk.latency_s


def simulate_programs(sp: StepPrograms, kernel_time: KernelTime, link: LinkOf | None = None,
                      record: bool = False, messages: MessageCosts | None = None) -> ProgramTimeline:
    """Run ``sp``'s programs with ``kernel_time`` per (device, kernel, micro-batch) and ``link`` per device
    pair (None: transfers are free and instant); ``record`` keeps every instruction's start and end;
    ``messages``: the devices' own time per message (None: none)."""
    import heapq

    n = len(sp.programs)
    msg = messages or MessageCosts()
    clock = [msg.post_s * sum(i.kind == "recv" for i in prog.instructions) for prog in sp.programs]
    busy = [0.0] * n
    pos = [0] * n
    arrival: dict[int, float] = {}
    blocked: dict[int, int] = {}  # transfer -> the device waiting for it
    waits_until = [0.0] * n  # a device that waited for a message did so until this time
    link_free: dict[tuple[int, int], float] = {}
    link_busy: dict[tuple[int, int], float] = {}
    events: list[tuple] = []
    # devices advance in time order (the earliest clock first), so when one sends, every other device's state
    # at that moment is known (for MessageCosts.send_busy_s) and links serve messages in the order sent
    ready = [(clock[d], d) for d in range(n) if sp.programs[d].instructions]
    heapq.heapify(ready)

    def active(o: int, now: float) -> bool:
        """Whether device ``o`` is working at ``now`` (not done, not waiting for a message)."""
        if o in blocked.values() or now < waits_until[o]:
            return False
        return pos[o] < len(sp.programs[o].instructions) or clock[o] > now

    while ready:
        _, d = heapq.heappop(ready)
        ins = sp.programs[d].instructions[pos[d]]
        start = clock[d]
        if ins.kind == "run":
            t = kernel_time(d, ins.kernel, ins.microbatch)
            clock[d] += t
            busy[d] += t
        elif ins.kind == "send":
            crowded = msg.send_busy_s is not None and any(active(o, start) for o in range(n) if o != d)
            clock[d] += msg.send_busy_s if crowded else msg.send_s
            tr = ins.transfer
            arrival[tr] = _send(sp.transfers[tr], clock[d], link, link_free, link_busy)
            if tr in blocked:
                r = blocked.pop(tr)
                heapq.heappush(ready, (clock[r], r))
        elif ins.kind == "recv":
            if ins.transfer not in arrival:
                blocked[ins.transfer] = d
                continue
            waits_until[d] = arrival[ins.transfer]
            clock[d] = max(clock[d], arrival[ins.transfer]) + msg.recv_s
        if record:
            what = ins.kernel if ins.kind == "run" else ins.buffer if ins.kind == "free" else ins.transfer
            events.append((d, ins.kind, what, ins.microbatch, start, clock[d]))
        pos[d] += 1
        if pos[d] < len(sp.programs[d].instructions):
            heapq.heappush(ready, (clock[d], d))
    stuck = [sp.devices[d] for d in range(n) if pos[d] < len(sp.programs[d].instructions)]
    if stuck:
        raise SimulationError(f"the programs cannot finish: {', '.join(stuck)} wait for messages never sent")
    return ProgramTimeline(max(clock, default=0.0), clock, busy, link_busy, events)


@dataclass
class StreamTimeline:
    """Steps streamed back to back (the runtime's ``stream``): when each (micro-batch, step) job was back at
    the driver, each device's kernel time, and the steady-state period between steps."""

    done_s: dict[tuple[int, int], float]  # (micro-batch, step) -> when every device had finished it
    busy_s: list[float]
    link_busy_s: dict[tuple[int, int], float]
    steps: int
    micro_batches: int
    waits_s: list[list[float]] = field(default_factory=list)  # per device: how long each receive waited

    @property
    def makespan_s(self) -> float:
        return max(self.done_s.values(), default=0.0)

    @property
    def first_step_s(self) -> float:
        """When every micro-batch of the first step was back (fill and drain included)."""
        return max(self.done_s[(m, 0)] for m in range(self.micro_batches))

    @property
    def period_s(self) -> float:
        """Seconds per step once the pipeline is full: the time between the last step's and the first step's
        completions, over the steps in between."""
        if self.steps < 2:
            return self.first_step_s
        last = max(self.done_s[(m, self.steps - 1)] for m in range(self.micro_batches))
        return (last - self.first_step_s) / (self.steps - 1)


def simulate_stream(sp: StepPrograms, kernel_time: KernelTime, link: LinkOf | None = None, steps: int = 4,
                    feedback_s: float = 0.0, messages: MessageCosts | None = None) -> StreamTimeline:
    """``steps`` steps of ``sp`` streamed as the runtime streams them: every device takes jobs (one
    micro-batch of one step: its instructions for that micro-batch, in order) first come first served;
    micro-batch m's step i+1 is queued on every device ``feedback_s`` after all devices finished its step i
    (the driver's round trip). Sends, receives, links and ``messages`` behave as in
    :func:`simulate_programs` (a job posts its own receives when it starts); events are processed in time
    order, so links serve messages in the order they are sent."""
    import heapq

    n, count = len(sp.programs), sp.micro_batches
    if steps < 1:
        raise SimulationError(f"steps must be at least 1 (got {steps})")
    jobs_of = [[[ins for ins in prog.instructions if ins.microbatch == m] for m in range(count)]
               for prog in sp.programs]
    members = {m: [d for d in range(n) if jobs_of[d][m]] for m in range(count)}
    msg = messages or MessageCosts()
    posts = [[msg.post_s * sum(ins.kind == "recv" for ins in job) for job in jobs] for jobs in jobs_of]
    queue: list[list[tuple[float, int, int, int]]] = [[] for _ in range(n)]  # per device: (ready, order, m, step)
    events: list[tuple[float, int, int, int]] = []  # (time, order, device, token)
    token = [0] * n  # a device's newest event; older ones are stale
    wake = [None] * n  # when an idle device next looks at its queue (None: nothing queued)
    clock = [0.0] * n
    busy = [0.0] * n
    current: list[list[int] | None] = [None] * n  # [m, step, position]
    blocked: dict[tuple[int, int], int] = {}  # (step, transfer) -> the device waiting for it
    waits_until = [0.0] * n  # a device that waited for a message did so until this time
    wait_from: dict[int, float] = {}  # a blocked device: since when
    waits: list[list[float]] = [[] for _ in range(n)]
    arrival: dict[tuple[int, int], float] = {}
    link_free: dict[tuple[int, int], float] = {}
    link_busy: dict[tuple[int, int], float] = {}
    left: dict[tuple[int, int], int] = {}
    done: dict[tuple[int, int], float] = {}
    counter = 0

    def schedule(d: int, at: float) -> None:
        nonlocal counter
        token[d] += 1
        counter += 1
        heapq.heappush(events, (at, counter, d, token[d]))

    def enqueue(m: int, i: int, at: float) -> None:
        nonlocal counter
        left[(m, i)] = len(members[m])
        if not members[m]:
            done[(m, i)] = at
        for d in members[m]:
            counter += 1
            heapq.heappush(queue[d], (at, counter, m, i))
            if current[d] is None and (wake[d] is None or at < wake[d]):
                wake[d] = max(at, clock[d])
                schedule(d, wake[d])

    for m in range(count):
        enqueue(m, 0, 0.0)
    while events:
        now, _, d, tok = heapq.heappop(events)
        if tok != token[d]:
            continue
        clock[d] = max(clock[d], now)
        if current[d] is None:
            wake[d] = None
            if not queue[d]:
                continue
            if queue[d][0][0] > clock[d]:
                wake[d] = queue[d][0][0]
                schedule(d, wake[d])
                continue
            _, _, m, i = heapq.heappop(queue[d])
            current[d] = [m, i, 0]
            if posts[d][m]:  # the job's receives are posted before its first instruction
                clock[d] += posts[d][m]
                schedule(d, clock[d])
                continue
        m, i, p = current[d]
        job = jobs_of[d][m]
        if p == len(job):
            current[d] = None
            left[(m, i)] -= 1
            if left[(m, i)] == 0:
                done[(m, i)] = clock[d]
                if i + 1 < steps:
                    enqueue(m, i + 1, clock[d] + feedback_s)
            if current[d] is None and token[d] == tok:  # not woken by its own enqueue: look at the queue now
                schedule(d, clock[d])
            continue
        ins = job[p]
        if ins.kind == "recv" and (i, ins.transfer) not in arrival:
            blocked[(i, ins.transfer)] = d
            wait_from[d] = clock[d]
            continue
        if ins.kind == "run":
            t = kernel_time(d, ins.kernel, m)
            clock[d] += t
            busy[d] += t
        elif ins.kind == "send":
            key = (i, ins.transfer)
            crowded = msg.send_busy_s is not None and any(
                current[o] is not None and o not in blocked.values() and clock[d] >= waits_until[o]
                for o in range(n) if o != d)
            clock[d] += msg.send_busy_s if crowded else msg.send_s
            arrival[key] = _send(sp.transfers[ins.transfer], clock[d], link, link_free, link_busy)
            if key in blocked:
                r = blocked.pop(key)
                waits_until[r] = arrival[key]
                schedule(r, max(clock[r], arrival[key]))
        elif ins.kind == "recv":
            got = arrival[(i, ins.transfer)]
            waits[d].append(max(0.0, got - wait_from.pop(d, clock[d])))
            waits_until[d] = max(waits_until[d], got)
            clock[d] = max(clock[d], got) + msg.recv_s
        current[d][2] = p + 1
        schedule(d, clock[d])
    if len(done) != count * steps:
        stuck = sorted({sp.devices[d] for d in blocked.values()})
        raise SimulationError(f"the streamed programs cannot finish: {', '.join(stuck) or 'some devices'} wait for "
                              "messages never sent")
    return StreamTimeline(done, busy, link_busy, steps, count, waits)
