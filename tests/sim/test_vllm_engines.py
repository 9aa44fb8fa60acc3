"""The vLLM scheduler of the simulator on small cases worked out by hand: one step at a time, running
requests first, chunked prefill under the token budget, the sequence cap, preemption by recompute, the
prefill-decode handoff, route shares and engines taking turns on a shared device."""

from __future__ import annotations

import pytest

from tessera.cost.engine_steps import EngineStepTimes
from tessera.sim.vllm_engines import EngineSim, SimRoute, VLLMSimulationError, simulate_vllm

PREFILL_S, DECODE_S, OVERHEAD_S = 0.1, 0.01, 0.002


def flat_times() -> EngineStepTimes:
    """A prefill step always 0.1 s, a decode step always 0.01 s (prompt tokens riding along cost nothing)."""
    return EngineStepTimes("vllm", "m", "test", ((1, PREFILL_S), (100_000, PREFILL_S)),
                           ((1, 1, DECODE_S), (1, 100_000, DECODE_S)), overhead_s=OVERHEAD_S)


def engine(name="e", max_num_seqs=8, max_tokens=2048, block_size=16, kv_blocks=None, **kw) -> EngineSim:
    return EngineSim(name, flat_times(), max_num_seqs, max_tokens, block_size, kv_blocks, **kw)


def whole(engines: list[EngineSim]) -> list[SimRoute]:
    return [SimRoute(f"r{i}", 1.0, (i,)) for i in range(len(engines))]


def test_one_request_prefills_then_decodes_one_token_per_step():
    e = engine()
    r = simulate_vllm([e], whole([e]), [(0.0, 100, 5)])
    req = r.requests[0]
    assert req.first_s == pytest.approx(PREFILL_S)
    assert req.finish_s == pytest.approx(PREFILL_S + 4 * DECODE_S)
    s = r.summary()
    assert s["ttft_p50_s"] == pytest.approx(PREFILL_S + OVERHEAD_S)
    assert s["tpot_p50_s"] == pytest.approx(DECODE_S)
    assert s["steps"] == 5
    assert s["throughput"] == pytest.approx(5 / (PREFILL_S + 4 * DECODE_S))


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    e = engine(max_tokens=64)
    r = simulate_vllm([e], whole([e]), [(0.0, 150, 2)])  # chunks of 64, 64 and 22 tokens
    assert r.requests[0].first_s == pytest.approx(3 * PREFILL_S)
    assert r.summary()["steps"] == 4


def test_the_sequence_cap_holds_a_request_back_until_one_finishes():
    e = engine(max_num_seqs=1)
    r = simulate_vllm([e], whole([e]), [(0.0, 10, 3), (0.0, 10, 3)])
    a, b = r.requests
    assert a.finish_s == pytest.approx(PREFILL_S + 2 * DECODE_S)
    assert b.first_s == pytest.approx(a.finish_s + PREFILL_S)


def test_prompts_arriving_together_share_one_step_and_decodes_run_with_new_prompts():
    e = engine()
    r = simulate_vllm([e], whole([e]), [(0.0, 100, 3), (0.0, 100, 3), (0.105, 50, 2)])
    a, b, c = r.requests
    assert a.first_s == b.first_s == pytest.approx(PREFILL_S)
    # c arrives during a and b's first decode step and joins the next one, which holds decodes: it costs a decode
    assert c.first_s == pytest.approx(PREFILL_S + 2 * DECODE_S)
    assert a.finish_s == pytest.approx(PREFILL_S + 2 * DECODE_S)


def test_running_out_of_kv_blocks_preempts_the_latest_request_which_recomputes():
    e = engine(block_size=16, kv_blocks=4)
    r = simulate_vllm([e], whole([e]), [(0.0, 30, 20), (0.0, 30, 20)])
    assert all(req.finish_s is not None for req in r.requests)
    assert r.summary()["preemptions"] >= 1
    assert r.requests[0].finish_s < r.requests[1].finish_s


def test_prefill_decode_hands_the_kv_on_and_recomputes_the_last_prompt_token():
    handoff = 0.05
    p, d = engine("prefill"), engine("decode", handoff_s=handoff)
    r = simulate_vllm([p, d], [SimRoute("pd", 1.0, (0, 1))], [(0.0, 100, 3)])
    req = r.requests[0]
    first = PREFILL_S + handoff + PREFILL_S  # prefill engine's step, the handoff, the decode engine's 1-token step
    assert req.first_s == pytest.approx(first)
    assert req.finish_s == pytest.approx(first + 2 * DECODE_S)
    assert r.summary()["ttft_p50_s"] == pytest.approx(first + 2 * OVERHEAD_S)  # two engine calls


def test_requests_follow_the_route_shares():
    a, b = engine("a"), engine("b")
    r = simulate_vllm([a, b], [SimRoute("a", 0.25, (0,)), SimRoute("b", 0.75, (1,))],
                      [(i * 1.0, 10, 2) for i in range(8)])
    served = [req.hops[0] for req in r.requests]
    assert served.count(0) == 2 and served.count(1) == 6


def test_engines_on_one_device_take_turns():
    a, b = engine("a", devices=frozenset({"gpu0"})), engine("b", devices=frozenset({"gpu0"}))
    r = simulate_vllm([a, b], whole([a, b]), [(0.0, 10, 2), (0.0, 10, 2)])
    x, y = sorted(r.requests, key=lambda q: q.first_s)
    assert x.first_s == pytest.approx(PREFILL_S)
    assert y.first_s == pytest.approx(2 * PREFILL_S)  # waited for the other engine's step
    apart = [engine("a", devices=frozenset({"gpu0"})), engine("b", devices=frozenset({"gpu1"}))]
    r = simulate_vllm(apart, whole(apart), [(0.0, 10, 2), (0.0, 10, 2)])
    assert [q.first_s for q in r.requests] == pytest.approx([PREFILL_S, PREFILL_S])


def test_a_request_larger_than_the_cache_is_refused_with_its_sizes():
    e = engine(block_size=16, kv_blocks=2)
    with pytest.raises(VLLMSimulationError, match=r"request 0 \(30 prompt \+ 20 output tokens\).*engine e has \(2 of 16"):
        simulate_vllm([e], whole([e]), [(0.0, 30, 20)])
    with pytest.raises(VLLMSimulationError, match="no routes"):
        simulate_vllm([e], [], [(0.0, 3, 2)])
