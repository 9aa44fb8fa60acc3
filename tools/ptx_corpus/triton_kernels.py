"""Triton kernels of the PTX corpus, their launch specs, and the observation of their ground truth.

Each `Spec` says how a kernel is launched: a `make_args(seed)` that builds valid arguments (CPU tensors,
scalars, tensor descriptors) in the kernel's parameter order, the constexprs, the grid and the
compile options. `generate.py` compiles every spec with `triton.compile` for sm_80 and sm_90a
through Triton's own launch binder (so constexpr arguments, integers equal to 1 and alignment are
specialised exactly as a real launch would), and runs this file with `TRITON_INTERPRET=1 ... --observe`
to observe which buffers each kernel reads and writes:

- write: the buffer is filled with a canary byte pattern (0xA5, then 0x5A), the others with valid
  random data; any byte that differs after the run means the kernel wrote it. Buffers that must hold
  valid indices (`index_buffers`) are never canary-filled; they are checked for any change instead.
- read: the buffer is replaced by poison (NaN, +-3e38 and the values of two other seeds for float
  buffers; other seeds' valid values for index buffers) and the final contents of every buffer are
  compared with a normal run; bytes of the poisoned buffer itself that neither run touched are
  ignored. Any difference means the kernel read it.
- indirect: the interpreter records the pointers of every load, store and atomic (all lanes, masked or
  not); when the buffer's valid poison (another seed's data) changes any of them, its contents flow
  into addresses.

Nothing is declared by hand: in-place and atomic targets come out read-write because they are
observed to be both. Each run reuses the same tensors (contents restored), so pointers compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


# --------------------------------------------------------------------------- kernels


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def scale_inplace_kernel(x_ptr, s, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * s, mask=m)


@triton.jit
def fill_kernel(out_ptr, value, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32) + value, mask=offs < n)


@triton.jit
def masked_copy2d_kernel(src_ptr, dst_ptr, M, N, stride_sm, stride_sn, stride_dm, stride_dn,
                         BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    m = (rm[:, None] < M) & (rn[None, :] < N)
    v = tl.load(src_ptr + rm[:, None] * stride_sm + rn[None, :] * stride_sn, mask=m, other=0.0)
    tl.store(dst_ptr + rm[:, None] * stride_dm + rn[None, :] * stride_dn, v, mask=m)


@triton.jit
def softmax_kernel(x_ptr, y_ptr, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=-float("inf"))
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(y_ptr + row * stride_y + offs, e / tl.sum(e, axis=0), mask=m)


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < n_cols
    x = tl.load(x_ptr + row * stride + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + row * stride + offs, x * r * w, mask=m)


@triton.jit
def sum_atomic_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.atomic_add(out_ptr, tl.sum(x, axis=0))


@triton.jit
def atomic_stats_kernel(x_ptr, sum_ptr, max_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.atomic_add(sum_ptr + (offs % 8), x, mask=m)
    tl.atomic_max(max_ptr, tl.max(tl.where(m, x, -float("inf")), axis=0))


@triton.jit
def row_sum_loop_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ptrs = x_ptr + row * stride + offs
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, n_cols, BLOCK):
        acc += tl.load(ptrs, mask=offs + k < n_cols, other=0.0)
        ptrs += BLOCK
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(tl.float16), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def unused_ptr_kernel(x_ptr, unused_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2.0, mask=m)


@triton.jit
def embedding_kernel(ids_ptr, weight_ptr, out_ptr, dim, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    row = tl.load(ids_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < dim
    tl.store(out_ptr + t * dim + offs, tl.load(weight_ptr + row * dim + offs, mask=m), mask=m)


@triton.jit
def select_ptr_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    src = tl.where(pid % 2 == 0, a_ptr, b_ptr)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def tma_scale_kernel(in_desc, out_desc, s, BM: tl.constexpr, BN: tl.constexpr):
    pm = tl.program_id(0) * BM
    pn = tl.program_id(1) * BN
    out_desc.store([pm, pn], in_desc.load([pm, pn]) * s)


# --------------------------------------------------------------------------- launch specs


@dataclass
class Spec:
    """How one corpus kernel is launched (arguments in parameter order, constexprs excluded)."""

    name: str
    fn: Callable
    make_args: Callable[[int], dict]
    constexprs: dict
    grid: tuple
    options: dict = field(default_factory=lambda: {"num_warps": 4})
    index_buffers: tuple = ()
    caps: tuple = (80, 90)
    note: str = ""


def _rand(seed: int, *shape, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _elementwise(seed):
    # n divisible by 16: Triton vectorises the masked accesses (ld.global.v4)
    return {"x_ptr": _rand(seed, 4096), "y_ptr": _rand(seed + 1, 4096), "out_ptr": _rand(seed + 2, 4096),
            "n": 4096}


def _copy2d(seed):
    return {"src_ptr": _rand(seed, 50, 70), "dst_ptr": _rand(seed + 1, 50, 70), "M": 50, "N": 70,
            "stride_sm": 70, "stride_sn": 1, "stride_dm": 70, "stride_dn": 1}


def _matmul(seed):
    a, b, c = _rand(seed, 96, 80, dtype=torch.float16), _rand(seed + 1, 80, 72, dtype=torch.float16), \
        _rand(seed + 2, 96, 72, dtype=torch.float16)
    return {"a_ptr": a, "b_ptr": b, "c_ptr": c, "M": 96, "N": 72, "K": 80, "stride_am": 80, "stride_ak": 1,
            "stride_bk": 72, "stride_bn": 1, "stride_cm": 72, "stride_cn": 1}


def _embedding(seed):
    g = torch.Generator().manual_seed(seed)
    return {"ids_ptr": torch.randint(0, 40, (12,), generator=g, dtype=torch.int32),
            "weight_ptr": _rand(seed + 1, 40, 48), "out_ptr": _rand(seed + 2, 12, 48), "dim": 48}


def _tma(seed):
    x, y = _rand(seed, 64, 96), _rand(seed + 1, 64, 96)
    return {"in_desc": TensorDescriptor.from_tensor(x, [32, 32]),
            "out_desc": TensorDescriptor.from_tensor(y, [32, 32]), "s": 3.0}


SPECS: list[Spec] = [
    Spec("add", add_kernel, _elementwise, {"BLOCK": 1024}, (4,)),
    Spec("scale_inplace", scale_inplace_kernel,
         lambda s: {"x_ptr": _rand(s, 4096), "s": 0.5, "n": 4096}, {"BLOCK": 1024}, (4,)),
    Spec("fill", fill_kernel, lambda s: {"out_ptr": _rand(s, 3000), "value": 7.0, "n": 3000}, {"BLOCK": 1024},
         (3,)),
    Spec("masked_copy2d", masked_copy2d_kernel, _copy2d, {"BM": 32, "BN": 32}, (2, 3),
         note="stride_sn and stride_dn equal 1: specialised to constants and dropped from the PTX"),
    Spec("softmax", softmax_kernel,
         lambda s: {"x_ptr": _rand(s, 6, 100), "y_ptr": _rand(s + 1, 6, 100), "stride_x": 100, "stride_y": 100,
                    "n_cols": 100}, {"BLOCK": 128}, (6,)),
    Spec("rmsnorm", rmsnorm_kernel,
         lambda s: {"x_ptr": _rand(s, 5, 96), "w_ptr": _rand(s + 1, 96), "out_ptr": _rand(s + 2, 5, 96),
                    "stride": 96, "n_cols": 96, "eps": 1e-6}, {"BLOCK": 128}, (5,)),
    Spec("sum_atomic", sum_atomic_kernel,
         lambda s: {"x_ptr": _rand(s, 3000), "out_ptr": _rand(s + 1, 1), "n": 3000}, {"BLOCK": 1024}, (3,)),
    Spec("atomic_stats", atomic_stats_kernel,
         lambda s: {"x_ptr": _rand(s, 3000), "sum_ptr": _rand(s + 1, 8), "max_ptr": _rand(s + 2, 1) - 10.0,
                    "n": 3000}, {"BLOCK": 1024}, (3,)),
    Spec("row_sum_loop", row_sum_loop_kernel,
         lambda s: {"x_ptr": _rand(s, 4, 300), "out_ptr": _rand(s + 1, 4), "n_cols": 300, "stride": 300},
         {"BLOCK": 64}, (4,)),
    Spec("matmul", matmul_kernel, _matmul, {"BM": 64, "BN": 64, "BK": 32}, (2, 2),
         options={"num_warps": 4, "num_stages": 3},
         note="tl.dot: wgmma on sm_90a, mma.sync on sm_80; unit strides specialised and dropped"),
    Spec("unused_ptr", unused_ptr_kernel,
         lambda s: {"x_ptr": _rand(s, 3000), "unused_ptr": _rand(s + 1, 3000), "y_ptr": _rand(s + 2, 3000),
                    "n": 3000}, {"BLOCK": 1024}, (3,)),
    Spec("embedding", embedding_kernel, _embedding, {"BLOCK_D": 64}, (12,), index_buffers=("ids_ptr",)),
    Spec("select_ptr", select_ptr_kernel,
         lambda s: {"a_ptr": _rand(s, 3000), "b_ptr": _rand(s + 1, 3000), "out_ptr": _rand(s + 2, 3000),
                    "n": 3000}, {"BLOCK": 512}, (6,)),
    Spec("tma_scale", tma_scale_kernel, _tma, {"BM": 32, "BN": 32}, (2, 3),
         note="host TensorDescriptor: a CUtensorMap (.b8[128]) plus shape/strides on sm_90a; lowered to a "
              "pointer plus shape/strides/padding on sm_80"),
]


# --------------------------------------------------------------------------- observation


def buffers_of(args: dict) -> dict[str, torch.Tensor]:
    """The memory each argument refers to: tensors themselves, tensor descriptors' base tensors."""
    out = {}
    for name, v in args.items():
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif TensorDescriptor is not None and isinstance(v, TensorDescriptor):
            out[name] = v.base
    return out


_TRACE: list | None = None  # pointer arrays of every memory operation of the current run (all lanes)


def _install_trace() -> None:
    """Record, in the interpreter, the pointers of every load, store and atomic (masked-off lanes too)."""
    from triton.runtime.interpreter import InterpreterBuilder

    def wrap(method, ptr_arg):
        def traced(self, *a, **kw):
            if _TRACE is not None:
                ptrs = a[ptr_arg - 1] if ptr_arg else a[0]
                _TRACE.append(ptrs.data.copy())
            return method(self, *a, **kw)
        return traced

    if getattr(InterpreterBuilder, "_tessera_traced", False):
        return
    InterpreterBuilder.create_masked_load = wrap(InterpreterBuilder.create_masked_load, 0)
    InterpreterBuilder.create_masked_store = wrap(InterpreterBuilder.create_masked_store, 0)
    InterpreterBuilder.create_atomic_rmw = wrap(InterpreterBuilder.create_atomic_rmw, 2)
    InterpreterBuilder.create_atomic_cas = wrap(InterpreterBuilder.create_atomic_cas, 0)
    InterpreterBuilder._tessera_traced = True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).clone()


def _poisons(spec: Spec, name: str, seed: int) -> list[tuple[torch.Tensor, bool]]:
    """(poison contents, valid?) for one buffer: other seeds' valid data, then NaN and +-3e38 for floats."""
    ref = buffers_of(spec.make_args(seed))[name]
    out = [(buffers_of(spec.make_args(seed + 101 + k))[name], True) for k in range(2)]
    if ref.is_floating_point() and name not in spec.index_buffers:
        # +-3e38 become +-inf in fp16
        out += [(torch.full(ref.shape, value).to(ref.dtype), False) for value in (float("nan"), 3e38, -3e38)]
    return out


class _Runner:
    """Runs one spec repeatedly on the SAME buffers (so pointer values are comparable between runs),
    restoring their initial contents, or putting a canary or poison into one of them, before each run."""

    def __init__(self, spec: Spec, seed: int):
        self.spec, self.args = spec, spec.make_args(seed)
        self.bufs = buffers_of(self.args)
        self.init = {k: v.clone() for k, v in self.bufs.items()}

    def run(self, name: str | None = None, canary: int | None = None, poison: torch.Tensor | None = None):
        """(contents before, contents after, pointer trace)."""
        global _TRACE
        for k, v in self.bufs.items():
            v.copy_(self.init[k])
        if name is not None and canary is not None:
            self.bufs[name].view(torch.uint8).fill_(canary)
        if name is not None and poison is not None:
            self.bufs[name].copy_(poison)
        before = {k: _bytes(v) for k, v in self.bufs.items()}
        _TRACE = []
        try:
            self.spec.fn[self.spec.grid](*self.args.values(), **self.spec.constexprs)
            trace = _TRACE
        finally:
            _TRACE = None
        return before, {k: _bytes(v) for k, v in self.bufs.items()}, trace


def _same_trace(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and (x == y).all() for x, y in zip(a, b, strict=True))


def observe(spec: Spec, seeds: tuple = (0, 1)) -> dict[str, dict]:
    """Observe, by running `spec` under the interpreter, which of its buffers it reads and writes, and
    whose contents flow into addresses (indirect)."""
    _install_trace()
    names = list(buffers_of(spec.make_args(seeds[0])))
    result: dict[str, dict] = {}
    for name in names:
        wrote, read, indirect = [], [], []
        for seed in seeds:
            r = _Runner(spec, seed)
            # writes: canary-fill this buffer (index buffers keep their valid data) and look for changes
            for canary in [None] if name in spec.index_buffers else [0xA5, 0x5A]:
                before, after, _ = r.run(name, canary=canary)
                changed = int((after[name] != before[name]).sum())
                if changed:
                    wrote.append(f"seed {seed} canary {canary if canary is None else hex(canary)}: "
                                 f"{changed} bytes changed")
            # reads: poison this buffer and compare every buffer's final contents with a normal run;
            # indirect: valid poison changes the pointers of some memory operation
            init_n, fin_n, trace_n = r.run()
            for k, (poison, valid) in enumerate(_poisons(spec, name, seed)):
                init_p, fin_p, trace_p = r.run(name, poison=poison)
                for other in names:
                    if other == name:
                        touched = (fin_n[other] != init_n[other]) | (fin_p[other] != init_p[other])
                        diff = int((fin_n[other][touched] != fin_p[other][touched]).sum())
                    else:
                        diff = int((fin_n[other] != fin_p[other]).sum())
                    if diff:
                        read.append(f"seed {seed} poison {k}: {other} differs in {diff} bytes")
                        break
                if valid and not _same_trace(trace_n, trace_p):
                    indirect.append(f"seed {seed} poison {k}: the pointers of a memory operation changed")
        access = {(False, False): "none", (True, False): "read", (False, True): "write",
                  (True, True): "read-write"}[(bool(read), bool(wrote))]
        result[name] = {"access": access, "indirect": bool(indirect), "read_evidence": read[:3],
                        "write_evidence": wrote[:3], "indirect_evidence": indirect[:3]}
    return result


def main(argv: list[str] | None = None) -> int:
    """`--observe OUT.json`: observe every spec (run with TRITON_INTERPRET=1) and write the results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--observe", required=True, help="output JSON path")
    p.add_argument("--only", nargs="*", help="kernel names (default: all)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--observe must run under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # poison overflows in numpy, on purpose
    out = {}
    for spec in SPECS:
        if a.only and spec.name not in a.only:
            continue
        if spec.name == "tma_scale" and TensorDescriptor is None:
            print(f"skip {spec.name}: this Triton has no TensorDescriptor", file=sys.stderr)
            continue
        out[spec.name] = observe(spec)
        print(spec.name, {k: v["access"] for k, v in out[spec.name].items()}, file=sys.stderr)
    with open(a.observe, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
