"""The kernel-level simulation of device programs: exact on hand-computed cases, never below the bounds."""

from __future__ import annotations

import pytest
import torch

from tessera.capture.step import Step
from tessera.capture.trace import trace
from tessera.hardware.cluster import Link
from tessera.program.placements import synthetic_placement
from tessera.program.program import build_programs
from tessera.sim.programs import MessageCosts, SimulationError, simulate_programs, simulate_stream


def _chain():
    def fn(inp, st, _c):
        a = inp["x"] * 2  # k0
        b = a + 1  # k1
        c = b * 3  # k2
        return {"c": c}

    return trace(Step(model="unit", family="test", phase="unit", modules={}, fn=fn, inputs={"x": torch.ones(256)},
                      state={}))


def test_one_device_and_free_transfers_give_the_sum_of_kernel_times():
    g = _chain()
    sp = build_programs(g, [0, 0, 0], ["a"])
    times = {0: 1.0, 1: 2.0, 2: 4.0}
    result = simulate_programs(sp, lambda d, k, m: times[k])
    assert result.makespan_s == 7.0 and result.busy_s == [7.0]


def test_a_transfer_costs_its_wire_time_and_latency():
    g = _chain()
    sp = build_programs(g, [0, 1, 1], ["a", "b"])  # a (1 KiB of float32) moves from device 0 to 1
    link = Link("pcie", bandwidth=1024.0, latency_s=0.5)  # 1 s on the wire, 0.5 s latency
    result = simulate_programs(sp, lambda d, k, m: 1.0, lambda s, d: link, record=True)
    assert result.makespan_s == pytest.approx(1.0 + 1.0 + 0.5 + 2.0)
    assert result.link_busy_s == {(0, 1): pytest.approx(1.0)}
    assert [e[1] for e in result.events if e[0] == 1] == ["recv", "run", "free", "run", "free"]


def test_messages_cost_their_devices_posting_sending_and_unpacking_time():
    g = _chain()
    sp = build_programs(g, [0, 1, 1], ["a", "b"])
    link = Link("pcie", bandwidth=1024.0, latency_s=0.5)
    costs = MessageCosts(post_s=0.25, send_s=0.125, recv_s=0.0625)
    # device 0: k0 (1 s), sends (0.125 s), 1 s on the wire + 0.5 s: there at 2.625; device 1 posts its receive
    # (0.25 s), takes the message at 2.625 + 0.0625, runs k1 and k2
    want = 1.0 + 0.125 + 1.0 + 0.5 + 0.0625 + 2.0
    one = simulate_programs(sp, lambda d, k, m: 1.0, lambda s, d: link, messages=costs)
    assert one.makespan_s == pytest.approx(want) and one.busy_s == [1.0, 2.0]
    stream = simulate_stream(sp, lambda d, k, m: 1.0, lambda s, d: link, steps=1, messages=costs)
    assert stream.first_step_s == pytest.approx(want)
    # a device that only receives pays its postings before its first instruction, even with nothing to wait for
    late = MessageCosts(post_s=10.0)
    assert simulate_programs(sp, lambda d, k, m: 1.0, lambda s, d: link, messages=late).makespan_s == 12.0
    assert simulate_stream(sp, lambda d, k, m: 1.0, lambda s, d: link, steps=1, messages=late).first_step_s == 12.0


def test_a_send_costs_more_while_another_device_works():
    g = _chain()
    sp = build_programs(g, [0, 1, 1], ["a", "b"], 2)
    costs = MessageCosts(send_s=0.125, send_busy_s=0.5)
    # device 0 sends micro-batch 0 at 1.0 while device 1 waits for it (0.125 s), micro-batch 1 at 2.125 while
    # device 1 runs micro-batch 0's k2 (0.5 s)
    result = simulate_programs(sp, lambda d, k, m: 1.0, messages=costs, record=True)
    sends = [(start, end) for d, kind, _, _, start, end in result.events if kind == "send"]
    assert sends == [(1.0, 1.125), (2.125, 2.625)]
    assert result.makespan_s == 5.125
    plain = simulate_programs(sp, lambda d, k, m: 1.0, messages=MessageCosts(send_s=0.125), record=True)
    assert [end - start for d, kind, _, _, start, end in plain.events if kind == "send"] == [0.125, 0.125]
    # streamed: the same decisions, and how long each receive waited (device 1: 1.125 s for micro-batch 0)
    stream = simulate_stream(sp, lambda d, k, m: 1.0, steps=1, messages=costs)
    assert stream.first_step_s == 5.125 and stream.waits_s == [[], [1.125, 0.0]]
    slower = simulate_stream(sp, lambda d, k, m: 1.0, steps=1, messages=MessageCosts(send_s=0.125, send_busy_s=2.0))
    assert slower.first_step_s == 2.125 + 2.0 + 2.0  # micro-batch 1 arrives at 4.125, after device 1 is done with 0


def test_micro_batches_pipeline_but_never_beat_the_busiest_device():
    g = _chain()
    for m in (1, 2, 4, 8):
        sp = build_programs(g, [0, 1, 1], ["a", "b"], m)
        result = simulate_programs(sp, lambda d, k, mb: 1.0)
        assert result.makespan_s >= result.bottleneck_s == 2.0 * m
        assert result.makespan_s == 2.0 * m + 1.0  # device 1 waits for micro-batch 0 only


@pytest.mark.parametrize("kind,seed", [("alternate", 0), ("random", 4)])
def test_bounds_hold_on_a_traced_model(kind, seed):
    from tessera.capture.build import instantiate
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import StepShape, build_model, step_for
    from tessera.capture.tiny import tiny_config

    meta, values = instantiate(lambda: build_model("llm", tiny_config("llm")), "meta")
    g = trace(step_for(resolve_model("smollm2-135m"), meta, values, "decode", StepShape(batch=2, seq=1, ctx=16)))
    sp = build_programs(g, synthetic_placement(g, 3, kind, seed), ["a", "b", "c"], 2)
    result = simulate_programs(sp, lambda d, k, m: 1e-4 * (1 + k % 3), lambda s, d: Link("ib", 25e9 / 8, 5e-6))
    total = sum(1e-4 * (1 + k % 3) for k in range(len(g.kernels))) * 2
    assert sum(result.busy_s) == pytest.approx(total)
    assert result.bottleneck_s <= result.makespan_s <= total + len(sp.transfers) * 1e-3


def test_a_receive_without_its_send_is_reported():
    g = _chain()
    sp = build_programs(g, [0, 1, 1], ["a", "b"])
    sp.programs[0].instructions = [i for i in sp.programs[0].instructions if i.kind != "send"]
    with pytest.raises(SimulationError, match="b wait for messages never sent"):
        simulate_programs(sp, lambda d, k, m: 1.0)
