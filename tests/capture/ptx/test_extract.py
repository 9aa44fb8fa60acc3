"""PTX extraction: plain PTX, cubins, fatbinaries, objects, shared libraries, archives and Triton kernels.

The binary fixtures (tests/fixtures/ptx/binaries, built by its build.sh with nvcc 13.0) are read with
the pinned `cuobjdump` from the PyPI package nvidia-cuda-cuobjdump; those tests skip without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessera.capture.ptx import extract
from tessera.capture.ptx.extract import (
    ExtractError,
    PtxSource,
    extract_ptx,
    find_tool,
    ptx_entries,
    triton_ptx,
)
from tessera.errors import TesseraError

BINARIES = Path(__file__).resolve().parents[2] / "fixtures" / "ptx" / "binaries"
SAMPLES = Path(__file__).resolve().parents[2] / "fixtures" / "ptx" / "instrument"

needs_cuobjdump = pytest.mark.skipif(
    find_tool("cuobjdump") is None, reason="cuobjdump not found: pip install nvidia-cuda-cuobjdump"
)


def test_plain_ptx_is_read_as_it_is():
    path = SAMPLES / "gpu_kernels.sm_80.ptx"
    result = extract_ptx(path)
    assert result.file == str(path)
    assert result.sass_only == [] and result.errors == []
    [src] = result.ptx
    assert src == PtxSource(str(path), "", "sm_80", path.read_text())
    assert src.name == str(path)


def test_ptx_text_is_recognised_whatever_its_suffix(tmp_path):
    path = tmp_path / "kernel.txt"
    path.write_text((SAMPLES / "triton_masked_add.sm_90a.ptx").read_text())
    [src] = extract_ptx(path).ptx
    assert src.arch == "sm_90a" and ptx_entries(src.text) == ["masked_add"]


@needs_cuobjdump
def test_sass_only_cubin_has_no_ptx_and_lists_its_kernels():
    result = extract_ptx(BINARIES / "kernels.cubin")
    assert result.ptx == []
    assert sorted(result.sass_only) == ["scale", "vadd"]
    assert result.errors == []


@needs_cuobjdump
@pytest.mark.parametrize("name", ["kernels.fatbin", "kernels.o", "kernels.so"])
def test_binaries_with_ptx(name):
    result = extract_ptx(BINARIES / name)
    [src] = result.ptx
    assert src.file == str(BINARIES / name)
    assert src.member.endswith(".sm_90.ptx") and src.arch == "sm_90"
    assert src.name == f"{BINARIES / name}:{src.member}"
    assert src.text.startswith(".version") and "\n.target sm_90\n" in src.text
    assert sorted(ptx_entries(src.text)) == ["scale", "vadd"]
    assert result.sass_only == [] and result.errors == []


@needs_cuobjdump
def test_archive_with_a_sass_only_member():
    result = extract_ptx(BINARIES / "mixed.a")
    [src] = result.ptx
    assert src.member.startswith("kernels.o:") and src.member.endswith(".ptx")
    assert sorted(ptx_entries(src.text)) == ["scale", "vadd"]
    assert result.sass_only == ["histogram"]


@needs_cuobjdump
def test_ptx_from_a_binary_is_the_ptx_nvcc_emits():
    """The extracted PTX defines the same kernels with the same parameters as the .cu source says."""
    src = extract_ptx(BINARIES / "kernels.so").ptx[0]
    assert ".visible .entry vadd(\n.param .u64 vadd_param_0," in src.text
    assert "st.global.f32" in src.text and "ld.global.f32" in src.text


@needs_cuobjdump
def test_host_only_binary_reports_no_device_code():
    result = extract_ptx(Path(sys.executable).resolve())
    assert result.ptx == [] and result.sass_only == []
    assert len(result.errors) == 1 and "no device code" in result.errors[0]


@needs_cuobjdump
def test_corrupt_fatbinary_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.fatbin"
    path.write_bytes(b"\x50\xed\x55\xba" + b"\x01\x00" * 40)
    with pytest.raises(ExtractError, match=r"broken\.fatbin: cuobjdump cannot read it"):
        extract_ptx(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ExtractError, match=r"nope\.ptx: no such file; check the path"):
        extract_ptx(tmp_path / "nope.ptx")


def test_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ExtractError, match="is a directory"):
        extract_ptx(tmp_path)


def test_unsupported_format_is_a_clear_error():
    with pytest.raises(ExtractError, match=r"kernels\.cu: unsupported format.*compile the kernel with nvcc"):
        extract_ptx(BINARIES / "kernels.cu")


def test_unreadable_file_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "k.ptx"
    path.write_text(".version 8.0\n")

    def refuse(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(ExtractError, match=r"k\.ptx: cannot be read \(Permission denied\); check its perm"):
        extract_ptx(path)


def test_binary_without_cuobjdump_says_what_to_install(monkeypatch):
    monkeypatch.setattr(extract, "find_tool", lambda name: None)
    with pytest.raises(ExtractError, match="pip install nvidia-cuda-cuobjdump"):
        extract_ptx(BINARIES / "kernels.cubin")


def test_errors_are_tessera_errors():
    assert issubclass(ExtractError, TesseraError)


def test_find_tool_prefers_the_pinned_wheels():
    for name in ("cuobjdump", "ptxas"):
        path = find_tool(name)
        if path is None:
            pytest.skip(f"{name} not installed")
        assert path.name == name and path.is_file()
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "NVIDIA" in out.stdout
    assert find_tool("surely-not-a-cuda-tool") is None


def test_cuobjdump_output_parsing():
    """Section headers, archive members and symbol tables as cuobjdump 13 prints them."""
    dump = (
        "\nmember /x/lib.a:a.o:\n\nFatbin elf code:\n================\narch = sm_90\n\n"
        "Fatbin ptx code:\n================\narch = sm_80\ncode version = [9,0]\ncompressed\n\n\n"
        ".version 9.0\n.target sm_80\n.visible .entry k1()\n{\nret;\n}\n\n"
        "member /x/lib.a:b.o:\n\nFatbin ptx code:\n================\narch = sm_90a\n\n"
        ".version 9.0\n.target sm_90a\n.visible .entry k2()\n{\nret;\n}\n"
    )
    sections = extract._parse_ptx_dump(dump, "/x/lib.a")
    assert [(m, a) for m, a, _ in sections] == [("a.o:", "sm_80"), ("b.o:", "sm_90a")]
    assert sections[0][2].startswith(".version 9.0\n.target sm_80") and sections[0][2].endswith("}\n")
    listing = ("\nmember /x/lib.a:a.o:\nPTX file    1: lib.1.sm_80.ptx\n\n"
               "member /x/lib.a:b.o:\nPTX file    1: lib.1.sm_90a.ptx\n")
    assert extract._parse_lptx(listing, "/x/lib.a") == ["a.o:lib.1.sm_80.ptx", "b.o:lib.1.sm_90a.ptx"]
    symbols = ("symbols:\nSTT_OBJECT       STB_WEAK   STV_DEFAULT  U .nv.reservedSmem.offset0\n"
               "STT_FUNC         STB_GLOBAL STO_ENTRY      k1\n"
               "STT_FUNC         STB_LOCAL  STV_DEFAULT    helper\n"
               "STT_FUNC         STB_GLOBAL STO_ENTRY      k2\n"
               "STT_FUNC         STB_GLOBAL STO_ENTRY      k1\n")
    assert extract._parse_entry_symbols(symbols) == ["k1", "k2"]


def test_ptx_entries_ignores_comments():
    text = "// .entry fake(\n/* .entry also_fake( */\n.visible .entry real(\n.param .u64 p\n)\n{\nret;\n}\n"
    assert ptx_entries(text) == ["real"]


_TRITON_SNIPPET = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import gen_triton
from tessera.capture.ptx.extract import triton_ptx
signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
compiled = triton.compile(ASTSource(fn=gen_triton.masked_add, signature=signature, constexprs={"BLOCK": 64}),
                          target=GPUTarget("cuda", 90, 32))
src = triton_ptx(compiled)
json.dump({"file": src.file, "member": src.member, "arch": src.arch, "same": src.text == compiled.asm["ptx"],
           "text": src.text}, sys.stdout)
"""


def test_triton_ptx_from_a_compiled_kernel():
    """A real CompiledKernel (compiled in a subprocess: the tests run Triton in interpreter mode)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SAMPLES), str(Path(extract.__file__).parents[3])])
    proc = subprocess.run([sys.executable, "-c", _TRITON_SNIPPET], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["file"] == "<triton:masked_add>" and got["member"] == "masked_add.ptx"
    assert got["arch"] == "sm_90a" and got["same"]
    assert ptx_entries(got["text"]) == ["masked_add"]


def test_triton_ptx_without_ptx_is_a_clear_error():
    fake = SimpleNamespace(asm={"ttir": ""}, metadata=SimpleNamespace(name="k"))
    with pytest.raises(ExtractError, match=r"has no PTX \(asm\['ptx'\]\)"):
        triton_ptx(fake)
    named = SimpleNamespace(asm={"ptx": b".version 8.7\n.target sm_80\n.visible .entry kk()\n{\nret;\n}\n"})
    src = triton_ptx(named)
    assert src.member == "kk.ptx" and src.arch == "sm_80"
