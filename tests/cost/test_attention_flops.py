"""Attention FLOPs count only the (query, key) pairs the mask allows: causal, sliding window, decode window."""

import itertools

import pytest
import torch

import tessera.kernels  # noqa: F401  (registers torch.ops.tessera.*)
from tessera.graph.opclass import FUSED, causal_pairs, flops_of

AT = torch.ops.aten
TS = torch.ops.tessera


def test_causal_pairs_matches_brute_force():
    for sq, sk, w in itertools.product(range(9), range(9), range(10)):
        if sq > sk:
            continue
        brute = sum(min(sk - sq + i + 1, w if w > 0 else sk, sk) for i in range(sq))
        assert causal_pairs(sq, sk, w) == brute, (sq, sk, w)
    assert causal_pairs(512, 512) == 512 * 513 // 2 == 131328
    assert causal_pairs(512, 512, 128) == 128 * 129 // 2 + (512 - 128) * 128 == 57408


def test_prefill_attention_is_causal_and_windowed():
    q = torch.empty(2, 4, 16, 8, device="meta")  # B=2, H=4, S=16, D=8
    k = torch.empty(2, 2, 16, 8, device="meta")  # KVH=2 (GQA: FLOPs follow the query heads)
    # sum_i (i+1) = 136 pairs per (row, head), 2 x (8 + 8) FLOPs each
    assert flops_of(TS.prefill_attention.default, (q, k, k, 0.1, 0, None), {}, None) == 2 * 2 * 4 * 136 * 16 == 34816
    # window 4: 1+2+3+4 + 12 x 4 = 58 pairs
    assert flops_of(TS.prefill_attention.default, (q, k, k, 0.1, 4, None), {}, None) == 2 * 2 * 4 * 58 * 16 == 14848
    # a window at least the sequence length is plain causal
    assert flops_of(TS.prefill_attention.default, (q, k, k, 0.1, 16, None), {}, None) == 34816


def test_decode_attention_window_caps_keys():
    q = torch.empty(2, 4, 1, 8, device="meta")
    cache = torch.empty(8, 2, 32, 8, device="meta")  # [slots, kv_heads, ctx=32, head_dim]
    slots = torch.empty(2, dtype=torch.int64, device="meta")
    args = (q, cache, cache, slots, slots, 0.1)
    assert flops_of(TS.decode_attention.default, (*args, 0, None), {}, None) == 2 * 2 * 4 * 32 * 16 == 8192
    assert flops_of(TS.decode_attention.default, (*args, 8, None), {}, None) == 2 * 2 * 4 * 8 * 16 == 2048
    assert flops_of(TS.decode_attention.default, (*args, 64, None), {}, None) == 8192  # window > ctx


@pytest.mark.parametrize("op, args, kwargs", [
    (AT.scaled_dot_product_attention.default, (), {"is_causal": True}),
    (AT._scaled_dot_product_flash_attention_for_cpu.default, (0.0, True), {}),
])
def test_sdpa_is_causal_counts_half_the_square(op, args, kwargs):
    q = torch.randn(2, 4, 16, 8)
    full = flops_of(op, (q, q, q), {}, None)
    causal = flops_of(op, (q, q, q, *args), kwargs, None)
    assert full == 2 * 2 * 4 * 256 * 16 == 65536
    assert causal == 2 * 2 * 4 * 136 * 16 == 34816


def test_decode_attention_window_caps_kv_bytes():
    """A sliding-window layer reads the window's keys and values of its slot, as its FLOPs count, not the slot."""
    q = torch.empty(2, 4, 1, 8, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(8, 2, 32, 8, dtype=torch.bfloat16, device="meta")  # [slots, kv_heads, ctx=32, head_dim]
    slots = torch.empty(2, dtype=torch.int64, device="meta")
    out = torch.empty(2, 1, 4, 8, dtype=torch.bfloat16, device="meta")
    args = (q, cache, cache, slots, slots, 0.1)
    traffic = FUSED["decode_attention"].traffic
    q_and_indices = 2 * 4 * 8 * 2 + 2 * 2 * 8
    slot = 2 * 32 * 8 * 2 * 2  # K and V of one slot: 2 heads x 32 positions x 8 dims x 2 bytes, twice
    assert traffic((*args, 0, None), {}, out) == (q_and_indices + 2 * slot, 2 * 4 * 8 * 2)
    assert traffic((*args, 8, None), {}, out) == (q_and_indices + 2 * slot // 4, 2 * 4 * 8 * 2)
    assert traffic((*args, 64, None), {}, out) == traffic((*args, 0, None), {}, out)  # window > ctx
