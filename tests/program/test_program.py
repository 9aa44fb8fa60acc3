"""Device programs: exactly the bytes a consumer needs move, in a deadlock-free order, per micro-batch."""

from __future__ import annotations

import random

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.models import resolve_model
from tessera.capture.phases import StepShape, build_model, step_for
from tessera.capture.step import Step
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace
from tessera.graph.dataflow import colocation_units
from tessera.graph.ir import TensorRef
from tessera.graph.ranges import Ranges
from tessera.program.placements import synthetic_placement
from tessera.program.program import PlacementError, build_programs, single_device_program
from tessera.sim.programs import simulate_programs


def _graph(fn, inputs, state=None):
    return trace(Step(model="unit", family="test", phase="unit", modules={}, fn=fn, inputs=inputs,
                      state=state or {}))


def _moves(sp):
    return [(t.src, t.dst, t.microbatch, [(p.buffer, p.spans) for p in t.pieces], t.after, t.before)
            for t in sp.transfers]


def test_ranges_algebra():
    a = Ranges.of([(0, 4), (8, 12), (4, 6)])
    assert a.spans == ((0, 6), (8, 12)) and a.nbytes == 10
    assert (a - Ranges.of([(2, 9)])).spans == ((0, 2), (9, 12))
    assert (a & Ranges.of([(5, 10)])).spans == ((5, 6), (8, 10))
    assert (a | Ranges.of([(6, 8)])).spans == ((0, 12),)
    assert not (a - a)
    assert not (a & Ranges()) and (a - Ranges()) == a and not (Ranges() - a)


def test_ranges_set_operations_match_byte_sets():
    rng = random.Random(7)

    def random_ranges() -> tuple[Ranges, set[int]]:
        spans = [(lo, lo + rng.randint(0, 6)) for lo in (rng.randint(0, 60) for _ in range(rng.randint(0, 8)))]
        return Ranges.of(spans), {x for lo, hi in spans for x in range(lo, hi)}

    def as_set(r: Ranges) -> set[int]:
        return {x for lo, hi in r.spans for x in range(lo, hi)}

    for _ in range(300):
        (a, sa), (b, sb) = random_ranges(), random_ranges()
        assert as_set(a) == sa and Ranges.of(a.spans) == a
        assert as_set(a - b) == sa - sb and as_set(a & b) == sa & sb and as_set(a | b) == sa | sb
        for r in (a - b, a & b, a | b):  # canonical: sorted, disjoint, not touching
            assert all(lo < hi for lo, hi in r.spans)
            assert all(r.spans[i][1] < r.spans[i + 1][0] for i in range(len(r.spans) - 1))


def test_exact_bytes_of_disjoint_slices_move_to_their_readers():
    def fn(inp, st, _c):
        x = inp["x"] * 2  # k0 on device 0: writes 128 bytes
        x[:4].add_(1)  # k1 on device 1: needs rows 0-3 (bytes 0-63), rewrites them
        b = x[4:] + 3  # k2 on device 1: needs rows 4-7 (bytes 64-127) from device 0
        c = x[:4] * 5  # k3 on device 0: needs rows 0-3 back from device 1 (device 1 rewrote them)
        return {"b": b, "c": c}

    g = _graph(fn, {"x": torch.ones(8, 4)})
    sp = build_programs(g, [0, 1, 1, 0], ["a", "b"])
    x = g.kernels[0].outputs[0][0]
    assert _moves(sp) == [(0, 1, 0, [(x, ((0, 64),))], 0, 1), (0, 1, 0, [(x, ((64, 128),))], 0, 2),
                          (1, 0, 0, [(x, ((0, 64),))], 1, 3)]
    assert sp.cut_bytes == 192
    assert sp.programs[0].outputs == ["c"] and sp.programs[1].outputs == ["b"]
    assert sp.programs[0].inputs == ["x"] and sp.programs[1].inputs == []


def test_strided_reads_move_only_their_columns():
    def fn(inp, st, _c):
        x = inp["x"] + 1  # [4, 8] float32 on device 0
        y = x[:, ::2] * 2  # even columns, on device 1
        return {"y": y}

    g = _graph(fn, {"x": torch.ones(4, 8)})
    sp = build_programs(g, [0, 1], ["a", "b"])
    (t,) = sp.transfers
    assert t.pieces[0].spans == tuple((r * 32 + c * 4, r * 32 + c * 4 + 4) for r in range(4) for c in range(0, 8, 2))
    assert t.nbytes == 64  # half of the 128-byte buffer


def test_one_message_per_consumer_and_source_and_forwarding_after_arrival():
    def fn(inp, st, _c):
        a = inp["x"] + 1  # k0 dev 0
        b = inp["x"] * 2  # k1 dev 0
        c = a + b  # k2 dev 1: a and b from device 0 in ONE message
        d = c - 1  # k3 dev 2: c from device 1, sent after c arrived
        e = a * c  # k4 dev 2: a from device 0 (device 1's copy is just as good, device 0 is asked first)
        return {"d": d, "e": e}

    g = _graph(fn, {"x": torch.ones(4)})
    sp = build_programs(g, [0, 0, 1, 2, 2], ["a", "b", "c"])
    first = sp.transfers[0]
    assert (first.src, first.dst, first.after, first.before, len(first.pieces)) == (0, 1, 1, 2, 2)
    assert [(t.src, t.dst, t.after, t.before) for t in sp.transfers[1:]] == [(1, 2, 2, 3), (0, 2, 0, 4)]


def test_micro_batches_repeat_transfers_with_own_tags_and_interleave_segments():
    _, meta_step, g = _tiny_decode()
    placement = synthetic_placement(g, 2, "alternate")
    one = build_programs(g, placement, ["a", "b"], 1)
    three = build_programs(g, placement, ["a", "b"], 3)
    assert len(three.transfers) == 3 * len(one.transfers)
    assert len({t.tag for t in three.transfers}) == len(three.transfers)
    assert three.cut_bytes == 3 * one.cut_bytes
    runs = [(i.kernel, i.microbatch) for i in three.programs[0].instructions if i.kind == "run"]
    first = [k for k, m in runs if m == 0]
    assert runs[:3] == [(first[0], 0), (first[0], 1), (first[0], 2)]  # segment by segment, each for m = 0..2


def _tiny_decode(batch: int = 2):
    spec = resolve_model("smollm2-135m")
    cfg = tiny_config("llm")
    meta, values = instantiate(lambda: build_model("llm", cfg), "meta")
    step = step_for(spec, meta, values, "decode", StepShape(batch=batch, seq=1, ctx=16), device="meta")
    return spec, step, trace(step)


@pytest.mark.parametrize("devices,kind,seed,micro", [(2, "alternate", 0, 1), (3, "alternate", 0, 4),
                                                      (2, "random", 1, 2), (3, "random", 2, 3), (4, "random", 3, 2)])
def test_programs_complete_without_deadlock(devices, kind, seed, micro):
    _, _, g = _tiny_decode()
    sp = build_programs(g, synthetic_placement(g, devices, kind, seed), [f"d{i}" for i in range(devices)], micro)
    simulate_programs(sp, lambda d, k, m: 1.0)  # raises if some receive never gets its message
    for d, prog in enumerate(sp.programs):  # every send and recv of the device is in its program, once
        mine = sorted(i.transfer for i in prog.instructions if i.kind in ("send", "recv"))
        assert mine == sorted(i for i, t in enumerate(sp.transfers) if d in (t.src, t.dst))
        assert prog.micro_batches == micro


def test_single_device_program_frees_activations_and_moves_nothing():
    _, _, g = _tiny_decode()
    sp = build_programs(g, [0] * len(g.kernels), ["cpu"])
    assert not sp.transfers
    prog = single_device_program(g)
    assert prog.instructions == sp.programs[0].instructions
    freed = [i.buffer for i in prog.instructions if i.kind == "free"]
    kept = {TensorRef.from_json(r).buffer for r in g.outputs.values()}  # step outputs are collected
    transient = {a.buffer for a in g.accesses if g.buffers[a.buffer].kind in ("activation", "input", "output")}
    assert len(freed) == len(set(freed)) and set(freed) == transient - kept and freed  # each exactly once
    assert not kept & set(freed) and not {b for b in freed if g.buffers[b].kind in ("weight", "state")}
    position = {i.buffer: n for n, i in enumerate(prog.instructions) if i.kind == "free"}
    for n, i in enumerate(prog.instructions):  # a buffer is freed after the last kernel that touches it
        if i.kind == "run":
            touched = {a.buffer for a in g.accesses if a.kernel == i.kernel}
            assert all(position[b] > n for b in touched if b in position)
    assert set(prog.weights) == set(g.weight_names())


def test_state_must_stay_with_its_kernels():
    _, _, g = _tiny_decode()
    writer, reader = sorted({a.kernel for a in g.accesses if a.buffer == "cache.layer0.k"})  # index_put_, attention
    units = colocation_units(g)
    assert units[writer] == units[reader]  # synthetic placements keep them together
    split = [0] * len(g.kernels)
    split[reader] = 1
    with pytest.raises(PlacementError, match=r"state cache\.layer0\.k is touched by kernels on devices \[0, 1\]"):
        build_programs(g, split, ["a", "b"])
    with pytest.raises(PlacementError, match="placement has 3 entries but the graph has"):
        build_programs(g, [0, 1, 0], ["a", "b"])
    with pytest.raises(PlacementError, match="placed on device 5, but there are 2 devices"):
        build_programs(g, [5] * len(g.kernels), ["a", "b"])
    with pytest.raises(PlacementError, match="unknown placement 'zigzag'"):
        synthetic_placement(g, 2, "zigzag")
