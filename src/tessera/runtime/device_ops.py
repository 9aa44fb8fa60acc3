"""How a worker moves transfer bytes between its device and the host, and times its kernels, per device type.

Transfers travel over gloo, which reads and writes host memory. On the host (``cpu``, and ``meta`` in tests)
:class:`HostOps` packs a send into a new host tensor and unpacks a receive in place, and kernel time is the
host clock around each kernel: what the runtime always did. On a CUDA device :class:`CudaOps`:

- stages through pinned host buffers, reused per (shape, dtype) once the copy that used them is done;
- copies with ``non_blocking=True`` on a side stream, ordered against the compute stream by CUDA events: a
  send's bytes are snapshotted on the compute stream and copied out on the side stream once an event says the
  snapshot is there, so the next kernels run meanwhile; a receive is copied in on the side stream and the
  compute stream waits on its event before the kernels that read it;
- measures busy time with CUDA events around each run of kernels between transfers (the host clock would
  measure launches only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tessera.graph.ir import KernelGraph
from tessera.program.program import Piece
from tessera.runtime.wire import gather, pack, unpack


@dataclass
class Staged:
    """A send's bytes in host memory; ``event`` (None: already there) completes when the copy into them has."""

    flat: torch.Tensor
    event: Any = None

    def ready(self) -> bool:
        """Whether the bytes are all in host memory (the send may be posted without waiting)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block until the bytes are in host memory."""
        if self.event is not None:
            self.event.synchronize()


class HostBuffers:
    """Host staging buffers reused per (shape, dtype): one handed out (``take``) is not handed out again until
    it is given back (``give``) and the event given with it (anything with ``query()``) has completed.
    ``pin``: page-locked memory (needs CUDA), which a device copies from and to asynchronously."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[torch.Tensor, Any]]] = {}
        self.allocated = 0  # buffers made so far (each reused after)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` and ``dtype`` nobody uses (its contents are stale)."""
        key = (tuple(shape), dtype)
        waiting = self.free.get(key, [])
        for i, (buf, event) in enumerate(waiting):
            if event is None or event.query():
                del waiting[i]
                return buf
        self.allocated += 1
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, event: Any = None) -> None:
        """``buf`` is free once ``event`` (None: now) has completed."""
        self.free.setdefault((tuple(buf.shape), buf.dtype), []).append((buf, event))


class HostOps:
    """Transfers and kernel timing of a worker whose tensors live in host memory (the runtime as it was)."""

    def __init__(self, device: torch.device):
        self.device = device

    def recv_buffer(self, nbytes: int) -> torch.Tensor:
        """A host tensor for a receive of ``nbytes`` bytes."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def stage(self, storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...]) -> Staged:
        """The bytes of ``pieces`` in host memory, for a send."""
        return Staged(pack(storages, pieces))

    def unpack(self, storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...], flat: torch.Tensor,
               graph: KernelGraph | None = None) -> None:
        """Write a received host tensor into the pieces' buffers (allocated if absent: ``graph`` gives sizes)."""
        unpack(storages, pieces, flat, self.device, graph)

    def busy_timer(self) -> EventBusyTimer | None:
        """A timer of kernel runs on the device, or None where the host clock around each kernel is the time."""
        return None

    def begin_step(self) -> None:
        """A step starts (buffers a failed step left lent are never reused)."""

    def end_step(self) -> None:
        """Every send of the step has completed and every receive has been unpacked."""


class EventBusyTimer:
    """Seconds the compute stream spent in runs of kernels, from CUDA events recorded when a run begins
    (:meth:`enter`, once per run) and ends (:meth:`leave`). Gaps inside a run count: the host's launches are
    what keeps the stream busy there."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.open: Any = None
        self.pairs: list[tuple[Any, Any]] = []

    def enter(self) -> None:
        """A kernel (or graph) is about to be launched: open a run unless one is open."""
        if self.open is None:
            self.open = torch.cuda.Event(enable_timing=True)
            self.open.record(self.stream)

    def leave(self) -> None:
        """The run of kernels, if open, ends here (a transfer follows)."""
        if self.open is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            self.pairs.append((self.open, end))
            self.open = None

    def seconds(self) -> float:
        """Busy seconds of every run so far (waits for the last one to finish)."""
        self.leave()
        if not self.pairs:
            return 0.0
        self.pairs[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.pairs) * 1e-3


class CudaOps(HostOps):
    """Transfers through pinned buffers on a side stream and kernel time from CUDA events (module docstring)."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        torch.cuda.set_device(device)  # graphs are captured, and events recorded, on the current device
        self.compute = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)
        self.buffers = HostBuffers(pin=True)
        self.lent: dict[int, tuple[torch.Tensor, Any]] = {}  # this step's buffers: id -> (buffer, last copy's event)

    def recv_buffer(self, nbytes: int) -> torch.Tensor:
        """A pinned host tensor for a receive of ``nbytes`` bytes."""
        buf = self.buffers.take((nbytes,), torch.uint8)
        self.lent[id(buf)] = (buf, None)
        return buf

    def stage(self, storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...]) -> Staged:
        """The bytes of ``pieces`` copied to a pinned host buffer on the side stream (the copy in flight)."""
        snapshot = gather(storages, pieces)  # on the compute stream: later kernels may overwrite these bytes
        taken = torch.cuda.Event()
        taken.record(self.compute)
        host = self.buffers.take(tuple(snapshot.shape), snapshot.dtype)
        self.side.wait_event(taken)
        with torch.cuda.stream(self.side):
            host.copy_(snapshot, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.side)
        snapshot.record_stream(self.side)  # its memory is not reused before the side stream has read it
        self.lent[id(host)] = (host, copied)
        return Staged(host, copied)

    def unpack(self, storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...], flat: torch.Tensor,
               graph: KernelGraph | None = None) -> None:
        """Copy a received pinned tensor to the device on the side stream, then (the compute stream waiting for
        that copy) write it into the pieces' buffers."""
        with torch.cuda.stream(self.side):
            landed = torch.empty(flat.shape, dtype=flat.dtype, device=self.device)
            landed.copy_(flat, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.side)
        self.compute.wait_event(copied)
        landed.record_stream(self.compute)
        unpack(storages, pieces, landed, self.device, graph)
        if id(flat) in self.lent:
            self.lent[id(flat)] = (flat, copied)

    def busy_timer(self) -> EventBusyTimer:
        """CUDA events on the compute stream around each run of kernels."""
        return EventBusyTimer(self.compute)

    def begin_step(self) -> None:
        """Forget buffers a failed step left lent (gloo may still write into them)."""
        self.lent = {}

    def end_step(self) -> None:
        """Give this step's staging buffers back, each free once its last copy has completed."""
        for buf, event in self.lent.values():
            self.buffers.give(buf, event)
        self.lent = {}


def device_ops(device: torch.device | str) -> HostOps:
    """The transfer and timing operations of a worker on ``device``: CUDA's for a CUDA device, else the host's."""
    device = torch.device(device)
    if device.type != "cuda":
        return HostOps(device)
    return CudaOps(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))

