"""Record a model step into a KernelGraph with a TorchDispatchMode (on `meta` or real tensors).

Kernels are the non-view aten ops in program order; fused units (scaled-dot-product attention,
Tessera's custom ops) are one kernel each, as eager runs them. Every tensor is resolved to a buffer
with a stable name and every argument to a strided view of it, so accesses and edges are exact.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tessera.capture.opaque import binding_for, kernel_accesses, reconcile
from tessera.capture.step import Step, qualified
from tessera.errors import TesseraError
from tessera.graph.codec import dtype_name, encode
from tessera.graph.deps import compute_edges
from tessera.graph.ir import Access, Buffer, Kernel, KernelGraph, TensorRef
from tessera.graph.layers import LAYER_RE
from tessera.graph.opclass import flops_of, indexed_traffic, op_class
from tessera.graph.values import pack_values

aten = torch.ops.aten


class TraceError(TesseraError):
    """A model step could not be recorded."""


class DataDependentOpError(TraceError):
    """An op needs tensor values on the host, which a static kernel graph cannot express."""


_DATA_DEPENDENT = {
    aten._local_scalar_dense.default: "a tensor value read on the host (.item(), .tolist(), int(t), "
                                      "or a Python `if` on a tensor)",
    aten.nonzero.default: "an output whose shape depends on tensor values (nonzero / torch.where with one "
                          "argument / boolean-mask indexing)",
    aten.masked_select.default: "an output whose shape depends on tensor values (boolean-mask selection)",
    aten.unique_dim.default: "an output whose shape depends on tensor values (unique)",
    aten._unique2.default: "an output whose shape depends on tensor values (unique)",
    aten.repeat_interleave.Tensor: "an output whose shape depends on tensor values (repeat_interleave "
                                   "with tensor repeats)",
}
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                aten.new_empty.default, aten.new_empty_strided.default}


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors inside an argument (nested lists, tuples and dicts), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _layout_key(value: Any) -> Any:
    """A hashable description of an argument with tensors reduced to their layout."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, (list, tuple)):
        return tuple(_layout_key(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _layout_key(v)) for k, v in value.items())
    return value


def _min_nbytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def layer_of(scope: str) -> int | None:
    """Layer index of a module scope such as ``model.layers.3.mlp`` (None outside numbered layers)."""
    m = LAYER_RE.search(scope)
    return int(m.group(1)) if m else None


def _like_device_sdpa(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """On `meta`, give SDPA's output the layout the fused device kernels give it: the query's.

    `meta` takes SDPA's math path, whose output is contiguous; the fused kernels (CPU flash attention,
    CUDA flash) allocate it like the query. A query viewed [B,H,S,D] from a [B,S,H,D] projection then
    makes the `meta` trace copy after attention where the device does not.
    """
    if out.device.type != "meta" or out.shape != query.shape:
        return out
    return torch.empty_like(query, dtype=out.dtype)


class _FusedUnits(TorchFunctionMode):
    """Catch fused torch functions above the dispatcher so they are recorded as one kernel."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.recorder.executing:
            with self.recorder.executing_op():
                out = _like_device_sdpa(func(*args, **kwargs), args[0] if args else kwargs["query"])
            self.recorder.record(aten.scaled_dot_product_attention.default, args, kwargs, out)
            return out
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, step: Step):
        super().__init__()
        self.step = step
        self.kernels: list[Kernel] = []
        self.accesses: list[Access] = []
        self.buffers: dict[str, Buffer] = {}
        self.names: dict[int, str] = {}  # storage key -> buffer name
        self.keepalive: list[torch.Tensor] = []  # storages must outlive the trace or keys get reused
        self.scopes: list[str] = []
        self.ordinals: Counter[tuple[str, str]] = Counter()
        self.executing = False
        self.memo: dict | None = None  # set for meta traces, see _run
        self.warnings: list[str] = []
        self.module_names: dict[int, str] = {}
        for root, mod in step.modules.items():
            for name, sub in mod.named_modules():
                self.module_names[id(sub)] = qualified(root, name) or root or type(sub).__name__
        self._register_known()

    # -- buffers ------------------------------------------------------------------------------------
    def _add_buffer(self, t: torch.Tensor, name: str, kind: str, values: torch.Tensor | None = None) -> str:
        key = _storage_key(t)
        if key in self.names:
            existing = self.buffers[self.names[key]]
            if name != existing.name and name not in existing.aliases:
                existing.aliases.append(name)
            return existing.name
        self.names[key] = name
        self.keepalive.append(t)
        self.buffers[name] = Buffer(name=name, kind=kind, nbytes=t.untyped_storage().nbytes(),
                                    dtype=dtype_name(t.dtype), shape=list(t.shape),
                                    values=pack_values(values) if values is not None else None)
        return name

    def _register_known(self) -> None:
        step = self.step
        for root, mod in step.modules.items():
            persistent = {}
            for mod_name, sub in mod.named_modules(remove_duplicate=False):
                for pname, p in sub._parameters.items():
                    if p is not None:
                        persistent[qualified(root, qualified(mod_name, pname))] = p
                for bname, b in sub._buffers.items():
                    if b is None:
                        continue
                    full = qualified(root, qualified(mod_name, bname))
                    if bname in sub._non_persistent_buffers_set:
                        if full not in step.constant_values:
                            raise TraceError(f"constant buffer {full} has no host value in the step")
                        self._add_buffer(b, full, "constant", step.constant_values[full])
                    else:
                        persistent[full] = b
            # canonical weight name = first in state-dict order; later names of the same storage are aliases
            for full, t in persistent.items():
                self._add_buffer(t, full, "weight")
        for name, t in step.inputs.items():
            self._add_buffer(t, name, "input")
        for name, t in step.state.items():
            self._add_buffer(t, name, "state")
        for name, t in step.constants.items():
            if name not in step.constant_values:
                raise TraceError(f"constant {name} has no host value in the step")
            self._add_buffer(t, name, "constant", step.constant_values[name])

    def ref(self, t: torch.Tensor) -> TensorRef:
        key = _storage_key(t)
        name = self.names.get(key)
        if name is None:
            if t.device.type == "cpu" and self.step_device != "cpu":
                raise TraceError(
                    f"module '{self.scope}' uses a host tensor of shape {list(t.shape)} on a {self.step_device} "
                    "trace; create it on the step's device or register it as a step constant")
            raise TraceError(f"module '{self.scope}' uses a tensor of shape {list(t.shape)} that no recorded "
                             "kernel produced and that is not a weight, input, state or constant")
        return TensorRef(name, dtype_name(t.dtype), t.storage_offset(), list(t.shape), list(t.stride()))

    @property
    def scope(self) -> str:
        return self.scopes[-1] if self.scopes else "step"

    @contextmanager
    def executing_op(self):
        prev, self.executing = self.executing, True
        try:
            yield
        finally:
            self.executing = prev

    # -- recording ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.executing:
            return func(*args, **kwargs)
        if func in _DATA_DEPENDENT:
            raise DataDependentOpError(
                f"{func} in module '{self.scope}' needs {_DATA_DEPENDENT[func]}; a static kernel graph cannot "
                "express it (and a `meta` trace cannot run it). Make it static: keep such values as host-side "
                "Python numbers computed from the shapes, pass them to the step as inputs or constants, or use "
                "a fixed-shape alternative (masks with torch.where(cond, a, b), topk, sort, index_select).")
        out = self._run(func, args, kwargs)
        if func.is_view or func is aten.lift_fresh.default or self._aliases_only(func, args, kwargs, out):
            return out
        if func in _ALLOCATIONS:
            self._add_buffer(out, f"{self.scope}:alloc#{len(self.buffers)}", "activation")
            return out
        self.record(func, args, kwargs, out)
        return out

    def _run(self, func, args, kwargs):
        """Run the op; on `meta`, ops already seen with the same argument layouts reuse the output
        layouts (meta results depend on layouts only), which makes repeated layers cheap."""
        key = None
        if self.memo is not None and not func.is_view and func not in _ALLOCATIONS:
            try:
                key = (func, _layout_key(args), _layout_key(kwargs))
                cached = self.memo.get(key)
            except TypeError:  # an unhashable argument: just run the op
                key = cached = None
            if cached is not None:
                outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                        for shape, stride, dtype in cached[1]]
                return outs[0] if cached[0] else tuple(outs)
        with self.executing_op():
            out = func(*args, **kwargs)
        if key is not None and not func._schema.is_mutable:
            single = isinstance(out, torch.Tensor)
            outs = [out] if single else out
            if isinstance(outs, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in outs):
                ins = {_storage_key(t) for t in _tensors((args, kwargs))}
                fresh = all(_storage_key(o) not in ins and o.storage_offset() == 0
                            and o.untyped_storage().nbytes() == _min_nbytes(o) for o in outs)
                if fresh:
                    self.memo[key] = (single, [(tuple(o.shape), o.stride(), o.dtype) for o in outs])
        return out

    @staticmethod
    def _aliases_only(func, args, kwargs, out) -> bool:
        """An op that writes nothing and returns views of its inputs (e.g. _unsafe_view) is no kernel."""
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            return False
        outs = _tensors(out)
        ins = {_storage_key(t) for t in _tensors((args, kwargs))}
        return bool(outs) and all(_storage_key(o) in ins for o in outs)

    def record(self, func, args, kwargs, out) -> None:
        index = len(self.kernels)
        schema = func._schema
        written: list[torch.Tensor] = []
        read: list[torch.Tensor] = []
        bound = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        for arg, value in zip(schema.arguments, bound, strict=False):
            tensors = _tensors(value)
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            if is_write:
                written.extend(tensors)
                if not arg.is_out:
                    read.extend(tensors)  # in-place ops read what they overwrite
            else:
                read.extend(tensors)
        scope = self.scope
        op = str(func)
        indirect = False
        binding = binding_for(func)
        if binding is not None:  # a kernel-backed op: its PTX, not its schema, says what it touches
            try:
                ptx = kernel_accesses(binding, args, kwargs, out)
            except TesseraError as e:
                raise TraceError(f"{op} in module '{scope}': {e}") from e
            inputs = _tensors((args, kwargs))
            self.warnings.extend(reconcile(binding.op, written, ptx, inputs))
            known = {_storage_key(t) for t in inputs}
            read = [t for t in ptx.reads if _storage_key(t) in known]
            written = [t for t in ptx.writes if _storage_key(t) in known]
            indirect = ptx.indirect
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        ordinal = self.ordinals[(scope, op)]
        input_keys = {_storage_key(t) for t in read + written}
        out_refs: list[Any] = []
        for j, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                out_refs.append(None)
                continue
            if _storage_key(o) in input_keys and _storage_key(o) in self.names:
                out_refs.append(self.ref(o).to_json())  # returns (a view of) an argument it wrote in place
                continue
            self._add_buffer(o, f"{scope}:{op}#{ordinal}:out{j}", "activation")
            written.append(o)
            out_refs.append(self.ref(o).to_json())
        refs: dict[int, TensorRef] = {}

        def ref(t: torch.Tensor) -> TensorRef:
            r = refs.get(id(t))
            if r is None:
                r = refs[id(t)] = self.ref(t)
            return r

        try:
            enc_args = encode(list(args), ref)
            enc_kwargs = {k: encode(v, ref) for k, v in kwargs.items()}
        except TypeError as e:
            raise TraceError(f"{op} in module '{scope}': {e}") from e
        bytes_read = bytes_written = 0
        for mode, tensors in (("read", read), ("write", written)):
            for t in tensors:
                r = ref(t)
                acc = Access(index, r.buffer, mode, r.offset, r.sizes, r.strides, t.element_size())
                self.accesses.append(acc)
                nb = t.numel() * t.element_size() if t.is_contiguous() else acc.region.nbytes_touched
                if mode == "read":
                    bytes_read += nb
                else:
                    bytes_written += nb
        traffic = indexed_traffic(func, args, out, kwargs)
        if traffic is not None:
            bytes_read, bytes_written = traffic
        tensor_args = _tensors((args, kwargs))
        self.ordinals[(scope, op)] += 1
        self.kernels.append(Kernel(
            index=index, op=op, scope=scope, ordinal=ordinal, layer=layer_of(scope), op_class=op_class(op),
            args=enc_args, kwargs=enc_kwargs, outputs=out_refs,
            shapes=[list(t.shape) for t in tensor_args], dtypes=[dtype_name(t.dtype) for t in tensor_args],
            flops=flops_of(func, args, kwargs, out), bytes_read=bytes_read, bytes_written=bytes_written,
            indirect=indirect))

    # -- module scopes ------------------------------------------------------------------------------
    def _pre_hook(self, module, _args):
        self.scopes.append(self.module_names.get(id(module), type(module).__name__))

    def _post_hook(self, module, _args, _out):
        if self.scopes:
            self.scopes.pop()


def trace(step: Step) -> KernelGraph:
    """Run ``step`` under the recorder and return its KernelGraph."""
    t0 = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the trace allocates many small objects and frees none; collection only costs time
    rec = _Recorder(step)
    rec.step_device = next(iter(step.inputs.values())).device.type if step.inputs else "meta"
    if rec.step_device == "meta":
        rec.memo = {}
    pre = torch.nn.modules.module.register_module_forward_pre_hook(rec._pre_hook)
    post = torch.nn.modules.module.register_module_forward_hook(rec._post_hook, always_call=True)
    try:
        with torch.no_grad(), _FusedUnits(rec), rec:
            outputs = step.fn(step.inputs, step.state, step.constants)
    finally:
        pre.remove()
        post.remove()
        if gc_was_enabled:
            gc.enable()
    out_refs = {}
    for name, t in outputs.items():
        r = rec.ref(t)
        buf = rec.buffers[r.buffer]
        if buf.kind == "activation":
            buf.kind = "output"
        out_refs[name] = r.to_json()
    edges = compute_edges(rec.accesses)
    meta = dict(step.meta) | {"family": step.family, "device": rec.step_device,
                              "trace_seconds": round(time.perf_counter() - t0, 4)}
    if rec.warnings:
        meta["warnings"] = rec.warnings
    return KernelGraph(model=step.model, phase=step.phase, meta=meta, kernels=rec.kernels, buffers=rec.buffers,
                       accesses=rec.accesses, edges=edges, inputs=list(step.inputs), state=list(step.state),
                       outputs=out_refs)
