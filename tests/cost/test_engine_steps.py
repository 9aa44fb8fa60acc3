"""Engine step times: interpolation, the mixed-step rule, the file format and its errors."""

from __future__ import annotations

import json

import pytest

from tessera.cost.engine_steps import STEP_TIMES_VERSION, EngineStepTimes, EngineStepTimesError


def times(**kw) -> EngineStepTimes:
    base = dict(engine="vllm 0.32.0", model="smollm2-135m", device="cpu (2 threads)",
                prefill=((16, 0.02), (64, 0.05), (256, 0.17)),
                decode=((1, 64, 0.010), (1, 1024, 0.014), (8, 64, 0.020), (8, 1024, 0.040)), overhead_s=0.003)
    base.update(kw)
    return EngineStepTimes(**base)


def test_the_prefill_fit_recovers_the_gemm_attention_and_per_prompt_parts():
    a, b, c, d = 0.004, 2e-4, 5e-8, 3e-3  # fixed, per token, per attention pair, per prompt
    lone = tuple((n, a + b * n + c * n * n + d) for n in (16, 64, 256, 1024))
    batched = tuple((k, n, a + b * k * n + c * k * n * n + d * k) for k, n in ((32, 64), (8, 256), (128, 16)))
    t = times(prefill=lone, batched=batched)
    fit = t.prefill_fit
    assert (fit.fixed, fit.per_token, fit.per_pair, fit.per_sequence) == pytest.approx((a, b, c, d), rel=1e-6)
    assert t.prefill_s(512) == pytest.approx(a + b * 512 + c * 512 * 512 + d)
    assert t.prefill_s(512, 8 * 64 * 64, 8) == pytest.approx(a + b * 512 + c * 8 * 64 * 64 + 8 * d)  # 8 of 64


def test_the_fit_never_goes_negative():
    t = times(prefill=((16, 0.05), (64, 0.05), (256, 0.04)))  # noise that a free fit would answer with b < 0
    fit = t.prefill_fit
    assert min(fit.fixed, fit.per_token, fit.per_pair, fit.per_sequence) >= 0 and fit.per_sequence == 0
    assert t.prefill_s(1024) > 0


def test_decode_is_linear_in_context_then_rows():
    t = times()
    assert t.decode_s(1, 64) == pytest.approx(0.010)
    assert t.decode_s(8, 1024) == pytest.approx(0.040)
    mid_ctx = 64 + (1024 - 64) / 2
    assert t.decode_s(1, mid_ctx) == pytest.approx(0.012)
    assert t.decode_s(8, mid_ctx) == pytest.approx(0.030)
    assert t.decode_s(4.5, mid_ctx) == pytest.approx(0.021)


def test_a_mixed_step_is_its_decode_plus_what_the_prompt_tokens_add():
    t = times(batched=((32, 64, 0.9),))
    fit = t.prefill_fit
    assert t.step_s(0, 8, 64) == pytest.approx(t.decode_s(8, 64))
    assert t.step_s(100, 0, 0) == pytest.approx(t.prefill_s(100))
    squares = 56 * 56 + 2 * 56 * 200 + 10 * 10
    assert t.step_s(66, 8, 64, prompt_squares=squares, prompts=2) == pytest.approx(
        t.decode_s(8, 64) + fit.per_token * 66 + fit.per_pair * squares + 2 * fit.per_sequence)


def test_round_trip_and_errors(tmp_path):
    t = times(kv_blocks=1456, block_size=32, batched=((32, 64, 0.9),))
    path = tmp_path / "steps.json"
    t.save(path)
    assert EngineStepTimes.load(path) == t
    d = json.loads(path.read_text())
    assert d["version"] == STEP_TIMES_VERSION
    for broken, message in (({**d, "version": 0}, "version 0"), ({k: v for k, v in d.items() if k != "decode"},
                                                                 "missing decode"),
                            ({**d, "prefill": [[16, "x"]]}, "malformed"), ({**d, "prefill": [[16, 0.1]]},
                                                                          "at least two prefill"),
                            ({**d, "decode": [[0, 64, 0.1]]}, "at least 1"), ([1, 2], "JSON object")):
        path.write_text(json.dumps(broken))
        with pytest.raises(EngineStepTimesError, match=message):
            EngineStepTimes.load(path)
    path.write_text("{not json")
    with pytest.raises(EngineStepTimesError, match="not a JSON file"):
        EngineStepTimes.load(path)
    with pytest.raises(EngineStepTimesError, match="no decode points"):
        times(decode=())
