"""Fused kernels of Mamba2 (SSD) layers, as a serving engine (vLLM's MambaMixer2, mamba_ssm) launches them.

Decode, per layer: `mamba_add_rms_norm` (residual add + RMSNorm), the in_proj GEMM, `causal_conv1d_update`
(the new token shifted into each row's conv window, in place on the rows of the engine's conv state that
``slots`` selects; depthwise conv + SiLU), `selective_state_update` (one SSM recurrence step, in place on
the selected rows of the SSM state; softplus(dt + dt_bias), A = -exp(A_log), group-shared B and C, D skip),
`gated_rms_norm` (y * silu(z), RMSNorm per group) and the out_proj GEMM.

Prefill, per layer: `mamba_add_rms_norm`, in_proj, `causal_conv1d` (the whole prompt; writes each row's
last ``kernel`` inputs into its conv-state slot), the SSD chunked scan as mamba_ssm's five kernels
(`ssd_chunk_cumsum`, `ssd_chunk_state`, `ssd_state_passing`, which also writes each row's final SSM state
into its slot, `ssd_bmm_chunk`, `ssd_chunk_scan`), `gated_rms_norm` and out_proj.

The op bodies follow Hugging Face's Mamba2Mixer torch path (transformers ``modeling_mamba2``: the decode
recurrence of ``mamba2_selective_state_update``, the chunked algorithm of ``mamba2_chunk_scan`` cut where
mamba_ssm's ``ssd_combined`` cuts it), with the dtypes of the engine kernels: the chunk states and the scan
in float32, the chunk-start states in the SSM state's dtype, the scan output in the input's dtype. Shapes
are static: a prompt is padded to a multiple of the chunk inside the bodies, as Hugging Face does.

Layouts: ``conv_state`` [slots, conv_dim, kernel], ``ssm_state`` [slots, heads, head_dim, d_state];
chunked per-head tensors (dt, dA_cumsum) [B, heads, chunks, chunk]; chunk states [B, chunks, heads,
head_dim, d_state]; ``CB`` [B, chunks, groups, chunk, chunk].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _row_bytes(state: torch.Tensor, slots: torch.Tensor) -> int:
    """Bytes of the state rows ``slots`` select (a kernel given the whole state touches only these)."""
    return slots.numel() * math.prod(state.shape[1:]) * state.element_size()


def _chunks(seq: int, chunk: int) -> tuple[int, int]:
    """(number of chunks, padding) of a ``seq``-token prompt cut into ``chunk``-token chunks."""
    pad = (chunk - seq % chunk) % chunk
    return (seq + pad) // chunk, pad


def _pad_seq(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dim 1 (the sequence) of a [B, S, ...] tensor by ``pad`` positions."""
    if pad == 0:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))


def _heads_of_groups(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Group-shared B or C repeated for each head of its group along ``dim``."""
    return t.repeat_interleave(heads // t.shape[dim], dim=dim, output_size=heads)


def _segsum_exp(dA_cumsum: torch.Tensor) -> torch.Tensor:
    """exp(sum of dA over (s, l]) for l >= s, 0 above the diagonal: [..., L] -> [..., L(l), L(s)]."""
    L = dA_cumsum.shape[-1]
    diff = dA_cumsum[..., :, None] - dA_cumsum[..., None, :]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool, device=dA_cumsum.device))
    return torch.exp(diff.masked_fill(~causal, -torch.inf))


# ---------------------------------------------------------------------------------------------------
# Residual add + RMSNorm


@custom_op("tessera::mamba_add_rms_norm", mutates_args=())
def mamba_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       residual_fp32: bool, cast_input: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, the way a Mamba2 block carries its residual stream.

    x [..., D] (the previous layer's mixer output, or the embeddings when ``residual`` is None),
    residual [..., D] -> (normed [..., D] in the weight's dtype, new residual ``x + residual`` [..., D],
    float32 if ``residual_fp32`` else x's dtype). ``cast_input``: the norm reads the sum rounded to the
    weight's dtype (Hugging Face's block norms); otherwise in float32 (its final norm).
    """
    s = x.float() if residual is None else residual.float() + x.float()
    new_residual = s if residual_fp32 else s.to(x.dtype)
    h = new_residual.to(weight.dtype) if cast_input else new_residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (weight * hf.to(h.dtype)).to(weight.dtype)
    return normed, new_residual.clone() if new_residual is x else new_residual


@mamba_add_rms_norm.register_fake
def _(x, residual, weight, eps, residual_fp32, cast_input):
    return x.new_empty(x.shape, dtype=weight.dtype), x.new_empty(x.shape, dtype=torch.float32 if residual_fp32
                                                                   else x.dtype)


register_fused("mamba_add_rms_norm", "norm", flops=lambda a, k, out: 6 * a[0].numel())


# ---------------------------------------------------------------------------------------------------
# Depthwise causal conv1d


@custom_op("tessera::causal_conv1d_update", mutates_args=("conv_state",))
def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """Decode: shift each row's new input into its conv window and convolve it.

    x [B, C] (xBC of the new token), conv_state [slots, C, K] (rows ``slots`` [B] updated in place),
    weight [C, K], bias [C] -> [B, C] (SiLU applied if ``silu``).
    """
    rows = conv_state.index_select(0, slots)
    window = torch.cat([rows, x[:, :, None]], dim=-1).to(weight.dtype)  # [B, C, K+1]
    conv_state.index_copy_(0, slots, window[:, :, 1:].to(conv_state.dtype))
    out = F.conv1d(window, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])[:, :, -1]
    if silu:
        out = F.silu(out)
    return out.to(x.dtype)


@causal_conv1d_update.register_fake
def _(x, conv_state, slots, weight, bias, silu):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _conv_update_traffic(a, k, out) -> tuple[int, int]:
    x, conv_state, slots, weight, bias = a[:5]
    rows = _row_bytes(conv_state, slots)
    read = _nbytes(x) + rows + _nbytes(slots) + _nbytes(weight) + (_nbytes(bias) if bias is not None else 0)
    return read, rows + _nbytes(out)


# A depthwise conv of K taps per channel is a stencil on CUDA cores, bandwidth bound (vLLM's Triton kernel):
# "elementwise", not "conv" (which the cost model runs as tensor-core convolutions).
register_fused("causal_conv1d_update", "elementwise",
               flops=lambda a, k, out: a[0].numel() * (2 * a[3].shape[-1] + 5), traffic=_conv_update_traffic)


@custom_op("tessera::causal_conv1d", mutates_args=("conv_state",))
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  slots: torch.Tensor, silu: bool, chunk: int) -> torch.Tensor:
    """Prefill: causal depthwise conv over each row's prompt (from a zero window); writes the row's last K
    inputs (left-padded with zeros) into its conv-state slot.

    x [B, S, C], weight [C, K], bias [C], conv_state [slots, C, K], slots [B] -> [B, S', C] with S' the
    prompt padded to a multiple of ``chunk`` (zeros after S), the layout the SSD kernels read in chunks.
    """
    b, s, c = x.shape
    k = weight.shape[-1]
    _, pad = _chunks(s, chunk)
    xt = x.transpose(1, 2)
    window = F.pad(xt, (k - s, 0)) if s < k else xt[:, :, -k:]
    conv_state.index_copy_(0, slots, window.to(conv_state.dtype))
    out = F.conv1d(xt.to(weight.dtype), weight.unsqueeze(1), bias, padding=k - 1, groups=c)[:, :, :s]
    if silu:
        out = F.silu(out)
    return _pad_seq(out.to(x.dtype).transpose(1, 2), pad).contiguous()


@causal_conv1d.register_fake
def _(x, weight, bias, conv_state, slots, silu, chunk):
    b, s, c = x.shape
    nc, _ = _chunks(s, chunk)
    return x.new_empty(b, nc * chunk, c)


def _conv_traffic(a, k, out) -> tuple[int, int]:
    x, weight, bias, conv_state, slots = a[:5]
    read = _nbytes(x) + _nbytes(weight) + (_nbytes(bias) if bias is not None else 0) + _nbytes(slots)
    return read, _nbytes(out) + _row_bytes(conv_state, slots)


register_fused("causal_conv1d", "elementwise",
               flops=lambda a, k, out: a[0].numel() * (2 * a[1].shape[-1] + 5), traffic=_conv_traffic)


# ---------------------------------------------------------------------------------------------------
# Decode: one step of the SSM recurrence


@custom_op("tessera::selective_state_update", mutates_args=("ssm_state",))
def selective_state_update(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """h = exp(dt*A) h + dt B x; y = C h + D x, on the rows ``slots`` of the SSM state, in place.

    ssm_state [slots, H, P, N], x [B, H*P], dt [B, H], A_log/D/dt_bias [H], B/C [B, G*N] (shared by the
    H/G heads of a group), slots [B] -> y [B, H*P] in x's dtype. dt = softplus(dt + dt_bias) in dt's dtype,
    A = -exp(A_log) in float32, as Hugging Face's decode path computes them.
    """
    bsz = x.shape[0]
    _, heads, head_dim, n = ssm_state.shape
    groups = B.shape[-1] // n
    state = ssm_state.index_select(0, slots)
    xh = x.reshape(bsz, heads, head_dim)
    dt = F.softplus(dt + dt_bias.to(dt.dtype))[:, :, None, None]  # [B, H, 1, 1]
    A = -torch.exp(A_log.float())[None, :, None, None]
    dA = torch.exp(dt.float() * A)
    Bh = _heads_of_groups(B.reshape(bsz, groups, 1, n), heads, 1)  # [B, H, 1, N]
    dBx = (dt * Bh) * xh[..., None]
    new = state * dA + dBx
    ssm_state.index_copy_(0, slots, new.to(ssm_state.dtype))
    Ch = _heads_of_groups(C.reshape(bsz, groups, n), heads, 1)  # [B, H, N]
    y = torch.bmm(new.to(Ch.dtype).reshape(bsz * heads, head_dim, n), Ch.reshape(bsz * heads, n, 1))
    y = y.reshape(bsz, heads, head_dim)
    y = (y + xh * D[:, None].to(xh.dtype)).to(y.dtype)
    return y.to(x.dtype).reshape(bsz, heads * head_dim)


@selective_state_update.register_fake
def _(ssm_state, x, dt, A_log, B, C, D, dt_bias, slots):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _ssu_traffic(a, k, out) -> tuple[int, int]:
    ssm_state, slots = a[0], a[8]
    rows = _row_bytes(ssm_state, slots)
    return rows + sum(_nbytes(t) for t in a[1:9]), rows + _nbytes(out)


def _ssu_flops(a, k, out) -> int:
    ssm_state, x = a[0], a[1]
    state = x.shape[0] * math.prod(ssm_state.shape[1:])  # elements of the selected rows
    # per state element: dt*B, *x, h*dA, +, C*h, + (the reduction over N); per head: softplus, exp
    return 6 * state + 4 * x.numel() + 10 * x.shape[0] * ssm_state.shape[1]


# One time step: every state element is read, updated and written once, with a row reduction over N; a
# streaming kernel (no dependence along the sequence within the kernel), so "elementwise".
register_fused("selective_state_update", "elementwise", flops=_ssu_flops, traffic=_ssu_traffic)


# ---------------------------------------------------------------------------------------------------
# Prefill: the SSD chunked scan (mamba_ssm ssd_combined: cumsum -> chunk_state -> state_passing ->
# bmm_chunk -> chunk_scan). x, B and C are views of the padded conv output cut into chunks:
# x [B, nc, L, H, P], B/C [B, nc, L, G, N].


@custom_op("tessera::ssd_chunk_cumsum", mutates_args=())
def ssd_chunk_cumsum(dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, chunk: int, dt_min: float,
                     dt_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dt [B, S, H] -> (dt = clamp(softplus(dt + dt_bias)) [B, H, nc, L] float32, zero on the padding;
    dA_cumsum = cumsum of dt * A within each chunk [B, H, nc, L] float32), A = -exp(A_log)."""
    b, s, h = dt.shape
    nc, pad = _chunks(s, chunk)
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=dt_min, max=dt_max).float()
    dA = -torch.exp(A_log.float()) * dt
    dt_c = _pad_seq(dt, pad).reshape(b, nc, chunk, h).permute(0, 3, 1, 2)
    dA_c = _pad_seq(dA, pad).reshape(b, nc, chunk, h).permute(0, 3, 1, 2)
    return dt_c.contiguous(), torch.cumsum(dA_c, dim=-1).contiguous()


@ssd_chunk_cumsum.register_fake
def _(dt, dt_bias, A_log, chunk, dt_min, dt_max):
    b, s, h = dt.shape
    nc, _ = _chunks(s, chunk)
    return dt.new_empty(b, h, nc, chunk, dtype=torch.float32), dt.new_empty(b, h, nc, chunk, dtype=torch.float32)


# softplus (exp, log1p), bias add, clamp, exp(A_log) * dt, the running sum: ~12 per position and head
register_fused("ssd_chunk_cumsum", "scan", flops=lambda a, k, out: 12 * out[0].numel())


@custom_op("tessera::ssd_chunk_state", mutates_args=())
def ssd_chunk_state(B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor) -> torch.Tensor:
    """Each chunk's own final state (from zero): sum over its positions l of
    exp(dA_cs[last] - dA_cs[l]) dt[l] x[l] B[l]^T.

    B [B, nc, L, G, N], x [B, nc, L, H, P], dt/dA_cumsum [B, H, nc, L] -> [B, nc, H, P, N] float32.
    """
    h = x.shape[3]
    xs = x.float() * dt.permute(0, 2, 3, 1)[..., None]
    Bh = _heads_of_groups(B.float(), h, 3)
    decay = torch.exp(dA_cumsum[:, :, :, -1:] - dA_cumsum)  # [b, h, c, l]
    B_decay = Bh * decay.permute(0, 2, 3, 1)[..., None]
    return torch.einsum("bclhn,bclhp->bchpn", B_decay, xs).contiguous()


@ssd_chunk_state.register_fake
def _(B, x, dt, dA_cumsum):
    b, nc, L, h, p = x.shape
    return x.new_empty(b, nc, h, p, B.shape[-1], dtype=torch.float32)


register_fused("ssd_chunk_state", "gemm",
               flops=lambda a, k, out: 2 * out.numel() * a[1].shape[2])


@custom_op("tessera::ssd_state_passing", mutates_args=("ssm_state",))
def ssd_state_passing(states: torch.Tensor, dA_cumsum: torch.Tensor, ssm_state: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """The recurrence across chunks (from a zero initial state): the state at the start of each chunk, and
    the final state, written into the rows ``slots`` of the SSM state.

    states [B, nc, H, P, N] float32, dA_cumsum [B, H, nc, L], ssm_state [slots, H, P, N] -> chunk-start
    states [B, nc, H, P, N] in the SSM state's dtype (vLLM: mamba_ssm_cache_dtype).
    """
    all_states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # [b, nc+1, h, p, n]
    last = F.pad(dA_cumsum[:, :, :, -1], (1, 0))  # [b, h, nc+1]: each chunk's total decay
    decay_chunk = _segsum_exp(torch.cumsum(last, dim=-1)).transpose(1, 3)  # [b, z (from), c (to), h]
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, all_states)
    ssm_state.index_copy_(0, slots, new_states[:, -1].to(ssm_state.dtype))
    return new_states[:, :-1].to(ssm_state.dtype).contiguous()


@ssd_state_passing.register_fake
def _(states, dA_cumsum, ssm_state, slots):
    return states.new_empty(states.shape, dtype=ssm_state.dtype)


def _state_passing_traffic(a, k, out) -> tuple[int, int]:
    states, dA_cumsum, ssm_state, slots = a[:4]
    return _nbytes(states) + _nbytes(dA_cumsum) + _nbytes(slots), _nbytes(out) + _row_bytes(ssm_state, slots)


# mamba_ssm's kernel runs this recurrence sequentially over the chunks: one multiply-add per state element
# per chunk.
register_fused("ssd_state_passing", "scan", flops=lambda a, k, out: 2 * a[0].numel(),
               traffic=_state_passing_traffic)


@custom_op("tessera::ssd_bmm_chunk", mutates_args=())
def ssd_bmm_chunk(C: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """C B^T within each chunk, per group: C/B [B, nc, L, G, N] -> CB [B, nc, G, L, L] float32."""
    return torch.einsum("bclgn,bcsgn->bcgls", C.float(), B.float()).contiguous()


@ssd_bmm_chunk.register_fake
def _(C, B):
    b, nc, L, g, n = C.shape
    return C.new_empty(b, nc, g, L, L, dtype=torch.float32)


register_fused("ssd_bmm_chunk", "gemm",
               flops=lambda a, k, out: 2 * out.numel() * a[0].shape[-1])


@custom_op("tessera::ssd_chunk_scan", mutates_args=())
def ssd_chunk_scan(x: torch.Tensor, CB: torch.Tensor, dt: torch.Tensor, dA_cumsum: torch.Tensor, C: torch.Tensor,
                   states: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """The output: within-chunk (CB masked by the decay, applied to dt x) plus the chunk-start state read
    through C and decayed, plus the D skip.

    x [B, nc, L, H, P], CB [B, nc, G, L, L], dt/dA_cumsum [B, H, nc, L], C [B, nc, L, G, N],
    states [B, nc, H, P, N], D [H] -> y [B, nc, L, H, P] in x's dtype. (x comes first: mamba_ssm's kernel
    runs both matrix products in x's dtype on tensor cores, CB and the states cast to it, and a recorded
    kernel's compute dtype is its first floating argument's.)
    """
    h = x.shape[3]
    xf = x.float()
    xs = xf * dt.permute(0, 2, 3, 1)[..., None]
    decay = _segsum_exp(dA_cumsum)  # [b, h, c, l, s]
    M = _heads_of_groups(CB, h, 2).permute(0, 1, 3, 4, 2) * decay.permute(0, 2, 3, 4, 1)  # [b, c, l, s, h]
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, xs)
    y_off = torch.einsum("bclhn,bchpn->bclhp", _heads_of_groups(C.float(), h, 3), states.float())
    y_off = y_off * torch.exp(dA_cumsum).permute(0, 2, 3, 1)[..., None]
    y = y_diag + y_off + D.float()[:, None] * xf
    return y.to(x.dtype).contiguous()


@ssd_chunk_scan.register_fake
def _(x, CB, dt, dA_cumsum, C, states, D):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _chunk_scan_flops(a, k, out) -> int:
    b, nc, L, h, p = a[0].shape
    return 2 * b * nc * h * L * p * (L + a[4].shape[-1]) + 4 * out.numel()


register_fused("ssd_chunk_scan", "gemm", flops=_chunk_scan_flops)


# ---------------------------------------------------------------------------------------------------
# Gated RMSNorm


@custom_op("tessera::gated_rms_norm", mutates_args=())
def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float) -> torch.Tensor:
    """RMSNorm of y * silu(z) over groups of ``group_size`` channels (Hugging Face's MambaRMSNormGated,
    vLLM's Mixer2RMSNormGated). y/z [..., I], weight [I] -> [..., I] in y's dtype."""
    h = y.float() * F.silu(z.float())
    *prefix, last = h.shape
    g = h.reshape(*prefix, last // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * g.reshape(*prefix, last).to(y.dtype)).to(y.dtype)


@gated_rms_norm.register_fake
def _(y, z, weight, group_size, eps):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


register_fused("gated_rms_norm", "norm", flops=lambda a, k, out: 10 * a[0].numel())
