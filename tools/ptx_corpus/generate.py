"""Regenerate the PTX corpus in tests/fixtures/ptx/corpus/ (run from the repository root).

    .venv/bin/python tools/ptx_corpus/generate.py [--only-cuda | --only-triton] [--no-observe]

- CUDA C kernels (`corpus/cuda/*.cu`) through the system `nvcc -ptx` for the architectures named by
  each file's `// tessera-archs:` line (sm_90 builds carry `-lineinfo`, so `.loc`/`.file` directives
  are exercised), and through NVRTC (libnvrtc from the `nvidia-cuda-nvrtc` wheel, via ctypes) for
  those named by `// tessera-nvrtc:` -> `corpus/ptx/<stem>.<arch>.ptx`, `<stem>.nvrtc.<arch>.ptx`.
  Their ground truth is the hand-written `// tessera-expect:` comments in the sources.
- Triton kernels (`tools/ptx_corpus/triton_kernels.py`) through `triton.compile` for sm_80 and
  sm_90a, specialised by Triton's own launch binder -> `corpus/ptx/triton_<name>.<arch>.ptx`; their
  ground truth (access and indirect) is observed under TRITON_INTERPRET=1 (a subprocess running triton_kernels.py
  --observe) and written, per compiled PTX parameter, to `corpus/triton_expected.json`.

A compiler that is missing is reported and its part skipped; the committed PTX stays as it is.
Absolute paths in `.file` directives are rewritten relative to the repository root.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fixtures" / "ptx" / "corpus"
CUDA_DIR = CORPUS / "cuda"
PTX_DIR = CORPUS / "ptx"
TRITON_JSON = CORPUS / "triton_expected.json"
HERE = Path(__file__).resolve().parent


def _relativise(ptx: str) -> str:
    """Rewrite absolute source paths in `.file` directives relative to the repository root."""
    return ptx.replace(str(ROOT) + "/", "")


def _header_list(source: str, key: str) -> list[str]:
    m = re.search(rf"^//\s*tessera-{key}:\s*(.*)$", source, re.M)
    return m.group(1).split() if m else []


# --------------------------------------------------------------------------- nvcc


def find_nvcc() -> str | None:
    """The system nvcc (PATH, then /usr/local/cuda/bin)."""
    found = shutil.which("nvcc")
    if found:
        return found
    cand = Path("/usr/local/cuda/bin/nvcc")
    return str(cand) if cand.exists() else None


def build_nvcc(nvcc: str, skipped: list[str]) -> list[Path]:
    """Compile every corpus .cu for its `tessera-archs` with `nvcc -ptx`."""
    written = []
    for cu in sorted(CUDA_DIR.glob("*.cu")):
        for arch in _header_list(cu.read_text(), "archs"):
            out = PTX_DIR / f"{cu.stem}.{arch}.ptx"
            cmd = [nvcc, "-ptx", f"-arch={arch}", str(cu), "-o", str(out)]
            if arch.startswith("sm_90"):
                cmd.insert(2, "-lineinfo")
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                skipped.append(f"nvcc {cu.name} {arch}: {r.stderr.strip()[:300]}")
                continue
            out.write_text(_relativise(out.read_text()))
            written.append(out)
    return written


# --------------------------------------------------------------------------- NVRTC


def find_nvrtc() -> Path | None:
    """libnvrtc.so from the nvidia-cuda-nvrtc wheel (nvidia/cu13/lib or nvidia/cuda_nvrtc/lib)."""
    try:
        import nvidia  # namespace package of the NVIDIA wheels
    except ImportError:
        return None
    for base in map(Path, nvidia.__path__):
        for lib in sorted(base.glob("*/lib/libnvrtc.so*")):
            if "builtins" not in lib.name and "alt" not in lib.name:
                return lib
    return None


class Nvrtc:
    """A minimal ctypes binding: compile CUDA C to PTX."""

    def __init__(self, lib: Path):
        for builtins in sorted(lib.parent.glob("libnvrtc-builtins.so*")):
            if "alt" not in builtins.name:
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                break
        self.lib = ctypes.CDLL(str(lib))
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"

    def compile(self, source: str, name: str, options: list[str]) -> tuple[str | None, str]:
        """(ptx or None, log)."""
        prog = ctypes.c_void_p()
        rc = self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
        if rc:
            return None, f"nvrtcCreateProgram failed ({rc})"
        try:
            opts = [o.encode() for o in options]
            arr = (ctypes.c_char_p * len(opts))(*opts)
            rc = self.lib.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            if rc:
                return None, log.value.decode(errors="replace")
            self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            ptx = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetPTX(prog, ptx)
            return ptx.value.decode(), log.value.decode(errors="replace")
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def build_nvrtc(nvrtc: Nvrtc, skipped: list[str]) -> list[Path]:
    """Compile the corpus files that name `tessera-nvrtc` architectures with NVRTC."""
    written = []
    for cu in sorted(CUDA_DIR.glob("*.cu")):
        src = cu.read_text()
        for arch in _header_list(src, "nvrtc"):
            ptx, log = nvrtc.compile(src, cu.name, [f"--gpu-architecture={arch.replace('sm_', 'compute_')}"])
            if ptx is None:
                skipped.append(f"nvrtc {cu.name} {arch}: {log.strip()[:300]}")
                continue
            out = PTX_DIR / f"{cu.stem}.nvrtc.{arch}.ptx"
            out.write_text(ptx)
            written.append(out)
    return written


# --------------------------------------------------------------------------- Triton


def _param_decls(ptx: str, entry: str) -> list[str]:
    m = re.search(rf"\.entry\s+{re.escape(entry)}\s*\((.*?)\)", ptx, re.S)
    return [p.strip() for p in m.group(1).split(",")] if m and m.group(1).strip() else []


def triton_param_map(sig: dict, tensordesc_meta: list, decls: list[str]) -> list[dict]:
    """Map compiled PTX parameters to Python arguments (constexprs dropped, tensor descriptors
    expanded as the Triton driver expands them, scratch pointers appended)."""
    rows: list[dict] = []
    desc_i = 0
    for name, ty in sig.items():
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            meta = tensordesc_meta[desc_i] if tensordesc_meta else None
            desc_i += 1
            ndim = re.match(r"tensordesc<[^[>]*\[([^]]*)\]", ty).group(1).count(",") + 1
            if meta is None:  # lowered to plain loads: base pointer, shape, strides, padding, tf32 flag
                parts = [("base", "pointer")] + [("shape", "i64")] * ndim + [("stride", "i64")] * ndim
                parts += [("padding_nan", "i1"), ("round_f32_to_tf32", "i1")]
            else:  # a CUtensorMap
                parts = [("tensormap", "descriptor")]
            parts += [("shape", "i32")] * ndim + [("stride", "i64")] * ndim
            rows += [{"arg": name, "part": part, "type": t} for part, t in parts]
        else:
            rows.append({"arg": name, "part": None, "type": ty})
    extra = len(decls) - len(rows)
    if extra != 2:
        raise RuntimeError(f"expected 2 scratch params after {len(rows)} arguments, PTX has {len(decls)}")
    rows += [{"arg": "global_scratch", "part": "scratch", "type": "*scratch"},
             {"arg": "profile_scratch", "part": "scratch", "type": "*scratch"}]
    for i, (row, decl) in enumerate(zip(rows, decls, strict=True)):
        row["index"] = i
        row["ptx_name"] = decl.split()[-1]
        row["ptx_decl"] = decl
    return rows


def _kind_and_access(row: dict, observed: dict) -> tuple[str | None, str, bool, str]:
    """(expected kind or None when PTX cannot tell, access, indirect, where they come from)."""
    t = row["type"]
    if t == "*scratch":
        return "pointer", "none", False, "Triton scratch pointer (metadata scratch sizes are 0): unused"
    if t.startswith("*") or t == "pointer" or t == "descriptor":
        obs = observed.get(row["arg"])
        if obs is None:
            raise RuntimeError(f"no observation for {row['arg']}")
        kind = "descriptor" if t == "descriptor" else "pointer"
        return kind, obs["access"], obs["indirect"], "observed under TRITON_INTERPRET=1"
    # scalars: 64-bit integers are typed like pointers in PTX, so their kind is not checked
    kind = None if t in ("i64", "u64") else "scalar"
    return kind, "none", False, "scalar"


def compile_triton(skipped: list[str]) -> dict:
    """Compile every Triton spec for sm_80 and sm_90a; return {kernel: {arch: compile record}}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    sys.path.insert(0, str(HERE))
    import triton_kernels as tk

    records: dict = {}
    for spec in tk.SPECS:
        if spec.name == "tma_scale" and tk.TensorDescriptor is None:
            skipped.append("triton tma_scale: this Triton has no TensorDescriptor")
            continue
        for cap in spec.caps:
            target = GPUTarget("cuda", cap, 32)
            backend = make_backend(target)
            binder = create_function_from_signature(spec.fn.signature, spec.fn.params, backend)
            bound, specialization, _ = binder(*spec.make_args(0).values(), **spec.constexprs)
            options = backend.parse_options(dict(spec.options))
            _, sig, constexprs, attrs = spec.fn._pack_args(backend, {}, bound, specialization, options)
            try:
                k = triton.compile(ASTSource(spec.fn, sig, constexprs, attrs), target=target,
                                   options=dict(spec.options))
            except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
                skipped.append(f"triton {spec.name} sm_{cap}: {type(e).__name__}: {str(e)[:300]}")
                continue
            ptx = k.asm["ptx"]
            arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).split(",")[0]
            out = PTX_DIR / f"triton_{spec.name}.{arch}.ptx"
            out.write_text(_relativise(ptx))
            md = k.metadata
            entry = md.name
            rows = triton_param_map(sig, list(md.tensordesc_meta or []), _param_decls(ptx, entry))
            dropped = {name: f"constexpr = {constexprs[(spec.fn.arg_names.index(name),)]!r}"
                       for name, ty in sig.items() if ty == "constexpr"}
            records.setdefault(spec.name, {})[arch] = {
                "file": f"ptx/{out.name}", "entry": entry, "signature": sig, "dropped": dropped, "rows": rows,
                "scratch_sizes": [md.global_scratch_size, md.profile_scratch_size],
                "tensordesc_meta": list(md.tensordesc_meta or []),
            }
            print(f"  triton {spec.name} -> {out.relative_to(ROOT)}")
    return records


def observe_triton(names: list[str]) -> dict:
    """Run triton_kernels.py --observe under TRITON_INTERPRET=1 in a subprocess."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "observed.json"
        env = dict(os.environ, TRITON_INTERPRET="1")
        r = subprocess.run([sys.executable, str(HERE / "triton_kernels.py"), "--observe", str(out), "--only", *names],
                           env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"observation failed:\n{r.stderr[-3000:]}")
        return json.loads(out.read_text())


def write_triton_expected(records: dict, observed: dict) -> None:
    """Merge compile records and observations into triton_expected.json."""
    import triton

    sys.path.insert(0, str(HERE))
    import triton_kernels as tk

    notes = {s.name: s.note for s in tk.SPECS}
    kernels = {}
    for name, per_arch in sorted(records.items()):
        obs = observed[name]
        entry = {"note": notes.get(name, ""), "observed": obs, "ptx": {}}
        for arch, rec in sorted(per_arch.items()):
            params = []
            for row in rec["rows"]:
                kind, access, indirect, source = _kind_and_access(row, obs)
                params.append({"index": row["index"], "ptx_name": row["ptx_name"], "ptx_decl": row["ptx_decl"],
                               "arg": row["arg"], "part": row["part"], "type": row["type"], "kind": kind,
                               "access": access, "indirect": indirect, "source": source})
            entry["ptx"][arch] = {
                "file": rec["file"], "entry": rec["entry"], "signature": rec["signature"],
                "dropped": rec["dropped"], "scratch_sizes": rec["scratch_sizes"],
                "arg_to_ptx_index": _arg_index(params), "params": params,
            }
        kernels[name] = entry
    doc = {
        "about": "Ground truth of the Triton kernels of the PTX corpus, observed (not declared) by running "
                 "each kernel under TRITON_INTERPRET=1 on CPU tensors: canary-filled buffers detect writes, "
                 "poisoned buffers detect reads, and a buffer is indirect when other valid contents change "
                 "the pointers of some memory operation (see tools/ptx_corpus/triton_kernels.py). Parameters are "
                 "listed in compiled PTX order: constexpr and specialised arguments are dropped, tensor "
                 "descriptors expanded, and Triton's scratch pointers appended (expected none). kind null: "
                 "a 64-bit integer scalar, which PTX types like a pointer, so its kind is not checked.",
        "triton_version": triton.__version__,
        "generator": "tools/ptx_corpus/generate.py",
        "kernels": kernels,
    }
    TRITON_JSON.write_text(json.dumps(doc, indent=1) + "\n")


def _arg_index(params: list[dict]) -> dict:
    out: dict = {}
    for p in params:
        out.setdefault(p["arg"], []).append(p["index"])
    return out


def main(argv: list[str] | None = None) -> int:
    """Regenerate what the available compilers allow; print what was skipped."""
    ap = argparse.ArgumentParser(description="Regenerate the PTX corpus")
    ap.add_argument("--only-cuda", action="store_true")
    ap.add_argument("--only-triton", action="store_true")
    ap.add_argument("--no-observe", action="store_true", help="compile Triton kernels but keep the JSON")
    a = ap.parse_args(argv)
    PTX_DIR.mkdir(parents=True, exist_ok=True)
    skipped: list[str] = []
    if not a.only_triton:
        nvcc = find_nvcc()
        if nvcc:
            print(f"nvcc: {nvcc}")
            for p in build_nvcc(nvcc, skipped):
                print(f"  {p.relative_to(ROOT)}")
        else:
            skipped.append("nvcc not found: CUDA C PTX kept as committed")
        lib = find_nvrtc()
        if lib:
            nv = Nvrtc(lib)
            print(f"nvrtc {nv.version}: {lib}")
            for p in build_nvrtc(nv, skipped):
                print(f"  {p.relative_to(ROOT)}")
        else:
            skipped.append("libnvrtc not found (pip install nvidia-cuda-nvrtc): NVRTC PTX kept as committed")
    if not a.only_cuda:
        try:
            import triton  # noqa: F401
        except ImportError:
            skipped.append("triton not importable: Triton PTX and triton_expected.json kept as committed")
        else:
            records = compile_triton(skipped)
            if records and not a.no_observe:
                write_triton_expected(records, observe_triton(sorted(records)))
                print(f"  {TRITON_JSON.relative_to(ROOT)}")
    for s in skipped:
        print(f"SKIPPED: {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
