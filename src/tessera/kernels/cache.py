"""KV-cache writes (vLLM's ``reshape_and_cache_flash``): a layer's new K and V into the engine cache.

The cache is [slots, KVH, ctx, D] per layer. Prefill (``positions`` None) writes the S new tokens to
positions 0..S-1 of row ``slots[b]``; decode writes the one new token of row b to position
``positions[b]`` of row ``slots[b]``. One kernel for K and V together.
"""

from __future__ import annotations

import torch

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op


@custom_op("tessera::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, positions: torch.Tensor | None) -> None:
    """k/v [B,KVH,S,D] into k_cache/v_cache [slots,KVH,ctx,D]; slots [B]; positions [B] (decode) or None."""
    if positions is None:
        s = k.shape[2]
        k_cache[:, :, :s].index_put_((slots,), k)
        v_cache[:, :, :s].index_put_((slots,), v)
    else:
        k_cache[slots, :, positions] = k[:, :, 0]
        v_cache[slots, :, positions] = v[:, :, 0]


@kv_write.register_fake
def _(k, v, k_cache, v_cache, slots, positions):
    return None


def _traffic(args, kwargs, out) -> tuple[int, int]:
    """The new K and V (and the indices) are read; only their bytes are written into the caches."""
    k, v, _k_cache, _v_cache, slots, positions = args[:6]
    new = k.numel() * k.element_size() + v.numel() * v.element_size()
    indices = slots.numel() * slots.element_size() + (0 if positions is None else
                                                      positions.numel() * positions.element_size())
    return new + indices, new


register_fused("kv_write", "copy", flops=lambda args, kwargs, out: 0, traffic=_traffic)
