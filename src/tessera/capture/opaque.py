"""Custom ops backed by compiled kernels: their accesses come from the kernel's PTX, not the op schema.

A `torch.library` op implemented with a Triton kernel is opaque to the framework; its schema may be
wrong about what it writes. Registering the op with the kernel and a function that maps the op's
arguments to the kernel's arguments lets the recorder compile the kernel to PTX (no GPU needed),
analyse which pointer parameters it reads and writes, and map them back to the op's tensors **by
the compiled signature**: constexpr arguments and integers specialised to 1 are not kernel
parameters, and Triton appends scratch pointers after the declared ones. Where schema and PTX
disagree the PTX wins, with a warning naming the op, the parameter and both claims.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.capture.triton_ptx import TritonCompileError, compile_ptx
from tessera.errors import TesseraError

# Triton's compile target when no GPU is present: Hopper (sm_90), 32-thread warps.
DEFAULT_TARGET = (90, 32)

_TRITON_DTYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5",
}


class OpaqueKernelError(TesseraError):
    """A kernel-backed op could not be compiled or analysed."""


class SchemaMismatchWarning(UserWarning):
    """An op schema and the PTX of its kernel disagree about what a parameter accesses."""


@dataclass(frozen=True)
class TritonBinding:
    """A custom op implemented by one Triton kernel, and how the op's values become kernel arguments.

    ``arguments(args, kwargs, out)`` returns the kernel's Python arguments by name (tensors, scalars
    and constexprs), given the op's arguments and its result.
    """

    op: str  # e.g. "tessera::triton_rms_norm"
    kernel: Any  # the @triton.jit function
    arguments: Callable[[tuple, dict, Any], dict[str, Any]]
    target: tuple[int, int] = DEFAULT_TARGET


@dataclass
class ParamBinding:
    """One PTX parameter of a compiled kernel, the Python argument it came from, and its access."""

    index: int
    ptx_name: str
    arg: str | None  # None for Triton's appended scratch pointers
    access: str
    indirect: bool
    reason: str


@dataclass
class KernelAccesses:
    """What a kernel-backed op reads and writes according to its PTX."""

    kernel: str
    params: list[ParamBinding]
    reads: list[torch.Tensor] = field(default_factory=list)
    writes: list[torch.Tensor] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # kernel argument name -> tensor
    indirect: bool = False


_REGISTRY: dict[str, TritonBinding] = {}


def register_triton_op(op: str, kernel: Any, arguments: Callable[[tuple, dict, Any], dict[str, Any]],
                       target: tuple[int, int] = DEFAULT_TARGET) -> TritonBinding:
    """Declare that custom op ``op`` (``namespace::name``) runs ``kernel`` with ``arguments``."""
    binding = TritonBinding(op=op, kernel=kernel, arguments=arguments, target=target)
    _REGISTRY[op] = binding
    return binding


def binding_for(func) -> TritonBinding | None:
    """The binding of a traced op overload (``torch.ops.ns.name.default``), if it has one."""
    if not _REGISTRY:
        return None
    name = func._schema.name  # "ns::name"
    return _REGISTRY.get(name)


def _jit_function(kernel: Any):
    """The JITFunction behind a kernel (also when Triton's interpreter mode wrapped it)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(getattr(kernel, "fn", kernel))  # parses the signature only; never compiled here


def _signature(jit, values: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """Triton signature and constexprs of a launch, specialising as Triton's launcher does."""
    sig: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for p in jit.params:
        if p.name not in values:
            raise OpaqueKernelError(f"kernel {jit.__name__}: no value for argument {p.name!r}")
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            if v.dtype not in _TRITON_DTYPES:
                raise OpaqueKernelError(f"kernel {jit.__name__}: argument {p.name} has dtype {v.dtype}, "
                                        "which Triton pointers do not support")
            sig[p.name] = "*" + _TRITON_DTYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not p.do_not_specialize:  # Triton specialises integers equal to 1 away
                sig[p.name], constexprs[p.name] = "constexpr", 1
            else:
                sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif v is None:
            sig[p.name], constexprs[p.name] = "constexpr", None
        else:
            raise OpaqueKernelError(f"kernel {jit.__name__}: cannot pass {type(v).__name__} as {p.name}")
    return sig, constexprs


def kernel_accesses(binding: TritonBinding, args: tuple, kwargs: dict, out: Any) -> KernelAccesses:
    """Compile the op's kernel for this launch's signature, analyse its PTX and map params to tensors."""
    from tessera.capture.ptx.analyze import analyze_ptx

    jit = _jit_function(binding.kernel)
    values = binding.arguments(args, kwargs, out)
    sig, constexprs = _signature(jit, values)
    try:
        ptx = compile_ptx(binding.kernel, sig, constexprs, binding.target)
    except TritonCompileError as e:
        raise OpaqueKernelError(str(e)) from e
    kernels, errors = analyze_ptx(ptx, file=f"<triton {jit.__name__}>")
    entry = next((k for k in kernels if k.name == jit.__name__), kernels[0] if len(kernels) == 1 else None)
    if entry is None:
        detail = "; ".join(str(e) for e in errors) or "no .entry found"
        raise OpaqueKernelError(f"PTX of {jit.__name__} could not be analysed: {detail}")
    runtime_args = [name for name, s in sig.items() if s != "constexpr"]
    result = KernelAccesses(kernel=entry.name, params=[], indirect=entry.indirect)
    for p in entry.params:
        arg = runtime_args[p.index] if p.index < len(runtime_args) else None
        result.params.append(ParamBinding(p.index, p.name, arg, p.access, p.indirect, p.reason))
        value = values.get(arg) if arg else None
        if not isinstance(value, torch.Tensor):
            continue
        result.tensors[arg] = value
        if p.access in ("read", "read-write"):
            result.reads.append(value)
        if p.access in ("write", "read-write"):
            result.writes.append(value)
    return result


def reconcile(op: str, schema_writes: list[torch.Tensor], ptx: KernelAccesses,
              inputs: list[torch.Tensor]) -> list[str]:
    """Warn where the schema and the PTX disagree about writing an op input; returns the messages."""
    messages = []
    schema_ids = {id(t) for t in schema_writes}
    ptx_ids = {id(t) for t in ptx.writes}
    for t in inputs:
        claims_schema, claims_ptx = id(t) in schema_ids, id(t) in ptx_ids
        if claims_schema == claims_ptx:
            continue
        param = next((p for p in ptx.params if p.arg is not None and id(ptx.tensors.get(p.arg)) == id(t)), None)
        where = f"parameter {param.index} ({param.ptx_name}, argument {param.arg})" if param else "an input"
        schema_claim = "writes it" if claims_schema else "does not write it"
        ptx_claim = f"{param.access} ({param.reason})" if param else "no access"
        msg = (f"op {op}: {where}: the schema {schema_claim}, the PTX of kernel {ptx.kernel} says "
               f"{ptx_claim}; using the PTX")
        warnings.warn(msg, SchemaMismatchWarning, stacklevel=3)
        messages.append(msg)
    return messages
