"""One worker process per device: it loads its weights, holds its state and runs its programs.

Workers take commands from the driver through a key-value store (``cmd/<worker>/<n>``, answered at
``reply/<worker>/<n>``) and exchange activations with each other over a torch.distributed process group
(gloo: CPU tensors; CUDA workers stage through host memory). Transfers are asynchronous: receives are
posted when a step starts and sends return at once, so micro-batch m's transfer overlaps m+1's compute.
Every wait has a timeout. A heartbeat key (``hb/<worker>``) tells the driver the worker is alive.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tessera.graph.codec import dtype_from_name, dtype_name
from tessera.graph.ir import KernelGraph, TensorRef
from tessera.program.program import Piece, Program, Transfer

HEARTBEAT_S = 0.2


def nap(waited_s: float) -> float:
    """Seconds to sleep before the next look at the store after waiting ``waited_s``: 2% of the wait so far,
    between 0.2 and 20 ms (the store's timed waits log a warning on every timeout, so waiting is polling)."""
    return min(max(0.0002, waited_s / 50), 0.02)


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker finds the driver and runs: its id, the store address, threads and torch device."""

    worker: int
    host: str
    port: int
    threads: int
    device: str = "cpu"
    transfer_timeout_s: float = 30.0  # one receive or send
    idle_timeout_s: float = 3600.0  # no command for this long: the driver is gone, exit
    parent_pid: int | None = None  # local workers exit when their driver process is gone
    shared_outputs: bool = False  # step outputs through a shared-memory arena (driver on the same host)


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def pack(storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...]) -> torch.Tensor:
    """The bytes of ``pieces`` as one flat host tensor."""
    parts = [_bytes_view(storages[p.buffer])[lo:hi] for p in pieces for lo, hi in p.spans]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    return flat.cpu()


def unpack(storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...], flat: torch.Tensor,
           device: torch.device, graph: KernelGraph | None = None) -> None:
    """Write a received flat tensor into the pieces' buffers (allocating one not present yet: ``graph`` gives
    its size)."""
    at = 0
    for p in pieces:
        st = storages.get(p.buffer)
        if st is None:
            st = torch.zeros(graph.buffers[p.buffer].nbytes, dtype=torch.uint8, device=device).untyped_storage()
            storages[p.buffer] = st
        view = _bytes_view(st)
        for lo, hi in p.spans:
            view[lo:hi].copy_(flat[at: at + hi - lo])
            at += hi - lo


class OutputArena:
    """Step outputs written into shared memory (one region per micro-batch) for a driver on the same host:
    the reply carries (arena, offset, dtype, shape) instead of the bytes. A region is rewritten only by the
    next step of its micro-batch, which the driver sends after it has copied the region out."""

    REGION_ALIGN = 64

    def __init__(self):
        self.shm = None
        self.region = 0

    def put(self, microbatch: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        from multiprocessing import shared_memory

        sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
        need = sum(-(-s // self.REGION_ALIGN) * self.REGION_ALIGN for s in sizes.values())
        if self.shm is None or need > self.region or (microbatch + 1) * self.region > self.shm.size:
            self.region = max(need, self.region)
            old, self.shm = self.shm, shared_memory.SharedMemory(create=True, size=max(1, 8 * self.region))
            if old is not None:
                old.close()
                old.unlink()
        buf = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        at = microbatch * self.region
        refs = {}
        for name, t in tensors.items():
            flat = t.detach().contiguous().view(-1).view(torch.uint8)
            buf[at: at + flat.numel()].copy_(flat.cpu())
            refs[name] = ("shared", self.shm.name, at, dtype_name(t.dtype), list(t.shape))
            at += -(-sizes[name] // self.REGION_ALIGN) * self.REGION_ALIGN
        return refs

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None


class Worker:
    """The state of one worker process between commands."""

    def __init__(self, cfg: WorkerConfig, store: dist.Store):
        self.cfg = cfg
        self.store = store
        self.device = torch.device(cfg.device)
        self.pg = None
        self.rank = -1  # position in the current process group
        self.weights: dict[str, torch.Tensor] = {}
        self.source: tuple | None = None  # the weight files (and their mtimes) self.weights came from
        self.phases: dict[str, tuple[KernelGraph, Program, list[Transfer], Any, list, list]] = {}
        self.state: list[dict[str, torch.Tensor]] = []  # per micro-batch
        self.timeout = timedelta(seconds=cfg.transfer_timeout_s)
        self.arena = OutputArena() if cfg.shared_outputs else None

    # ------------------------------------------------------------------------------------------------
    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        return getattr(self, "op_" + op)(**{k: v for k, v in cmd.items() if k != "op"})

    def op_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "threads": torch.get_num_threads(), "device": str(self.device)}

    def op_connect(self, epoch: int, members: list[int]) -> dict[str, Any]:
        """Join the process group of ``members`` (worker ids; rank = position) for ``epoch``."""
        self.pg = None
        if self.cfg.worker not in members:
            return {"rank": -1}
        self.rank = members.index(self.cfg.worker)
        prefix = dist.PrefixStore(f"pg/{epoch}", self.store)
        self.pg = dist.ProcessGroupGloo(prefix, self.rank, len(members), self.timeout)
        return {"rank": self.rank}

    def op_load(self, phases: dict[str, dict[str, Any]], weights_path: str | list[str] | None,
                weights: dict[str, torch.Tensor] | None, state_instances: int) -> dict[str, Any]:
        """Load every phase's graph and program; read only the weights its kernels use; zero its state."""
        from tessera.runtime.executor import Executor
        from tessera.weights import load_weights

        names = sorted({w for ph in phases.values() for w in ph["program"].weights})
        source = None if weights is not None else _files_identity(weights_path)
        # weights already loaded from the same files are kept (a re-plan after a lost worker); never by name alone
        have = {n: t for n, t in self.weights.items() if n in names} if source and source == self.source else {}
        self.source = source
        missing = [n for n in names if n not in have]
        if missing and weights is not None:
            have.update({n: weights[n] for n in missing if n in weights})
        elif missing and weights_path is not None:
            graphs = [ph["graph"] for ph in phases.values()]
            wanted = set(missing) | {a for g in graphs for n in missing for a in g.buffers[n].aliases}
            for path in [weights_path] if isinstance(weights_path, str) else weights_path:
                got = load_weights(path, sorted(wanted - set(have)))
                have.update(got)
        self.weights = have
        self.phases = {}
        shapes: dict[str, tuple] = {}
        for name, ph in phases.items():
            graph, program = ph["graph"], ph["program"]
            ex = Executor(graph, program, self.weights, self.device)
            ops = _opcodes(program)
            by_microbatch = [[op for op in ops if op[2] == m] for m in range(program.micro_batches)]
            self.phases[name] = (graph, program, ph["transfers"], ex, ops, by_microbatch)
            for s in program.state:
                b = graph.buffers[s]
                shapes.setdefault(s, (b.dtype, tuple(b.shape)))
        self.state = [{s: torch.zeros(shape, dtype=dtype_from_name(dt), device=self.device)
                       for s, (dt, shape) in shapes.items()} for _ in range(state_instances)]
        return {"weights": len(self.weights), "weight_bytes": sum(t.nbytes for t in self.weights.values()),
                "state": len(shapes)}

    def op_set_state(self, values: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        for m, vals in enumerate(values):
            for name, t in vals.items():
                if name in self.state[m]:
                    self.state[m][name].copy_(t)
        return {}

    def op_get_state(self, names: list[str] | None = None) -> dict[str, Any]:
        return {"state": [{n: t.cpu().clone() for n, t in mb.items() if names is None or n in names}
                          for mb in self.state]}

    def op_move(self, moves: list[dict[str, Any]]) -> dict[str, Any]:
        """Explicit state moves: send or receive byte ranges of state buffers (per micro-batch)."""
        works, moved = [], 0
        for mv in moves:
            storages = {mv["buffer"]: self.state[mv["microbatch"]][mv["buffer"]].untyped_storage()}
            pieces = (Piece(mv["buffer"], tuple(mv["spans"])),)
            moved += pieces[0].nbytes
            if mv["send"]:
                works.append((self.pg.send([pack(storages, pieces)], mv["peer"], mv["tag"]), None))
            else:
                flat = torch.empty(pieces[0].nbytes, dtype=torch.uint8)
                works.append((self.pg.recv([flat], mv["peer"], mv["tag"]), (storages, pieces, flat)))
        for work, into in works:
            work.wait(self.timeout)
            if into is not None:
                storages, pieces, flat = into
                unpack(storages, pieces, flat, self.device)
        return {"bytes": moved}

    def op_step(self, phase: str, inputs: list[dict[str, torch.Tensor]], state_instances: list[int],
                trace: bool = False) -> dict[str, Any]:
        """Run ``phase``'s program, micro-batch m on state instance ``state_instances[m]``; return the step
        outputs this device holds."""
        graph, program, transfers, ex, opcodes, _ = self.phases[phase]
        t0 = time.perf_counter()
        ex.prepare_microbatches(inputs, [self.state[i] for i in state_instances], program.inputs, program.state)
        mine = [i for i, t in enumerate(transfers) if t.dst == self.rank]
        compute, timeline = self._execute(graph, transfers, ex, opcodes, mine, t0, trace)
        outputs = [self._outputs(graph, program, ex, m) for m in range(program.micro_batches)]
        ex.release()
        return {"outputs": outputs, "seconds": time.perf_counter() - t0, "compute_s": compute,
                "timeline": timeline, "t0": t0}

    def op_job(self, phase: str, microbatch: int, inputs: dict[str, torch.Tensor], state_instance: int,
               job: Any = None, trace: bool = False) -> dict[str, Any]:
        """Run only micro-batch ``microbatch`` of ``phase``'s program (the driver streams micro-batches through
        the pipeline step after step); return its outputs held here."""
        graph, program, transfers, ex, _, by_microbatch = self.phases[phase]
        t0 = time.perf_counter()
        ex.prepare_microbatch(microbatch, inputs, self.state[state_instance], program.inputs, program.state)
        mine = [i for i, t in enumerate(transfers) if t.dst == self.rank and t.microbatch == microbatch]
        compute, timeline = self._execute(graph, transfers, ex, by_microbatch[microbatch], mine, t0, trace)
        outputs = self._outputs(graph, program, ex, microbatch)
        ex.release(microbatch)
        return {"job": job, "outputs": [outputs], "seconds": time.perf_counter() - t0, "compute_s": compute,
                "timeline": timeline, "t0": t0}

    def _execute(self, graph, transfers, ex, opcodes, receives: list[int], t0: float,
                 trace: bool) -> tuple[float, list[tuple]]:
        """Post the receives, then run the opcodes; sends go out asynchronously and are waited for at the end.
        Returns the seconds spent in kernels and (traced) the timeline."""
        posted = {}
        for i in receives:
            t = transfers[i]
            flat = torch.empty(t.nbytes, dtype=torch.uint8)
            posted[i] = (self.pg.recv([flat], t.src, t.tag), flat)
        sends, timeline = [], []
        compute = 0.0
        torch.set_grad_enabled(False)  # a worker never needs autograd
        sync = self.device.type == "cuda" and trace
        clock = time.perf_counter
        current = -1
        for code, arg, m in opcodes:
            if m != current:
                ex.select(m)
                current = m
            start = clock()
            if code == _RUN:
                ex.run_kernel(arg)
                if sync:
                    torch.cuda.synchronize(self.device)
                compute += clock() - start
            elif code == _FREE:
                ex.free(arg)
            elif code == _SEND:
                t = transfers[arg]
                sends.append(self.pg.send([pack(ex.storages, t.pieces)], t.dst, t.tag))
            else:
                work, flat = posted.pop(arg)
                work.wait(self.timeout)
                unpack(ex.storages, transfers[arg].pieces, flat, self.device, graph)
            if trace:
                timeline.append((_KINDS[code], arg, m, start - t0, clock() - t0))
        for work in sends:
            work.wait(self.timeout)
        return compute, timeline

    def _outputs(self, graph, program, ex, m: int) -> dict[str, Any]:
        ex.select(m)
        views = {name: ex.view(TensorRef.from_json(graph.outputs[name])) for name in program.outputs}
        return self.arena.put(m, views) if self.arena is not None else {n: v.cpu().clone() for n, v in views.items()}

    def op_stop(self) -> dict[str, Any]:
        return {}

    # probes (tessera.runtime.probe): what the simulator needs to know about this pool ---------------------
    def op_probe_link(self, peer: int, sizes: list[int], repeats: int, lead: bool) -> dict[str, Any]:
        """Ping-pong with rank ``peer`` of the current process group; the lead's median round trip per size."""
        from tessera.runtime.probe import ping_pong

        return {"round_trip_s": ping_pong(self.pg, peer, sizes, repeats, lead, self.timeout)}

    def op_probe_messages(self, peer: int, count: int, nbytes: int) -> dict[str, Any]:
        """A burst of ``count`` messages each way with rank ``peer``; this side's CPU seconds per message."""
        from tessera.runtime.probe import message_burst

        return message_burst(self.pg, peer, count, nbytes, self.timeout)

    def op_echo(self, nbytes: int = 0, micro_batches: int = 0) -> dict[str, Any]:
        """A reply carrying ``micro_batches`` outputs of ``nbytes`` each, returned as step outputs are."""
        t = torch.zeros(nbytes // 4, dtype=torch.float32)
        return {"outputs": [self.arena.put(m, {"echo": t}) if self.arena is not None else {"echo": t.clone()}
                            for m in range(micro_batches)]}

    def op_time_program(self, graph: KernelGraph, program: Program, weights_path: str | list[str],
                        inputs: list[dict[str, torch.Tensor]], passes: int, warmup: int,
                        min_seconds: float = 0.0, pause_s: float = 0.0) -> dict[str, Any]:
        """Every kernel of one device ``program`` timed inside steps here (its weights loaded for the call)."""
        from tessera.runtime.probe import time_program, zero_state
        from tessera.weights import load_graph_weights

        weights = load_graph_weights(graph, weights_path, program.weights)
        state = [zero_state(graph, program.state) for _ in inputs]
        return {"seconds": time_program(graph, program, weights, inputs, state, passes, warmup, min_seconds,
                                        str(self.device), pause_s)}


_RUN, _FREE, _SEND, _RECV = range(4)
_KINDS = ("run", "free", "send", "recv")


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
        store.set(f"hb/{cfg.worker}", repr(time.time()))
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

    def receive(self) -> dict[str, Any]:
        key = f"cmd/{self.worker}/{self.seq}"
        cmd = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        return cmd

    def reply(self, reply: dict[str, Any]) -> None:
        self.store.set(f"reply/{self.worker}/{self.seq}", pickle.dumps(reply))
        self.seq += 1


class _PipeCommands:
    """Commands and replies over a pipe to the driver (local workers: no polling, one copy)."""

    def __init__(self, conn):
        self.conn = conn

    def wait(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def receive(self) -> dict[str, Any]:
        return pickle.loads(self.conn.recv_bytes())

    def reply(self, reply: dict[str, Any]) -> None:
        self.conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def worker_main(cfg: WorkerConfig, store: dist.Store | None = None, conn=None) -> None:
    """The worker loop: wait for a command, run it, send the reply; until ``stop`` or the driver is gone.
    ``store``: the driver's store (torchrun's rendezvous), else a client of ``cfg.host:cfg.port``; ``conn``:
    a pipe to a local driver for commands and replies (else they go through the store)."""
    torch.set_num_threads(cfg.threads)
    if store is None:
        store = dist.TCPStore(cfg.host, cfg.port, None, False, timeout=timedelta(seconds=60))
    stop = threading.Event()
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
                cmd = commands.receive()
            except (EOFError, OSError):  # the driver closed the pipe
                return
            try:
                reply = {"ok": True, **worker.handle(cmd)}
            except Exception as e:  # noqa: BLE001 - every failure goes back to the driver, which decides
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            commands.reply(reply)
            idle_since = time.monotonic()
            if cmd["op"] == "stop":
                return
    finally:
        stop.set()
        if worker.arena is not None:
            worker.arena.close()
