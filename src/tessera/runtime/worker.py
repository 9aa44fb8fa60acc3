"""One worker process per device: it loads its weights, holds its state and runs its programs.

Workers take commands from the driver (the dataclasses of :mod:`tessera.runtime.commands`, encoded by
:mod:`tessera.runtime.wire`; :data:`HANDLERS` names the method that runs each type) over a pipe (local
workers) or through a key-value store (``cmd/<worker>/<n>``, answered at ``reply/<worker>/<n>``), and
exchange activations with each other over a torch.distributed process group (gloo: CPU tensors; CUDA
workers stage through host memory). Transfers are asynchronous: receives are posted when a step starts and
sends return at once, so micro-batch m's transfer overlaps m+1's compute. Every wait has a timeout. A
heartbeat key (``hb/<worker>``) tells the driver the worker is alive.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tessera.graph.codec import dtype_from_name, dtype_name
from tessera.graph.ir import KernelGraph, TensorRef
from tessera.kernels.prepacked import PackedWeights
from tessera.program.program import Piece, Program, Transfer
from tessera.runtime.commands import (
    ARENA_TURNS,
    TAG_SPAN,
    Command,
    Connect,
    Connected,
    Done,
    Echo,
    Echoed,
    Failure,
    GetState,
    Job,
    KernelSeconds,
    Load,
    Loaded,
    MessageTimes,
    Move,
    Moved,
    Ping,
    Pong,
    ProbeLink,
    ProbeMessages,
    Reply,
    RoundTrips,
    SetState,
    SharedTensor,
    StateValues,
    Step,
    StepResult,
    Stop,
    TimeProgram,
    UnknownCommand,
    step_tag,
)
from tessera.runtime.coordination import LOOPBACK, LocalPlane, gloo_device
from tessera.runtime.cuda_graphs import GraphStats, SegmentGraph, graph_stats
from tessera.runtime.device_ops import device_ops
from tessera.runtime.probe import message_burst, ping_pong, time_program, zero_state
from tessera.runtime.segments import graph_segments
from tessera.runtime.wire import decode, encode, unpack

HEARTBEAT_S = 0.2


def nap(waited_s: float) -> float:
    """Seconds to sleep before the next look at the store after waiting ``waited_s``: 2% of the wait so far,
    between 0.2 and 20 ms (the store's timed waits log a warning on every timeout, so waiting is polling)."""
    return min(max(0.0002, waited_s / 50), 0.02)


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker finds the driver and runs: its id, the coordination plane, threads and torch device
    (``host`` and ``port`` only describe where the driver is)."""

    worker: int
    host: str
    port: int
    threads: int
    device: str = "cpu"
    transfer_timeout_s: float = 30.0  # one receive or send
    idle_timeout_s: float = 3600.0  # no command for this long: the driver is gone, exit
    parent_pid: int | None = None  # local workers exit when their driver process is gone
    shared_outputs: bool = False  # step outputs through a shared-memory arena (driver on the same host)
    plane: str | None = None  # the driver's LocalPlane directory (when no store is handed to worker_main)
    bind: str = LOOPBACK  # the address this worker's gloo pairs listen on
    cuda_graphs: bool = True  # on a CUDA device: replay each program segment from a CUDA graph (else eager)


class OutputArena:
    """Step outputs written into shared memory for a driver on the same host: the reply carries a
    :class:`SharedTensor` (arena, offset, dtype, shape) instead of the bytes. Steps take turns through
    ARENA_TURNS sets of regions (one region per micro-batch): a region is rewritten ARENA_TURNS steps later,
    and the driver keeps fewer steps than that unread per worker (streamed jobs use the first set, one step's
    micro-batches). An arena outgrown is kept until the worker exits: a reply still unread may point into it."""

    REGION_ALIGN = 64

    def __init__(self):
        self.shm = None
        self.region = 0
        self.retired: list = []

    def put(self, microbatch: int, tensors: dict[str, torch.Tensor], turn: int = 0,
            micro_batches: int = 1) -> dict[str, SharedTensor]:
        """Copy ``tensors`` into the region of micro-batch ``microbatch`` of step ``turn`` (of a program of
        ``micro_batches``); where each one lies."""
        from multiprocessing import shared_memory

        sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
        need = sum(-(-s // self.REGION_ALIGN) * self.REGION_ALIGN for s in sizes.values())
        index = (turn % ARENA_TURNS) * max(micro_batches, 1) + microbatch
        if self.shm is None or need > self.region or (index + 1) * self.region > self.shm.size:
            self.region = max(need, self.region)
            regions = max(8, ARENA_TURNS * max(micro_batches, 1), index + 1)
            old, self.shm = self.shm, shared_memory.SharedMemory(create=True, size=max(1, regions * self.region))
            if old is not None:
                self.retired.append(old)
        buf = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        at = index * self.region
        refs = {}
        for name, t in tensors.items():
            flat = t.detach().contiguous().view(-1).view(torch.uint8)
            buf[at: at + flat.numel()].copy_(flat.cpu())
            refs[name] = SharedTensor(self.shm.name, at, dtype_name(t.dtype), list(t.shape))
            at += -(-sizes[name] // self.REGION_ALIGN) * self.REGION_ALIGN
        return refs

    def close(self) -> None:
        """Release the shared memory (the driver's copies stay valid)."""
        for shm in [*self.retired, *([self.shm] if self.shm is not None else [])]:
            shm.close()
            shm.unlink()
        self.shm, self.retired = None, []


class Worker:
    """The state of one worker process between commands."""

    def __init__(self, cfg: WorkerConfig, store: dist.Store | None):
        self.cfg = cfg
        self.store = store
        self.device = torch.device(cfg.device)
        self.pg = None
        self.rank = -1  # position in the current process group
        self.weights: dict[str, torch.Tensor] = {}
        self.source: tuple | None = None  # the weight files (and their mtimes) self.weights came from
        self.packed = PackedWeights()  # the CPU GEMMs' packed copies of self.weights, shared by every phase
        self.warm_errors: dict[str, str] = {}  # phases whose warm pass at load failed (they run cold), and why
        self.phases: dict[str, tuple[KernelGraph, Program, list[Transfer], Any, list, list]] = {}
        self.state: list[dict[str, torch.Tensor]] = []  # per micro-batch
        self.timeout = timedelta(seconds=cfg.transfer_timeout_s)
        self.arena = OutputArena() if cfg.shared_outputs else None
        self.turn = 0  # steps run so far (their outputs take turns through the arena's regions)
        self.sending: list[tuple[Any, torch.Tensor]] = []  # state moves' sends still on their way (work, bytes)
        self.ops = device_ops(self.device)  # transfers and kernel timing for this device type
        self.graphs: dict[str, PhaseGraphs] = {}  # CUDA workers with graphs: each phase's segment graphs

    # ------------------------------------------------------------------------------------------------
    def handle(self, cmd: Command) -> Reply:
        """Run ``cmd``; its reply. A command this worker has no handler for raises UnknownCommand."""
        handler = HANDLERS.get(type(cmd))
        if handler is None:
            raise UnknownCommand(f"worker {self.cfg.worker} does not know the command {type(cmd).__name__} "
                                 f"(commands: {', '.join(c.__name__ for c in HANDLERS)})")
        if self.sending:
            self._reap_sends(wait=isinstance(cmd, (Connect, Stop)))
        return handler(self, cmd)

    def _reap_sends(self, wait: bool) -> None:
        """Drop the state moves' sends that arrived (all of them with ``wait``, before the process group
        changes); a send that failed raises here."""
        pending, self.sending = self.sending, []
        for work, flat in pending:
            if wait:
                try:
                    work.wait(self.timeout)
                except Exception:  # noqa: BLE001 - the old group is being replaced; its peer may be gone
                    continue
            elif not work.is_completed():
                self.sending.append((work, flat))
            else:
                work.wait(self.timeout)  # raises the send's error, if any

    def ping(self, cmd: Ping) -> Pong:
        """Who this worker is."""
        return Pong(os.getpid(), torch.get_num_threads(), str(self.device))

    def connect(self, cmd: Connect) -> Connected:
        """Join the process group of the command's members for its epoch."""
        self.pg = None
        if self.cfg.worker not in cmd.members:
            return Connected(-1)
        self.rank = cmd.members.index(self.cfg.worker)
        prefix = dist.PrefixStore(f"pg/{cmd.epoch}", self.store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [gloo_device(self.cfg.bind)]  # else gloo listens wherever the host name resolves
        self.pg = dist.ProcessGroupGloo(prefix, self.rank, len(cmd.members), options)
        return Connected(self.rank)

    def load(self, cmd: Load) -> Loaded:
        """Load every phase's graph and program; read only the weights its kernels use; zero its state."""
        from tessera.runtime.executor import Executor
        from tessera.weights import load_weights

        phases, weights_path, weights = cmd.phases, cmd.weights_path, cmd.weights
        names = sorted({w for ph in phases.values() for w in ph.program.weights})
        source = None if weights is not None else _files_identity(weights_path)
        # weights already loaded from the same files are kept (a re-plan after a lost worker); never by name alone
        kept = bool(source) and source == self.source
        have = {n: t for n, t in self.weights.items() if n in names} if kept else {}
        self.source = source
        if not kept:
            self.packed = PackedWeights()
        missing = [n for n in names if n not in have]
        if missing and weights is not None:
            have.update({n: weights[n] for n in missing if n in weights})
        elif missing and weights_path is not None:
            graphs = [ph.graph for ph in phases.values()]
            wanted = set(missing) | {a for g in graphs for n in missing for a in g.buffers[n].aliases}
            for path in [weights_path] if isinstance(weights_path, str) else weights_path:
                got = load_weights(path, sorted(wanted - set(have)))
                have.update(got)
        # one copy per worker on its device, which every phase's executor binds (on a GPU, .to() per phase
        # would hold a copy per phase: serve has a phase per bucket and objective)
        self.weights = {n: t if t.device == self.device and t.is_contiguous() else t.to(self.device).contiguous()
                        for n, t in have.items()}
        self.phases = {}
        shapes: dict[str, tuple] = {}
        for name, ph in phases.items():
            graph, program = ph.graph, ph.program
            ex = Executor(graph, program, self.weights, self.device, cmd.batch_invariant, self.packed)
            ops = _opcodes(program)
            by_microbatch = [[op for op in ops if op[2] == m] for m in range(program.micro_batches)]
            if ph.transfers and max(t.tag for t in ph.transfers) >= TAG_SPAN:
                raise ValueError(f"phase {name} sends {len(ph.transfers)} messages per step; a step's tags must "
                                 f"stay below {TAG_SPAN} (place fewer cuts)")
            self.phases[name] = (graph, program, ph.transfers, ex, ops, by_microbatch)
            for s in program.state:
                b = graph.buffers[s]
                shapes.setdefault(s, (b.dtype, tuple(b.shape)))
        self.state = [{s: torch.zeros(shape, dtype=dtype_from_name(dt), device=self.device)
                       for s, (dt, shape) in shapes.items()} for _ in range(cmd.state_instances)]
        self.graphs = {}
        self.warm_errors = {}
        if self.device.type == "cuda" and self.cfg.cuda_graphs:
            self.graphs = {name: self._capture(name) for name in self.phases}
        elif self.device.type == "cpu":
            for name in self.phases:
                self._warm(name)
        for instance in self.state:  # warm-up and capture ran on dummy inputs
            for t in instance.values():
                t.zero_()
        return Loaded(len(self.weights), sum(t.nbytes for t in self.weights.values()), len(shapes))

    def set_state(self, cmd: SetState) -> Done:
        """Copy the command's values into the state instances (the buffers held here)."""
        for m, vals in enumerate(cmd.values):
            for name, t in vals.items():
                if name in self.state[m]:
                    self.state[m][name].copy_(t)
        return Done()

    def get_state(self, cmd: GetState) -> StateValues:
        """Copies of the state instances (the buffers named, or all)."""
        return StateValues([{n: t.cpu().clone() for n, t in mb.items() if cmd.names is None or n in cmd.names}
                            for mb in self.state])

    def move(self, cmd: Move) -> Moved:
        """Explicit state moves: send or receive byte ranges of state buffers (per micro-batch). Sends are
        posted (their bytes packed now) and not waited for: the receiver may be in a step of its own."""
        works, moved = [], 0
        ops = self.ops  # host staging as in steps (pinned buffers on a CUDA device)
        ops.begin_step()
        for mv in cmd.moves:
            storages = {mv.buffer: self.state[mv.microbatch][mv.buffer].untyped_storage()}
            pieces = (Piece(mv.buffer, tuple(mv.spans)),)
            moved += pieces[0].nbytes
            if mv.send:
                out = ops.stage(storages, pieces)
                out.wait()
                # the send outlives this command: a staging buffer of its own (a CUDA device reuses its pinned
                # ones once the step's copies are done; the host packs a new tensor anyway)
                flat = out.flat.clone() if self.device.type == "cuda" else out.flat
                self.sending.append((self.pg.send([flat], mv.peer, mv.tag), flat))
            else:
                flat = ops.recv_buffer(pieces[0].nbytes)
                works.append((self.pg.recv([flat], mv.peer, mv.tag), (storages, pieces, flat)))
        for work, (storages, pieces, flat) in works:
            work.wait(self.timeout)
            ops.unpack(storages, pieces, flat)
        ops.end_step()
        return Moved(moved, cmd.step)

    def step(self, cmd: Step) -> StepResult:
        """Run the phase's program, micro-batch m on state instance ``state_instances[m]``; the step outputs
        this device holds."""
        graph, program, transfers, ex, opcodes, _ = self.phases[cmd.phase]
        if cmd.phase in self.graphs and not cmd.trace:  # a traced step times kernel by kernel: eager
            opcodes = self.graphs[cmd.phase].opcodes
        t0 = time.perf_counter()
        ex.prepare_microbatches(cmd.inputs, [self.state[i] for i in cmd.state_instances], program.inputs,
                                program.state)
        mine = [i for i, t in enumerate(transfers) if t.dst == self.rank]
        compute, timeline = self._execute(graph, transfers, ex, opcodes, mine, t0, cmd.trace, step_tag(cmd.step, 0))
        turn, self.turn = self.turn, self.turn + 1
        outputs = [self._outputs(graph, program, ex, m, turn) for m in range(program.micro_batches)]
        ex.release()
        return StepResult(outputs, time.perf_counter() - t0, compute, timeline, t0, None, cmd.step)

    def job(self, cmd: Job) -> StepResult:
        """Run only one micro-batch of the phase's program (the driver streams micro-batches through the
        pipeline step after step); its outputs held here."""
        graph, program, transfers, ex, _, by_microbatch = self.phases[cmd.phase]
        if cmd.phase in self.graphs and not cmd.trace:
            by_microbatch = self.graphs[cmd.phase].by_microbatch
        m = cmd.microbatch
        t0 = time.perf_counter()
        ex.prepare_microbatch(m, cmd.inputs, self.state[cmd.state_instance], program.inputs, program.state)
        mine = [i for i, t in enumerate(transfers) if t.dst == self.rank and t.microbatch == m]
        compute, timeline = self._execute(graph, transfers, ex, by_microbatch[m], mine, t0, cmd.trace)
        outputs = self._outputs(graph, program, ex, m)
        ex.release(m)
        return StepResult([outputs], time.perf_counter() - t0, compute, timeline, t0, cmd.key)

    def _execute(self, graph, transfers, ex, opcodes, receives: list[int], t0: float,
                 trace: bool, base: int = 0) -> tuple[float, list[tuple]]:
        """Post the receives, then run the opcodes; sends go out asynchronously and are waited for at the end.
        Messages are tagged ``base`` + their transfer's tag (the step's tags). Returns the seconds spent in
        kernels and (traced) the timeline. Host staging and kernel timing are the device type's
        (`tessera.runtime.device_ops`): on a CUDA device a send is posted once its bytes have reached pinned
        host memory, and every copy still in flight is posted before waiting for a receive."""
        ops = self.ops
        ops.begin_step()
        posted = {}
        for i in receives:
            t = transfers[i]
            flat = ops.recv_buffer(t.nbytes)
            posted[i] = (self.pg.recv([flat], t.src, base + t.tag), flat)
        sends, staged, timeline = [], [], []
        compute = 0.0
        torch.set_grad_enabled(False)  # a worker never needs autograd
        sync = self.device.type == "cuda" and trace
        timer = None if trace else ops.busy_timer()  # None: the host clock around each kernel
        clock = time.perf_counter
        current = -1
        for code, arg, m in opcodes:
            if m != current:
                ex.select(m)
                current = m
            start = clock()
            if code == _RUN:
                if timer is not None:
                    timer.enter()
                ex.run_kernel(arg)
                if sync:
                    torch.cuda.synchronize(self.device)
                compute += clock() - start
            elif code == _GRAPH:
                timer.enter()
                arg.run(ex)
            elif code == _FREE:
                ex.free(arg)
            elif code == _SEND:
                if timer is not None:
                    timer.leave()
                t = transfers[arg]
                out = ops.stage(ex.storages, t.pieces)
                if out.ready():
                    sends.append(self.pg.send([out.flat], t.dst, base + t.tag))
                else:
                    staged.append((out, t))
            else:
                if timer is not None:
                    timer.leave()
                self._post(staged, sends, True, base)  # the peer may wait for them before it sends this
                work, flat = posted.pop(arg)
                work.wait(self.timeout)
                ops.unpack(ex.storages, transfers[arg].pieces, flat, graph)
            if staged:
                self._post(staged, sends, False, base)
            if trace:
                timeline.append((_KINDS[code], arg, m, start - t0, clock() - t0))
        self._post(staged, sends, True, base)
        for work in sends:
            work.wait(self.timeout)
        ops.end_step()
        if timer is not None:
            compute = timer.seconds()
        return compute, timeline

    def _post(self, staged: list, sends: list, wait: bool, base: int = 0) -> None:
        """Post the staged sends whose bytes are in host memory (``wait``: all of them, waiting for each),
        tagged ``base`` + their transfer's tag."""
        while staged and (wait or staged[0][0].ready()):
            out, t = staged.pop(0)
            out.wait()
            sends.append(self.pg.send([out.flat], t.dst, base + t.tag))

    def _dummy_pass(self, name: str, by_microbatch: list[list[tuple]],
                    on_graph: Callable[[Any, Any], None] | None = None) -> None:
        """Run phase ``name``'s opcodes (``by_microbatch[m]``) once per micro-batch m on state instance m with zero
        inputs, every receive read as zeros and nothing sent (``on_graph(segment, executor)`` for a CUDA graph
        segment); the caller zeroes the state afterwards."""
        graph, program, transfers, ex, _, _ = self.phases[name]
        torch.set_grad_enabled(False)
        for m in range(min(program.micro_batches, len(self.state))):
            ex.prepare_microbatch(m, zero_state(graph, program.inputs), self.state[m], program.inputs, program.state)
            for code, arg, _ in by_microbatch[m]:
                if code == _GRAPH:
                    on_graph(arg, ex)
                elif code == _RUN:
                    ex.run_kernel(arg)
                elif code == _FREE:
                    ex.free(arg)
                elif code == _RECV:  # the bytes a step receives here: zeros
                    pieces = transfers[arg].pieces
                    unpack(ex.storages, pieces, torch.zeros(sum(p.nbytes for p in pieces), dtype=torch.uint8),
                           self.device, graph)
            ex.release(m)

    def _warm(self, name: str) -> None:
        """Run phase ``name`` once on dummy inputs at load (a CPU worker), so that its first served step does not
        pay what a first step pays once: each kernel's call bound, buffers allocated, packed weights made
        (10-30 ms a phase, 200 ms for the first; serve has a phase per bucket and objective). A phase whose pass
        fails is left cold (its first step pays them) and named in ``warm_errors``."""
        try:
            self._dummy_pass(name, self.phases[name][5])
        except Exception as e:  # noqa: BLE001 - a step on real inputs still runs, and says what fails
            self.warm_errors[name] = f"{type(e).__name__}: {e}"
            self.phases[name][3].release()

    def _capture(self, name: str) -> PhaseGraphs:
        """Phase ``name``'s program cut into segments, each captured into a CUDA graph per micro-batch (on
        state instance m) after warm-up on dummy inputs; the state is zeroed by the caller afterwards."""
        graph, program, transfers, ex, opcodes, _ = self.phases[name]
        plan = graph_segments(graph, program)
        pools: dict[tuple, Any] = {}
        segments = [SegmentGraph(graph, program, s, pools) for s in plan.segments]
        phase = PhaseGraphs(_graph_opcodes(opcodes, segments), [], segments, plan.eager)
        phase.by_microbatch = [[op for op in phase.opcodes if op[2] == m] for m in range(program.micro_batches)]

        def capture(segment, ex) -> None:
            captured = segment.capture(ex)
            if captured is not None:
                segment.replay(ex, captured)
            else:
                segment.eager(ex)

        try:
            self._dummy_pass(name, phase.by_microbatch, capture)
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - the phase then captures lazily, in its first steps
            phase.load_error = f"{type(e).__name__}: {e}"
            ex.release()
        return phase

    def _outputs(self, graph, program, ex, m: int, turn: int = 0) -> dict[str, Any]:
        ex.select(m)
        views = {name: ex.view(TensorRef.from_json(graph.outputs[name])) for name in program.outputs}
        if self.arena is None:
            return {n: v.cpu().clone() for n, v in views.items()}
        return self.arena.put(m, views, turn, program.micro_batches)

    def stop(self, cmd: Stop) -> Done:
        """Nothing: the worker loop leaves after replying."""
        return Done()

    # probes (tessera.runtime.probe): what the simulator needs to know about this pool ---------------------
    def probe_link(self, cmd: ProbeLink) -> RoundTrips:
        """Ping-pong with a peer of the current process group; the lead's median round trip per size."""
        return RoundTrips(ping_pong(self.pg, cmd.peer, cmd.sizes, cmd.repeats, cmd.lead, self.timeout))

    def probe_messages(self, cmd: ProbeMessages) -> MessageTimes:
        """A burst of messages each way with a peer; this side's CPU seconds per message."""
        return message_burst(self.pg, cmd.peer, cmd.count, cmd.nbytes, self.timeout)

    def echo(self, cmd: Echo) -> Echoed:
        """Outputs of the asked size and number, returned as step outputs are."""
        t = torch.zeros(cmd.nbytes // 4, dtype=torch.float32)
        return Echoed([self.arena.put(m, {"echo": t}) if self.arena is not None else {"echo": t.clone()}
                       for m in range(cmd.micro_batches)])

    def time_program(self, cmd: TimeProgram) -> KernelSeconds:
        """Every kernel of one device program timed inside steps here (its weights loaded for the call)."""
        from tessera.weights import load_graph_weights

        graph, program = cmd.graph, cmd.program
        weights = load_graph_weights(graph, cmd.weights_path, program.weights)
        state = [zero_state(graph, program.state) for _ in cmd.inputs]
        return KernelSeconds(time_program(graph, program, weights, cmd.inputs, state, cmd.passes, cmd.warmup,
                                          cmd.min_seconds, str(self.device), cmd.pause_s))


# the handler of each command type (Worker.handle)
HANDLERS: dict[type[Command], Callable[[Worker, Any], Reply]] = {
    Ping: Worker.ping, Connect: Worker.connect, Load: Worker.load, SetState: Worker.set_state,
    GetState: Worker.get_state, Move: Worker.move, Step: Worker.step, Job: Worker.job, Stop: Worker.stop,
    ProbeLink: Worker.probe_link, ProbeMessages: Worker.probe_messages, Echo: Worker.echo,
    TimeProgram: Worker.time_program,
}


_RUN, _FREE, _SEND, _RECV, _GRAPH = range(5)
_KINDS = ("run", "free", "send", "recv", "graph")


@dataclass
class PhaseGraphs:
    """A phase's opcodes on a CUDA device with graphs: each capturable segment one ``graph`` opcode (its
    :class:`SegmentGraph`), the kernels no graph can hold (``eager``: kernel -> why) left as they were."""

    opcodes: list[tuple[int, Any, int]]
    by_microbatch: list[list[tuple[int, Any, int]]]
    segments: list[SegmentGraph]
    eager: dict[int, str]
    load_error: str | None = None  # why capture at load failed (the segments then capture in the first steps)

    def stats(self) -> GraphStats:
        """Captured graphs, replays, eager runs and the reasons of what is eager."""
        return graph_stats(self.segments, self.eager)


def _graph_opcodes(opcodes: list[tuple[int, Any, int]], segments: list[SegmentGraph]) -> list[tuple[int, Any, int]]:
    """``opcodes`` (one per program instruction) with each segment's instructions replaced by one graph opcode."""
    at = {s.segment.start: s for s in segments}
    out, i = [], 0
    while i < len(opcodes):
        seg = at.get(i)
        if seg is None:
            out.append(opcodes[i])
            i += 1
        else:
            out.append((_GRAPH, seg, seg.segment.microbatch))
            i = seg.segment.stop
    return out


def _opcodes(program: Program) -> list[tuple[int, Any, int]]:
    """The program as (opcode, kernel / buffer / transfer, micro-batch) tuples (cheap to dispatch)."""
    code = {k: i for i, k in enumerate(_KINDS)}
    return [(code[i.kind], i.kernel if i.kind == "run" else i.buffer if i.kind == "free" else i.transfer,
             i.microbatch) for i in program.instructions]


def _files_identity(paths: str | list[str] | None) -> tuple | None:
    if paths is None:
        return None
    files = [paths] if isinstance(paths, str) else list(paths)
    return tuple((f, os.path.getmtime(f)) for f in files)


def _heartbeat(cfg: WorkerConfig, store: dist.Store, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            store.set(f"hb/{cfg.worker}", repr(time.time()))
        except Exception:  # noqa: BLE001 - the driver's store is gone: the worker loop notices and leaves
            return
        stop.wait(HEARTBEAT_S)


def _driver_alive(cfg: WorkerConfig) -> bool:
    if cfg.parent_pid is None:
        return True
    try:
        os.kill(cfg.parent_pid, 0)
        return True
    except OSError:
        return False


class _StoreCommands:
    """Commands at ``cmd/<worker>/<n>`` of the store, replies at ``reply/<worker>/<n>`` (several hosts)."""

    def __init__(self, store: dist.Store, worker: int):
        self.store, self.worker, self.seq = store, worker, 0

    def wait(self, timeout_s: float) -> bool:
        key = f"cmd/{self.worker}/{self.seq}"
        began = time.monotonic()
        while not self.store.check([key]):
            waited = time.monotonic() - began
            if waited > timeout_s:
                return False
            time.sleep(nap(waited))
        return True

    def receive(self) -> bytes:
        key = f"cmd/{self.worker}/{self.seq}"
        data = self.store.get(key)
        self.store.delete_key(key)
        return data

    def reply(self, data: bytes) -> None:
        self.store.set(f"reply/{self.worker}/{self.seq}", data)
        self.seq += 1


class _PipeCommands:
    """Commands and replies over a pipe to the driver (local workers: no polling, one copy)."""

    def __init__(self, conn):
        self.conn = conn

    def wait(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def receive(self) -> bytes:
        return self.conn.recv_bytes()

    def reply(self, data: bytes) -> None:
        self.conn.send_bytes(data)


def _failure(e: Exception, cmd: Command | None = None) -> Failure:
    return Failure(f"{type(e).__name__}: {e}", traceback.format_exc(), getattr(cmd, "step", -1))


def worker_main(cfg: WorkerConfig, store: dist.Store | None = None, conn=None) -> None:
    """The worker loop: wait for a command, run it, send the reply; until :class:`Stop` or the driver is gone.
    ``store``: the coordination store (torchrun's ranks), else the driver's plane ``cfg.plane``; ``conn``:
    a pipe to a local driver for commands and replies (else they go through the store, with heartbeats)."""
    torch.set_num_threads(cfg.threads)
    if cfg.parent_pid is not None:  # a local worker stops when its driver says or is gone, not on the
        # terminal's Ctrl-C or a supervisor's SIGTERM to the process group (the driver drains first)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if store is None:
        if cfg.plane is None:
            raise ValueError(f"worker {cfg.worker}: no coordination store and no plane to join")
        store = LocalPlane.join(cfg.plane).store
    stop = threading.Event()
    if conn is None:  # a local driver watches the process itself
        threading.Thread(target=_heartbeat, args=(cfg, store.clone(), stop), daemon=True).start()
    worker = Worker(cfg, store)
    commands = _PipeCommands(conn) if conn is not None else _StoreCommands(store, cfg.worker)
    idle_since = time.monotonic()
    try:
        while True:
            if not commands.wait(1.0):
                if not _driver_alive(cfg) or time.monotonic() - idle_since > cfg.idle_timeout_s:
                    return
                continue
            try:
                data = commands.receive()
            except (EOFError, OSError):  # the driver closed the pipe
                return
            cmd = None
            try:
                cmd = decode(data)
                reply = worker.handle(cmd)
            except Exception as e:  # noqa: BLE001 - every failure goes back to the driver, which decides
                reply = _failure(e, cmd)
            try:
                data = encode(reply)
            except Exception as e:  # noqa: BLE001 - a reply that cannot travel (e.g. not picklable)
                data = encode(_failure(e))
            try:
                commands.reply(data)
            except (BrokenPipeError, ConnectionError, EOFError, OSError):  # the driver is gone: nobody to answer
                return
            idle_since = time.monotonic()
            if isinstance(cmd, Stop):
                return
    finally:
        stop.set()
        if worker.arena is not None:
            worker.arena.close()
