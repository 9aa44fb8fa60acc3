"""Execute a device Program kernel by kernel on real tensors.

Buffers live as untyped storages by name; every kernel argument is rebuilt as the exact strided
view the trace recorded, so a graph traced on `meta` runs bit for bit like eager on a real device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

import tessera.kernels  # noqa: F401  (registers the tessera:: ops a graph may call)
from tessera.errors import TesseraError
from tessera.graph.codec import decode, dtype_from_name
from tessera.graph.ir import KernelGraph, TensorRef
from tessera.graph.values import unpack_values
from tessera.program.program import Program


class ExecutionError(TesseraError):
    """A program could not run: missing weights, wrong inputs, or a kernel failure."""


def resolve_op(name: str):
    """``aten.mm.default`` -> the OpOverload ``torch.ops.aten.mm.default``."""
    ns, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError) as e:
        raise ExecutionError(f"op {name} is not available in this process ({e})") from e


class Executor:
    """Runs a Program of ``graph`` on ``device`` with weights given by buffer name."""

    def __init__(self, graph: KernelGraph, program: Program, weights: Mapping[str, torch.Tensor],
                 device: str | torch.device = "cpu"):
        if program.graph_hash != graph.hash:
            raise ExecutionError(f"program was built for graph {program.graph_hash}, not {graph.hash}")
        self.graph = graph
        self.program = program
        self.device = torch.device(device)
        self.storages: dict[str, torch.UntypedStorage] = {}
        self._static: dict[str, torch.UntypedStorage] = {}
        missing = []
        for name in program.weights:
            buf = graph.buffers[name]
            t = next((weights[n] for n in [name, *buf.aliases] if n in weights), None)
            if t is None:
                missing.append(name)
                continue
            if list(t.shape) != buf.shape or str(t.dtype).removeprefix("torch.") != buf.dtype:
                raise ExecutionError(f"weight {name}: expected {buf.dtype}{buf.shape}, got "
                                     f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
            self._static[name] = t.to(self.device).contiguous().untyped_storage()
        if missing:
            raise ExecutionError(f"{len(missing)} weights missing, e.g. {missing[:3]}")
        for buf in graph.buffers.values():
            if buf.kind == "constant":
                values = unpack_values(buf.values, dtype_from_name(buf.dtype), buf.shape)
                self._static[buf.name] = values.to(self.device).untyped_storage()

    def _materialize(self, ref: TensorRef) -> torch.Tensor:
        storage = self.storages.get(ref.buffer)
        if storage is None:
            buf = self.graph.buffers[ref.buffer]
            if buf.kind not in ("activation", "output"):
                raise ExecutionError(f"buffer {ref.buffer} ({buf.kind}) is not available on {self.device}")
            # an allocation the model made (torch.empty) and later writes into
            storage = torch.zeros(buf.nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
            self.storages[ref.buffer] = storage
        t = torch.empty(0, dtype=dtype_from_name(ref.dtype), device=self.device)
        return t.set_(storage, ref.offset, ref.sizes, ref.strides)

    def _bind_output(self, ref: TensorRef, value: torch.Tensor) -> None:
        present = self.storages.get(ref.buffer)
        if present is not None:
            if value.untyped_storage().data_ptr() != present.data_ptr():
                # the buffer already holds bytes (received from another device): the new ones go into it
                self._materialize(ref).copy_(value)
            return  # else written in place
        buf = self.graph.buffers[ref.buffer]
        st = value.untyped_storage()
        if (st.nbytes() == buf.nbytes and value.storage_offset() == ref.offset
                and list(value.stride()) == ref.strides):
            self.storages[ref.buffer] = st
            return
        # the device kernel chose another layout than the trace recorded: keep the recorded one
        storage = torch.empty(buf.nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
        self.storages[ref.buffer] = storage
        self._materialize(ref).copy_(value)

    def _bind_inputs(self, kind: str, names: list[str], given: Mapping[str, torch.Tensor]) -> None:
        for name in names:
            if name not in given:
                raise ExecutionError(f"{kind} {name!r} is missing (expected {sorted(names)})")
            t, buf = given[name], self.graph.buffers[name]
            if list(t.shape) != buf.shape or str(t.dtype).removeprefix("torch.") != buf.dtype:
                raise ExecutionError(f"{kind} {name!r}: expected {buf.dtype}{buf.shape}, got "
                                     f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
            if t.device != self.device or not t.is_contiguous() or t.storage_offset() != 0:
                if kind == "state":
                    raise ExecutionError(f"state {name!r} must be a contiguous tensor on {self.device}")
                t = t.to(self.device).contiguous().clone()
            self.storages[name] = t.untyped_storage()

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor a buffer view refers to over the current storages (allocated zeroed if unwritten)."""
        return self._materialize(ref)

    def prepare(self, inputs: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
        """Start a step: bind weights, constants, ``inputs`` and ``state``; no activation exists yet."""
        self.prepare_microbatches([inputs], [state])

    def prepare_microbatches(self, inputs: list[Mapping[str, torch.Tensor]], state: list[Mapping[str, torch.Tensor]],
                             input_names: list[str] | None = None, state_names: list[str] | None = None) -> None:
        """Start a step of ``len(inputs)`` micro-batches, each with its own buffer instances, inputs and state
        (only ``input_names`` / ``state_names`` are bound, all of the graph's by default); micro-batch 0 is
        selected."""
        self.instances = []
        for mb_inputs, mb_state in zip(inputs, state, strict=True):
            self.storages = dict(self._static)
            self._bind_inputs("input", self.graph.inputs if input_names is None else input_names, mb_inputs)
            self._bind_inputs("state", self.graph.state if state_names is None else state_names, mb_state)
            self.instances.append(self.storages)
        self.storages = self.instances[0]

    def select(self, microbatch: int) -> None:
        """Make ``microbatch``'s buffer instances the current ones."""
        self.storages = self.instances[microbatch]

    def bind_kernel(self, index: int) -> tuple[Any, list[Any], dict[str, Any]]:
        """The op of kernel ``index`` and its arguments as tensors over the current storages.

        Calling ``func(*args, **kwargs)`` again reruns the kernel on the same tensors (what a profiler
        times); its result is not bound, see :meth:`run_kernel`.
        """
        k = self.graph.kernels[index]
        func = resolve_op(k.op)
        args = decode(k.args, self._materialize, self.device)
        kwargs = {n: decode(v, self._materialize, self.device) for n, v in k.kwargs.items()}
        return func, args, kwargs

    def run_kernel(self, index: int) -> None:
        """Run kernel ``index`` once on the current storages and bind the buffers it produces."""
        k = self.graph.kernels[index]
        func, args, kwargs = self.bind_kernel(index)
        with torch.no_grad():
            try:
                out = func(*args, **kwargs)
            except Exception as e:
                raise ExecutionError(f"kernel {k.id} failed: {e}") from e
            outs = tree_flatten(out)[0]
            for ref_json, value in zip(k.outputs, outs, strict=False):
                if ref_json is not None and isinstance(value, torch.Tensor):
                    self._bind_output(TensorRef.from_json(ref_json), value)

    def outputs(self) -> dict[str, torch.Tensor]:
        """The step outputs as tensors over the current storages."""
        return {name: self._materialize(TensorRef.from_json(ref)) for name, ref in self.graph.outputs.items()}

    def run(self, inputs: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Execute the program; ``state`` tensors are updated in place; returns the step outputs."""
        if self.program.micro_batches != 1:
            raise ExecutionError("a program of several micro-batches needs the distributed runtime")
        self.prepare(inputs, state)
        for ins in self.program.instructions:
            if ins.kind == "run":
                self.run_kernel(ins.kernel)
            elif ins.kind == "free":
                self.storages.pop(ins.buffer, None)
            else:
                raise ExecutionError(f"instruction {ins.kind} needs the distributed runtime")
        return self.outputs()
