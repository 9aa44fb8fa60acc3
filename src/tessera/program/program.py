"""Per-device instruction lists over (buffer, micro-batch) instances.

A Program is what a device executes (the runtime) or what is timed (the simulator). This module
builds the single-device case used for reference replay: run every kernel in order and free each
activation after its last use. Multi-device programs (send/receive of byte ranges, state moves)
extend the same instruction set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tessera.graph.codec import tensor_refs
from tessera.graph.ir import KernelGraph

InstructionKind = Literal["run", "send", "recv", "move", "free"]


@dataclass(frozen=True)
class Instruction:
    """One step of a device program."""

    kind: InstructionKind
    kernel: int | None = None  # run
    buffer: str | None = None  # free / send / recv / move
    microbatch: int = 0


@dataclass
class Program:
    """The ordered instructions of one device, with the weights it must load."""

    device: str
    graph_hash: str
    instructions: list[Instruction]
    weights: list[str] = field(default_factory=list)

    def kernels(self) -> list[int]:
        return [i.kernel for i in self.instructions if i.kind == "run"]


def kernel_buffers(graph: KernelGraph, kernel: int) -> set[str]:
    """Names of every buffer a kernel's arguments or outputs refer to."""
    k = graph.kernels[kernel]
    refs = tensor_refs(k.args) + tensor_refs(list(k.kwargs.values())) + tensor_refs(k.outputs)
    return {r.buffer for r in refs}


def single_device_program(graph: KernelGraph, device: str = "cpu") -> Program:
    """Every kernel on one device, in program order, activations freed after their last use."""
    last_use: dict[str, int] = {}
    used: set[str] = set()
    for k in graph.kernels:
        for name in kernel_buffers(graph, k.index):
            last_use[name] = k.index
            used.add(name)
    frees: dict[int, list[str]] = {}
    for name, idx in last_use.items():
        if graph.buffers[name].kind == "activation":
            frees.setdefault(idx, []).append(name)
    instructions: list[Instruction] = []
    for k in graph.kernels:
        instructions.append(Instruction("run", kernel=k.index))
        for name in sorted(frees.get(k.index, ())):
            instructions.append(Instruction("free", buffer=name))
    weights = sorted(n for n in used if graph.buffers[n].kind == "weight")
    return Program(device=device, graph_hash=graph.hash, instructions=instructions, weights=weights)
