"""Model units implemented as Triton kernels behind `torch.library` ops (opaque to the framework).

On a CUDA device the kernel is compiled and launched by Triton; on the CPU it runs in Triton's
interpreter, so the same op works in tests on any machine. The ops are registered with
:mod:`tessera.capture.opaque`, so a trace takes their accesses from the kernel's PTX.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tessera.capture.opaque import register_triton_op
from tessera.errors import TesseraError


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Launch a Triton kernel; CPU tensors need Triton's interpreter (``TRITON_INTERPRET=1`` set before
    triton is imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if tensors and tensors[0].device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        raise TesseraError(f"Triton kernel {kernel.__name__} got CPU tensors: run with TRITON_INTERPRET=1 "
                           "(set before triton is imported) to execute Triton kernels on the CPU")
    kernel[grid](*args, **kwargs)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, stride_x, stride_out, BLOCK: tl.constexpr):
    """One row per program: out = w * (x * rsqrt(mean(x^2) + eps)), in float32 then rounded like HF."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, w * normed, mask=mask)


def _rms_norm_args(args: tuple, kwargs: dict, out) -> dict:
    x, weight, eps = args[0], args[1], args[2]
    n = x.shape[-1]
    return {"x_ptr": x, "w_ptr": weight, "out_ptr": out, "n_cols": n, "eps": float(eps), "stride_x": n,
            "stride_out": n, "BLOCK": _next_power_of_2(n)}


@torch.library.custom_op("tessera::triton_rms_norm", mutates_args=())
def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of a contiguous ``x`` as one Triton kernel."""
    if not x.is_contiguous():
        raise ValueError("triton_rms_norm needs a contiguous input")
    out = torch.empty_like(x)
    n = x.shape[-1]
    rows = x.numel() // n
    launch(rms_norm_kernel, (rows,), x, weight, out, n, float(eps), n, n, BLOCK=_next_power_of_2(n))
    return out


@triton_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


register_triton_op("tessera::triton_rms_norm", rms_norm_kernel, _rms_norm_args)


def _rms_norm_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.ops.tessera.triton_rms_norm(hidden_states.contiguous(), module.weight,
                                             float(module.variance_epsilon))


def use_triton_rms_norm(model: torch.nn.Module, class_name: str = "LlamaRMSNorm") -> int:
    """Route every ``class_name`` module of ``model`` (Hugging Face RMSNorm: ``weight``,
    ``variance_epsilon``) through the Triton RMSNorm op; returns how many were rerouted."""
    count = 0
    for mod in model.modules():
        if type(mod).__name__ == class_name:
            mod.forward = functools.partial(_rms_norm_forward, mod)
            count += 1
    return count
