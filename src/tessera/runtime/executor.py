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
from tessera.kernels.invariant import invariant_op
from tessera.kernels.prepacked import PackedWeights, packable
from tessera.kernels.replay import replay_op
from tessera.kernels.sample import with_sampling_defaults
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
    """Runs a Program of ``graph`` on ``device`` with weights given by buffer name. With ``batch_invariant``
    its GEMMs run row by row (`tessera.kernels.invariant`): a row's results do not depend on the batch.
    Otherwise, on a CPU, bf16 GEMMs of whole weights run on packed copies (`tessera.kernels.prepacked`, the
    same bits), held by ``packed``: pass one object to every executor over the same weights to share them
    (by default each executor packs its own); ``prepack=False`` runs the GEMMs as traced."""

    def __init__(self, graph: KernelGraph, program: Program, weights: Mapping[str, torch.Tensor],
                 device: str | torch.device = "cpu", batch_invariant: bool = False,
                 packed: PackedWeights | None = None, prepack: bool = True):
        if program.graph_hash != graph.hash:
            raise ExecutionError(f"program was built for graph {program.graph_hash}, not {graph.hash}")
        self.graph = graph
        self.program = program
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        self.packed = None if batch_invariant or not prepack or self.device.type != "cpu" else (
            packed if packed is not None else PackedWeights())
        self.storages: dict[str, torch.UntypedStorage] = {}
        self._static: dict[str, torch.UntypedStorage] = {}
        self._static_views: dict[str, dict[tuple, torch.Tensor]] = {}  # weight / constant -> view key -> view
        self._calls: dict[int, _Call] = {}
        self.instances: list[dict[str, torch.UntypedStorage]] = []  # per micro-batch: buffer -> storage
        self._view_caches: list[dict] = [{}]  # per micro-batch: buffer -> view key -> (storage, tensor)
        self._views = self._view_caches[0]
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
        return self._tensor(_Slot.of(ref))

    def _tensor(self, slot: _Slot) -> torch.Tensor:
        """The view ``slot`` over the current storages (cached while the buffer's storage stays the same)."""
        storage = self.storages.get(slot.buffer)
        if storage is None:
            buf = self.graph.buffers[slot.buffer]
            if buf.kind not in ("activation", "output"):
                raise ExecutionError(f"buffer {slot.buffer} ({buf.kind}) is not available on {self.device}")
            # an allocation the model made (torch.empty) and later writes into
            storage = torch.zeros(buf.nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
            self.storages[slot.buffer] = storage
        views = self._views.get(slot.buffer)
        if views is None:
            views = self._views[slot.buffer] = {}
        else:
            hit = views.get(slot.key)
            if hit is not None and hit[0] is storage:
                return hit[1]
            # another view of the same storage and dtype: restriding it is cheaper than a new tensor
            base = next((t for st, t in views.values() if st is storage and t.dtype == slot.dtype), None)
            if base is not None:
                t = base.as_strided(slot.sizes, slot.strides, slot.offset)
                views[slot.key] = (storage, t)
                return t
        t = torch.empty(0, dtype=slot.dtype, device=self.device).set_(storage, slot.offset, slot.sizes, slot.strides)
        views[slot.key] = (storage, t)
        return t

    def _bind_output(self, slot: _Slot, value: torch.Tensor) -> None:
        present = self.storages.get(slot.buffer)
        if present is not None:
            if value.untyped_storage().data_ptr() != present.data_ptr():
                # the buffer already holds bytes (received from another device): the new ones go into it
                self._tensor(slot).copy_(value)
            return  # else written in place
        st = value.untyped_storage()
        if slot.recorded_layout is None:  # the same op on the same layouts returns the same layout every time
            slot.recorded_layout = (st.nbytes() == slot.nbytes and value.storage_offset() == slot.offset
                                    and value.stride() == slot.strides)
        if slot.recorded_layout:  # the usual case: a new buffer in the traced layout, its first view cached
            self.storages[slot.buffer] = st
            self._views[slot.buffer] = {slot.key: (st, value)}
            return
        # the device kernel chose another layout than the trace recorded: keep the recorded one
        storage = torch.empty(slot.nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
        self.storages[slot.buffer] = storage
        self._tensor(slot).copy_(value)

    def _bind_inputs(self, kind: str, names: list[str], given: Mapping[str, torch.Tensor]) -> None:
        if kind == "input" and "temperature" in self.graph.buffers:  # sampler inputs left out: greedy
            given = with_sampling_defaults(names, dict(given), self.graph.buffers["temperature"].shape[0])
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
        for m, (mb_inputs, mb_state) in enumerate(zip(inputs, state, strict=True)):
            self.prepare_microbatch(m, mb_inputs, mb_state, input_names, state_names)
        self.select(0)

    def prepare_microbatch(self, microbatch: int, inputs: Mapping[str, torch.Tensor],
                           state: Mapping[str, torch.Tensor], input_names: list[str] | None = None,
                           state_names: list[str] | None = None) -> None:
        """Fresh buffer instances for one micro-batch (the others keep theirs), selected."""
        while len(self._view_caches) <= microbatch:
            self._view_caches.append({})
        while len(self.instances) <= microbatch:
            self.instances.append({})
        self.storages = dict(self._static)
        self._bind_inputs("input", self.graph.inputs if input_names is None else input_names, inputs)
        self._bind_inputs("state", self.graph.state if state_names is None else state_names, state)
        self.instances[microbatch] = self.storages
        self._views = self._view_caches[microbatch]

    def select(self, microbatch: int) -> None:
        """Make ``microbatch``'s buffer instances the current ones."""
        self.storages = self.instances[microbatch]
        self._views = self._view_caches[microbatch]

    def release(self, microbatch: int | None = None) -> None:
        """Drop the buffer instances and cached activation views of one micro-batch, or of all (the step is
        over)."""
        for m in range(len(self.instances)) if microbatch is None else [microbatch]:
            if m < len(self.instances):
                self.instances[m] = {}
            cache = self._view_caches[m] if m < len(self._view_caches) else {}
            for name in [b for b in cache if b not in self._static]:
                del cache[name]
        if microbatch is None:
            self.instances = []
        self.storages = {}

    def _compiled(self, index: int) -> _Call:
        call = self._calls.get(index)
        if call is None:
            call = _Call.compile(self.graph, index, self.device, self.batch_invariant)
            gemm = self._packed_gemm(self.graph.kernels[index].op, call.args)
            if gemm is not None:
                call.func = call.op = gemm
            # weights and constants never change storage: their views are bound once, not refilled every call
            static = [h for h in call.holes if h[2].buffer in self._static]
            for container, key, slot in static:
                container[key] = self._static_view(slot)
            call.holes = [h for h in call.holes if h[2].buffer not in self._static]
            self._calls[index] = call
        return call

    def _packed_gemm(self, op: str, args: list):
        """The kernel on packed weights for a GEMM of whole bf16 weights without bias (``aten.mm`` of a weight's
        transpose, ``aten.linear``, ``tessera::merged_linear``), or None to run the op as traced."""
        if self.packed is None:
            return None
        one_weight = ((op == "aten.mm.default" and len(args) == 2 and self._whole_weight(args[1], transposed=True))
                      or (op == "aten.linear.default" and (len(args) == 2 or (len(args) == 3 and args[2] is None))
                          and self._whole_weight(args[1])))
        if one_weight:
            slots = [args[1]]
        elif (op == "tessera.merged_linear.default" and len(args) == 3 and not args[2] and isinstance(args[1], list)
              and args[1] and all(self._whole_weight(w) for w in args[1])):
            slots = args[1]
        else:
            return None
        names = tuple(w.buffer for w in slots)
        weights = [torch.empty(0, dtype=w.dtype, device=self.device).set_(self._static[w.buffer], 0,
                                                                            self.graph.buffers[w.buffer].shape)
                   for w in slots]  # each whole weight, contiguous
        return self.packed.gemm(names, weights)

    def _whole_weight(self, arg, transposed: bool = False) -> bool:
        """Whether ``arg`` is a whole 2-D weight [N, K] (or its transpose) of a dtype packed GEMMs run."""
        if not isinstance(arg, _Slot) or arg.buffer not in self._static or arg.offset != 0:
            return False
        buf = self.graph.buffers[arg.buffer]
        if buf.kind != "weight" or len(buf.shape) != 2 or not packable(arg.dtype, self.device):
            return False
        n, k = buf.shape
        return (arg.sizes, arg.strides) == (((k, n), (1, k)) if transposed else ((n, k), (k, 1)))

    def _static_view(self, slot: _Slot) -> torch.Tensor:
        """The view ``slot`` of a weight or constant, shared by every kernel that reads it so."""
        views = self._static_views.setdefault(slot.buffer, {})
        t = views.get(slot.key)
        if t is None:
            t = views[slot.key] = torch.empty(0, dtype=slot.dtype, device=self.device).set_(
                self._static[slot.buffer], slot.offset, slot.sizes, slot.strides)
        return t

    def bind_kernel(self, index: int) -> tuple[Any, list[Any], dict[str, Any]]:
        """The op of kernel ``index`` and its arguments as tensors over the current storages.

        Calling ``func(*args, **kwargs)`` again reruns the kernel on the same tensors (what a profiler
        times); its result is not bound, see :meth:`run_kernel`.
        """
        call = self._compiled(index)
        call.fill(self.storages, self._views, self._tensor)
        return call.func, list(call.args), dict(call.kwargs)

    def run_kernel(self, index: int) -> None:
        """Run kernel ``index`` once on the current storages and bind the buffers it produces."""
        call = self._calls.get(index) or self._compiled(index)
        call.fill(self.storages, self._views, self._tensor)
        try:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    out = call.op(*call.args, **call.kwargs)
            else:
                out = call.op(*call.args, **call.kwargs)
        except Exception as e:
            raise ExecutionError(f"kernel {self.graph.kernels[index].id} failed: {e}") from e
        call.clear()
        if isinstance(out, torch.Tensor):
            if call.out is not None:
                self._bind_output(call.out, out)
            return
        if not isinstance(out, (tuple, list)):
            return
        # a flat tuple of tensors (add_rms_norm's) needs no pytree walk
        outs = out if all(isinstance(v, torch.Tensor) for v in out) else tree_flatten(out)[0]
        for slot, value in zip(call.outs, outs, strict=False):
            if slot is not None and isinstance(value, torch.Tensor):
                self._bind_output(slot, value)

    def free(self, buffer: str) -> None:
        """Drop the current instance of ``buffer`` and its cached views."""
        self.storages.pop(buffer, None)
        self._views.pop(buffer, None)

    def outputs(self) -> dict[str, torch.Tensor]:
        """The step outputs as tensors over the current storages."""
        return {name: self._materialize(TensorRef.from_json(ref)) for name, ref in self.graph.outputs.items()}

    def run(self, inputs: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Execute the program; ``state`` tensors are updated in place; returns the step outputs."""
        if self.program.micro_batches != 1:
            raise ExecutionError("a program of several micro-batches needs the distributed runtime")
        self.prepare(inputs, state)
        with torch.no_grad():
            for ins in self.program.instructions:
                if ins.kind == "run":
                    self.run_kernel(ins.kernel)
                elif ins.kind == "free":
                    self.free(ins.buffer)
                else:
                    raise ExecutionError(f"instruction {ins.kind} needs the distributed runtime")
        return self.outputs()


class _Slot:
    """A tensor argument: a strided view of a buffer, with what binding it needs precomputed."""

    __slots__ = ("buffer", "dtype", "offset", "sizes", "strides", "key", "nbytes", "recorded_layout")

    def __init__(self, ref: TensorRef, nbytes: int = 0):
        self.buffer = ref.buffer
        self.dtype = dtype_from_name(ref.dtype)
        self.offset = ref.offset
        self.sizes = tuple(ref.sizes)
        self.strides = tuple(ref.strides)
        self.key = (ref.buffer, ref.dtype, self.offset, self.sizes, self.strides)
        self.nbytes = nbytes
        self.recorded_layout: bool | None = None  # outputs: does the op return the traced layout?

    @classmethod
    def of(cls, ref: TensorRef) -> _Slot:
        return cls(ref)


class _Call:
    """One kernel's op with its arguments decoded once; tensor positions are refilled before every call."""

    def __init__(self, func, args: list, kwargs: dict, holes: list, outs: list[_Slot | None]):
        self.func, self.args, self.kwargs, self.holes, self.outs = func, args, kwargs, holes, outs
        self.op = getattr(func, "_op", func)  # the OpOverload's C++ callable (one Python frame less)
        self.out = outs[0] if outs else None  # a single-tensor result binds the first output

    @classmethod
    def compile(cls, graph: KernelGraph, index: int, device: torch.device, batch_invariant: bool = False) -> _Call:
        k = graph.kernels[index]
        func = (invariant_op(k.op) if batch_invariant else replay_op(k.op)) or resolve_op(k.op)
        args = decode(k.args, _Slot.of, device)
        kwargs = {n: decode(v, _Slot.of, device) for n, v in k.kwargs.items()}
        holes: list[tuple[Any, Any, _Slot]] = []

        def find(container, key, value) -> None:
            if isinstance(value, _Slot):
                holes.append((container, key, value))
            elif isinstance(value, list):
                for i, v in enumerate(value):
                    find(value, i, v)

        for i, v in enumerate(args):
            find(args, i, v)
        for n, v in kwargs.items():
            find(kwargs, n, v)
        outs = []
        for ref in k.outputs:
            if ref is None:
                outs.append(None)
                continue
            r = TensorRef.from_json(ref)
            outs.append(_Slot(r, graph.buffers[r.buffer].nbytes))
        return cls(func, args, kwargs, holes, outs)

    def clear(self) -> None:
        """Drop the argument tensors: a buffer's memory must go back to the allocator when the program frees
        it, not when this kernel's arguments are next refilled (a step later)."""
        for container, key, _ in self.holes:
            container[key] = None

    def fill(self, storages: dict, views: dict, make) -> None:
        """Put the current tensor of every slot into the argument containers (cached views where their
        storage is still the buffer's, else ``make(slot)``)."""
        for container, key, slot in self.holes:
            cached = views.get(slot.buffer)
            hit = cached.get(slot.key) if cached is not None else None
            container[key] = hit[1] if hit is not None and hit[0] is storages.get(slot.buffer) else make(slot)
