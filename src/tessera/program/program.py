"""Per-device instruction lists over (buffer, micro-batch) instances.

A Program is what one device executes (the runtime) or what is timed (the simulator); it names no
engine. From a step's KernelGraph and a placement (kernel -> device) :func:`build_programs` derives:

- which bytes move: a byte-level coherence pass over the graph in program order tracks, per buffer,
  the byte ranges each device holds. A kernel reading bytes its device does not hold receives exactly
  those bytes from the device that holds them, packed with everything else it needs from that device
  into one message (coalesced per source and destination), sent right after the sender last updated
  them. Writes invalidate the other devices' copies. Weights and constants never move (each device
  loads what its kernels read); step inputs come from the driver; state stays on its device.
- the order: each device's kernels form segments (maximal runs with no other device's kernel in
  between); a device runs segment by segment, each for micro-batch 0..M-1, so micro-batch m's transfer
  overlaps m+1's compute. This order is deadlock-free with asynchronous sends.
- when buffers die: each (buffer, micro-batch) instance is freed after its last local use.

Every micro-batch has its own instance of every activation, input, output and state buffer (the graph
is traced at the micro-batch size: its state holds that micro-batch's slots).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from tessera.errors import TesseraError
from tessera.graph.codec import tensor_refs
from tessera.graph.ir import KernelGraph, TensorRef
from tessera.graph.overlap import Region
from tessera.graph.ranges import Ranges

InstructionKind = Literal["run", "send", "recv", "free"]
STATIC_KINDS = ("weight", "constant")


class PlacementError(TesseraError, ValueError):
    """A placement a program cannot be built for (wrong length, state split over devices, ...)."""


@dataclass(frozen=True)
class Instruction:
    """One step of a device program: run a kernel, send or receive a transfer, or free a buffer instance."""

    kind: InstructionKind
    kernel: int | None = None  # run
    buffer: str | None = None  # free
    microbatch: int = 0
    transfer: int | None = None  # send / recv: index into StepPrograms.transfers


@dataclass(frozen=True)
class Piece:
    """Byte ranges of one buffer inside a transfer."""

    buffer: str
    spans: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.spans)


@dataclass(frozen=True)
class Transfer:
    """One message: ``pieces`` of micro-batch ``microbatch``'s buffers from device ``src`` to ``dst``,
    sent after kernel ``after`` ran on src (-1: at the start) and needed before kernel ``before`` on dst
    (len(kernels): at the end of the step, for step outputs)."""

    src: int
    dst: int
    microbatch: int
    pieces: tuple[Piece, ...]
    after: int
    before: int
    tag: int

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass
class Program:
    """The ordered instructions of one device, with the weights it loads and the buffers it is handed."""

    device: str
    graph_hash: str
    instructions: list[Instruction]
    weights: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # step inputs its kernels read (the driver sends them)
    state: list[str] = field(default_factory=list)  # state buffers its kernels touch (they live here)
    outputs: list[str] = field(default_factory=list)  # step outputs this device returns
    micro_batches: int = 1

    def kernels(self) -> list[int]:
        return [i.kernel for i in self.instructions if i.kind == "run"]


@dataclass
class StepPrograms:
    """One step's programs on every device of a placement, and the transfers between them."""

    graph_hash: str
    placement: list[int]  # kernel -> device index
    devices: list[str]
    micro_batches: int
    programs: list[Program]
    transfers: list[Transfer]

    @property
    def cut_bytes(self) -> int:
        """Bytes moved between devices per step (all micro-batches)."""
        return sum(t.nbytes for t in self.transfers)

    def state_holder(self) -> dict[str, int]:
        """State buffer -> the device whose kernels touch it."""
        return {name: d for d, p in enumerate(self.programs) for name in p.state}


def kernel_buffers(graph: KernelGraph, kernel: int) -> set[str]:
    """Names of every buffer a kernel's arguments or outputs refer to."""
    k = graph.kernels[kernel]
    refs = tensor_refs(k.args) + tensor_refs(list(k.kwargs.values())) + tensor_refs(k.outputs)
    return {r.buffer for r in refs}


def single_device_program(graph: KernelGraph, device: str = "cpu") -> Program:
    """Every kernel on one device, in program order, buffers freed after their last use."""
    return build_programs(graph, [0] * len(graph.kernels), [device]).programs[0]


def _ref_ranges(ref: TensorRef) -> Ranges:
    from tessera.graph.codec import dtype_from_name

    itemsize = dtype_from_name(ref.dtype).itemsize
    return Ranges.region(Region(ref.offset, tuple(ref.sizes), tuple(ref.strides), itemsize))


def check_placement(graph: KernelGraph, placement: list[int], devices: int) -> None:
    """Raise a clear error unless ``placement`` gives every kernel a device and keeps each state buffer
    on one device."""
    if len(placement) != len(graph.kernels):
        raise PlacementError(f"the placement has {len(placement)} entries but the graph has "
                             f"{len(graph.kernels)} kernels")
    bad = [k for k, d in enumerate(placement) if not 0 <= d < devices]
    if bad:
        raise PlacementError(f"kernel {graph.kernels[bad[0]].id} is placed on device {placement[bad[0]]}, "
                             f"but there are {devices} devices (0..{devices - 1})")
    where: dict[str, set[int]] = defaultdict(set)
    state = set(graph.state)
    for a in graph.accesses:
        if a.buffer in state:
            where[a.buffer].add(placement[a.kernel])
    split = {n: sorted(d) for n, d in where.items() if len(d) > 1}
    if split:
        name, ds = next(iter(split.items()))
        raise PlacementError(f"state {name} is touched by kernels on devices {ds}: state stays with every "
                             f"kernel that touches it ({len(split)} state buffers split); place them together")


def build_programs(graph: KernelGraph, placement: list[int], devices: list[str],
                   micro_batches: int = 1) -> StepPrograms:
    """Per-device programs for ``graph`` with kernel k on ``devices[placement[k]]`` and ``micro_batches``
    micro-batches in flight (see the module docstring)."""
    n, nk = len(devices), len(graph.kernels)
    if micro_batches < 1:
        raise PlacementError(f"micro_batches must be >= 1, got {micro_batches}")
    check_placement(graph, placement, n)
    kinds = {name: b.kind for name, b in graph.buffers.items()}
    accesses = defaultdict(list)
    for a in graph.accesses:
        accesses[a.kernel].append(a)

    held: dict[str, dict[int, Ranges]] = defaultdict(dict)  # buffer -> device -> bytes it holds
    updated: dict[tuple[str, int], list[tuple[Ranges, int]]] = defaultdict(list)  # bytes that changed after kernel
    uses: dict[int, dict[str, int]] = defaultdict(dict)  # device -> buffer -> last event position
    weights: list[set[str]] = [set() for _ in range(n)]
    inputs: list[set[str]] = [set() for _ in range(n)]
    state: list[set[str]] = [set() for _ in range(n)]
    pending: list[tuple[int, int, int, list[Piece]]] = []  # (src, dst, after, pieces), in creation order
    recvs_before: dict[tuple[int, int], list[int]] = defaultdict(list)  # (dst, kernel) -> pending indices
    before: list[int] = []  # per pending transfer, the kernel it is received for

    def need(d: int, consumer: int, name: str, want: Ranges) -> None:
        """Make ``want`` bytes of ``name`` valid on d before ``consumer``, from whoever holds them."""
        missing = want - held[name].get(d, Ranges())
        by_src: dict[int, list[Ranges]] = defaultdict(list)
        for s, have in held[name].items():
            if s == d or not missing:
                continue
            got = missing & have
            if got:
                by_src[s].append(got)
                missing = missing - got
        if missing and kinds[name] not in ("activation", "output"):
            raise PlacementError(f"kernel {graph.kernels[consumer].id if consumer < nk else 'output'} reads "
                                 f"{missing.nbytes} bytes of {kinds[name]} {name} that no device holds")
        # bytes no kernel wrote yet (an allocation read before it is filled) need no transfer
        for s, parts in by_src.items():
            got = parts[0]
            for p in parts[1:]:
                got = got | p
            after = max((k for r, k in updated[(name, s)] if r & got), default=-1)
            key = (d, consumer)
            merged = next((i for i in recvs_before[key] if pending[i][0] == s), None)
            if merged is None:
                recvs_before[key].append(len(pending))
                pending.append((s, d, after, [Piece(name, got.spans)]))
                before.append(consumer)
            else:
                src, dst, aft, pieces = pending[merged]
                pending[merged] = (src, dst, max(aft, after), [*pieces, Piece(name, got.spans)])
            held[name][d] = held[name].get(d, Ranges()) | got
            updated[(name, d)].append((got, consumer))  # forwarded only after it arrived

    for k in range(nk):
        d = placement[k]
        for a in accesses[k]:
            kind = kinds[a.buffer]
            if kind in STATIC_KINDS:
                if kind == "weight":
                    weights[d].add(a.buffer)
                continue
            if kind == "input":
                inputs[d].add(a.buffer)
                held[a.buffer][d] = Ranges(((0, graph.buffers[a.buffer].nbytes),))
            elif kind == "state":
                state[d].add(a.buffer)
                held[a.buffer][d] = Ranges(((0, graph.buffers[a.buffer].nbytes),))
            if a.mode == "read" and not (kind in ("activation", "output") and held[a.buffer].keys() <= {d}):
                need(d, k, a.buffer, Ranges.region(a.region))  # (bytes only this device wrote need nothing)
        for a in accesses[k]:
            if kinds[a.buffer] in STATIC_KINDS or a.mode == "read":
                continue
            wrote = Ranges.region(a.region)
            for s in list(held[a.buffer]):
                if s != d:
                    held[a.buffer][s] = held[a.buffer][s] - wrote
            held[a.buffer][d] = held[a.buffer].get(d, Ranges()) | wrote
            updated[(a.buffer, d)].append((wrote, k))
        # a fused unit's extra outputs may appear in its accesses only (a written, never read residual): freed too
        for name in kernel_buffers(graph, k) | {a.buffer for a in accesses[k]}:
            if kinds[name] not in STATIC_KINDS:
                uses[d][name] = k
            elif kinds[name] == "weight":
                weights[d].add(name)

    # step outputs: gathered on the device holding most of their bytes
    outputs: list[list[str]] = [[] for _ in range(n)]
    for out_name, ref_json in graph.outputs.items():
        ref = TensorRef.from_json(ref_json)
        want = _ref_ranges(ref)
        holders = held[ref.buffer]
        if not holders:
            raise PlacementError(f"step output {out_name} ({ref.buffer}) is written by no kernel")
        d = max(holders, key=lambda s: ((holders[s] & want).nbytes, -s))
        need(d, nk, ref.buffer, want)
        uses[d][ref.buffer] = nk
        outputs[d].append(out_name)

    for s, _, after, pieces in pending:  # a sender keeps what it sends until the send
        for p in pieces:
            uses[s][p.buffer] = max(uses[s].get(p.buffer, -1), after)
    per_mb = len(pending)
    transfers = [Transfer(s, d, m, tuple(pieces), after, before[i], tag=m * per_mb + i)
                 for m in range(micro_batches) for i, (s, d, after, pieces) in enumerate(pending)]
    kept = {TensorRef.from_json(r).buffer for r in graph.outputs.values()}  # step outputs are collected, not freed
    freeable = {name for name, kind in kinds.items() if kind in ("activation", "input", "output")} - kept
    programs = [_device_program(graph, placement, d, devices[d], micro_batches, pending, recvs_before, uses[d],
                                freeable, sorted(weights[d]), sorted(inputs[d]), sorted(state[d]), outputs[d])
                for d in range(n)]
    return StepPrograms(graph.hash, list(placement), list(devices), micro_batches, programs, transfers)


def _device_program(graph: KernelGraph, placement: list[int], d: int, device: str, micro_batches: int,
                    pending, recvs_before, last_use: dict[str, int], freeable: set[str], weights, inputs, state,
                    outputs: list[str]) -> Program:
    nk = len(graph.kernels)
    per_mb = len(pending)
    sends_after: dict[int, list[int]] = defaultdict(list)
    for i, (s, _, after, _) in enumerate(pending):
        if s == d:
            sends_after[after].append(i)
    mine = [k for k in range(nk) if placement[k] == d]
    segments: list[list[int]] = []
    for k in mine:
        if segments and segments[-1][-1] == k - 1:  # no other device's kernel in between
            segments[-1].append(k)
        else:
            segments.append([k])
    if not segments and (sends_after or outputs):
        segments.append([])
    frees_after: dict[int, list[str]] = defaultdict(list)
    for name, pos in last_use.items():
        if name in freeable:
            frees_after[pos].append(name)
    instructions: list[Instruction] = []
    for si, seg in enumerate(segments):
        for m in range(micro_batches):
            events: list[Instruction] = []
            if si == 0:
                events += [Instruction("send", microbatch=m, transfer=m * per_mb + i) for i in sends_after.get(-1, ())]
            for k in seg:
                events += [Instruction("recv", microbatch=m, transfer=m * per_mb + i)
                           for i in recvs_before.get((d, k), ())]
                events.append(Instruction("run", kernel=k, microbatch=m))
                events += [Instruction("send", microbatch=m, transfer=m * per_mb + i) for i in sends_after.get(k, ())]
                events += [Instruction("free", buffer=b, microbatch=m) for b in sorted(frees_after.get(k, ()))]
            if si == len(segments) - 1:
                events += [Instruction("recv", microbatch=m, transfer=m * per_mb + i)
                           for i in recvs_before.get((d, nk), ())]
            instructions += events
    return Program(device=device, graph_hash=graph.hash, instructions=instructions, weights=weights, inputs=inputs,
                   state=state, outputs=outputs, micro_batches=micro_batches)
