"""Per-parameter access analysis of PTX kernels: real compiler output and hand-written edge cases.

Expectations for the compiled samples (tests/fixtures/ptx/unit/*.cu and generate.py) are written from
the CUDA/Triton source. The big ground-truth corpus is checked by tests/capture/ptx/test_corpus.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tessera.capture.ptx import access_sites, analyze_module, analyze_ptx, parse_ptx

UNIT = Path(__file__).resolve().parents[2] / "fixtures" / "ptx" / "unit"
HEADER = ".version 8.3\n.target sm_90a\n.address_size 64\n"

# kernel -> [(kind, access, indirect, {field offset: access})] in parameter order
P_R, P_W, P_RW, P_NONE = ("pointer", "read"), ("pointer", "write"), ("pointer", "read-write"), ("pointer", "none")
SCALAR = ("scalar", "none")

MISC = {   # misc.cu, nvcc -arch=sm_90
    "k_struct": [("struct", "read-write", False, {0: "write", 8: "read"}), (*P_W, False)],
    "k_func": [(*P_RW, False), (*P_R, False)],
    "k_selp": [(*P_R, False), (*P_R, False), (*P_W, False), (*SCALAR, False)],
    "k_ind": [(*P_R, True), (*P_W, False)],
    "k_atom": [(*P_RW, False), (*P_RW, False)],
    "k_vec": [(*P_R, False), (*P_W, False)],
    "k_loop": [(*P_R, False), (*P_W, False), (*SCALAR, False)],
    "k_cpasync": [(*P_R, False), (*P_W, False)],
    "k_unused": [(*P_NONE, False), (*P_W, False), (*SCALAR, False)],
    "k_gen": [(*P_W, False)],
}
CALLS = {  # calls.cu, nvcc -arch=sm_90 -rdc=true
    # a.p[i] with a run-time i: any slot of the by-value array may be dereferenced (the slot at +32
    # holds n and padding: reachable by the same indexing, so conservatively read too)
    "k_arr": [("struct", "read", False, {0: "read", 8: "read", 16: "read", 24: "read", 32: "read"}), SCALAR + (False,),
              (*P_W, False)],
    "k_printf": [(*P_R, False), (*SCALAR, False)],
    "k_ext": [(*P_RW, False), (*P_W, False)],          # passed to an extern function: read-write
    "k_rec": [(*P_RW, False), (*P_W, False), (*SCALAR, False)],   # recursion: conservative
    "k_indcall": [(*P_RW, False), (*SCALAR, False)],   # indirect call through a loaded function pointer
    "k_tex": [("descriptor", "read", False), (*P_W, False)],
    "k_red": [(*P_RW, False), (*P_R, False)],
    "k_retptr": [(*P_R, False), (*P_R, False), (*P_W, False), (*SCALAR, False)],
    "k_tmap": [("descriptor", "read", False), (*P_W, False)],
    "k_tstore": [("descriptor", "write", False), (*P_R, False)],
    "k_shptr": [(*P_W, False), (*P_W, False), (*SCALAR, False)],
    "k_stride": [(*P_W, False), (*SCALAR, False), (*SCALAR, False)],
    "k_gather": [(*P_R, False), (*P_R, True), (*P_W, False)],
}
REALISTIC = {  # realistic.cu, nvcc -arch=sm_90: patterns of PyTorch/apex extensions
    # multi-tensor apply: tensor addresses picked from a by-value table with a run-time index, so every
    # 8-byte slot of the 3568-byte struct may be one of the pointers (conservative, as it must be)
    "multi_tensor_scale": [("struct", "read-write", False, {o: "read-write" for o in range(0, 3568, 8)}),
                           (*SCALAR, False), (*SCALAR, False)],
    "softmax": [(*P_R, False), (*P_W, False), (*SCALAR, False), (*SCALAR, False)],    # int64 rows, cols
    "layernorm_vec": [(*P_R, False), (*P_R, False), (*P_W, False), (*SCALAR, False)],  # uint4 __ldg
    # parameters passed by pointer: the struct is read, the pointers inside it are dereferenced
    "by_pointer_params": [(*P_R, True)],
    # a paged KV gather: the block table indexes the cache
    "paged_gather": [(*P_R, False), (*P_R, True), (*P_W, False), (*SCALAR, False)],
}
NVRTC = {
    "saxpy": [(*SCALAR, False), ("struct", "read-write", False, {0: "read", 8: "read-write"}), (*SCALAR, False)],
    "_Z5scaleIdEvPT_S0_i": [(*P_RW, False), (*SCALAR, False), (*SCALAR, False)],
    "_Z5gridc4Pairi": [("struct", "read-write", False, {0: "read", 8: "write"}), (*SCALAR, False)],
}
TRITON = {
    # tensor descriptors expand to (map, 2 x i32 shape, 2 x i64 stride); scratch pointers are appended
    "tma_copy": [("descriptor", "read", False)] + [(*SCALAR, False)] * 4 + [("descriptor", "write", False)]
                + [(*SCALAR, False)] * 4 + [(*P_NONE, False)] * 2,
    # h[x[i]] += 1: the keys index the histogram (indirect), the histogram is read-write
    "atomic_hist": [(*P_R, True), (*P_RW, False), (*SCALAR, False), (*P_NONE, False), (*P_NONE, False)],
}


def _check(kernels, expected: dict) -> None:
    got = {k.name: k for k in kernels}
    assert set(expected) <= set(got), sorted(set(expected) - set(got))
    for name, params in expected.items():
        k = got[name]
        assert len(k.params) == len(params), name
        for i, (p, e) in enumerate(zip(k.params, params, strict=True)):
            kind, access, indirect = e[:3]
            where = f"{name} param {i} ({p.reason})"
            assert (p.index, p.kind, p.access, p.indirect) == (i, kind, access, indirect), where
            assert p.reason, where
            if kind == "struct":
                assert {f.offset: f.access for f in p.fields} == e[3], where
            else:
                assert p.fields == [], where
        assert k.indirect == any(e[2] for e in params), name


@pytest.mark.parametrize("file,expected", [("misc.sm_90.ptx", MISC), ("calls.sm_90.ptx", CALLS),
                                           ("realistic.sm_90.ptx", REALISTIC),
                                           ("nvrtc.sm_80.ptx", NVRTC), ("triton_tma_copy.sm_90a.ptx", TRITON),
                                           ("triton_atomic_hist.sm_90a.ptx", TRITON)])
def test_compiled_samples(file, expected):
    kernels, errors = analyze_ptx((UNIT / file).read_text(), file)
    assert errors == []
    expected = {k: v for k, v in expected.items() if k in {x.name for x in kernels}}
    _check(kernels, expected)
    assert all(k.file == file for k in kernels)


def test_reasons_name_instruction_and_line():
    text = (UNIT / "misc.sm_90.ptx").read_text()
    got = {k.name: k for k in analyze_ptx(text)[0]}
    vec = got["k_vec"].params
    assert vec[0].reason == f"ld.global.nc.v4.f32 at line {_line(text, 'ld.global.nc.v4.f32')}"
    assert vec[1].reason == f"st.global.v4.f32 at line {_line(text, 'st.global.v4.f32')}"
    assert got["k_func"].params[0].reason.startswith("passed to .func _Z5addtoPfPKfi at line ")
    assert got["k_func"].params[0].reason.endswith("(reads and writes its param 0)")
    assert got["k_unused"].params[0].reason == "never dereferenced"
    assert got["k_atom"].params[0].reason.startswith("atom.global.add.u32 at line ")
    assert "pointers loaded from it are dereferenced" in got["k_ind"].params[0].reason


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_to_json_shape():
    k = {k.name: k for k in analyze_ptx((UNIT / "misc.sm_90.ptx").read_text(), "m.ptx")[0]}["k_struct"]
    j = k.to_json()
    assert list(j) == ["name", "file", "indirect", "params"]
    assert j["name"] == "k_struct" and j["file"] == "m.ptx" and j["indirect"] is False
    assert [list(p) for p in j["params"]] == [["index", "name", "kind", "access", "indirect", "reason", "fields"]] * 2
    assert j["params"][0]["fields"] == [{"offset": 0, "access": "write"}, {"offset": 8, "access": "read"}]
    assert j["params"][1]["fields"] == []


def test_alias_loaded_option_spreads_loaded_pointer_accesses():
    text = (UNIT / "misc.sm_90.ptx").read_text()
    default = {k.name: k for k in analyze_ptx(text)[0]}["k_ind"]
    assert default.indirect_access == "read" and default.params[0].indirect_access == "read"
    aliased = {k.name: k for k in analyze_ptx(text, alias_loaded=True)[0]}["k_ind"]
    assert [p.access for p in aliased.params] == ["read", "read-write"]
    assert "may alias any argument" in aliased.params[1].reason


# ------------------------------------------------------------------------------------- hand-written


def test_hand_written_features():
    kernels, errors = analyze_ptx((UNIT / "hand_features.ptx").read_text())
    assert errors == []
    got = {k.name: [(p.kind, p.access) for p in k.params] for k in kernels}
    assert got == {
        # bulk copies: global source read, global destination written, reduction read-write; a prefetch
        # shows that pf is a pointer but touches no data
        "k_bulk": [P_R, P_W, P_RW, P_NONE],
        # an unknown opcode with a parameter-derived address: read-write; multimem loads and stores
        "k_unknown": [P_RW, P_R, P_W],
        # `red` is read-write; the inner-block %rd1 shadows the outer one, so q is only written
        "k_mixed": [P_RW, P_W, SCALAR],
        # passed to an extern function: read-write; stored in the vprintf argument buffer: read
        "k_printf": [P_RW, P_R],
        # accesses through pointers held in module variables are not arguments'
        "k_glob": [P_W],
    }
    k_glob = next(k for k in kernels if k.name == "k_glob")
    assert k_glob.indirect and k_glob.indirect_access == "read-write"
    reason = next(k for k in kernels if k.name == "k_bulk").params[3].reason
    assert reason.endswith("(no data access)")


def test_malformed_module_still_analyses_the_good_kernels():
    kernels, errors = analyze_ptx((UNIT / "hand_malformed.ptx").read_text(), "bad.ptx")
    assert [str(e).split(": ")[0] for e in errors] == ["bad.ptx:61", "bad.ptx:74", "bad.ptx:82"]
    got = {k.name: [(p.kind, p.access) for p in k.params] for k in kernels}
    # k_outparam: b is stored into a local slot by the .func put_ptr, reloaded and written through;
    # a goes through offset_ptr (which returns a pointer derived from its argument) and is read
    assert got == {"k_outparam": [P_R, P_W], "k_after": [P_W]}


def _one(body: str, params: str, extra: str = "", **kw):
    kernels, errors = analyze_ptx(HEADER + extra + f"\n.visible .entry k({params})\n{{\n{body}\n}}\n", **kw)
    assert errors == [], [str(e) for e in errors]
    assert len(kernels) == 1
    return kernels[0]


def _access(k):
    return [(p.kind, p.access, p.indirect) for p in k.params]


def test_generic_access_without_cvta_and_predication():
    k = _one("""
    .reg .b64 %rd<6>; .reg .pred %p<2>; .reg .b32 %r<3>;
    ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [b]; ld.param.u32 %r1, [n];
    setp.lt.s32 %p1, %r1, 4;
    mul.wide.s32 %rd3, %r1, 4;
    add.s64 %rd4, %rd1, %rd3;
    @%p1 ld.f32 %f1, [%rd4];
    add.s64 %rd5, %rd2, %rd3;
    @!%p1 st.f32 [%rd5+8], %f1;
    ret;""", ".param .u64 a, .param .u64 b, .param .u32 n")
    assert _access(k) == [("pointer", "read", False), ("pointer", "write", False), ("scalar", "none", False)]


def test_integer_scalars_used_as_offsets_are_not_pointers():
    k = _one("""
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [p]; ld.param.u64 %rd2, [ld]; ld.param.u64 %rd3, [off];
    cvta.to.global.u64 %rd4, %rd1;
    mul.lo.s64 %rd5, %rd2, 12;
    add.s64 %rd6, %rd4, %rd5;
    add.s64 %rd7, %rd6, %rd3;          // + a byte offset: p is the definite (cvta) pointer
    st.global.u8 [%rd7], 0;
    ret;""", ".param .u64 p, .param .u64 ld, .param .u64 off")
    assert _access(k) == [("pointer", "write", False), ("scalar", "none", False), ("scalar", "none", False)]


def test_ambiguous_sum_of_two_generic_values_charges_both():
    k = _one("""
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [p]; ld.param.u64 %rd2, [q];
    add.s64 %rd3, %rd1, %rd2;
    st.u32 [%rd3], 0;
    ret;""", ".param .u64 p, .param .u64 q")
    assert _access(k) == [("pointer", "write", False), ("pointer", "write", False)]


def test_loop_with_pointer_increments_and_phi_moves():
    k = _one("""
    .reg .b64 %rd<8>; .reg .b32 %r<3>; .reg .pred %p<2>;
    ld.param.u64 %rd1, [src]; ld.param.u64 %rd2, [dst]; ld.param.u32 %r1, [n];
    mov.u64 %rd3, %rd1; mov.u64 %rd4, %rd2;
L1:
    ld.global.f32 %f1, [%rd3];
    st.global.f32 [%rd4], %f1;
    add.s64 %rd5, %rd3, 4; add.s64 %rd6, %rd4, 4;
    mov.u64 %rd3, %rd5; mov.u64 %rd4, %rd6;
    add.s32 %r1, %r1, -1;
    setp.ne.s32 %p1, %r1, 0;
    @%p1 bra L1;
    ret;""", ".param .u64 src, .param .u64 dst, .param .u32 n")
    assert _access(k) == [("pointer", "read", False), ("pointer", "write", False), ("scalar", "none", False)]


def test_selp_between_pointers_and_slct():
    k = _one("""
    .reg .b64 %rd<6>; .reg .b32 %r<3>; .reg .pred %p<2>;
    ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [b]; ld.param.u64 %rd3, [c]; ld.param.u32 %r1, [f];
    setp.ne.s32 %p1, %r1, 0;
    selp.b64 %rd4, %rd1, %rd2, %p1;
    atom.global.exch.b32 %r2, [%rd4], 1;
    slct.b64.s32 %rd5, %rd3, %rd1, %r1;
    ld.global.u32 %r2, [%rd5];
    ret;""", ".param .u64 a, .param .u64 b, .param .u64 c, .param .u32 f")
    assert [p.access for p in k.params] == ["read-write", "read-write", "read", "none"]


def test_pointer_loaded_from_memory_and_index_loaded_from_memory():
    k = _one("""
    .reg .b64 %rd<12>; .reg .b32 %r<4>;
    ld.param.u64 %rd1, [table]; ld.param.u64 %rd2, [ids]; ld.param.u64 %rd3, [w]; ld.param.u64 %rd4, [out];
    cvta.to.global.u64 %rd5, %rd1;
    ld.global.nc.v2.u64 {%rd6, %rd7}, [%rd5];        // a pair of pointers
    st.global.u32 [%rd7], 1;                         // written through a loaded pointer
    cvta.to.global.u64 %rd8, %rd2;
    ld.global.u32 %r1, [%rd8];                      // an index
    mul.wide.u32 %rd9, %r1, 4;
    cvta.to.global.u64 %rd10, %rd3;
    add.s64 %rd11, %rd10, %rd9;
    ld.global.u32 %r2, [%rd11];                     // w[ids[0]]
    cvta.to.global.u64 %rd12, %rd4;
    st.global.u32 [%rd12], %r2;
    ret;""", ".param .u64 table, .param .u64 ids, .param .u64 w, .param .u64 out")
    assert _access(k) == [("pointer", "read", True), ("pointer", "read", True), ("pointer", "read", False),
                          ("pointer", "write", False)]
    assert k.indirect and k.indirect_access == "write"
    assert k.params[0].indirect_access == "write" and k.params[1].indirect_access == "none"


def test_reused_register_merges_conservatively():
    # the analysis merges every definition of a register (compiler output is SSA-like); hand-written
    # PTX that reuses one register for two pointers gets the union: over-reported, never missed
    k = _one("""
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [b];
    cvta.to.global.u64 %rd3, %rd1;
    ld.global.u32 %r1, [%rd3];
    cvta.to.global.u64 %rd3, %rd2;
    st.global.u32 [%rd3], %r1;
    ret;""", ".param .u64 a, .param .u64 b")
    assert [p.access for p in k.params] == ["read-write", "read-write"]


def test_atomic_old_value_used_as_index():
    k = _one("""
    .reg .b64 %rd<8>; .reg .b32 %r<3>;
    ld.param.u64 %rd1, [counter]; ld.param.u64 %rd2, [out];
    cvta.to.global.u64 %rd3, %rd1;
    atom.global.add.u32 %r1, [%rd3], 1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.u32 %rd5, %r1, 4;
    add.s64 %rd6, %rd4, %rd5;
    st.global.u32 [%rd6], 7;
    ret;""", ".param .u64 counter, .param .u64 out")
    assert _access(k) == [("pointer", "read-write", True), ("pointer", "write", False)]


def test_local_array_of_pointers_keeps_identity():
    # float* ptrs[2] = {a, b}; float* q[2] = {c, d}; ptrs[k & 1][i] = q[k & 1][i]
    k = _one("""
    .local .align 8 .b8 __local_depot0[32];
    .reg .b64 %SPL; .reg .b64 %rd<16>; .reg .b32 %r<4>;
    mov.u64 %SPL, __local_depot0;
    ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [b]; ld.param.u64 %rd3, [c]; ld.param.u64 %rd4, [d];
    ld.param.u32 %r1, [k];
    add.u64 %rd5, %SPL, 0;
    st.local.u64 [%rd5], %rd1; st.local.u64 [%rd5+8], %rd2;
    st.local.v2.u64 [%rd5+16], {%rd3, %rd4};
    and.b32 %r2, %r1, 1;
    mul.wide.u32 %rd6, %r2, 8;
    add.s64 %rd7, %rd5, %rd6;
    ld.local.u64 %rd8, [%rd7+16];
    ld.f32 %f1, [%rd8];
    ld.local.u64 %rd9, [%rd7];
    st.f32 [%rd9], %f1;
    ret;""", ".param .u64 a, .param .u64 b, .param .u64 c, .param .u64 d, .param .u32 k")
    assert [p.access for p in k.params] == ["write", "write", "read", "read", "none"]


def test_pointer_array_with_unbounded_index_is_conservative():
    k = _one("""
    .local .align 8 .b8 __local_depot0[32];
    .reg .b64 %SPL; .reg .b64 %rd<16>; .reg .b32 %r<4>;
    mov.u64 %SPL, __local_depot0;
    ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [b]; ld.param.u32 %r1, [k];
    st.local.u64 [%SPL], %rd1; st.local.u64 [%SPL+16], %rd2;
    mul.wide.u32 %rd6, %r1, 8;
    add.s64 %rd7, %SPL, %rd6;
    ld.local.u64 %rd8, [%rd7];
    st.u32 [%rd8], 0;
    ret;""", ".param .u64 a, .param .u64 b, .param .u32 k")
    assert [p.access for p in k.params] == ["write", "write", "none"]


def test_pointers_staged_in_shared_memory():
    k = _one("""
    .shared .align 8 .b8 sp[16];
    .reg .b64 %rd<8>; .reg .b32 %r<3>;
    ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [b];
    mov.u32 %r1, sp;
    st.shared.v2.u64 [%r1], {%rd1, %rd2};
    bar.sync 0;
    ld.shared.u64 %rd3, [%r1+8];
    st.u32 [%rd3], 0;
    ret;""", ".param .u64 a, .param .u64 b")
    # shared memory is one cell: both staged pointers may be the one written through
    assert [p.access for p in k.params] == ["write", "write"]


def test_struct_fields_by_value_and_through_a_generic_param_address():
    k = _one("""
    .reg .b64 %rd<12>;
    ld.param.u64 %rd1, [s+8];                 // field +8
    st.global.u32 [%rd1], 0;
    mov.b64 %rd2, t;                          // __grid_constant__: the address of the parameter
    cvta.param.u64 %rd3, %rd2;
    ld.u64 %rd4, [%rd3+16];                   // field +16 of t, read through a generic address
    ld.global.u32 %r1, [%rd4];
    ret;""", ".param .align 8 .b8 s[24], .param .align 8 .b8 t[24]")
    assert [(p.kind, p.access, {f.offset: f.access for f in p.fields}) for p in k.params] == [
        ("struct", "write", {8: "write"}), ("struct", "read", {16: "read"})]


def test_unused_by_value_struct_is_a_scalar_and_unused_tensor_map_a_descriptor():
    k = _one("ret;", ".param .align 4 .b8 s[12], .param .align 64 .b8 tm[128]")
    assert [(p.kind, p.access) for p in k.params] == [("scalar", "none"), ("descriptor", "none")]


def test_tensor_maps_by_value_and_by_pointer_and_prefetch():
    k = _one("""
    .reg .b64 %rd<6>; .reg .b32 %r<4>;
    mov.u32 %r1, smem;
    cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [m1, {%r2}], [%r1+64];
    ld.param.u64 %rd1, [m2];
    cp.reduce.async.bulk.tensor.1d.global.shared::cta.add.tile.bulk_group [%rd1, {%r2}], [%r1];
    prefetch.tensormap [m3];
    ret;""", ".param .align 64 .b8 m1[128], .param .u64 m2, .param .align 64 .b8 m3[128]",
        extra=".extern .shared .align 16 .b8 smem[];")
    got = [(p.kind, p.access, p.indirect) for p in k.params]
    # m2 points to a tensor map in global memory: the map is read, the tensor's identity is in memory
    assert got == [("descriptor", "read", False), ("descriptor", "read-write", True), ("descriptor", "none", False)]
    assert "(no data access)" in k.params[2].reason


def test_textures_and_surfaces():
    k = _one("""
    .reg .b64 %rd<4>; .reg .f32 %f<6>; .reg .b32 %r<3>;
    ld.param.u64 %rd1, [t];
    tex.1d.v4.f32.s32 {%f1, %f2, %f3, %f4}, [%rd1, {%r1}];
    sust.b.1d.b32.trap [s, {%r1}], {%r2};
    suld.b.1d.b32.trap {%r2}, [r, {%r1}];
    txq.width.b32 %r1, [q];
    ret;""", ".param .u64 t, .param .surfref s, .param .surfref r, .param .texref q")
    assert [(p.kind, p.access) for p in k.params] == [("descriptor", "read"), ("descriptor", "write"),
                                                     ("descriptor", "read"), ("descriptor", "none")]


def test_shared_and_local_spaces_do_not_count_and_async_shared_stores_are_ignored():
    k = _one("""
    .reg .b64 %rd<4>; .reg .b32 %r<6>;
    ld.param.u64 %rd1, [p];
    mov.u32 %r1, smem;
    ld.shared.u32 %r2, [%r1];
    st.shared.u32 [%r1+4], %r2;
    atom.shared.add.u32 %r3, [%r1], 1;
    st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%r1], %r2, [%r1+8];
    red.async.relaxed.cluster.shared::cluster.mbarrier::complete_tx::bytes.add.u32 [%r1], 1, [%r1+8];
    ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r2, %r3, %r4, %r5}, [%r1];
    mbarrier.arrive.shared.b64 %rd2, [%r1];
    cvta.shared.u64 %rd3, %rd2;
    ld.u32 %r2, [%rd3];                       // generic, but provably shared
    ret;""", ".param .u64 p", extra=".extern .shared .align 16 .b8 smem[];")
    assert [(p.kind, p.access) for p in k.params] == [("scalar", "none")]


def test_misc_memory_instructions():
    k = _one("""
    .reg .b64 %rd<6>; .reg .b32 %r<10>;
    ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [b]; ld.param.u64 %rd3, [c]; ld.param.u64 %rd4, [d];
    discard.global.L2 [%rd1], 128;
    wmma.load.a.sync.aligned.row.m16n16k16.global.f16 {%r1, %r2, %r3, %r4, %r5, %r6, %r7, %r8}, [%rd2], 16;
    wmma.store.d.sync.aligned.row.m16n16k16.f32 [%rd3], {%r1, %r2, %r3, %r4, %r5, %r6, %r7, %r8}, 16;
    tensormap.replace.tile.global_address.global.b1024.b64 [%rd4], %rd1;
    ret;""", ".param .u64 a, .param .u64 b, .param .u64 c, .param .u64 d")
    assert [p.access for p in k.params] == ["write", "read", "write", "write"]


def test_calls_unknown_recursive_and_returned_pointers():
    text = HEADER + """
.extern .func ext(.param .b64 p);
.func (.param .b64 r) id(.param .b64 p)
{
    .reg .b64 %rd<2>;
    ld.param.u64 %rd1, [p];
    st.param.b64 [r], %rd1;
    ret;
}
.func rec(.param .b64 p)
{
    .reg .b64 %rd<3>;
    ld.param.u64 %rd1, [p];
    ld.global.u32 %r1, [%rd1];
    add.s64 %rd2, %rd1, 4;
    { .param .b64 param0; st.param.b64 [param0], %rd2; call.uni rec, (param0); }
    ret;
}
.visible .entry k(.param .u64 a, .param .u64 b, .param .u64 c, .param .u64 d)
{
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [a]; ld.param.u64 %rd2, [b]; ld.param.u64 %rd3, [c]; ld.param.u64 %rd4, [d];
    { .param .b64 param0; st.param.b64 [param0], %rd1; call.uni ext, (param0); }
    { .param .b64 param0; st.param.b64 [param0], %rd2; .param .b64 retval0;
      call.uni (retval0), id, (param0); ld.param.b64 %rd5, [retval0]; }
    st.global.u32 [%rd5], 1;
    { .param .b64 param0; st.param.b64 [param0], %rd3; call.uni rec, (param0); }
    { .param .b64 param0; st.param.b64 [param0], %rd4; call.uni undeclared_fn, (param0); }
    ret;
}
"""
    kernels, errors = analyze_ptx(text)
    assert errors == []
    got = [(p.access, p.reason) for p in kernels[0].params]
    assert got[0] == ("read-write", f"passed to extern .func ext (no body) at line {_line(text, 'call.uni ext')}")
    assert got[1][0] == "write"
    assert got[2][0] == "read-write" and "recursive .func rec" in got[2][1]
    assert got[3][0] == "read-write"


def test_kernel_without_parameters_and_scalars_only():
    k = _one("ret;", "")
    assert k.params == [] and not k.indirect
    k = _one("ret;", ".param .f32 x, .param .u32 n, .param .b16 h")
    assert [(p.kind, p.access, p.reason) for p in k.params] == [
        ("scalar", "none", "scalar .f32"), ("scalar", "none", "scalar .u32"), ("scalar", "none", "scalar .b16")]


def test_offset_growth_in_loops_terminates():
    # a local pointer and a parameter address advanced in a loop: offsets are forgotten, not enumerated
    k = _one("""
    .local .align 8 .b8 __local_depot0[64];
    .reg .b64 %rd<8>; .reg .pred %p<2>;
    ld.param.u64 %rd1, [a];
    mov.u64 %rd2, __local_depot0;
    mov.b64 %rd4, s;
L:
    st.local.u64 [%rd2], %rd1;
    add.s64 %rd3, %rd2, 8;
    mov.u64 %rd2, %rd3;
    ld.param.u64 %rd5, [%rd4];
    add.s64 %rd4, %rd4, 8;
    ld.local.u64 %rd6, [%rd2];
    st.u32 [%rd6], 0;
    @%p1 bra L;
    ld.u32 %r1, [%rd5];
    ret;""", ".param .u64 a, .param .align 8 .b8 s[4096]")
    assert k.params[0].access == "write"
    assert k.params[1].kind == "struct" and k.params[1].access == "read"


# ------------------------------------------------------------------------------------- access sites


def test_access_sites_of_a_kernel():
    m = parse_ptx((UNIT / "misc.sm_90.ptx").read_text(), "misc.ptx")
    sites = access_sites(m, "k_vec")
    assert [(s.opcode, s.space, s.mode, s.width, s.params, s.instrumentable) for s in sites] == [
        ("ld.global.nc.v4.f32", "global", "read", 16, [0], True),
        ("st.global.v4.f32", "global", "write", 16, [1], True)]
    assert sites[0].address == "%rd1" and sites[0].function == "k_vec"
    cp = access_sites(m, "k_cpasync")
    assert [(s.opcode, s.mode, s.width, s.params) for s in cp] == [
        ("cp.async.ca.shared.global", "read", 4, [0]), ("st.global.f32", "write", 4, [1])]
    struct = access_sites(m, "k_struct")
    assert [s.params for s in struct] == [[0], [0], [1]]
    func = access_sites(m, "_Z5addtoPfPKfi")       # a .func: its own parameter indices
    assert [(s.mode, s.params) for s in func] == [("read", [1]), ("read", [0]), ("write", [0])]
    with pytest.raises(KeyError):
        access_sites(m, "nope")


def test_access_sites_predicates_and_bulk_tensor():
    m = parse_ptx((UNIT / "triton_tma_copy.sm_90a.ptx").read_text())
    sites = access_sites(m, "tma_copy")
    assert [(s.space, s.mode, s.instrumentable, s.predicate) for s in sites] == [
        ("bulk-tensor", "read", False, "@%p3"), ("bulk-tensor", "write", False, "@%p5")]
    assert all("tensor map" in s.reason for s in sites)
    m = parse_ptx((UNIT / "triton_atomic_hist.sm_90a.ptx").read_text())
    preds = [s.predicate for s in access_sites(m, "atomic_hist")]
    assert all(p is not None for p in preds)


def test_analyze_module_matches_analyze_ptx():
    text = (UNIT / "calls.sm_90.ptx").read_text()
    a = [k.to_json() for k in analyze_module(parse_ptx(text, "c.ptx"))]
    b = [k.to_json() for k in analyze_ptx(text, "c.ptx")[0]]
    assert a == b


# -------------------------------------------------------------------------- regenerated with nvcc


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: the committed PTX is used instead")
def test_freshly_compiled_sources_give_the_same_answers(tmp_path):
    # another target than the committed files (sm_80 for misc.cu; calls.cu needs sm_90 for its TMA kernels)
    for cu, arch, extra, expected in (("misc.cu", "sm_80", [], MISC), ("calls.cu", "sm_90a", ["-rdc=true"], CALLS),
                                      ("realistic.cu", "sm_80", [], REALISTIC)):
        out = tmp_path / (cu + ".ptx")
        subprocess.run(["nvcc", "-ptx", f"-arch={arch}", *extra, str(UNIT / cu), "-o", str(out)], check=True,
                       capture_output=True, timeout=300)
        kernels, errors = analyze_ptx(out.read_text())
        assert errors == []
        _check(kernels, expected)


def test_an_internal_failure_gives_the_conservative_answer(monkeypatch):
    from tessera.capture.ptx.dataflow import FunctionDataflow

    def boom(self):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(FunctionDataflow, "solve", boom)
    kernels, errors = analyze_ptx((UNIT / "nvrtc.sm_80.ptx").read_text(), "n.ptx")
    assert len(kernels) == 3 and len(errors) == 3
    assert "simulated bug" in errors[0].message and str(errors[0]).startswith("n.ptx:")
    saxpy = kernels[0]
    assert saxpy.indirect and [(p.kind, p.access) for p in saxpy.params] == [
        ("scalar", "none"), ("struct", "read-write"), ("scalar", "none")]
