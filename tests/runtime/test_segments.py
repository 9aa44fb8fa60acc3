"""CUDA-graph segments of real traced device programs: maximal runs of one micro-batch's kernels between
transfers, the kernels no graph can hold (the sampler: a host sync) left eager with their reason. Exact sets,
derived independently from the transfers and the ops; no GPU needed."""

from __future__ import annotations

import pytest
import torch

from tessera.capture.build import instantiate
from tessera.capture.models import resolve_model
from tessera.capture.phases import StepShape, build_model, step_for
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace
from tessera.program.program import (
    Instruction,
    Program,
    build_programs,
    kernel_buffers,
    single_device_program,
)
from tessera.runtime.segments import BLOCKED_OPS, Segment, capture_blocker, graph_segments


@pytest.fixture(scope="module")
def decode_graph():
    meta, values = instantiate(lambda: build_model("llm", tiny_config("llm")), "meta")
    return trace(step_for(resolve_model("smollm2-135m"), meta, values, "decode", StepShape(batch=2, seq=1, ctx=16),
                          device="meta"))


def _sampler(graph) -> int:
    (k,) = [k.index for k in graph.kernels if k.op == "tessera.sample.default"]
    return k


def test_one_device_decode_is_one_segment_and_the_sampler(decode_graph):
    g = decode_graph
    program = single_device_program(g, "cuda:0")
    plan = graph_segments(g, program)
    sampler = _sampler(g)
    assert sampler == len(g.kernels) - 1
    assert [s.kernels for s in plan.segments] == [tuple(range(sampler))]
    assert plan.eager == {sampler: f"tessera.sample.default: {BLOCKED_OPS['tessera.sample']}"}
    (seg,) = plan.segments
    inside = program.instructions[seg.start: seg.stop]
    assert seg.start == 0 and program.instructions[seg.stop] == Instruction("run", kernel=sampler)
    assert {i.kind for i in inside} == {"run", "free"} and [i.kernel for i in inside if i.kind == "run"] == list(
        range(sampler))


def _alternating(graph) -> list[int]:
    """Layer 0 on device 0, layer 1 on device 1, everything outside the layers on device 0: device 0 runs two
    separate stretches (embedding + layer 0, then the head and the sampler)."""
    return [1 if k.layer == 1 else 0 for k in graph.kernels]


def _expected(graph, sp, d: int, m: int) -> list[tuple[int, ...]]:
    """Device d's kernels cut before every kernel it receives bytes for, after every kernel it sends bytes
    after, and around blocked kernels; in program order."""
    recv_before = {t.before for t in sp.transfers if t.dst == d and t.microbatch == m}
    send_after = {t.after for t in sp.transfers if t.src == d and t.microbatch == m}
    runs: list[list[int]] = []
    last = None
    for k in (k for k, p in enumerate(sp.placement) if p == d):
        blocked = capture_blocker(graph, k) is not None
        # another device's kernels in between cut only where micro-batches take turns (or bytes arrive)
        gap = last is not None and last != k - 1 and sp.micro_batches > 1
        if blocked or last is None or k in recv_before or last in send_after or gap:
            runs.append([])
        if not blocked:
            runs[-1].append(k)
        last = None if blocked else k
    return [tuple(r) for r in runs if r]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_split_programs_are_cut_at_every_transfer_and_micro_batch(decode_graph, micro_batches):
    g = decode_graph
    sp = build_programs(g, _alternating(g), ["cuda:0", "cuda:1"], micro_batches)
    sampler = _sampler(g)
    assert sp.transfers, "the split must move bytes between the devices"
    for d, program in enumerate(sp.programs):
        plan = graph_segments(g, program)
        for m in range(micro_batches):
            got = [s.kernels for s in plan.segments if s.microbatch == m]
            assert got == _expected(g, sp, d, m), f"device {d}, micro-batch {m}"
        assert plan.eager == ({sampler: capture_blocker(g, sampler)} if sp.placement[sampler] == d else {})
        assert plan.captured_kernels() | set(plan.eager) == set(program.kernels())
        for seg in plan.segments:  # nothing but its micro-batch's runs and frees, and maximal
            inside = program.instructions[seg.start: seg.stop]
            assert all(i.kind in ("run", "free") and i.microbatch == seg.microbatch for i in inside)
            assert inside[0].kind == "run" and tuple(i.kernel for i in inside if i.kind == "run") == seg.kernels
            if seg.stop < len(program.instructions):
                nxt = program.instructions[seg.stop]
                assert nxt.kind in ("send", "recv") or nxt.microbatch != seg.microbatch or nxt.kernel == sampler
    # device 0 holds two stretches of kernels, so at least two segments per micro-batch
    assert len(graph_segments(g, sp.programs[0]).segments) >= 2 * micro_batches


def test_hand_written_program_segments_exactly(decode_graph):
    g = decode_graph
    sampler = _sampler(g)
    run = lambda k, m=0: Instruction("run", kernel=k, microbatch=m)  # noqa: E731
    free = lambda b, m=0: Instruction("free", buffer=b, microbatch=m)  # noqa: E731
    instructions = [free("x"), run(0), free("a"), run(1), Instruction("send", microbatch=0, transfer=0), run(2),
                    run(sampler), free("b"), run(3), free("c"), run(3, 1), Instruction("recv", microbatch=1, transfer=1),
                    run(4, 1), free("d", 1)]
    program = Program("cuda:0", g.hash, instructions)
    plan = graph_segments(g, program)
    assert plan.segments == (Segment(0, 1, 4, (0, 1)), Segment(0, 5, 6, (2,)), Segment(0, 8, 10, (3,)),
                             Segment(1, 10, 11, (3,)), Segment(1, 12, 14, (4,)))
    assert set(plan.eager) == {sampler}


def test_blocked_ops_and_a_foreign_program_are_named(decode_graph):
    g = decode_graph
    assert capture_blocker(g, 0) is None
    assert capture_blocker(g, _sampler(g)).startswith("tessera.sample.default: host sync")
    other = Program("cuda:0", "not-this-graph", [])
    with pytest.raises(ValueError, match="program was built for graph not-this-graph"):
        graph_segments(g, other)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_graph_opcodes_replace_each_segment_by_one_opcode_holding_exactly_its_instructions(decode_graph,
                                                                                          micro_batches):
    from tessera.runtime.cuda_graphs import SegmentGraph
    from tessera.runtime.worker import _GRAPH, _KINDS, _graph_opcodes, _opcodes

    g = decode_graph
    sp = build_programs(g, _alternating(g), ["cuda:0", "cuda:1"], micro_batches)
    for program in sp.programs:
        plan = graph_segments(g, program)
        pools: dict = {}
        segments = [SegmentGraph(g, program, s, pools) for s in plan.segments]
        opcodes = _graph_opcodes(_opcodes(program), segments)
        assert [arg for code, arg, _ in opcodes if code == _GRAPH] == segments
        expanded = []
        for code, arg, m in opcodes:
            if code == _GRAPH:
                assert m == arg.segment.microbatch
                expanded += [("run" if is_run else "free", a, m) for is_run, a in arg.steps]
            else:
                expanded.append((_KINDS[code], arg, m))
        assert expanded == [(i.kind, i.kernel if i.kind == "run" else i.buffer if i.kind == "free" else i.transfer,
                             i.microbatch) for i in program.instructions]
        for seg in segments:
            assert seg.buffers == set().union(*(kernel_buffers(g, k) for k in seg.segment.kernels))
            assert seg.state_buffers == {b for b in seg.buffers if g.buffers[b].kind == "state"}
            assert seg.instance_buffer == program.state[0] and seg.pools is pools


def test_a_program_run_segment_by_segment_eagerly_equals_the_executor(decode_graph):
    """The host can run each segment's instructions eagerly (what a CUDA worker does before capture): the
    outputs are those of the whole program."""
    from tessera.graph.codec import dtype_from_name
    from tessera.runtime.cuda_graphs import SegmentGraph
    from tessera.runtime.executor import Executor
    from tessera.runtime.worker import _FREE, _GRAPH, _RUN, _graph_opcodes, _opcodes

    g = decode_graph
    program = single_device_program(g, "cpu")
    gen = torch.Generator().manual_seed(0)
    weights = {n: (torch.randn(g.buffers[n].shape, generator=gen) * 0.2).to(dtype_from_name(g.buffers[n].dtype))
               for n in g.weight_names()}
    inputs = {"input_ids": torch.tensor([[3], [7]]), "positions": torch.tensor([2, 5]), "slots": torch.tensor([0, 1])}

    def state():
        return {s: torch.zeros(g.buffers[s].shape, dtype=dtype_from_name(g.buffers[s].dtype)) for s in g.state}

    ref_state = state()
    ref = Executor(g, program, weights).run(inputs, ref_state)
    ex = Executor(g, program, weights)
    mine = state()
    ex.prepare(inputs, mine)
    segments = [SegmentGraph(g, program, s, {}) for s in graph_segments(g, program).segments]
    with torch.no_grad():
        for code, arg, _ in _graph_opcodes(_opcodes(program), segments):
            if code == _GRAPH:
                arg.eager(ex)
            elif code == _RUN:
                ex.run_kernel(arg)
            elif code == _FREE:
                ex.free(arg)
    got = ex.outputs()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert all(torch.equal(mine[s], ref_state[s]) for s in g.state)
    assert [s.eager_runs for s in segments] == [1] and segments[0].warm
