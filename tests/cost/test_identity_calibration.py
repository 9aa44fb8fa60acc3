"""Measured vLLM kernels map to Tessera fused-op identities; per-identity factors reach the cost model."""

import pytest

from tessera.cost.efficiency import ClassEfficiency, DeviceEfficiency, efficiency_for
from tessera.cost.gpu_calibration import kernel_identity, load_pairs
from tessera.hardware.devices import resolve_device


@pytest.mark.parametrize("name,phase,block,identity", [
    ("void marlin_moe_wna16::Marlin<(long)1125899906909960>", "decode", "ffn", "moe_mxfp4_gemm"),
    ("kernel_unified_attention_2d", "decode", "attention", "decode_attention"),
    ("kernel_unified_attention_3d", "prefill", "attention", "prefill_attention"),
    ("reshape_and_cache_kernel_flash", "decode", "attention", "kv_write"),
    ("triton_red_fused__to_copy_add_addmm_mean_mul_pow_rsqrt_0", "decode", "attention", "add_rms_norm"),
    ("triton_red_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0", "decode", "attention", "rms_norm"),
    ("void vllm::moe::topkGating<(int)8>", "decode", "ffn", "topk_gating"),
    ("void vllm::moe::moe_align_block_size_kernel<int>", "prefill", "ffn", "moe_align"),
    ("void vllm::moe::moe_sum_kernel<c10::BFloat16, (int)4>", "decode", "ffn", "moe_sum"),
    ("void vllm::swigluoai_and_mul_kernel<c10::BFloat16>", "decode", "ffn", "swigluoai_and_mul"),
    ("ampere_bf16_s16816gemm_bf16_64x64_sliced1x2_ldg8_f2f_stages_64x6_tn", "decode", "attention", "merged_linear"),
    ("ampere_bf16_s16816gemm_bf16_256x64_ldg8_f2f_stages_64x3_tn", "decode", "other", "lm_head"),
    ("void at::native::<unnamed>::cunn_SoftMaxForward<(int)4, float>", "decode", "other", "sample"),
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::FillFunctor<int>>", "decode", "ffn", None),
])
def test_kernel_identity(name, phase, block, identity):
    assert kernel_identity(name, phase, block) == identity


def test_rotary_is_named_by_the_l40s_name():
    names = ("triton_poi_fused_3", "triton_poi_fused__to_copy_add_cat_index_select_mul_split_split_with_sizes")
    assert kernel_identity(names, "decode", "attention") == "rotary_"


def test_pairs_carry_identities():
    usable, _ = load_pairs()
    assert sum(k.identity is not None for k in usable) > 0.8 * len(usable)


def test_per_op_factors_win_over_class_factors():
    cls = {"gemm": ClassEfficiency(0.5, 0.5, 1000)}
    eff = DeviceEfficiency("X", cls, "test", ("gemm",), {"lm_head": ClassEfficiency(0.9, 0.9, 500)})
    assert eff.for_kernel("gemm", "lm_head").floor_cycles == 500
    assert eff.for_kernel("gemm", "merged_linear").floor_cycles == 1000
    assert eff.for_kernel("gemm").floor_cycles == 1000
    assert DeviceEfficiency.from_dict(eff.to_dict(), "t") == eff


def test_shipped_factors_hold_identity_fits():
    l40s = efficiency_for(resolve_device("L40S"))
    assert l40s.ops and set(l40s.ops) <= {"lm_head", "rotary_", "merged_linear", "add_rms_norm", "sample",
                                          "moe_mxfp4_gemm", "moe_align", "prefill_attention", "decode_attention"}
