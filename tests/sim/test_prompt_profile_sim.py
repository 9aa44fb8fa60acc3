"""The simulator times a served prompt step with the prompt profile's measured kernel times (where they and the
run's own profile both time a kernel, the prompt profile's), a lone request's TTFT holds its prefill step once,
and GPU simulations are unchanged by a host profile carrying prompt steps."""

from __future__ import annotations

import pytest

from tessera.cost.profile import KernelTiming, Profile, kernel_signature
from tessera.hardware.catalog import HOST_ID
from tessera.plan.planner import plan_policy
from tessera.runtime.prompt_profile import decode_graphs, prompt_graphs, with_prompt_kernels
from tessera.runtime.session import runtime_context
from tessera.sim.requests import engines_for, simulate

MODEL, SLOTS, CTX = "smollm2-135m", 8, 128
SHAPE = (1, 16, 32)  # a lone prompt of 9-16 tokens


def _profile(graph, seconds) -> Profile:
    """A profile of this host timing each kernel of ``graph`` at ``seconds(its signature)`` (kernels alike, e.g.
    in every layer, alike)."""
    kernels = [KernelTiming(k.index, k.id, sig, k.op, k.op_class, seconds(sig), seconds(sig), 1)
               for k in graph.kernels for sig in [kernel_signature(k)]]
    return Profile(HOST_ID, "test cpu", 1, MODEL, "prefill", graph.hash, {}, 0, 1, "now", kernels)


@pytest.fixture(scope="module")
def prompt():
    return prompt_graphs(MODEL, [SHAPE], SLOTS)["prefill@1x16c32"]


def _timer(profile, cluster: str = "cpu:1", policy: str = "homogeneous", device: str | None = "cpu"):
    ctx = runtime_context(MODEL, 1, 64, 64, CTX, SLOTS, 1, profile, cluster=cluster)
    plan = plan_policy(ctx, policy, device=device)
    return ctx, plan, engines_for(ctx, plan, max_context=CTX, feedback_s=1e-4, min_prompt=16)[0].timer


def test_a_prompt_step_is_timed_by_the_prompt_profile_kernel_by_kernel(prompt):
    times = lambda sig: (1 + int(sig[:4], 16) % 7) * 2.0**-12  # noqa: E731 - exactly representable times
    # the run's own profile times the same kernels otherwise (older code's): the prompt profile's stand
    stale = _profile(prompt, lambda sig: 1.0)
    merged = with_prompt_kernels(stale, [_profile(prompt, times)])
    _, _, timer = _timer(merged)
    step = timer.time("prefill", *SHAPE)
    assert len(prompt.kernels) > 100
    assert step.busy_s[0] == pytest.approx(sum(times(kernel_signature(k)) for k in prompt.kernels), abs=1e-12)
    # without it, the roofline: a different time
    _, _, plain = _timer(Profile(HOST_ID, "test cpu", 1, MODEL, "decode", "", {}, 0, 1, "now", []))
    assert plain.time("prefill", *SHAPE).busy_s[0] != pytest.approx(step.busy_s[0], rel=1e-3)


def test_a_decode_step_of_fewer_rows_than_the_slots_is_timed_by_its_bucket_s_profile():
    bucket = decode_graphs(MODEL, [2], CTX, SLOTS)["decode@2"]
    times = lambda sig: (1 + int(sig[:4], 16) % 7) * 2.0**-12  # noqa: E731 - exactly representable times
    merged = with_prompt_kernels(_profile(bucket, lambda sig: 1.0), [_profile(bucket, times)])
    ctx, _, timer = _timer(merged)
    graph = ctx.graph(timer.phase_spec("decode", 2, None, CTX), timer.micro_batches("decode", 2))
    charged = timer.kernel_times("decode", 2, None, CTX)[:, 0]
    held = {kernel_signature(k) for k in bucket.kernels}
    measured = [k for k in graph.kernels if kernel_signature(k) in held]
    # the simulator's graph of the bucket holds a cache of its own rows, the engine's one of every slot: only the
    # kernels over the cache differ
    assert {k.op for k in graph.kernels if kernel_signature(k) not in held} == {
        "tessera.kv_write.default", "tessera.decode_attention.default"}
    assert {k.op for k in measured} >= {"aten.mm.default", "tessera.merged_linear.default"}
    for k in measured:
        assert charged[k.index] == times(kernel_signature(k))
    # without it, every kernel by the roofline
    _, _, plain = _timer(Profile(HOST_ID, "test cpu", 1, MODEL, "decode", "", {}, 0, 1, "now", []))
    plain_charged = plain.kernel_times("decode", 2, None, CTX)[:, 0]
    assert all(plain_charged[k.index] != times(kernel_signature(k)) for k in measured)


def test_a_lone_request_s_ttft_holds_its_prefill_step_once(prompt):
    profile = with_prompt_kernels(_profile(prompt, lambda sig: 1.0), [_profile(prompt, lambda sig: 2.0**-11)])
    ctx, plan, timer = _timer(profile)
    result = simulate(ctx, plan, max_context=CTX, feedback_s=1e-4, min_prompt=16, draws=[(0.0, 12, 4)])
    prefill, decode = timer.time("prefill", *SHAPE), timer.time("decode", 1, None, 32)
    assert result.ttft_s[0] == pytest.approx(prefill.first_s + decode.first_s, abs=1e-12)


def test_gpu_steps_are_unchanged_by_a_host_profile_with_prompt_steps(prompt):
    profile = with_prompt_kernels(_profile(prompt, lambda sig: 1.0), [_profile(prompt, lambda sig: 2.0**-11)])
    _, _, hosted = _timer(profile, "A100:1,L40S:1", "layer-pipeline", None)
    _, _, plain = _timer(None, "A100:1,L40S:1", "layer-pipeline", None)
    for bucket in (("prefill", *SHAPE), ("prefill", 1, 64, 128), ("decode", 4, None, 128)):
        assert hosted.time(*bucket) == plain.time(*bucket)
