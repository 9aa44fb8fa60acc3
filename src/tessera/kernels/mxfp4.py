"""MXFP4 (OCP Microscaling FP4) weights: e2m1 values in blocks of 32 sharing a power-of-two E8M0 scale.

The layout is the one of the openai/gpt-oss checkpoints (and of transformers'
``convert_moe_packed_tensors``, which this module matches): a weight used as ``x @ W`` with W [E, K, N]
is stored transposed, blocked along its depth K:

- ``blocks`` uint8 [E, N, K/32, 16]: the 32 e2m1 codes of one block, two per byte, element ``2j`` in
  the low nibble and element ``2j+1`` in the high nibble;
- ``scales`` uint8 [E, N, K/32]: the block's E8M0 exponent, biased by 127 (value = code * 2^(s-127)).

An e2m1 code is a sign bit (bit 3) and a 3-bit magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Quantisation follows the OCP MX specification: the shared scale is 2^(floor(log2(amax)) - 2) (2 being
the largest e2m1 exponent), elements round to the nearest e2m1 value (ties to even) and saturate at 6.

These are format helpers (plain PyTorch functions), not kernels: the MXFP4 grouped GEMM,
``tessera::moe_mxfp4_gemm`` in `tessera.kernels.moe`, dequantises with them.
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements sharing one scale
SCALE_BIAS = 127  # E8M0 exponent bias
E2M1_EMAX = 2  # exponent of the largest e2m1 normal (6 = 1.5 * 2^2)
E2M1_MAX = 6.0
# e2m1 code -> value (bit 3 = sign); the order of transformers' FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive magnitudes, and whether a value exactly on one rounds up (to the even
# code above: round half to even).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def packed_shapes(experts: int, k: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of (blocks, scales) of an [E, K, N] weight: [E, N, K/32, 16] and [E, N, K/32]."""
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs a depth that is a multiple of {BLOCK} (got {k})")
    return (experts, n, k // BLOCK, BLOCK // 2), (experts, n, k // BLOCK)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, 0..15) of already scaled values: nearest, ties to even, saturating at +-6."""
    mag = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, up in _MIDPOINTS:
        code += (mag >= mid if up else mag > mid).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of e2m1 codes (uint8, 0..15)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=codes.device)
    return lut[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2m] codes -> [..., m] bytes: even elements in the low nibble, odd ones in the high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] bytes -> [..., 2m] codes (inverse of `pack_nibbles`)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise along the last dimension: [..., K] -> blocks [..., K/32, 16], scales [..., K/32]."""
    *prefix, k = x.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs a last dimension that is a multiple of {BLOCK} (got {k})")
    if x.device.type == "meta":
        return (torch.empty(*prefix, k // BLOCK, BLOCK // 2, dtype=torch.uint8, device="meta"),
                torch.empty(*prefix, k // BLOCK, dtype=torch.uint8, device="meta"))
    v = x.float().reshape(*prefix, k // BLOCK, BLOCK)
    amax = v.abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    exp = torch.where(amax > 0, e - 1 - E2M1_EMAX, torch.full_like(e, -SCALE_BIAS))
    exp = exp.clamp(-SCALE_BIAS, 254 - SCALE_BIAS)  # 255 is E8M0's NaN
    codes = encode_e2m1(torch.ldexp(v, -exp[..., None].float()))
    return pack_nibbles(codes), (exp + SCALE_BIAS).to(torch.uint8)


def dequantize_blocks(blocks: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [..., G, 16], scales [..., G] -> values [..., G*32] (inverse of `quantize_blocks`)."""
    *prefix, g, b = blocks.shape
    if blocks.device.type == "meta":
        return torch.empty(*prefix, g * b * 2, dtype=dtype, device="meta")
    vals = decode_e2m1(unpack_nibbles(blocks), dtype)
    exp = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(vals, exp[..., None]).to(dtype).reshape(*prefix, g * b * 2)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An [E, K, N] weight (``x @ W[e]``) -> checkpoint blocks [E, N, K/32, 16] and scales [E, N, K/32]."""
    return quantize_blocks(w.transpose(-2, -1))


def dequantize_weight(blocks: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Checkpoint blocks [E, N, K/32, 16] and scales [E, N, K/32] -> the [E, K, N] weight, contiguous
    (what transformers' ``convert_moe_packed_tensors`` returns)."""
    return dequantize_blocks(blocks, scales, dtype).transpose(-2, -1).contiguous()
