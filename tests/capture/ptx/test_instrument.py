"""Range instrumentation: what is inserted, where, under which predicate, and that ptxas accepts it.

Every instrumented module is assembled with the pinned ptxas (PyPI nvidia-cuda-nvcc) for the target
it was generated for; those tests skip, saying so, where no ptxas is found. The GPU half of the
check (running the kernels and comparing the recorded ranges with the launch buffers) is
benchmarks/gpu_ptx_ranges.py; its launch plan and its checking logic are tested here without a GPU.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.capture.ptx import instrument as inst
from tessera.capture.ptx.analyze import access_sites
from tessera.capture.ptx.extract import find_tool, ptx_target
from tessera.capture.ptx.instrument import BUFFER_PARAM, SLOT_BYTES, instrument_ptx
from tessera.capture.ptx.parse import parse_ptx

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "ptx"
SAMPLES = sorted((FIXTURES / "instrument").glob("*.ptx"))
CORPUS = sorted((FIXTURES / "corpus" / "ptx").glob("*.ptx"))
BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_ptx_ranges.py"
PTXAS = find_tool("ptxas")
needs_ptxas = pytest.mark.skipif(PTXAS is None, reason="ptxas not found: pip install nvidia-cuda-nvcc")
ATOM_RE = re.compile(r"(@!?[%\w]+\s+)?atom\.global\.(min|max)\.u64\s+%tsr3, \[%tsr0\+(\d+)\], (%tsr[12]);")


def assemble(text: str, arch: str, tmp_path: Path) -> None:
    """Assemble PTX with the pinned ptxas for `arch`; fail with ptxas's message if it refuses."""
    path = tmp_path / "instrumented.ptx"
    path.write_text(text)
    out = subprocess.run([str(PTXAS), f"-arch={arch}", str(path), "-o", str(tmp_path / "out.cubin")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"ptxas -arch={arch} refused the instrumented PTX:\n{out.stderr[-3000:]}"


def functions(text: str) -> dict[str, inst._Fn]:
    return {fn.name: fn for fn in inst._functions(inst._Source(text, inst._mask(text)))}


def sample(name: str) -> Path:
    return FIXTURES / "instrument" / name


def check_structure(original: str, result: inst.InstrumentResult) -> None:
    """Original statements kept in order; 2 atoms per site into its slot; buffer param last."""
    before, after = functions(original), functions(result.text)
    assert before.keys() == after.keys()
    for name, fn in before.items():
        kept = [s.text for s in after[name].stmts if "%tsr" not in s.text and BUFFER_PARAM not in s.text]
        assert kept == [s.text for s in fn.stmts], f"{name}: original statements changed"
        if fn.is_entry:
            assert after[name].params == [*fn.params, result.buffer_param]
        else:
            assert after[name].params == fn.params
        sites = [s for s in result.sites if s["function"] == name]
        assert [s["slot"] for s in sites] == list(range(len(sites)))
        body = result.text[after[name].body_open:after[name].body_close] if fn.is_entry else ""
        atoms = ATOM_RE.findall(body)
        assert len(atoms) == 2 * len(sites)
        for slot in range(len(sites)):
            assert [a[1:] for a in atoms[2 * slot:2 * slot + 2]] == [
                ("min", str(SLOT_BYTES * slot), "%tsr1"), ("max", str(SLOT_BYTES * slot + 8), "%tsr2")]
            assert atoms[2 * slot][0] == atoms[2 * slot + 1][0]  # both under the same guard
    assert all(s["function"] in before and before[s["function"]].is_entry for s in result.sites)


# ------------------------------------------------------------------------------- own samples


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_keep_their_code_and_get_two_atoms_per_site(path):
    text = path.read_text()
    result = instrument_ptx(text, str(path))
    assert result.sites or result.skipped, "every sample has global accesses"
    check_structure(text, result)


@needs_ptxas
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_instrumented_samples_assemble(path, tmp_path):
    text = path.read_text()
    assemble(text, ptx_target(text), tmp_path)  # the fixture itself is valid
    assemble(instrument_ptx(text, str(path)).text, ptx_target(text), tmp_path)


GPU_KERNEL_SITES = {  # from gpu_kernels.cu: (mode, width, the pointer parameter the address comes from)
    "vadd": [("read", 4, 1), ("read", 4, 0), ("write", 4, 2)],
    "scale_inplace": [("read", 4, 0), ("write", 4, 0)],
    "strided": [("read", 4, 0), ("write", 4, 1)],
    "histogram": [("read", 4, 1), ("read-write", 4, 0)],
    "copy_vec4": [("read", 16, 0), ("write", 16, 1)],
    "gather_ptrs": [("read", 8, 0), ("read", 4, None), ("write", 4, 1)],  # None: through a loaded pointer
    "select_generic": [("write", 4, 0), ("write", 4, 0)],
    "stage_cp_async": [("read", 16, 0), ("write", 16, 1)],
    "stage_ignore_src": [("read", 16, 0), ("write", 16, 1)],
}


def test_gpu_kernel_sites_are_the_accesses_of_the_source():
    result = instrument_ptx(sample("gpu_kernels.sm_80.ptx").read_text())
    assert result.skipped == []
    for kernel, expected in GPU_KERNEL_SITES.items():
        sites = [s for s in result.sites if s["function"] == kernel]
        assert [(s["mode"], s["width"]) for s in sites] == [(m, w) for m, w, _ in expected], kernel
        for site, (_, _, param) in zip(sites, expected, strict=True):
            if param is not None:
                assert param in site["params"], (kernel, site)


def _site_code(result: inst.InstrumentResult, line: int, function: str | None = None) -> str:
    """The instrumentation inserted for the site at `line` (from its comment to its second atom)."""
    site = next(s for s in result.sites if s["line"] == line and function in (None, s["function"]))
    fn = functions(result.text)[site["function"]]
    start = result.text.index(f"// tessera range slot {site['slot']}:", fn.body_open)
    return result.text[start:result.text.index("atom.global.max", start)]


def test_atoms_run_under_the_access_predicate():
    result = instrument_ptx(sample("edge_forms.ptx").read_text())
    lines = {s["line"]: s for s in result.sites if s["function"] == "forms"}
    assert "@%p1 atom.global.min.u64" in _site_code(result, 50)  # @%p1 ld.global.f32 after a label
    assert "@!%p1 atom.global.min.u64" in _site_code(result, 51)  # @!%p1 ld.global.nc...v2.f32
    assert "@q atom.global.min.u64" in _site_code(result, 53)  # @q inside a one-line { } scope
    unguarded = _site_code(result, 55)
    assert "\tatom.global.min.u64" in unguarded and "@" not in unguarded
    assert lines[51]["width"] == 8 and lines[56]["width"] == 8 and lines[50]["width"] == 4


def test_address_forms():
    result = instrument_ptx(sample("edge_forms.ptx").read_text())
    assert "add.s64 %tsr1, %rd8, -16;" in _site_code(result, 50)  # [%rd8+-16]
    assert "add.s64 %tsr1, %rd8, 8;" in _site_code(result, 51)  # [ %rd8 + 8 ]
    two = [s for s in result.sites if s["line"] == 52]  # two statements on one line
    assert len(two) == 2 and "add.s64 %tsr1, %rd8, 32;" in result.text  # [%rd8+0x20]
    assert "mov.u64 %tsr1, table;\n\tadd.s64 %tsr1, %tsr1, 8;" in _site_code(result, 64)  # [table+8]
    code = _site_code(result, 60)  # atom.global.add.noftz.f16x2: 4 bytes
    assert "add.s64 %tsr2, %tsr1, 3;" in code


def test_what_is_not_instrumented():
    result = instrument_ptx(sample("edge_forms.ptx").read_text())
    lines = {s["line"] for s in result.sites}
    # generic access to a .shared variable, .shared, prefetches, .param and call: no sites
    assert not lines & {66, 67, 73, 74, 76}
    skipped = {s["line"]: s["reason"] for s in result.skipped}
    assert "bulk tensor copy" in skipped[72]
    assert skipped[19].startswith("in .func load_first")
    assert set(skipped) == {19, 72}


def test_copy_sizes_known_at_run_time():
    result = instrument_ptx(sample("gpu_kernels.sm_80.ptx").read_text())
    cp = next(s for s in result.sites if s["function"] == "stage_cp_async" and s["mode"] == "read")
    code = _site_code(result, cp["line"], "stage_cp_async")
    # cp.async ... 16, %r4: records src-size bytes, nothing when it is 0
    assert "cvt.u64.u32 %tsr2, %r4;" in code and "setp.ne.u32 %tsrp0, %r4, 0;" in code
    assert "@%tsrp0 atom.global.min.u64" in code
    ign = next(s for s in result.sites if s["function"] == "stage_ignore_src" and s["mode"] == "read")
    # the ignore-src predicate q: 16 bytes when q is clear
    assert "selp.u32 %tsrw0, 0, 16, q;" in _site_code(result, ign["line"], "stage_ignore_src")
    edge = instrument_ptx(sample("edge_forms.ptx").read_text())
    bulk = _site_code(edge, 70)  # cp.async.bulk ... [%rd8], %r1: a register size
    assert "cvt.u64.u32 %tsr2, %r1;" in bulk
    reduce_ = next(s for s in edge.sites if s["line"] == 71)
    assert reduce_["mode"] == "read-write" and reduce_["width"] == 64


ZERO_FILL = """
.version 8.0
.target sm_80
.address_size 64
.visible .entry zfill(.param .u64 src, .param .u32 n)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	.reg .b64 %rd<4>;
	.shared .align 16 .b8 tile[256];
	ld.param.u64 %rd1, [src];
	ld.param.u32 %r1, [n];
	cvta.to.global.u64 %rd2, %rd1;
	mov.u32 %r2, tile;
	setp.lt.u32 %p1, %r1, 16;
	@%p1 cp.async.ca.shared.global [%r2], [%rd2], 16, 0;
	@!%p1 cp.async.ca.shared.global.L2::128B [%r2], [%rd2+16], 8, 4;
	cp.async.ca.shared.global [%r2], [%rd2+32], 4, !%p1;
	cp.async.wait_all;
	ret;
}
"""


@needs_ptxas
def test_copies_of_immediate_sizes(tmp_path):
    result = instrument_ptx(ZERO_FILL)
    assert [(s["line"], s["reason"]) for s in result.skipped] == [(16, "copies 0 bytes: accesses nothing")]
    [site, ignore] = result.sites
    assert site["line"] == 17 and site["width"] == 4  # src-size 4 of a 8-byte copy
    assert "@!%p1 atom.global.max.u64" in result.text
    assert ignore["line"] == 18 and "selp.u32 %tsrw0, 4, 0, %p1;" in result.text  # ignore-src !%p1
    assemble(result.text, "sm_80", tmp_path)


@needs_ptxas
def test_instrumenting_twice_uses_fresh_names(tmp_path):
    once = instrument_ptx(sample("gpu_kernels.sm_80.ptx").read_text())
    twice = instrument_ptx(once.text)
    assert once.buffer_param == BUFFER_PARAM and twice.buffer_param == f"{BUFFER_PARAM}_1"
    assert ".reg .b64 %tsr_a<4>;" in twice.text
    assert len(twice.sites) == 3 * len(once.sites)  # the first pass's atoms are global accesses too
    assemble(twice.text, "sm_80", tmp_path)


@needs_ptxas
def test_entries_without_parameters_or_global_accesses(tmp_path):
    text = sample("edge_forms.ptx").read_text()
    result = instrument_ptx(text)
    assert ".visible .entry no_params( .param .u64 __tessera_ranges)" in result.text
    assert ".entry no_global_access(.param .u32 n, .param .u64 __tessera_ranges)" in result.text
    body = result.text[result.text.index(".entry no_global_access"):]
    assert "%tsr" not in body  # no sites: nothing loaded, nothing declared
    bare = ".version 8.0\n.target sm_80\n.address_size 64\n.visible .entry k\n{\n\tret;\n}\n"
    out = instrument_ptx(bare).text
    assert ".entry k(\n\t.param .u64 __tessera_ranges\n)" in out
    assemble(out, "sm_80", tmp_path)


def test_module_without_entries_is_unchanged():
    text = ".version 8.0\n.target sm_80\n.address_size 64\n.global .b32 x;\n"
    result = instrument_ptx(text)
    assert result.text == text and result.sites == [] and result.skipped == []


def test_a_malformed_function_does_not_stop_the_others():
    good = sample("gpu_kernels.sm_80.ptx").read_text()
    broken = good.replace(".visible .entry vadd(", ".visible .entry broken(\n.param .u64 p\n)\n{\n"
                          "\tld.global.f32 %f1, [%rd1;\n\tthis is not ptx\n}\n.visible .entry vadd(", 1)
    result = instrument_ptx(broken, "broken.ptx")
    shifted = [{**s, "line": s["line"] + 7} for s in instrument_ptx(good).sites]  # 7 lines inserted above
    assert result.sites == shifted
    [skip] = result.skipped
    assert skip["function"] == "broken" and skip["line"] == 18
    assert skip["reason"].startswith("not instrumented: the function could not be parsed (broken.ptx:22:")
    assert ".entry broken(\n.param .u64 p\n)\n{\n\tld.global.f32 %f1, [%rd1;" in result.text  # left as it is


def test_sites_match_the_analysis_access_sites():
    """Every access site of the analysis is instrumented or skipped, in every sample and corpus file."""
    for path in SAMPLES + CORPUS:
        text = path.read_text()
        module = parse_ptx(text, str(path))
        result = instrument_ptx(text, str(path))
        for fn in module.functions:
            want = sorted(s.line for s in access_sites(module, fn.name))
            got = sorted(s["line"] for s in result.sites + result.skipped if s["function"] == fn.name)
            assert got == want, f"{path.name}:{fn.name}"


# ------------------------------------------------------------------------------- the corpus


@pytest.mark.parametrize("path", CORPUS or [None], ids=lambda p: p.name if p else "empty")
def test_corpus_kernels_instrument_and_assemble(path, tmp_path):
    if path is None:
        pytest.skip("the PTX corpus (tests/fixtures/ptx/corpus/ptx) is empty")
    if PTXAS is None:
        pytest.skip("ptxas not found: pip install nvidia-cuda-nvcc")
    text = path.read_text()
    result = instrument_ptx(text, str(path))
    check_structure(text, result)
    assemble(result.text, ptx_target(text), tmp_path)


# ------------------------------------------------------------------------------- the GPU script


@pytest.fixture(scope="module")
def gpu_script():
    spec = importlib.util.spec_from_file_location("gpu_ptx_ranges", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_gpu_script_dry_run_prints_the_launch_plan(gpu_script, capsys):
    assert gpu_script.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for case in gpu_script.cases():
        assert f"{case.kernel} ({case.ptx}): grid {case.grid}" in out
    assert "params (u64 a, u64 b, u64 c, u32 1000, u64 ranges)" in out  # vadd
    assert "u32 64, u64 0, u64 0, u64 ranges)" in out  # the Triton matmul's scratch pointers get 0
    assert f"dry run: {len(gpu_script.cases())} launches planned" in out


def test_gpu_script_cases_are_consistent(gpu_script):
    for case in gpu_script.cases():
        result = instrument_ptx((gpu_script.FIXTURES / case.ptx).read_text())
        sites = [s for s in result.sites if s["function"] == case.kernel]
        assert sites, case.kernel
        types = gpu_script.entry_params(result.text, case.kernel)
        assert types[-1] == "u64" and len(case.args) <= len(types) - 1
        assert set(case.expect) <= set(case.buffers)
        for arg in case.args:
            assert arg in case.buffers if isinstance(arg, str) else arg[0] in ("i32", "u32", "f32")


def test_gpu_script_fails_fast_without_cuda(gpu_script, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run")
    assert gpu_script.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_script_checks(gpu_script):
    big = gpu_script.UINT64_MAX
    sites = [{"slot": k, "line": 10 + k, "mode": "read", "width": 4, "params": [0]} for k in range(3)]
    buffers = {"a": (0x1000, 400), "b": (0x2000, 400)}
    ok = gpu_script.evaluate("k", sites, [(0x1000, 0x1000 + 399), (big, 0), (0x2000, 0x2000 + 7)], buffers,
                             {"a": (0, 399), "b": (0, 7)})
    assert all(passed for passed, _ in ok) and "not executed" in ok[1][1]
    short = gpu_script.evaluate("k", sites[:1], [(0x1000, 0x1000 + 395)], buffers, {"a": (0, 399)})
    assert [p for p, _ in short] == [True, False]  # inside a, but does not cover it
    outside = gpu_script.evaluate("k", sites[:1], [(0x1000, 0x1000 + 400)], buffers, {"a": (0, 399)})
    assert [p for p, _ in outside] == [False, False]
    extra = gpu_script.evaluate("k", sites[:1], [(0x2000, 0x2003)], buffers, {})
    assert [p for p, _ in extra] == [True, False]  # b touched though nothing was expected


def test_gpu_script_lowers_the_ptx_version_for_old_drivers(gpu_script):
    text = ".version 9.0\n.target sm_80\n"
    assert gpu_script.fit_ptx_version(text, 12040).startswith(".version 8.4\n")
    assert gpu_script.fit_ptx_version(text, 12080).startswith(".version 8.7\n")
    assert gpu_script.fit_ptx_version(text, 13000) == text
    assert gpu_script.fit_ptx_version(".version 8.0\n", 12080) == ".version 8.0\n"
