"""Mamba2's fused units (tessera.kernels.mamba): declared accesses are true, and each equals its piece of
Hugging Face's Mamba2 torch path (transformers modeling_mamba2) on random inputs.

Shapes: 2 rows in a 3-slot state (rows at slots 2 and 0), 4 heads x 8 in 2 groups (2 heads per group, so
the group sharing of B and C is exercised), d_state 6, conv kernel 4, chunk 4, a 10-token prompt (padded
to 12 inside the ops). The pieces of Hugging Face's chunked scan are recorded from its own call (its
``torch.cumsum`` / ``torch.einsum`` results), not re-derived.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba2 import modeling_mamba2 as hf

import tessera.kernels  # noqa: F401
from tests.kernels.access_truth import assert_accesses_true

ops = torch.ops.tessera
BATCH, SLOTS, HEADS, HEAD_DIM, GROUPS, N, K, CHUNK, SEQ = 2, 3, 4, 8, 2, 6, 4, 4, 10
INNER = HEADS * HEAD_DIM
CONV_DIM = INNER + 2 * GROUPS * N
ROW_SLOTS = torch.tensor([2, 0])


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _params(seed: int = 0):
    g = _g(seed)
    return {"A_log": torch.rand(HEADS, generator=g) * 2, "D": torch.randn(HEADS, generator=g),
            "dt_bias": torch.randn(HEADS, generator=g) * 0.5, "conv_w": torch.randn(CONV_DIM, K, generator=g) * 0.5,
            "conv_b": torch.randn(CONV_DIM, generator=g) * 0.1}


def _zxbcdt(seq: int, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    """An in_proj output [B, S, inner + conv_dim + heads], which the units read through views."""
    return torch.randn(BATCH, seq, INNER + CONV_DIM + HEADS, generator=_g(seed)).to(dtype)


def _split(zxbcdt):
    return (zxbcdt[..., :INNER], zxbcdt[..., INNER:INNER + CONV_DIM], zxbcdt[..., INNER + CONV_DIM:])


# ---------------------------------------------------------------------------------------------------
# Decode


def _conv_update_args(dtype=torch.float32):
    p = _params()
    _, xbc, _ = _split(_zxbcdt(1, dtype=dtype))
    conv_state = torch.randn(SLOTS, CONV_DIM, K, generator=_g(2)).to(dtype)
    return (xbc[:, 0], conv_state, ROW_SLOTS, p["conv_w"].to(dtype), p["conv_b"].to(dtype), True)


def test_causal_conv1d_update_accesses():
    assert_accesses_true(ops.causal_conv1d_update, _conv_update_args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_update_equals_hugging_face(dtype):
    x, conv_state, slots, w, b, _ = _conv_update_args(dtype)
    rows = conv_state.index_select(0, slots)
    want = hf.causal_conv1d_update(x[:, :, None], rows, w, b, activation="silu")[:, :, 0]
    other = conv_state[1].clone()
    got = ops.causal_conv1d_update(x, conv_state, slots, w, b, True)
    assert torch.equal(got, want)
    assert torch.equal(conv_state.index_select(0, slots), rows)
    assert torch.equal(conv_state[1], other)


def _ssu_args(dtype=torch.float32, state_dtype=torch.float32):
    p = _params()
    _, xbc, dt = _split(_zxbcdt(1, seed=3, dtype=dtype))
    xbc = xbc[:, 0]
    ssm_state = torch.randn(SLOTS, HEADS, HEAD_DIM, N, generator=_g(4)).to(state_dtype)
    return (ssm_state, xbc[:, :INNER], dt[:, 0], p["A_log"].to(dtype), xbc[:, INNER:INNER + GROUPS * N],
            xbc[:, INNER + GROUPS * N:], p["D"].to(dtype), p["dt_bias"].to(dtype), ROW_SLOTS)


def test_selective_state_update_accesses():
    assert_accesses_true(ops.selective_state_update, _ssu_args())


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_selective_state_update_equals_hugging_face(dtype, state_dtype):
    ssm_state, x, dt, A_log, B, C, D, dt_bias, slots = _ssu_args(dtype, state_dtype)
    # Hugging Face's decode path (Mamba2Mixer.forward, recurrent form) on the gathered rows
    rows = ssm_state.index_select(0, slots)
    want = hf.mamba2_selective_state_update(
        rows, x.reshape(BATCH, HEADS, HEAD_DIM), dt[:, :, None].expand(-1, -1, HEAD_DIM),
        (-torch.exp(A_log.float()))[:, None, None].expand(-1, HEAD_DIM, N), B.reshape(BATCH, GROUPS, N),
        C.reshape(BATCH, GROUPS, N), D[:, None].expand(-1, HEAD_DIM), z=None,
        dt_bias=dt_bias[:, None].expand(-1, HEAD_DIM), dt_softplus=True).reshape(BATCH, INNER)
    other = ssm_state[1].clone()
    got = ops.selective_state_update(ssm_state, x, dt, A_log, B, C, D, dt_bias, slots)
    assert torch.equal(got, want)
    assert torch.equal(ssm_state.index_select(0, slots), rows)
    assert torch.equal(ssm_state[1], other)


# ---------------------------------------------------------------------------------------------------
# Prefill


def _conv_args(dtype=torch.float32, seq=SEQ):
    p = _params()
    _, xbc, _ = _split(_zxbcdt(seq, seed=5, dtype=dtype))
    conv_state = torch.randn(SLOTS, CONV_DIM, K, generator=_g(6)).to(dtype)
    return (xbc, p["conv_w"].to(dtype), p["conv_b"].to(dtype), conv_state, ROW_SLOTS, True, CHUNK)


def test_causal_conv1d_accesses():
    assert_accesses_true(ops.causal_conv1d, _conv_args())


@pytest.mark.parametrize("seq", [SEQ, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_equals_hugging_face(dtype, seq):
    x, w, b, conv_state, slots, _, chunk = _conv_args(dtype, seq)
    want = hf.causal_conv1d_fn(x.transpose(1, 2), w, b, activation="silu").transpose(1, 2)
    # the window Hugging Face's cache keeps: the last K inputs, left-padded with zeros
    window = F.pad(x.transpose(1, 2), (max(K - seq, 0), 0))[..., -K:]
    other = conv_state[1].clone()
    got = ops.causal_conv1d(x, w, b, conv_state, slots, True, chunk)
    padded = -(-seq // chunk) * chunk
    assert got.shape == (BATCH, padded, CONV_DIM)
    assert torch.equal(got[:, :seq], want)
    assert not got[:, seq:].any()
    assert torch.equal(conv_state.index_select(0, slots), window)
    assert torch.equal(conv_state[1], other)


class _Recorder:
    """Records the results of torch.cumsum / torch.einsum while Hugging Face's chunked scan runs."""

    def __init__(self, monkeypatch):
        self.cumsum, self.einsum = [], []
        cumsum, einsum = torch.cumsum, torch.einsum

        def rec_cumsum(*a, **k):
            out = cumsum(*a, **k)
            self.cumsum.append(out)
            return out

        def rec_einsum(eq, *a):
            out = einsum(eq, *a)
            self.einsum.append((eq, out))
            return out

        monkeypatch.setattr(torch, "cumsum", rec_cumsum)
        monkeypatch.setattr(torch, "einsum", rec_einsum)

    def pieces(self) -> dict[str, torch.Tensor]:
        return {eq: out for eq, out in self.einsum} | {"A_cumsum": self.cumsum[0]}


def _ssd_inputs(dtype=torch.float32):
    p = {k: v.to(dtype) for k, v in _params(7).items()}
    x, w, b, conv_state, slots, _, chunk = _conv_args(dtype)
    zxbcdt = _zxbcdt(SEQ, seed=5, dtype=dtype)
    xbc = ops.causal_conv1d(x, w, b, conv_state, slots, True, chunk)  # [B, S', conv_dim], zero padded
    nc = xbc.shape[1] // CHUNK
    views = {"x": xbc[..., :INNER].view(BATCH, nc, CHUNK, HEADS, HEAD_DIM),
             "B": xbc[..., INNER:INNER + GROUPS * N].view(BATCH, nc, CHUNK, GROUPS, N),
             "C": xbc[..., INNER + GROUPS * N:].view(BATCH, nc, CHUNK, GROUPS, N),
             "dt": _split(zxbcdt)[2]}
    return p, xbc, views


def _ssd_ours(p, v, ssm_state):
    dt, dA_cs = ops.ssd_chunk_cumsum(v["dt"], p["dt_bias"], p["A_log"], CHUNK, 0.0, float("inf"))
    states = ops.ssd_chunk_state(v["B"], v["x"], dt, dA_cs)
    start = ops.ssd_state_passing(states, dA_cs, ssm_state, ROW_SLOTS)
    CB = ops.ssd_bmm_chunk(v["C"], v["B"])
    y = ops.ssd_chunk_scan(v["x"], CB, dt, dA_cs, v["C"], start, p["D"])
    return {"dt": dt, "dA_cumsum": dA_cs, "states": states, "start": start, "CB": CB, "y": y}


def _ssd_hugging_face(p, xbc, monkeypatch):
    """Hugging Face's mamba2_chunk_scan on the unpadded prompt, with its pieces recorded."""
    rec = _Recorder(monkeypatch)
    x = xbc[:, :SEQ, :INNER].reshape(BATCH, SEQ, HEADS, HEAD_DIM)
    B = xbc[:, :SEQ, INNER:INNER + GROUPS * N].reshape(BATCH, SEQ, GROUPS, N)
    C = xbc[:, :SEQ, INNER + GROUPS * N:].reshape(BATCH, SEQ, GROUPS, N)
    dt = _split(_zxbcdt(SEQ, seed=5, dtype=xbc.dtype))[2]
    y, final = hf.mamba2_chunk_scan(x, dt, -torch.exp(p["A_log"].float()), B, C, chunk_size=CHUNK, D=p["D"],
                                    dt_bias=p["dt_bias"], dt_softplus=True, return_final_states=True)
    monkeypatch.undo()
    return y, final, rec.pieces()


def test_ssd_kernels_equal_the_pieces_of_hugging_faces_chunked_scan(monkeypatch):
    p, xbc, v = _ssd_inputs()
    ssm_state = torch.randn(SLOTS, HEADS, HEAD_DIM, N, generator=_g(8))
    other = ssm_state[1].clone()
    ours = _ssd_ours(p, v, ssm_state)
    y, final, hf_pieces = _ssd_hugging_face(p, xbc, monkeypatch)
    close = dict(atol=1e-5, rtol=1e-5)
    # cumsum: dA within each chunk ([b, h, c, l] in both); dt = softplus(dt + dt_bias), zero on the padding
    torch.testing.assert_close(ours["dA_cumsum"], hf_pieces["A_cumsum"], **close)
    dt_ref = F.softplus(v["dt"] + p["dt_bias"])
    nc = ours["dt"].shape[2]
    torch.testing.assert_close(ours["dt"].permute(0, 2, 3, 1).reshape(BATCH, nc * CHUNK, HEADS)[:, :SEQ], dt_ref)
    assert not ours["dt"].permute(0, 2, 3, 1).reshape(BATCH, nc * CHUNK, HEADS)[:, SEQ:].any()
    # chunk_state: each chunk's own state [b, c, h, p, n]
    torch.testing.assert_close(ours["states"], hf_pieces["bclhn,bclhp->bchpn"], **close)
    # state_passing: chunk-start states and the final state (written into the rows' slots)
    new_states = hf_pieces["bzch,bzhpn->bchpn"]
    torch.testing.assert_close(ours["start"], new_states[:, :-1], **close)
    torch.testing.assert_close(ssm_state.index_select(0, ROW_SLOTS), final, **close)
    assert torch.equal(ssm_state[1], other)
    # bmm_chunk: C B^T per group; Hugging Face computes it per head ([b, c, l, s, h])
    cb_heads = ours["CB"].repeat_interleave(HEADS // GROUPS, dim=2).permute(0, 1, 3, 4, 2)
    torch.testing.assert_close(cb_heads, hf_pieces["bclhn,bcshn->bclsh"], **close)
    # chunk_scan: the output, cut to the prompt
    got = ours["y"].reshape(BATCH, nc * CHUNK, HEADS, HEAD_DIM)[:, :SEQ]
    torch.testing.assert_close(got, y, **close)


def test_ssd_kernels_in_bfloat16_stay_close_to_hugging_face(monkeypatch):
    p, xbc, v = _ssd_inputs(torch.bfloat16)
    ssm_state = torch.zeros(SLOTS, HEADS, HEAD_DIM, N, dtype=torch.bfloat16)
    ours = _ssd_ours(p, v, ssm_state)
    y, final, _ = _ssd_hugging_face(p, xbc, monkeypatch)
    nc = ours["dt"].shape[2]
    got = ours["y"].reshape(BATCH, nc * CHUNK, HEADS, HEAD_DIM)[:, :SEQ]
    # ours: y and the chunk-start states in bf16 (mamba_ssm's dtypes); Hugging Face: float32
    torch.testing.assert_close(got.float(), y, atol=0.05, rtol=0.02)
    torch.testing.assert_close(ssm_state.index_select(0, ROW_SLOTS).float(), final, atol=0.05, rtol=0.02)


def test_ssd_kernels_accesses():
    p, xbc, v = _ssd_inputs()
    ssm_state = torch.randn(SLOTS, HEADS, HEAD_DIM, N, generator=_g(8))
    ours = _ssd_ours(p, v, ssm_state.clone())
    dt_cs = (v["dt"], p["dt_bias"], p["A_log"], CHUNK, 0.0, float("inf"))
    assert_accesses_true(ops.ssd_chunk_cumsum, dt_cs)
    assert_accesses_true(ops.ssd_chunk_state, (v["B"], v["x"], ours["dt"], ours["dA_cumsum"]))
    assert_accesses_true(ops.ssd_state_passing, (ours["states"], ours["dA_cumsum"], ssm_state, ROW_SLOTS))
    assert_accesses_true(ops.ssd_bmm_chunk, (v["C"], v["B"]))
    assert_accesses_true(ops.ssd_chunk_scan, (v["x"], ours["CB"], ours["dt"], ours["dA_cumsum"], v["C"],
                                              ours["start"], p["D"]))


# ---------------------------------------------------------------------------------------------------
# Norms


def _gated_args(dtype=torch.float32):
    z, _, _ = _split(_zxbcdt(3, seed=9, dtype=dtype))
    y = torch.randn(BATCH, 3, INNER, generator=_g(10)).to(dtype)
    w = (1 + 0.1 * torch.randn(INNER, generator=_g(11))).to(dtype)
    return (y, z, w, INNER // GROUPS, 1e-5)


def test_gated_rms_norm_accesses():
    assert_accesses_true(ops.gated_rms_norm, _gated_args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_equals_hugging_face(dtype):
    y, z, w, group, eps = _gated_args(dtype)
    norm = hf.MambaRMSNormGated(INNER, group_size=group, eps=eps).to(dtype)
    norm.weight.data.copy_(w)
    assert torch.equal(ops.gated_rms_norm(y, z, w, group, eps), norm(y, z))


def _norm_args(dtype, residual: bool, residual_fp32: bool, cast_input: bool = True):
    x = torch.randn(BATCH, 3, 16, generator=_g(12)).to(dtype)
    r = torch.randn(BATCH, 3, 16, generator=_g(13)).to(torch.float32 if residual_fp32 else dtype) if residual \
        else None
    w = (1 + 0.1 * torch.randn(16, generator=_g(14))).to(dtype)
    return (x, r, w, 1e-5, residual_fp32, cast_input)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("residual_fp32", [True, False])
def test_mamba_add_rms_norm_accesses(residual, residual_fp32):
    assert_accesses_true(ops.mamba_add_rms_norm, _norm_args(torch.bfloat16, residual, residual_fp32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual_fp32", [True, False])
def test_mamba_add_rms_norm_equals_hugging_faces_residual_stream(dtype, residual_fp32):
    x, r, w, eps, _, _ = _norm_args(dtype, True, residual_fp32)
    norm = hf.Mamba2RMSNorm(16, eps=eps).to(dtype)
    norm.weight.data.copy_(w)
    # a block: hidden = residual + mixer output; the next block's norm reads it in the norm's dtype
    hidden = r + x
    normed, new_residual = ops.mamba_add_rms_norm(x, r, w, eps, residual_fp32, True)
    assert torch.equal(new_residual, hidden)
    assert torch.equal(normed, norm(hidden.to(dtype)))
    # the final norm reads the residual stream as it is
    final, _ = ops.mamba_add_rms_norm(x, r, w, eps, residual_fp32, False)
    assert torch.equal(final, norm(hidden).to(dtype))
    # the first block: no residual yet, the embeddings become it
    normed0, residual0 = ops.mamba_add_rms_norm(x, None, w, eps, residual_fp32, True)
    assert torch.equal(residual0, x.to(torch.float32) if residual_fp32 else x)
    assert torch.equal(normed0, norm(x))
