"""The driver's side of the workers: start them (local processes, or torchrun ranks), send commands
(:mod:`tessera.runtime.commands`), collect replies with timeouts, and notice a lost worker within a bounded
time."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from multiprocessing import connection as mp_connection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tessera.errors import TesseraError
from tessera.graph.codec import dtype_from_name
from tessera.runtime.commands import Command, Failure, Ping, Reply, SharedTensor, Stop
from tessera.runtime.coordination import LOOPBACK, LocalPlane, StoreTampered
from tessera.runtime.wire import decode, encode
from tessera.runtime.worker import WorkerConfig, nap, worker_main

BACKENDS = ("gloo", "nccl")
START_TIMEOUT_S = 120.0
LOST_AFTER_S = 2.0  # no heartbeat for this long: the worker is lost
LIVENESS_S = 0.1  # while waiting for replies, look at the workers' liveness this often


class RuntimeSetupError(TesseraError):
    """The runtime cannot start as asked (backend, devices, workers)."""


class WorkerFailed(TesseraError):
    """A worker reported an error while running a command."""

    def __init__(self, device: str, message: str, detail: str = ""):
        super().__init__(f"worker {device}: {message}")
        self.device, self.detail = device, detail


class WorkerLost(TesseraError):
    """A worker process died or stopped answering."""

    def __init__(self, worker: int, device: str, how: str, seconds: float):
        super().__init__(f"worker {device} was lost ({how}; noticed after {seconds:.2f} s)")
        self.worker, self.device, self.how, self.seconds = worker, device, how, seconds


def check_backend(backend: str, devices: list[str]) -> None:
    """Raise a clear error unless ``backend`` can carry transfers between ``devices``."""
    if backend not in BACKENDS:
        raise RuntimeSetupError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeSetupError("backend nccl needs CUDA GPUs, and this machine has none; use --backend gloo "
                                    "(CPU workers, or CUDA workers staging transfers through host memory)")
        raise RuntimeSetupError("backend nccl is not supported by this runtime yet: NCCL matches messages by "
                                "order, not tag; use --backend gloo, which stages CUDA transfers through the host")
    for d in devices:
        if d.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeSetupError(f"worker device {d} needs CUDA, and this machine has none")


class WorkerPool:
    """Worker processes (one per device) and the store that carries commands and heartbeats."""

    def __init__(self, store: dist.Store, devices: list[str], processes: list[Any] | None, threads: int,
                 pipes: list[Any] | None = None, plane: Any = None):
        self.store = store
        self.plane = plane  # the coordination plane the pool made (closed with it), if any
        self.pipes = pipes  # local workers: commands and replies over pipes; else through the store
        self.devices = list(devices)
        self.processes = processes
        self.threads = threads
        self.seq = [0] * len(devices)
        self.lost: set[int] = set()
        self.epoch = 0  # process groups formed so far
        self._arenas: dict[str, Any] = {}  # shared-memory output arenas of local workers, by name
        self.pending: dict[int, deque[str]] = {w: deque() for w in range(len(devices))}  # unanswered reply keys
        # local pools: (devices, transfer timeout, CUDA graphs) to respawn with
        self._spawn: tuple[list[str], float, bool] | None = None

    @classmethod
    def local(cls, workers: int, threads: int | None = None, devices: list[str] | None = None,
              transfer_timeout_s: float = 30.0, backend: str = "gloo", allow_lost: bool = False,
              cuda_graphs: bool = True) -> WorkerPool:
        """Spawn ``workers`` processes on this host with ``threads`` torch threads each (cores / workers).
        ``allow_lost``: a worker lost while starting is left out (in ``lost``) as long as one starts; else it
        raises WorkerLost. ``cuda_graphs``: CUDA workers replay their program segments from CUDA graphs (else
        they run every kernel eagerly); no effect on CPU workers."""
        if workers < 1:
            raise RuntimeSetupError(f"need at least one worker, got {workers}")
        devices = devices or ["cpu"] * workers
        if len(devices) != workers:
            raise RuntimeSetupError(f"{workers} workers but {len(devices)} devices given")
        check_backend(backend, devices)
        threads = threads or max(1, (os.cpu_count() or 1) // workers)
        plane = LocalPlane.create()  # no listening socket: a private FileStore and a secret
        ctx = mp.get_context("spawn")
        procs, pipes = [], []
        try:
            for w in range(workers):
                cfg = WorkerConfig(w, LOOPBACK, 0, threads, devices[w], transfer_timeout_s, parent_pid=os.getpid(),
                                   shared_outputs=True, plane=plane.address, cuda_graphs=cuda_graphs)
                mine, theirs = ctx.Pipe(duplex=True)
                p = ctx.Process(target=worker_main, args=(cfg, None, theirs), daemon=True,
                                name=f"tessera-worker-{w}")
                p.start()
                theirs.close()
                procs.append(p)
                pipes.append(mine)
        except BaseException:
            for p in procs:
                p.kill()
            plane.close()
            raise
        pool = cls(plane.store, [f"{d}:{w}" if d == "cpu" else d for w, d in enumerate(devices)], procs, threads,
                   pipes, plane)
        pool._spawn = (list(devices), transfer_timeout_s, cuda_graphs)
        try:
            pool.ping_alive(allow_lost)
        except BaseException:
            pool.close()
            raise
        return pool

    def ping_alive(self, allow_lost: bool) -> None:
        """Wait until every live worker answers a ping; a lost one raises WorkerLost unless ``allow_lost`` (and
        some other worker answers)."""
        while True:
            try:
                self.call({w: Ping() for w in self.alive}, START_TIMEOUT_S)
                return
            except WorkerLost:
                if not allow_lost:
                    raise
                self.drain(START_TIMEOUT_S)
                if not self.alive:
                    raise

    @classmethod
    def attach(cls, store: dist.Store, workers: int, threads: int, devices: list[str] | None = None,
               plane: Any = None) -> WorkerPool:
        """Workers started elsewhere (torchrun ranks 1..N) that share ``store`` (of ``plane``, closed with the
        pool)."""
        devices = devices or [f"rank{w + 1}" for w in range(workers)]
        pool = cls(store, devices, None, threads, plane=plane)
        pool.call({w: Ping() for w in range(workers)}, START_TIMEOUT_S)
        return pool

    @property
    def alive(self) -> list[int]:
        return [w for w in range(len(self.devices)) if w not in self.lost]

    def _check(self, w: int, waited: float) -> None:
        """Raise WorkerLost if worker ``w`` is gone (process dead, or its heartbeat stopped)."""
        if self.processes is not None:  # local: the process itself says (heartbeats are for remote workers)
            if not self.processes[w].is_alive():
                self.lost.add(w)
                raise WorkerLost(w, self.devices[w], f"process exited with code {self.processes[w].exitcode}", waited)
            return
        try:
            beat = float(self.store.get(f"hb/{w}"))
        except StoreTampered:
            raise
        except Exception:  # noqa: BLE001 - no heartbeat yet
            return
        if time.time() - beat > LOST_AFTER_S:
            self.lost.add(w)
            raise WorkerLost(w, self.devices[w], f"no heartbeat for {time.time() - beat:.1f} s", waited)

    def send(self, w: int, cmd: Command) -> str:
        """Queue ``cmd`` for worker ``w``; returns the key its reply will have."""
        data = encode(cmd)
        n = self.seq[w]
        self.seq[w] += 1
        if self.pipes is not None:
            try:
                self.pipes[w].send_bytes(data)
            except (BrokenPipeError, EOFError, OSError):  # the worker died while idle: say which, not "Broken pipe"
                self.seq[w] -= 1
                self.lost.add(w)
                code = self.processes[w].exitcode if self.processes is not None else None
                how = f"process exited with code {code}" if code is not None else "its pipe closed"
                raise WorkerLost(w, self.devices[w], how, 0.0) from None
        else:
            self.store.set(f"cmd/{w}/{n}", data)
        return f"reply/{w}/{n}"

    def _ready(self, w: int, key: str, timeout_s: float = 0.0) -> bool:
        """Whether worker ``w``'s reply ``key`` is there (waiting at most ``timeout_s`` on a pipe)."""
        if self.pipes is not None:
            try:
                return self.pipes[w].poll(timeout_s)
            except (EOFError, OSError):
                return False
        return self.store.check([key])

    def submit(self, w: int, cmd: Command) -> None:
        """Send worker ``w`` a command without waiting; its reply comes from :meth:`next_reply` (replies of one
        worker arrive in the order of its commands)."""
        if w in self.lost:
            raise WorkerLost(w, self.devices[w], "lost earlier", 0.0)
        self.pending[w].append(self.send(w, cmd))

    def next_reply(self, workers, timeout_s: float, raise_failed: bool = True,
                   poll_s: float | None = None) -> tuple[int, Reply] | None:
        """The next reply of any of ``workers`` that have commands outstanding (a worker error raises
        WorkerFailed unless not ``raise_failed``, a lost worker WorkerLost as soon as it is noticed, no reply
        within ``timeout_s`` WorkerLost); with ``poll_s``, None when no reply came within that long."""
        waiting = [w for w in workers if self.pending[w]]
        if not waiting:
            raise RuntimeSetupError("no command is outstanding on these workers")
        start = time.monotonic()
        while True:
            if self.pipes is not None:
                wait_s = LIVENESS_S if poll_s is None else max(0.0, min(LIVENESS_S, poll_s - (time.monotonic() - start)))
                ready = mp_connection.wait([self.pipes[w] for w in waiting], timeout=wait_s)
                w = next((v for v in waiting if self.pipes[v] in ready), None)
            else:
                w = next((v for v in waiting if self._ready(v, self.pending[v][0])), None)
            if w is not None:
                reply = self._take(w, self.pending[w][0])
                if raise_failed and isinstance(reply, Failure):
                    raise WorkerFailed(self.devices[w], reply.error, reply.traceback)
                return w, reply
            waited = time.monotonic() - start
            for v in waiting:
                self._check(v, waited)
            if poll_s is not None and waited >= poll_s:
                return None
            if waited > timeout_s:
                v = waiting[0]
                self.lost.add(v)
                raise WorkerLost(v, self.devices[v], f"no reply within {timeout_s:.0f} s", waited)
            if self.pipes is None:
                time.sleep(nap(waited))

    def call(self, cmds: dict[int, Command], timeout_s: float) -> dict[int, Reply]:
        """Send each worker its command and wait for all replies; a worker error raises WorkerFailed after
        every reply is in, a lost worker WorkerLost as soon as it is noticed."""
        for w, cmd in cmds.items():
            if self.pending[w]:
                raise RuntimeSetupError(f"worker {self.devices[w]} still has {len(self.pending[w])} commands "
                                        "outstanding")
            self.submit(w, cmd)
        replies: dict[int, Reply] = {}
        while len(replies) < len(cmds):
            w, reply = self.next_reply([v for v in cmds if v not in replies], timeout_s, raise_failed=False)
            replies[w] = reply
        failed = [(w, r) for w, r in replies.items() if isinstance(r, Failure)]
        if failed:
            w, r = failed[0]
            raise WorkerFailed(self.devices[w], r.error, r.traceback)
        return replies

    def _take(self, w: int, key: str) -> Reply:
        if self.pipes is not None:
            try:
                data = self.pipes[w].recv_bytes()
            except (EOFError, OSError):  # the worker's end closed: it died
                self.pending[w].clear()
                self.lost.add(w)
                code = None
                if self.processes is not None:
                    self.processes[w].join(1.0)
                    code = self.processes[w].exitcode
                how = f"process exited with code {code}" if code is not None else "its pipe closed"
                raise WorkerLost(w, self.devices[w], how, 0.0) from None
        else:
            data = self.store.get(key)
            self.store.delete_key(key)
        self.pending[w].popleft()
        reply = decode(data)
        for outputs in getattr(reply, "outputs", ()):
            for name, value in outputs.items():
                if isinstance(value, SharedTensor):
                    outputs[name] = self._read_shared(*value)
        return reply

    def _read_shared(self, arena: str, offset: int, dtype: str, shape: list[int]) -> torch.Tensor:
        """A copy of a tensor a local worker left in its shared-memory arena."""
        from multiprocessing import shared_memory

        shm = self._arenas.get(arena)
        if shm is None:  # the worker created it and unlinks it; attaching registers nothing here
            shm = shared_memory.SharedMemory(name=arena)
            self._arenas[arena] = shm
        dt = dtype_from_name(dtype)
        n = math.prod(shape) * dt.itemsize
        # a plain memcpy: a torch copy of this size would wake the driver's idle OpenMP threads (ms per copy)
        raw = np.frombuffer(shm.buf, dtype=np.uint8, count=n, offset=offset).copy()
        return torch.from_numpy(raw).view(dt).view(shape)

    def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the live workers' unanswered replies and drop them: after a lost
        peer, the survivors fail their step (or time out) before taking new commands."""
        deadline = time.monotonic() + timeout_s
        for w in range(len(self.devices)):
            while self.pending[w]:
                if w in self.lost:
                    self.pending[w].clear()
                    break
                key = self.pending[w][0]
                began = time.monotonic()
                while not self._ready(w, key, LIVENESS_S):
                    try:
                        self._check(w, 0.0)
                    except WorkerLost:
                        self.pending[w].clear()
                        break
                    if time.monotonic() > deadline:
                        self.lost.add(w)
                        self.pending[w].clear()
                        break
                    if self.pipes is None:
                        time.sleep(nap(time.monotonic() - began))
                else:
                    with contextlib.suppress(WorkerLost):
                        self._take(w, key)

    def respawn(self, w: int) -> None:
        """Start a new process for lost local worker ``w`` (same device, threads and coordination plane) and
        wait until it answers; it holds nothing until a runner loads it.

        Raises:
            RuntimeSetupError: the pool's workers were not started here, or ``w`` is not lost.
            WorkerLost: the new process did not answer either.
        """
        if self._spawn is None or self.processes is None or self.pipes is None:
            raise RuntimeSetupError("only workers this pool started on this host can be started again")
        if w not in self.lost:
            raise RuntimeSetupError(f"worker {self.devices[w]} is not lost; only a lost worker is started again")
        devices, transfer_timeout_s, cuda_graphs = self._spawn
        cfg = WorkerConfig(w, LOOPBACK, 0, self.threads, devices[w], transfer_timeout_s, parent_pid=os.getpid(),
                           shared_outputs=True, plane=self.plane.address, cuda_graphs=cuda_graphs)
        mine, theirs = mp.get_context("spawn").Pipe(duplex=True)
        p = mp.get_context("spawn").Process(target=worker_main, args=(cfg, None, theirs), daemon=True,
                                            name=f"tessera-worker-{w}")
        p.start()
        theirs.close()
        with contextlib.suppress(OSError):
            self.pipes[w].close()
        self.processes[w], self.pipes[w] = p, mine
        self.pending[w].clear()
        self.lost.discard(w)
        self.call({w: Ping()}, START_TIMEOUT_S)

    def kill(self, w: int) -> None:
        """Kill worker ``w``'s process (fault tests)."""
        if self.processes is None:
            raise RuntimeSetupError("only local workers can be killed from the driver")
        self.processes[w].kill()

    def close(self) -> None:
        """Stop every live worker (and wait for local processes)."""
        for w in self.alive:
            with contextlib.suppress(Exception):  # closing anyway
                self.send(w, Stop())
        if self.processes is not None:
            for p in self.processes:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        for shm in self._arenas.values():
            shm.close()
            if self.processes is not None:  # a killed worker could not unlink its arena; the others did already
                with contextlib.suppress(Exception):
                    shm.unlink()
        self._arenas = {}
        if self.plane is not None:
            self.plane.close()
            self.plane = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
