"""Running step graphs on a pool of workers under a placement per phase.

The driver builds each phase's programs (:func:`tessera.program.program.build_programs`), loads them
on the workers, feeds every step's inputs to the workers that read them and collects the outputs.
State lives on the workers whose kernels touch it, one instance per micro-batch; when a phase needs
state rows another worker wrote last (the KV cache after a prefill elsewhere), the driver issues an
explicit move of exactly those rows first. The driver keeps every step it ran, so after a lost worker
it can re-plan onto the survivors, rebuild the state by replaying the same steps at the same shapes
(deterministic), and go on.

**Steps in flight.** :meth:`DistributedRunner.submit` sends a step's commands and returns a
:class:`StepHandle` at once; :meth:`~DistributedRunner.result` collects it later (``step`` is the two
together). Every command of a step carries its id, which tags its messages between workers and comes back
with each reply, so replies are matched to steps by id, whatever order they arrive in. Each worker runs its
commands in the order the driver submitted them: steps on disjoint workers run at the same time, steps
sharing a worker take turns on it in submission order, and since every worker follows the one submission
order no step waits on a step submitted after it (no deadlock). State moves are commands in that order
too: a row another worker wrote is sent after that write and received before the step that reads it. A
step may also push the rows it writes on to the workers that hold them for other phases
(``push_to``: a prefill's KV to the decode worker): the send is queued right behind the step on its worker
and the receive goes to the other worker once the step is back, so neither worker waits for the other's
steps.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.graph.state_reads import state_read
from tessera.kernels.sample import with_sampling_defaults
from tessera.program.program import StepPrograms, build_programs
from tessera.runtime.commands import (
    ARENA_TURNS,
    Connect,
    Failure,
    GetState,
    Job,
    Load,
    Move,
    PhaseLoad,
    Reply,
    SetState,
    StateMove,
    Step,
    step_tag,
)
from tessera.runtime.pool import RuntimeSetupError, WorkerFailed, WorkerLost, WorkerPool

# placements for n devices: phase -> kernel -> device index
Replanner = Callable[[int], dict[str, list[int]]]
FAILURE_MODES = ("fail", "replan")


class RuntimeInputError(TesseraError, ValueError):
    """Inputs that do not fit a phase's graph (rows, shapes, state instances)."""


@dataclass
class Recovery:
    """What happened when a worker was lost."""

    device: str
    how: str
    detected_s: float
    survivors: list[str]
    replayed_steps: int
    seconds: float


@dataclass
class TransfersMade:
    """The transfers one phase's steps made so far: full steps (`step`), streamed micro-batch jobs (`stream`),
    and the messages and bytes their programs sent between workers (replayed steps included)."""

    steps: int = 0
    jobs: int = 0
    messages: int = 0
    nbytes: int = 0


@dataclass
class StepTiming:
    """One step as the workers saw it: wall seconds per worker, compute seconds and (traced) timelines."""

    phase: str
    seconds: float
    worker_seconds: list[float]
    compute_s: list[float]
    timelines: list[list[tuple]] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)  # the device of each entry (workers with work this step)
    # each worker's clock (time.perf_counter) when it began the step, to which its timeline is relative; the
    # clocks of workers on one host agree, so their timelines can be laid side by side
    started_s: list[float] = field(default_factory=list)


@dataclass(eq=False)
class _Entry:
    """One recorded call the state depends on (replayed after a lost worker): ``set_state`` (``values``) or a
    step (``phase`` on ``chunks`` and ``instances``, pushing to ``push_to``; ``part``: its id)."""

    kind: str
    phase: str = ""
    chunks: list = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    owners: set[str] | None = None
    push_to: tuple[str, ...] = ()
    part: int = -1
    values: list = field(default_factory=list)


@dataclass(eq=False)
class _Part:
    """One step of M micro-batches in flight: the workers whose replies are still out, the replies in."""

    id: int
    phase: str
    chunks: list
    instances: list[int]
    trace: bool
    push_to: tuple[str, ...]
    submitted_s: float
    entry: _Entry | None = None
    waiting: set[int] = field(default_factory=set)
    replies: dict[int, Reply] = field(default_factory=dict)
    outputs: list[dict[str, torch.Tensor]] | None = None  # given by a replay (after a lost worker)
    done_s: float = 0.0  # when its last reply was read (time.monotonic, as submitted_s)


@dataclass(eq=False)
class _Push:
    """State rows a step pushed on (sent, queued behind the step on ``src``) and not yet received on ``dst``."""

    part: int
    name: str
    instance: int
    src: int  # ranks
    dst: int
    rows: frozenset[int]
    spans: list[tuple[int, int]]
    tag: int


@dataclass(eq=False)
class StepHandle:
    """A step submitted to the workers (:meth:`DistributedRunner.submit`); its outputs come from
    :meth:`DistributedRunner.result`. ``timings``: how each of its steps ran on the workers, once it is back."""

    id: int
    phase: str
    parts: list[int]
    workers: frozenset[str]  # the devices it runs on
    whole: bool = True  # result() concatenates the rows (submit) or returns the chunks' outputs (submit_chunks)
    timings: list[StepTiming] = field(default_factory=list)


class DistributedRunner:
    """Step graphs (one per phase) run by a WorkerPool under per-phase placements and micro-batch counts."""

    def __init__(self, pool: WorkerPool, graphs: dict[str, KernelGraph], placements: dict[str, list[int]],
                 micro_batches: dict[str, int] | None = None, *, weights_path: str | None = None,
                 weights: dict[str, torch.Tensor] | None = None, state_instances: int = 1,
                 on_failure: str = "fail", replan: Replanner | None = None, step_timeout_s: float = 120.0,
                 log: Callable[[str], None] | None = None, batch_invariant: bool = False):
        if on_failure not in FAILURE_MODES:
            raise RuntimeInputError(f"on_failure must be one of {FAILURE_MODES}, got {on_failure!r}")
        if on_failure == "replan" and replan is None:
            raise RuntimeInputError("on_failure='replan' needs a replanner for the surviving devices")
        _check_state_shapes(graphs)
        self.pool = pool
        self.graphs = graphs
        self.micro_batches = {p: 1 for p in graphs} | dict(micro_batches or {})
        self.weights_path, self.weights = weights_path, weights
        self.state_instances = state_instances
        self.batch_invariant = batch_invariant  # every worker runs its GEMMs row by row
        self.on_failure, self.replan = on_failure, replan
        self.step_timeout_s = step_timeout_s
        self.log = log or (lambda text: print(text, file=sys.stderr))
        self.history: list[tuple] = []
        self.recoveries: list[Recovery] = []
        self.on_lost: Callable[[WorkerLost], None] | None = None  # told when a lost worker is noticed
        self.on_recovered: Callable[[Recovery], None] | None = None  # told when the re-plan is done
        self.last_timing: StepTiming | None = None
        self.moved_bytes = 0  # state moved between workers so far (explicit moves)
        self.moves_made = 0  # explicit state moves so far (one per buffer, instance and source worker)
        # the state moves before the last step: (buffer, instance, from worker, to worker, rows)
        self.last_moves: list[tuple[str, int, int, int, tuple[int, ...]]] = []
        self.made: dict[str, TransfersMade] = {}  # per phase: the transfers its steps made so far
        self._row_counts: dict[str, int] = {}
        self._state_read: dict[str, frozenset[str]] = {}  # per phase: the state buffers its steps read
        self._next_id = 0  # ids of steps and moves (they tag their messages)
        self._parts: dict[int, _Part] = {}  # steps submitted and not yet collected
        self._background: dict[int, set[int]] = {}  # state moves submitted: id -> workers whose reply is out
        self._transit: list[_Push] = []  # rows pushed on and not yet received
        self._unread: dict[int, int] = {}  # per worker: steps whose reply the driver has not read yet
        self._errors: list[WorkerFailed] = []  # state moves that failed, raised by the next result()
        self._replaying = False
        self.started_on = list(range(len(self.pool.devices)))  # every worker it was given (restore() brings lost ones back)
        self._start(placements)

    def _start(self, placements: dict[str, list[int]]) -> None:
        """Install the placements on the live workers; a worker lost before or during start-up is handled as
        a loss during a step (re-planned onto the survivors under on_failure='replan', else raised)."""
        if self.pool.lost and self.on_failure != "replan":
            w = min(self.pool.lost)
            raise WorkerLost(w, self.pool.devices[w], "lost before the runner started", 0.0)
        if self.pool.lost:
            lost = ", ".join(self.pool.devices[w] for w in sorted(self.pool.lost))
            self.log(f"tessera: worker {lost} was lost while starting; re-planning onto {len(self.pool.alive)} "
                     "surviving workers")
            placements = self.replan(len(self.pool.alive))
        while True:
            try:
                self._install(placements, self.pool.alive)
                return
            except WorkerLost as lost:
                self.log(f"tessera: {lost} (while starting)")
                if self.on_failure != "replan":
                    raise
                self.pool.drain(timeout_s=self.step_timeout_s)
                if not self.pool.alive:
                    raise
                placements = self.replan(len(self.pool.alive))
                self.recoveries.append(Recovery(lost.device, lost.how, lost.seconds,
                                                [self.pool.devices[w] for w in self.pool.alive], 0, 0.0))

    # ------------------------------------------------------------------------------------------------
    def _install(self, placements: dict[str, list[int]], members: list[int]) -> None:
        """Build the programs for ``members`` (worker ids), connect them and load graphs, programs, weights."""
        if set(placements) != set(self.graphs):
            raise RuntimeInputError(f"placements for phases {sorted(placements)}, graphs for {sorted(self.graphs)}")
        used = max((max(p) for p in placements.values() if p), default=0) + 1
        if used > len(members):
            raise RuntimeInputError(f"the placement uses {used} devices but only {len(members)} workers are "
                                    f"available ({', '.join(self.pool.devices[w] for w in members)})")
        self.members = list(members)
        devices = [self.pool.devices[w] for w in members]
        self.programs: dict[str, StepPrograms] = {
            phase: build_programs(g, placements[phase], devices, self.micro_batches[phase])
            for phase, g in self.graphs.items()}
        self.placements = {p: list(a) for p, a in placements.items()}
        self.pool.epoch += 1  # a fresh process group each time (never reused: its store keys are spent)
        self.pool.call({w: Connect(self.pool.epoch, members) for w in members}, self.step_timeout_s)
        self.holder = {ph: sp.state_holder() for ph, sp in self.programs.items()}
        loads = {}
        for rank, w in enumerate(members):
            phases = {ph: PhaseLoad(self.graphs[ph], sp.programs[rank], sp.transfers)
                      for ph, sp in self.programs.items()}
            weights = None
            if self.weights is not None:  # only what this worker's kernels read travels to it
                names = {n for sp in self.programs.values() for n in sp.programs[rank].weights}
                names |= {a for g in self.graphs.values() for n in names if n in g.buffers for a in g.buffers[n].aliases}
                weights = {n: t for n, t in self.weights.items() if n in names}
            loads[w] = Load(phases, self.weights_path, weights, self.state_instances, self.batch_invariant)
        self.pool.call(loads, self.step_timeout_s)
        # state rows -> the rank holding their latest value (-1: every holder has the same value)
        self.owner: dict[tuple[str, int], list[int]] = {}

    def _buffer(self, name: str):
        return next(g.buffers[name] for g in self.graphs.values() if name in g.buffers)

    def _rows(self, name: str) -> int:
        rows = self._row_counts.get(name)
        if rows is None:
            shape = self._buffer(name).shape
            rows = self._row_counts[name] = max(1, shape[0]) if shape else 1
        return rows

    def _owner(self, name: str, inst: int) -> list[int]:
        return self.owner.setdefault((name, inst), [-1] * self._rows(name))

    # ------------------------------------------------------------------------------------------------
    def set_state(self, values: list[dict[str, torch.Tensor]]) -> None:
        """Give state instance i the tensors ``values[i]`` (on every worker holding them)."""
        self._settle()
        self._record(_Entry("set_state", values=values))
        self._run_guarded(lambda: self._set_state(values))

    def _set_state(self, values: list[dict[str, torch.Tensor]]) -> None:
        self.pool.call({w: SetState(values) for w in self.members}, self.step_timeout_s)
        for i, vals in enumerate(values):
            for name in vals:
                self.owner[(name, i)] = [-1] * self._rows(name)

    def get_state(self) -> list[dict[str, torch.Tensor]]:
        """Every state instance as the deployment holds it now (rows from the worker that wrote them last)."""
        self._settle()
        replies = self.pool.call({w: GetState() for w in self.members}, self.step_timeout_s)
        by_rank = [replies[w].state for w in self.members]
        out: list[dict[str, torch.Tensor]] = []
        for inst in range(self.state_instances):
            mb: dict[str, torch.Tensor] = {}
            names = sorted({n for r in by_rank for n in r[inst]})
            for name in names:
                holders = [r for r in range(len(by_rank)) if name in by_rank[r][inst]]
                owner = self._owner(name, inst)
                t = by_rank[holders[0]][inst][name].clone()
                for row, o in enumerate(owner):
                    if o >= 0 and o != holders[0]:
                        t[row] = by_rank[o][inst][name][row]
                mb[name] = t
            out.append(mb)
        return out

    def _moves_for(self, phase: str, chunks: list[dict[str, torch.Tensor]], instances: list[int]) -> None:
        """Move the state rows the step reads (its chunks' slots; every row where the state is not slot-major)
        from the worker that wrote them last (explicit, exact rows; submitted, so they run in order before the
        step); other rows stay where they are, and so do the rows of state the step only writes (a prefill's
        KV: `tessera.graph.state_reads`). Rows pushed on to this step's worker that it reads or writes are
        received first (a push landing after the step would overwrite what it wrote)."""
        holder = self.holder[phase]
        graph = self.graphs[phase]
        read = self._state_read.get(phase)
        if read is None:
            read = self._state_read[phase] = state_read(graph)
        touched: dict[tuple[str, int], set[int]] = {}
        for name in holder:
            n = self._rows(name)
            for inst, rows in zip(instances, _touched_rows(graph, chunks, n), strict=True):
                touched.setdefault((name, inst), set()).update(rows)
        reads = {key: rows for key, rows in touched.items() if key[0] in read}
        self._land([p for p in self._transit if p.rows & reads.get((p.name, p.instance), set())
                    or (p.dst == holder.get(p.name) and p.rows & touched.get((p.name, p.instance), set()))])
        moves: dict[int, list[StateMove]] = {}
        self.last_moves = []
        mid, k, nbytes = self._new_id(), 0, 0
        for name, dst in sorted(holder.items()):
            row_bytes = self._buffer(name).nbytes // self._rows(name)
            for (bname, inst), wanted in sorted(reads.items()):
                if bname != name:
                    continue
                owner = self._owner(name, inst)
                for src in sorted({owner[r] for r in wanted if owner[r] >= 0 and owner[r] != dst}):
                    rows = sorted(r for r in wanted if owner[r] == src)
                    self.last_moves.append((name, inst, src, dst, tuple(rows)))
                    spans = _row_spans(rows, row_bytes)
                    tag = step_tag(mid, k)
                    for me, peer, send in ((src, dst, True), (dst, src, False)):
                        moves.setdefault(self.members[me], []).append(StateMove(name, inst, spans, peer, tag, send))
                    k += 1
                    nbytes += len(rows) * row_bytes
                    self.moves_made += 1
                    for r in rows:
                        owner[r] = dst
        if moves:
            self.moved_bytes += nbytes
            self._send_background(mid, {w: Move(mv, mid) for w, mv in moves.items()})

    def _push(self, part: _Part, to: str) -> None:
        """Send the state rows ``part`` writes on to the workers holding them for phase ``to`` (queued right
        behind the step); they are received once the step is back (:meth:`_land`)."""
        graph = self.graphs[part.phase]
        mid, k = self._new_id(), 0
        sends: dict[int, list[StateMove]] = {}
        for name, src in sorted(self.holder[part.phase].items()):
            dst = self.holder[to].get(name)
            if dst is None or dst == src:
                continue
            n = self._rows(name)
            row_bytes = self._buffer(name).nbytes // n
            written: dict[int, set[int]] = {}
            for inst, rows in zip(part.instances, _touched_rows(graph, part.chunks, n), strict=True):
                written.setdefault(inst, set()).update(rows)
            for inst, rows in sorted(written.items()):
                if not rows:
                    continue
                spans = _row_spans(sorted(rows), row_bytes)
                tag = step_tag(mid, k)
                k += 1
                sends.setdefault(self.members[src], []).append(StateMove(name, inst, spans, dst, tag, True))
                self._transit.append(_Push(part.id, name, inst, src, dst, frozenset(rows), spans, tag))
                owner = self._owner(name, inst)
                for r in rows:
                    owner[r] = dst
                self.moves_made += 1
                self.moved_bytes += len(rows) * row_bytes
        if sends:
            self._send_background(mid, {w: Move(mv, mid) for w, mv in sends.items()})

    def _land(self, pushes: list[_Push]) -> None:
        """Receive pushed rows on their destination workers (submitted: after what those workers run now)."""
        if not pushes:
            return
        self._transit = [p for p in self._transit if p not in pushes]
        mid = self._new_id()
        recvs: dict[int, list[StateMove]] = {}
        for p in pushes:
            recvs.setdefault(self.members[p.dst], []).append(StateMove(p.name, p.instance, p.spans, p.src, p.tag,
                                                                       False))
        self._send_background(mid, {w: Move(mv, mid) for w, mv in recvs.items()})

    def _send_background(self, mid: int, cmds: dict[int, Move]) -> None:
        self._background[mid] = set(cmds)
        for w, cmd in cmds.items():
            self.pool.submit(w, cmd)

    # ------------------------------------------------------------------------------------------------
    def slots_per_instance(self) -> int:
        """Rows of each state instance (requests one micro-batch holds); 1 without state."""
        for g in self.graphs.values():
            if g.state:
                return self._rows(g.state[0])
        return 1

    def step(self, phase: str, inputs: dict[str, torch.Tensor], trace: bool = False,
             owners: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Run ``phase`` on a batch of rows: row r belongs to state instance r // slots_per_instance (its
        ``slots`` input is the local slot); rows are cut into the graph's batch, M chunks per step. Returns the
        outputs concatenated in row order. ``owners``: the requests whose state the step writes; once every
        one of them is forgotten (:meth:`forget`) the step is no longer replayed after a lost worker."""
        out = self.result(self.submit(phase, inputs, trace, owners))
        self._drain_moves()
        return out

    def submit(self, phase: str, inputs: dict[str, torch.Tensor], trace: bool = False,
               owners: set[str] | None = None, push_to: tuple[str, ...] = ()) -> StepHandle:
        """Send a step of ``phase`` on a batch of rows (as :meth:`step`) to the workers and return at once;
        :meth:`result` gives its outputs. ``push_to``: phases whose workers get the state rows this step writes
        as soon as it is done (instead of when a step of theirs first reads them)."""
        graph = self._graph(phase)
        chunks = _split_rows(graph, inputs)
        m = self.micro_batches[phase]
        b = graph.buffers[graph.inputs[0]].shape[0]
        per = self.slots_per_instance() if graph.state else b
        instances = [c * b // per for c in range(len(chunks))]
        if len(chunks) % m or max(instances) >= self.state_instances:
            raise RuntimeInputError(f"{phase}: {len(chunks) * b} rows do not fill steps of {m} micro-batches of {b} "
                                    f"over {self.state_instances} state instances of {per} slots")
        for to in push_to:
            self._graph(to)
        parts = [self._submit_part(phase, chunks[f: f + m], instances[f: f + m], trace,
                                   None if owners is None else set(owners), tuple(push_to))
                 for f in range(0, len(chunks), m)]
        return StepHandle(parts[0], phase, parts, self._devices_of(phase))

    def step_chunks(self, phase: str, chunks: list[dict[str, torch.Tensor]], instances: list[int],
                    trace: bool = False, owners: set[str] | None = None) -> list[dict[str, torch.Tensor]]:
        """One step of ``phase``: micro-batch i runs ``chunks[i]`` on state instance ``instances[i]``."""
        out = self.result(self.submit_chunks(phase, chunks, instances, trace, owners))
        self._drain_moves()
        return out

    def submit_chunks(self, phase: str, chunks: list[dict[str, torch.Tensor]], instances: list[int],
                      trace: bool = False, owners: set[str] | None = None, push_to: tuple[str, ...] = ()
                      ) -> StepHandle:
        """Send one step of ``phase`` (as :meth:`step_chunks`) and return at once; :meth:`result` gives the
        outputs of each chunk."""
        self._graph(phase)
        if len(chunks) != self.micro_batches[phase] or len(instances) != len(chunks):
            raise RuntimeInputError(f"{phase} runs {self.micro_batches[phase]} micro-batches per step, "
                                    f"got {len(chunks)} chunks for {len(instances)} state instances")
        for to in push_to:
            self._graph(to)
        pid = self._submit_part(phase, list(chunks), list(instances), trace, owners, tuple(push_to))
        return StepHandle(pid, phase, [pid], self._devices_of(phase), whole=False)

    def _devices_of(self, phase: str) -> frozenset[str]:
        sp = self.programs[phase]
        return frozenset(self.pool.devices[w] for rank, w in enumerate(self.members) if sp.programs[rank].instructions)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _submit_part(self, phase: str, chunks, instances: list[int], trace: bool, owners: set[str] | None,
                     push_to: tuple[str, ...]) -> int:
        part = _Part(self._new_id(), phase, chunks, instances, trace, push_to, time.monotonic())
        part.entry = _Entry("step", phase, chunks, instances, owners, push_to, part.id)
        self._record(part.entry)
        self._parts[part.id] = part
        try:
            self._send_part(part)
        except WorkerLost as lost:  # a worker died while idle: re-plan, and the replay runs this step too
            self._recover(lost)
        return part.id

    def _send_part(self, part: _Part) -> None:
        """Submit the state moves a step needs, its commands, and its pushes."""
        sp = self.programs[part.phase]
        self._moves_for(part.phase, part.chunks, part.instances)
        for rank, w in enumerate(self.members):
            prog = sp.programs[rank]
            if not prog.instructions:
                continue
            while self._unread.get(w, 0) >= ARENA_TURNS - 1:  # its outputs' region would be reused unread
                self._pump(self.step_timeout_s)
            self.pool.submit(w, Step(part.phase, [{n: c[n] for n in prog.inputs} for c in part.chunks],
                                     part.instances, part.trace, part.id))
            part.waiting.add(w)
            self._unread[w] = self._unread.get(w, 0) + 1
        self._mark_written(part.phase, part.chunks, part.instances)
        for to in part.push_to:
            self._push(part, to)

    # ------------------------------------------------------------------------------------------------
    def done(self, handle: StepHandle) -> bool:
        """Whether every reply of ``handle`` is in (its result will not wait); reads the replies that arrived."""
        if any(self._parts[p].waiting and self._parts[p].outputs is None for p in handle.parts):
            self.wait([handle], 0.0)
        return all(not self._parts[p].waiting or self._parts[p].outputs is not None for p in handle.parts)

    def wait(self, handles: list[StepHandle], timeout_s: float | None = None) -> list[StepHandle]:
        """The handles among ``handles`` whose replies are all in, waiting until at least one is (at most
        ``timeout_s``, None: as long as a step may take); reads replies of any step as they arrive."""

        def ready() -> list[StepHandle]:
            return [h for h in handles
                    if all(not self._parts[p].waiting or self._parts[p].outputs is not None for p in h.parts)]

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        looked = False
        while True:
            out = ready()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if out or (looked and left == 0.0):
                return out
            looked = True
            try:
                self._pump(self.step_timeout_s, left)
            except WorkerLost as lost:
                self._recover(lost)

    def result(self, handle: StepHandle):
        """The outputs of a submitted step (waiting for it): as :meth:`step` returns them for :meth:`submit`,
        a list per chunk for :meth:`submit_chunks`. A step that failed raises its worker's error
        (WorkerFailed, naming the step); a lost worker is re-planned as for :meth:`step`."""
        outs: list[dict[str, torch.Tensor]] = []
        for pid in handle.parts:
            got, timing = self._collect(pid)
            outs += got
            if timing is not None:
                handle.timings.append(timing)
                self.last_timing = timing
        if not handle.whole:
            return outs
        if len(outs) == 1:
            return outs[0]
        return {name: torch.cat([o[name] for o in outs]) for name in outs[0]}

    def _collect(self, pid: int) -> tuple[list[dict[str, torch.Tensor]], StepTiming | None]:
        part = self._parts.get(pid)
        if part is None:
            raise RuntimeInputError(f"step {pid} is not in flight (its result was taken already)")
        while part.outputs is None:
            if not part.waiting:
                failed = [(w, r) for w, r in part.replies.items() if isinstance(r, Failure)]
                if not failed:
                    break
                w, reply = failed[0]
                error = WorkerFailed(self.pool.devices[w], f"{part.phase} step {pid} failed: {reply.error}",
                                     reply.traceback)
                lost = self._lost_behind(error)
                if lost is None:
                    del self._parts[pid]
                    if part.entry in self.history:  # a step that failed is not replayed
                        self.history.remove(part.entry)
                    raise error
                self._recover(lost)
                continue
            try:
                self._pump(self.step_timeout_s)
            except WorkerLost as lost:
                self._recover(lost)
        del self._parts[pid]
        if self._errors:
            error, self._errors = self._errors[0], []
            raise error
        if part.outputs is not None:  # replayed after a lost worker
            return part.outputs, None
        return self._assemble(part)

    def _assemble(self, part: _Part) -> tuple[list[dict[str, torch.Tensor]], StepTiming]:
        """The outputs of a step whose replies are all in, its timing, and the transfers it made."""
        sp = self.programs[part.phase]
        outs: list[dict[str, torch.Tensor]] = [{} for _ in part.chunks]
        for r in part.replies.values():
            for i, o in enumerate(r.outputs):
                outs[i].update(o)
        made = self.made.setdefault(part.phase, TransfersMade())
        made.steps += 1
        made.messages += len(sp.transfers)
        made.nbytes += sp.cut_bytes
        order = sorted(part.replies)
        replies = part.replies
        timing = StepTiming(part.phase, max(0.0, part.done_s - part.submitted_s),
                            [replies[w].seconds for w in order], [replies[w].compute_s for w in order],
                            [replies[w].timeline for w in order] if part.trace else [],
                            [self.pool.devices[w] for w in order], [replies[w].t0 for w in order])
        return outs, timing

    def _pump(self, timeout_s: float, poll_s: float | None = None) -> bool:
        """Read one reply (waiting at most ``poll_s`` when given) and file it under its step; whether one came."""
        workers = [w for w in range(len(self.pool.devices)) if self.pool.pending[w]]
        if not workers:
            if any(p.waiting and p.outputs is None for p in self._parts.values()) or self._background:
                raise RuntimeSetupError("steps are waiting for replies no worker owes")
            return False
        got = self.pool.next_reply(workers, timeout_s, raise_failed=False, poll_s=poll_s)
        if got is None:
            self._check_overdue()
            return False
        w, reply = got
        sid = getattr(reply, "step", -1)
        part = self._parts.get(sid)
        if part is not None and w in part.waiting:
            part.waiting.discard(w)
            part.replies[w] = reply
            self._unread[w] -= 1
            if not part.waiting:  # rows it pushed on can be received now, after what their worker runs
                part.done_s = time.monotonic()
                self._land([p for p in self._transit if p.part == sid])
        elif sid in self._background:
            self._background[sid].discard(w)
            if not self._background[sid]:
                del self._background[sid]
            if isinstance(reply, Failure):
                self._errors.append(WorkerFailed(self.pool.devices[w], f"state move {sid} failed: {reply.error}",
                                                 reply.traceback))
        elif isinstance(reply, Failure):
            raise WorkerFailed(self.pool.devices[w], reply.error, reply.traceback)
        else:
            raise RuntimeSetupError(f"worker {self.pool.devices[w]} answered {type(reply).__name__} for step {sid}, "
                                    "which is not in flight")
        return True

    def _check_overdue(self) -> None:
        """A step in flight for longer than the step timeout: the first worker it waits for is lost."""
        now = time.monotonic()
        for part in self._parts.values():
            if part.waiting and part.outputs is None and now - part.submitted_s > self.step_timeout_s:
                w = min(part.waiting)
                self.pool.lost.add(w)
                raise WorkerLost(w, self.pool.devices[w], f"no reply within {self.step_timeout_s:.0f} s",
                                 now - part.submitted_s)

    def _drain_moves(self) -> None:
        """Read the replies of the state moves still out (a step run alone leaves the workers owing nothing)."""
        while self._background:
            try:
                self._pump(self.step_timeout_s)
            except WorkerLost as lost:
                self._recover(lost)

    def settle(self) -> None:
        """Wait until the workers have answered every command out (the results of steps not collected yet
        stay to be collected): pushed rows are received, state moves done."""
        self._settle()

    def _settle(self) -> None:
        """Receive every pushed row and read every reply still out (steps' results stay to be collected)."""
        self._land(list(self._transit))
        while any(p.waiting and p.outputs is None for p in self._parts.values()) or self._background:
            try:
                self._pump(self.step_timeout_s)
            except WorkerLost as lost:
                self._recover(lost)

    def _forget_flight(self) -> None:
        """After the workers were drained: no reply is owed any more; the steps not collected get their outputs
        from the replay."""
        self._background.clear()
        self._transit.clear()
        self._unread.clear()
        for part in self._parts.values():
            part.waiting.clear()

    def _graph(self, phase: str) -> KernelGraph:
        if phase not in self.graphs:
            raise RuntimeInputError(f"no graph for phase {phase!r}; phases: {', '.join(sorted(self.graphs))}")
        return self.graphs[phase]

    def _mark_written(self, phase: str, chunks: list[dict[str, torch.Tensor]], instances: list[int]) -> None:
        """The state rows ``phase`` wrote for these chunks now live on the worker holding that state."""
        graph = self.graphs[phase]
        touched: dict[int, list[list[int]]] = {}  # rows of a state buffer -> the rows each chunk wrote
        for name, rank in self.holder[phase].items():
            if name in graph.buffers:
                n = self._rows(name)
                if n not in touched:
                    touched[n] = _touched_rows(graph, chunks, n)
                for inst, rows in zip(instances, touched[n], strict=True):
                    owner = self._owner(name, inst)
                    for r in rows:
                        owner[r] = rank

    # ------------------------------------------------------------------------------------------------
    def stream(self, phase: str, first: list[dict[str, torch.Tensor]], steps: int,
               feed: Callable[[int, int, dict[str, torch.Tensor]], dict[str, torch.Tensor] | None],
               instances: list[int] | None = None) -> list[list[dict[str, torch.Tensor]]]:
        """Steps of ``phase`` pipelined across steps: micro-batch m starts with inputs ``first[m]`` on state
        instance ``instances[m]``; as soon as its step i is back, ``feed(m, i, outputs)`` gives its inputs for
        step i+1 (None: m stops), queued on the workers at once, so the first stage starts m's next step while
        the later stages finish other micro-batches (no fill and drain per step). At most ``steps`` steps per
        micro-batch; returns each micro-batch's outputs per step. Lost workers are not re-planned here."""
        graph = self._graph(phase)
        count = self.micro_batches[phase]
        instances = list(range(count)) if instances is None else list(instances)
        if len(first) != count or len(instances) != count:
            raise RuntimeInputError(f"{phase} streams {count} micro-batches: got {len(first)} inputs and "
                                    f"{len(instances)} state instances")
        if self.on_failure == "replan":
            raise RuntimeInputError("streamed steps cannot be replayed after a lost worker yet; use step() with "
                                    "on_failure='replan'")
        sp = self.programs[phase]
        self._settle()  # streamed jobs take every reply of these workers: nothing else may be out
        self._moves_for(phase, first, instances)  # a stream's later steps continue the same rows
        self._settle()
        workers = {m: [(rank, w) for rank, w in enumerate(self.members)
                       if any(i.microbatch == m for i in sp.programs[rank].instructions)] for m in range(count)}
        waiting: dict[tuple[int, int], set[int]] = {}
        gathered: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        results: list[list[dict[str, torch.Tensor]]] = [[] for _ in range(count)]
        busy = dict.fromkeys(self.members, 0.0)

        def submit(m: int, inputs: dict[str, torch.Tensor], i: int) -> None:
            inputs = with_sampling_defaults(graph.inputs, inputs, inputs[graph.inputs[0]].shape[0])
            for rank, w in workers[m]:
                names = sp.programs[rank].inputs
                self.pool.submit(w, Job(phase, m, {n: inputs[n] for n in names}, instances[m], key=(m, i)))
            waiting[(m, i)] = {w for _, w in workers[m]}

        t0 = time.perf_counter()
        for m in range(count):
            submit(m, first[m], 0)
        while waiting:
            w, reply = self.pool.next_reply(self.members, self.step_timeout_s)
            key = reply.key
            gathered.setdefault(key, {}).update(reply.outputs[0])
            busy[w] += reply.compute_s
            waiting[key].discard(w)
            if waiting[key]:
                continue
            del waiting[key]
            m, i = key
            made = self.made.setdefault(phase, TransfersMade())
            made.jobs += 1
            made.messages += sum(1 for t in sp.transfers if t.microbatch == m)
            made.nbytes += sum(t.nbytes for t in sp.transfers if t.microbatch == m)
            out = gathered.pop(key)
            results[m].append(out)
            nxt = feed(m, i, out) if i + 1 < steps else None
            if nxt is not None:
                submit(m, nxt, i + 1)
        seconds = time.perf_counter() - t0
        self._mark_written(phase, first, instances)
        self.last_timing = StepTiming(phase, seconds, [], [busy[w] for w in self.members], [],
                                      [self.pool.devices[w] for w in self.members])
        return results

    # ------------------------------------------------------------------------------------------------
    def forget(self, owners) -> None:
        """The requests ``owners`` are over: steps that wrote only their state are not replayed any more (so
        a recovery replays the steps of the requests still in flight, however long the runner has run)."""
        gone = set(owners)
        kept = []
        for entry in self.history:
            if entry.kind == "step" and entry.owners is not None:
                entry.owners.difference_update(gone)
                if not entry.owners and entry.part not in self._parts:
                    continue
            kept.append(entry)
        self.history = kept

    def restore(self) -> Recovery | None:
        """Start the pool's lost workers again and re-plan onto every worker the runner started with, replaying
        the history (the state of requests in flight is rebuilt); None when none is lost. A worker that does not
        come back is left out (the runner goes on with the ones it has)."""
        lost = sorted(set(self.started_on) - set(self.members))
        if not lost:
            return None
        self._settle()
        t0 = time.perf_counter()
        back = []
        for w in lost:
            try:
                self.pool.respawn(w)
                back.append(w)
            except (WorkerLost, RuntimeSetupError) as e:
                self.log(f"tessera: {self.pool.devices[w]} could not be started again: {e}")
        if not back:
            return None
        members = sorted(set(self.members) | set(back))
        self.log(f"tessera: {', '.join(self.pool.devices[w] for w in back)} started again; re-planning onto "
                 f"{len(members)} workers and replaying {len(self.history)} steps")
        self._install(self.replan(len(members)), members)
        self._replay(self.history)
        return Recovery(", ".join(self.pool.devices[w] for w in back), "started again", 0.0,
                        [self.pool.devices[w] for w in members], len(self.history), time.perf_counter() - t0)

    def rebuild(self) -> None:
        """Reconnect and reload the same workers and replay the history (after a step failed on a worker,
        which can leave the process group's transfers mismatched); steps in flight get their outputs from the
        replay."""
        self.pool.drain(timeout_s=self.step_timeout_s)
        self._forget_flight()
        self._install(self.placements, [w for w in self.members if w in self.pool.alive])
        self._replay(self.history)

    def _replay(self, entries: list[_Entry]) -> None:
        """Run ``entries`` again one after another; a step not collected yet keeps its replayed outputs."""
        self._replaying = True
        try:
            for entry in entries:
                if entry.kind == "set_state":
                    self._set_state(entry.values)
                    continue
                part = _Part(self._new_id(), entry.phase, entry.chunks, entry.instances, False, entry.push_to,
                             time.monotonic())
                self._parts[part.id] = part
                try:
                    self._send_part(part)
                    while part.waiting:
                        self._pump(self.step_timeout_s)
                finally:
                    del self._parts[part.id]
                failed = [(w, r) for w, r in part.replies.items() if isinstance(r, Failure)]
                if failed:
                    w, reply = failed[0]
                    raise WorkerFailed(self.pool.devices[w], f"replaying a {entry.phase} step failed: {reply.error}",
                                       reply.traceback)
                outs, _ = self._assemble(part)
                waiting = self._parts.get(entry.part)
                if waiting is not None:
                    waiting.outputs = outs
            self._land(list(self._transit))
        finally:
            self._replaying = False

    def _record(self, entry: _Entry) -> None:
        if not self._replaying:
            self.history.append(entry)

    def _run_guarded(self, action):
        """Run ``action``; on a lost worker either raise (on_failure='fail') or re-plan onto the survivors,
        replay the history (which rebuilds the state) and run the action again."""
        while True:
            try:
                return action()
            except WorkerLost as lost:
                self._recover(lost)
            except WorkerFailed as failed:
                lost = self._lost_behind(failed)
                if lost is None:
                    raise
                self._recover(lost)

    def _lost_behind(self, failed: WorkerFailed) -> WorkerLost | None:
        """A worker error caused by a dead peer (its transfer failed): the lost worker, if any."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:
            for w in self.members:
                try:
                    self.pool._check(w, time.monotonic() - t0)
                except WorkerLost as lost:
                    return lost
            time.sleep(0.05)
        return None

    def _recover(self, lost: WorkerLost) -> None:
        """Re-plan onto the survivors of ``lost`` and replay the history: the state is rebuilt and the steps
        in flight get their outputs (or raise ``lost`` under on_failure='fail')."""
        self.log(f"tessera: {lost}")
        if self.on_failure != "replan":
            raise lost
        t0 = time.perf_counter()
        survivors = [w for w in self.members if w in self.pool.alive]
        if survivors and self.on_lost is not None:
            self.on_lost(lost)
        self.pool.drain(timeout_s=self.step_timeout_s)
        self._forget_flight()
        survivors = [w for w in self.members if w in self.pool.alive]
        if not survivors:
            raise lost
        self.log(f"tessera: re-planning onto {len(survivors)} surviving workers "
                 f"({', '.join(self.pool.devices[w] for w in survivors)}) and replaying {len(self.history)} "
                 "recorded steps")
        self._install(self.replan(len(survivors)), survivors)
        self._replay(self.history)
        recovery = Recovery(lost.device, lost.how, lost.seconds, [self.pool.devices[w] for w in survivors],
                            len(self.history), time.perf_counter() - t0)
        self.recoveries.append(recovery)
        if self.on_recovered is not None:
            self.on_recovered(recovery)

    def close(self) -> None:
        self.pool.close()


def _row_spans(rows: list[int], row_bytes: int) -> list[tuple[int, int]]:
    spans: list[list[int]] = []
    for r in sorted(rows):
        if spans and spans[-1][1] == r * row_bytes:
            spans[-1][1] += row_bytes
        else:
            spans.append([r * row_bytes, (r + 1) * row_bytes])
    return [(a, b) for a, b in spans]


def _touched_rows(graph: KernelGraph, chunks, rows: int) -> list[list[int]]:
    """State rows a step writes per chunk: its ``slots`` (when state is slot-major), else every row."""
    if "slots" in graph.inputs:
        return [sorted({int(s) for s in c["slots"].reshape(-1).tolist() if 0 <= int(s) < rows}) for c in chunks]
    return [list(range(rows)) for _ in chunks]


def _split_rows(graph: KernelGraph, inputs: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Inputs of B rows -> chunks of the graph's batch (dim 0 of its first input); sampler inputs left out are
    greedy."""
    if graph.inputs and graph.inputs[0] in inputs:
        inputs = with_sampling_defaults(graph.inputs, inputs, inputs[graph.inputs[0]].shape[0])
    missing = [n for n in graph.inputs if n not in inputs]
    if missing:
        raise RuntimeInputError(f"{graph.phase}: inputs {missing} are missing (expected {graph.inputs})")
    b = graph.buffers[graph.inputs[0]].shape[0]
    total = inputs[graph.inputs[0]].shape[0]
    if total % b:
        raise RuntimeInputError(f"{graph.phase}: {total} rows do not split into micro-batches of {b}")
    chunks = []
    for c in range(total // b):
        chunk = {}
        for n in graph.inputs:
            t, want = inputs[n], graph.buffers[n].shape
            if list(t.shape) == want:
                chunk[n] = t
            elif t.shape[0] == total and list(t.shape[1:]) == want[1:]:
                chunk[n] = t[c * b: (c + 1) * b].contiguous()
            else:
                raise RuntimeInputError(f"{graph.phase}: input {n} has shape {list(t.shape)}; the graph takes "
                                        f"{want} per micro-batch ({total // b} of them)")
        chunks.append(chunk)
    return chunks


def _check_state_shapes(graphs: dict[str, KernelGraph]) -> None:
    seen: dict[str, tuple[str, list[int], str]] = {}
    for phase, g in graphs.items():
        for name in g.state:
            b = g.buffers[name]
            if name in seen and (seen[name][0], seen[name][1]) != (b.dtype, b.shape):
                raise RuntimeInputError(f"state {name} is {seen[name][0]}{seen[name][1]} in {seen[name][2]} but "
                                        f"{b.dtype}{b.shape} in {phase}: trace the phases with the same batch "
                                        "(slots) and context")
            seen.setdefault(name, (b.dtype, b.shape, phase))
