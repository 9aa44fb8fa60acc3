"""Run range-instrumented PTX kernels on a CUDA GPU and check the byte ranges they record.

Usage: PYTHONPATH=src python3 benchmarks/gpu_ptx_ranges.py [--dry-run]

Each case takes a kernel from the committed PTX fixtures (tests/fixtures/ptx/instrument: nvcc sm_80
kernels from gpu_kernels.cu, and Triton kernels from gen_triton.py), instruments it with
`tessera.capture.ptx.instrument.instrument_ptx`, loads the instrumented PTX with the CUDA driver API
(`cuModuleLoadData` from cuda-bindings: the driver JIT-compiles it), and launches it on torch CUDA
tensors with a ranges buffer of (UINT64_MAX, 0) per site. Then, per site, the recorded
[first, last] byte address must lie inside one of the launch's buffers, and per buffer the sites
together must cover exactly the bytes the kernel touches (e.g. [base, base + 4n - 1] for n floats);
the kernel's results must be unchanged by the instrumentation. One line per site, buffer and result
check, PASS or FAIL, then a summary; the exit status is 1 on any failure, 2 without a GPU. No
network, no compiler needed (nvcc may be absent). `--dry-run` instruments every case and prints the
launch plan without touching CUDA.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "ptx" / "instrument"
try:
    from tessera.capture.ptx.instrument import SLOT_BYTES, instrument_ptx
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))
    from tessera.capture.ptx.instrument import SLOT_BYTES, instrument_ptx

UINT64_MAX = 2**64 - 1
BLOCK = 128  # threads per block of every case (Triton's kernels were compiled for num_warps=4)
N = 1000  # elements: not a multiple of BLOCK, so every nvcc kernel has a predicated tail
N4 = 1000  # float4 elements of the vector and cp.async kernels
STRIDE = 3
TRITON_N = 4144  # a multiple of 16 (the compiled specialisation) but not of the 256-element block
MM = 64  # M = N = K of the Triton matmul (multiples of its 32 x 32 x 32 tiles)

# PTX ISA version each CUDA driver version JIT-compiles at most (CUDA release notes); newer: as is
_MAX_PTX_ISA = {(11, 8): (7, 8), (12, 0): (8, 0), (12, 1): (8, 1), (12, 2): (8, 2), (12, 3): (8, 3),
                (12, 4): (8, 4), (12, 5): (8, 5), (12, 6): (8, 5), (12, 8): (8, 7), (12, 9): (8, 8),
                (13, 0): (9, 0)}


@dataclass
class Buffer:
    """A launch buffer: torch dtype name, element count, and how to fill it (given torch and the buffers)."""

    dtype: str
    numel: int
    init: Callable | None = None


@dataclass
class Case:
    """One kernel launch and what its recorded ranges must be."""

    kernel: str
    ptx: str
    grid: tuple[int, int, int]
    buffers: dict[str, Buffer]
    args: list  # per original parameter: a buffer name, or ("i32" | "u32" | "f32", value)
    expect: dict[str, tuple[int, int]]  # buffer -> (first byte, last byte) touched, offsets from its base
    check: Callable | None = None  # (torch, buffers, initial copies) -> bool: results unchanged
    shared: int = 0  # dynamic shared memory bytes
    notes: list[str] = field(default_factory=list)


def _blocks(n: int, per_block: int = BLOCK) -> tuple[int, int, int]:
    return ((n + per_block - 1) // per_block, 1, 1)


def _randn(t, b, x):
    x.copy_(t.randn(x.numel(), device=x.device).to(x.dtype))


def _histogram_data(t, b, x):
    x.copy_(5 + (t.arange(x.numel()) * 3) % 56)  # every bin 5..60


def _pointers_into_src(t, b, x):
    x.copy_(b["src"].data_ptr() + 8 * t.arange(x.numel(), dtype=t.int64))


def _f32(n: int, init: Callable | None = _randn) -> Buffer:
    return Buffer("float32", n, init)


def _all(nbytes: int) -> tuple[int, int]:
    """The whole of a buffer of `nbytes`: first and last byte offsets."""
    return (0, nbytes - 1)


def _same(name_a: str, name_b: str):
    return lambda t, b, old: bool(t.equal(b[name_a], b[name_b]))


def _matmul_ok(t, b, old) -> bool:
    want = b["a"].view(MM, MM).float() @ b["b"].view(MM, MM).float()
    return bool(t.allclose(b["c"].view(MM, MM), want, atol=1e-2, rtol=1e-2))


def cases() -> list[Case]:
    """The launches: nvcc kernels (gpu_kernels.cu) and Triton kernels (gen_triton.py)."""
    cu, n4, tn = "gpu_kernels.sm_80.ptx", 4 * N4, TRITON_N
    copy4 = dict(buffers={"src": _f32(n4), "out": _f32(n4, None)}, args=["src", "out", ("i32", N4)],
                 expect={"src": _all(16 * N4), "out": _all(16 * N4)}, check=_same("out", "src"))
    return [
        Case("vadd", cu, _blocks(N), {"a": _f32(N), "b": _f32(N), "c": _f32(N, None)},
             ["a", "b", "c", ("i32", N)],
             {"a": _all(4 * N), "b": _all(4 * N), "c": _all(4 * N)},
             lambda t, b, old: bool(t.equal(b["c"], b["a"] + b["b"]))),
        Case("scale_inplace", cu, _blocks(N), {"x": _f32(N)}, ["x", ("f32", 2.0), ("i32", N)],
             {"x": _all(4 * N)},
             lambda t, b, old: bool(t.equal(b["x"], old["x"] * 2))),
        Case("strided", cu, _blocks(N), {"src": _f32(N * STRIDE), "out": _f32(N, None)},
             ["src", "out", ("i32", N), ("i32", STRIDE)],
             {"src": (0, 4 * STRIDE * (N - 1) + 3), "out": _all(4 * N)},
             lambda t, b, old: bool(t.equal(b["out"], b["src"][::STRIDE]))),
        Case("histogram", cu, _blocks(N),
             {"bins": Buffer("int32", 64), "data": Buffer("int32", N, _histogram_data)},
             ["bins", "data", ("i32", N)], {"bins": (4 * 5, 4 * 60 + 3), "data": _all(4 * N)},
             lambda t, b, old: bool(t.equal(b["bins"], t.bincount(b["data"].long(), minlength=64).int()))),
        Case("copy_vec4", cu, _blocks(N4), **copy4),
        Case("gather_ptrs", cu, _blocks(N),
             {"src": _f32(2 * N), "ptrs": Buffer("int64", N, _pointers_into_src), "out": _f32(N, None)},
             ["ptrs", "out", ("i32", N)],
             {"ptrs": _all(8 * N), "src": (0, 8 * (N - 1) + 3), "out": _all(4 * N)},
             lambda t, b, old: bool(t.equal(b["out"], b["src"][::2])),
             notes=["src is reached only through pointers loaded from ptrs (indirect)"]),
        Case("select_generic", cu, _blocks(N), {"x": _f32(N, None)}, ["x", ("i32", N), ("i32", 0)],
             {"x": _all(4 * N)}, lambda t, b, old: bool((b["x"] == 1).all()),
             notes=["generic store (no cvta); the use_shared branch's store never runs"]),
        Case("stage_cp_async", cu, _blocks(N4), **copy4,
             notes=["threads past the end copy src-size 0 bytes: nothing recorded for them"]),
        Case("stage_ignore_src", cu, _blocks(N4), **copy4,
             notes=["threads past the end set ignore-src: nothing recorded for them"]),
        Case("masked_add", "triton_masked_add.sm_90a.ptx", _blocks(tn, 256),
             {"x": _f32(tn), "y": _f32(tn), "out": _f32(tn, None)}, ["x", "y", "out", ("i32", tn)],
             {"x": _all(4 * tn), "y": _all(4 * tn), "out": _all(4 * tn)},
             lambda t, b, old: bool(t.equal(b["out"], b["x"] + b["y"])),
             notes=["Triton's scratch pointer parameters get 0"]),
        Case("matmul", "triton_matmul.sm_80.ptx", (MM // 32, MM // 32, 1),
             {"a": Buffer("float16", MM * MM, _randn), "b": Buffer("float16", MM * MM, _randn),
              "c": _f32(MM * MM, None)},
             ["a", "b", "c", ("i32", MM), ("i32", MM), ("i32", MM)],
             {"a": _all(2 * MM * MM), "b": _all(2 * MM * MM), "c": _all(4 * MM * MM)}, _matmul_ok,
             shared=8192, notes=["cp.async with a src-size register; the last k-tiles are masked (0 bytes)"]),
    ]


# ------------------------------------------------------------------------------------ checking


Span = tuple[int, int]


def evaluate(kernel: str, sites: list[dict], recorded: list[Span], buffers: dict[str, Span],
             expect: dict[str, Span]) -> list[tuple[bool, str]]:
    """PASS/FAIL lines for one launch: each site inside one buffer, each buffer covered exactly.

    `recorded`: (min, max) per slot as read back; `buffers`: name -> (base address, bytes).
    """
    lines, hulls = [], {}
    for site, (lo, hi) in zip(sites, recorded, strict=True):
        where = f"{kernel:16s} {_describe(site)}"
        if lo == UINT64_MAX and hi == 0:
            lines.append((True, f"{where}  not executed"))
            continue
        owner = next((n for n, (base, size) in buffers.items() if base <= lo <= hi < base + size), None)
        if owner is None:
            lines.append((False, f"{where}  [{lo:#x}, {hi:#x}] is not inside any launch buffer"))
            continue
        base = buffers[owner][0]
        lines.append((True, f"{where}  {owner}[{lo - base}, {hi - base}]"))
        old = hulls.get(owner, (lo, hi))
        hulls[owner] = (min(old[0], lo), max(old[1], hi))
    for name in list(expect) + [n for n in hulls if n not in expect]:
        base = buffers[name][0]
        got = (hulls[name][0] - base, hulls[name][1] - base) if name in hulls else None
        want = expect.get(name)
        recorded_text = list(got) if got else "nothing"
        lines.append((got == want, f"{kernel:16s} buffer {name:5s} recorded {recorded_text}, "
                                   f"expected {list(want) if want else 'nothing'}"))
    return lines


def _describe(site: dict) -> str:
    return f"slot {site['slot']:2d} line {site['line']:4d} {site['mode']:10s} {site['width']:2d} B"


def entry_params(ptx: str, kernel: str) -> list[str]:
    """The PTX scalar type of each parameter of `.entry kernel` (e.g. ["u64", "u32", ...])."""
    match = re.search(r"\.entry\s+" + re.escape(kernel) + r"\s*\(([^)]*)\)", ptx)
    if not match:
        raise ValueError(f"no .entry {kernel} in the PTX")
    types = []
    for decl in match.group(1).split(","):
        words = [w for w in re.sub(r"//[^\n]*", "", decl).split() if w.startswith(".")]
        kinds = [w[1:] for w in words if w not in (".param", ".ptr", ".global", ".align")]
        types.append(kinds[0] if kinds else "b8")
    return types


def plan(case: Case, instrumented: str, sites: list[dict]) -> list[str]:
    """The launch plan of one case as text lines (what --dry-run prints)."""
    types = entry_params(instrumented, case.kernel)
    extra = len(types) - 1 - len(case.args)
    args = [a if isinstance(a, str) else str(a[1]) for a in case.args] + ["0"] * extra + ["ranges"]
    lines = [f"{case.kernel} ({case.ptx}): grid {case.grid}, block ({BLOCK}, 1, 1), shared {case.shared} B, "
             f"params ({', '.join(f'{t} {a}' for t, a in zip(types, args, strict=True))})"]
    for name, buf in case.buffers.items():
        want = case.expect.get(name)
        lines.append(f"  buffer {name}: {buf.numel} x {buf.dtype}, expected {list(want) if want else 'none'}")
    for site in sites:
        lines.append(f"  {_describe(site)} params {site['params']}")
    lines += [f"  note: {n}" for n in case.notes]
    return lines


def fit_ptx_version(ptx: str, driver_version: int) -> str:
    """Lower `.version` to what the driver JIT-compiles (the kernels use nothing newer)."""
    key = (driver_version // 1000, driver_version % 1000 // 10)
    known = [v for v in _MAX_PTX_ISA if v <= key]
    if key > max(_MAX_PTX_ISA) or not known:
        return ptx
    major, minor = _MAX_PTX_ISA[max(known)]
    match = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", ptx, re.MULTILINE)
    if match and (int(match.group(1)), int(match.group(2))) > (major, minor):
        ptx = ptx[:match.start(1)] + f"{major}.{minor}" + ptx[match.end(2):]
    return ptx


# ------------------------------------------------------------------------------------ running


class Driver:
    """The few CUDA driver calls needed, through cuda-bindings, in torch's (primary) context."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            from cuda import cuda as cu  # cuda-python before 12.6
        self.cu = cu
        self.call(cu.cuInit(0), "cuInit")
        ctx = self.call(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if not int(ctx):
            dev = self.call(cu.cuDeviceGet(0), "cuDeviceGet")
            primary = self.call(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self.call(cu.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        self.version = self.call(cu.cuDriverGetVersion(), "cuDriverGetVersion")

    def call(self, result, what: str):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.cu.CUresult.CUDA_SUCCESS:
            name = self.cu.cuGetErrorName(err)[1]
            raise RuntimeError(f"{what}: {name.decode() if isinstance(name, bytes) else name}")
        return values[0] if len(values) == 1 else values

    def launch(self, ptx: str, kernel: str, grid, shared: int, params: list) -> None:
        cu = self.cu
        module = self.call(cu.cuModuleLoadData(fit_ptx_version(ptx, self.version).encode() + b"\0"),
                           f"cuModuleLoadData ({kernel})")
        try:
            function = self.call(cu.cuModuleGetFunction(module, kernel.encode()), "cuModuleGetFunction")
            pointers = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
            params_address = ctypes.addressof(pointers)
            launched = cu.cuLaunchKernel(function, *grid, BLOCK, 1, 1, shared, 0, params_address, 0)
            self.call(launched, f"cuLaunchKernel ({kernel})")
            self.call(cu.cuCtxSynchronize(), f"kernel {kernel}")
        finally:
            self.call(cu.cuModuleUnload(module), "cuModuleUnload")


def _ctype(ptx_type: str, value):
    if ptx_type == "f32":
        return ctypes.c_float(value)
    if ptx_type in ("u64", "b64", "s64"):
        return ctypes.c_uint64(value & UINT64_MAX)
    if ptx_type in ("u32", "b32", "s32"):
        return ctypes.c_int32(value) if value < 2**31 else ctypes.c_uint32(value)
    raise ValueError(f"parameter type .{ptx_type} not supported by this script")


def run_case(driver: Driver, torch, case: Case, ptx: str, sites: list[dict]) -> list[tuple[bool, str]]:
    """Launch one case on the GPU; PASS/FAIL lines for its sites, buffers and results."""
    dev = torch.device("cuda")
    bufs = {}
    for name, spec in case.buffers.items():
        bufs[name] = torch.zeros(spec.numel, dtype=getattr(torch, spec.dtype), device=dev)
        if spec.init:
            spec.init(torch, bufs, bufs[name])
    initial = {name: b.clone() for name, b in bufs.items()}
    ranges = torch.zeros(max(1, len(sites)) * SLOT_BYTES // 8, dtype=torch.int64, device=dev)
    ranges[0::2] = -1  # UINT64_MAX as a bit pattern: the min of nothing
    torch.cuda.synchronize()
    types = entry_params(ptx, case.kernel)
    values = [bufs[a].data_ptr() if isinstance(a, str) else a[1] for a in case.args]
    values += [0] * (len(types) - 1 - len(values)) + [ranges.data_ptr()]
    params = [_ctype(t, v) for t, v in zip(types, values, strict=True)]
    driver.launch(ptx, case.kernel, case.grid, case.shared, params)
    flat = [v & UINT64_MAX for v in ranges.cpu().tolist()]
    recorded = list(zip(flat[0::2], flat[1::2], strict=True))[:len(sites)]
    spans = {name: (b.data_ptr(), b.numel() * b.element_size()) for name, b in bufs.items()}
    lines = evaluate(case.kernel, sites, recorded, spans, case.expect)
    if case.check:
        ok = case.check(torch, bufs, initial)
        verdict = "unchanged" if ok else "WRONG"
        lines.append((ok, f"{case.kernel:16s} results {verdict} under instrumentation"))
    return lines


def _ptxas_diagnostics(ptx: str, target: str) -> str:
    from tessera.capture.ptx.extract import find_tool

    ptxas = find_tool("ptxas")
    if ptxas is None:
        return "(no ptxas to diagnose with)"
    path = Path("/tmp/gpu_ptx_ranges_failed.ptx")
    path.write_text(ptx)
    out = subprocess.run([str(ptxas), f"-arch={target}", str(path), "-o", "/dev/null"],
                         capture_output=True, text=True, timeout=120)
    return (out.stderr or out.stdout).strip()[-1500:] or "ptxas accepts it"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="instrument and print the launch plan; no CUDA")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    instrumented = {}
    for name in sorted({c.ptx for c in cases()}):
        instrumented[name] = instrument_ptx((FIXTURES / name).read_text(), str(FIXTURES / name))
    if args.dry_run:
        for case in cases():
            result = instrumented[case.ptx]
            sites = [s for s in result.sites if s["function"] == case.kernel]
            print("\n".join(plan(case, result.text, sites)))
        print(f"dry run: {len(cases())} launches planned in {time.perf_counter() - start:.2f} s")
        return 0
    try:
        import torch
    except ImportError:
        print("gpu_ptx_ranges: needs torch with CUDA (and an NVIDIA GPU); use --dry-run here",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_ptx_ranges: no CUDA device (torch.cuda.is_available() is False): this script needs an "
              "NVIDIA GPU; use --dry-run to see the launch plan", file=sys.stderr)
        return 2
    torch.empty(1, device="cuda")  # torch's primary context becomes current
    try:
        driver = Driver()
    except (ImportError, RuntimeError) as exc:
        print(f"gpu_ptx_ranges: CUDA driver API unavailable ({exc}): pip install cuda-bindings",
              file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()}, driver API {driver.version}, torch {torch.__version__}")
    passed = failed = 0
    for case in cases():
        result = instrumented[case.ptx]
        sites = [s for s in result.sites if s["function"] == case.kernel]
        try:
            lines = run_case(driver, torch, case, result.text, sites)
        except RuntimeError as exc:
            target = re.search(r"^\s*\.target\s+(\w+)", result.text, re.MULTILINE).group(1)
            diagnosis = _ptxas_diagnostics(result.text, target)
            lines = [(False, f"{case.kernel:16s} launch failed: {exc}; ptxas: {diagnosis}")]
        for ok, line in lines:
            print(f"{'PASS' if ok else 'FAIL'} {line}")
            passed, failed = passed + ok, failed + (not ok)
    print(f"{passed} passed, {failed} failed ({len(cases())} kernels, {time.perf_counter() - start:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
