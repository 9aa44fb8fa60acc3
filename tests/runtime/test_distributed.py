"""The distributed runtime: every family and placement gives outputs and state `torch.equal` to eager.

One persistent pool of 3 worker processes (1 thread each, the ``pool`` fixture of conftest) serves every case. A case plans a policy (or
draws a synthetic placement) at the runtime's shapes (2 requests, M = 2 decode micro-batches, one state
instance per micro-batch), runs a scenario of steps on the workers and compares each micro-batch's outputs
with the model's eager step at the same micro-batch shapes and thread count. Text families generate
greedily (prefill both requests into their instances, then decode steps fed by the argmax), so equal
logits mean identical greedy tokens; the state after the scenario is compared too.

Default cases: the five tiny families on 2 workers under tessera, attention-ffn (where it applies),
prefill-decode (text), layer-pipeline, alternate and random placements, on 3 workers under tessera,
alternate and random; smollm2-135m (real weights) on 2 workers under every policy and placement. Marked
slow: smollm2-135m on 3 workers (the same behaviour as the 2-worker smollm2 cases and the 3-worker tiny
cases).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tessera.capture.phases import make_step
from tessera.capture.tiny import tiny_config
from tessera.graph.ir import KernelGraph
from tessera.plan.planner import plan_policy
from tessera.program.placements import synthetic_placement
from tessera.runtime.distributed import DistributedRunner
from tessera.runtime.pool import WorkerPool
from tessera.weights import unique_state

BATCH, M, PROMPT, CTX, DECODES = 2, 2, 6, 16, 3
VLM_PROMPT, VLM_CTX, VLM_IMAGE = 20, 32, "112x84"
DIFFUSION_WORKLOAD = "images:steps=2,resolution=64x48"
FAMILIES = ("llm", "moe", "ssm", "vlm", "diffusion")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny random models of every family as local model directories (what the planner traces)."""
    root = tmp_path_factory.mktemp("tiny-models")
    out = {}
    for family in FAMILIES:
        folder = root / f"tiny-{family}"
        cfg = tiny_config(family)
        if family == "diffusion":
            for name, d in cfg.items():
                (folder / name).mkdir(parents=True)
                fname = "scheduler_config.json" if name == "scheduler" else "config.json"
                (folder / name / fname).write_text(json.dumps(d))
        else:
            cfg.save_pretrained(folder)
        out[family] = str(folder)
    return out


def _context(model: str, family: str, workers: int):
    from tessera.hardware.cluster import parse_cluster
    from tessera.plan.context import PlanContext
    from tessera.runtime.session import runtime_context
    from tessera.workload import parse_workload

    if family == "diffusion":
        return PlanContext(model, parse_cluster(f"cpu:{workers}"), parse_workload(DIFFUSION_WORKLOAD),
                           DIFFUSION_WORKLOAD, max_batch=BATCH, micro_batches=M, split_experts=False)
    if family == "vlm":
        return runtime_context(model, workers, VLM_PROMPT, DECODES, VLM_CTX, BATCH, M, image=VLM_IMAGE)
    return runtime_context(model, workers, PROMPT, DECODES, CTX, BATCH, M)


@dataclass
class Setup:
    graphs: dict[str, KernelGraph]
    placements: dict[str, list[int]]
    micro_batches: dict[str, int]
    how: str


def _setup(model: str, family: str, workers: int, how: str, seed: int = 0) -> Setup:
    """The graphs and placement of a case: a policy's plan, or a synthetic placement of the same graphs."""
    ctx = _context(model, family, workers)
    if how in ("alternate", "random"):
        graphs = {ph.phase: ctx.graph(ph, ctx.fixed_m(ph)) for ph in ctx.phases}
        return Setup(graphs, {p: synthetic_placement(g, workers, how, seed) for p, g in graphs.items()},
                     {ph.phase: ctx.fixed_m(ph) for ph in ctx.phases}, f"{how} {seed}")
    plan = plan_policy(ctx, how)
    if not plan.applicable:
        pytest.skip(f"{how} does not apply to {family}: {plan.reason}")
    assert plan.feasible, plan.reason
    by_phase = {ph.phase: ph for ph in ctx.phases}
    graphs = {s.phase: ctx.graph(by_phase[s.phase], s.micro_batches) for s in plan.steps}
    for s in plan.steps:
        assert graphs[s.phase].hash == s.graph_hash
    return Setup(graphs, {s.phase: s.assignment for s in plan.steps}, {s.phase: s.micro_batches for s in plan.steps},
                 plan.reason or how)


# ---------------------------------------------------------------------------------------------------------
# Scenarios: per step, the inputs of each micro-batch and its state instance


def _cpu_steps(model: str, graphs: dict[str, KernelGraph]):
    """Eager steps at every graph's shapes (same seeded random weights for every phase)."""
    out = {}
    for phase, g in graphs.items():
        m = g.meta
        res, image = m.get("resolution"), m.get("image")
        out[phase] = make_step(model, phase, batch=m.get("batch"), seq=m.get("seq") if phase == "prefill" else None,
                               ctx=m.get("ctx"), image=tuple(image) if image else None,
                               resolution=tuple(res) if res else None, device="cpu", slots=m.get("slots"))
    return out


def _random_inputs(step, phase: str, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in step.inputs.items():
        t = t.clone()
        if name in ("input_ids", "t5_ids", "clip_ids", "clip2_ids") or (t.dtype == torch.long and name.endswith("ids")
                                                                          and name != "position_ids"):
            t = torch.where(t == 0, torch.randint(1, vocab, t.shape, generator=g), t) if phase == "prefill" else \
                torch.randint(1, vocab, t.shape, generator=g)
        elif t.dtype.is_floating_point:
            t = torch.randn(t.shape, generator=g).to(t.dtype)
        out[name] = t
    return out


def _scenario(family: str, steps, graphs):
    """[(phase, [inputs per micro-batch], [state instances])]; decode inputs depend on the previous logits, so
    decode entries carry None and are filled while running."""
    vocab = 256 if family == "diffusion" else 200
    plan = []
    if family == "diffusion":
        plan.append(("encode", [_random_inputs(steps["encode"], "encode", 1, vocab)], [0]))
        for t in range(2):
            plan.append(("step", [_random_inputs(steps["step"], "step", 10 + t * 2 + c, vocab) for c in range(M)],
                         list(range(M))))
        plan.append(("decode", [_random_inputs(steps["decode"], "decode", 20, vocab)], [0]))
        return plan
    if family == "vlm":
        plan.append(("encode", [_random_inputs(steps["encode"], "encode", 1, vocab)], [0]))
    for c in range(M):  # each request prefilled into its own state instance
        inputs = _random_inputs(steps["prefill"], "prefill", 100 + c, vocab)
        inputs["slots"] = torch.zeros_like(inputs["slots"])
        plan.append(("prefill", [inputs], [c]))
    for _ in range(DECODES):
        plan.append(("decode", None, list(range(M))))
    return plan


def _decode_inputs(step, logits: list[torch.Tensor], t: int, prompt: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for lg in logits:
        inputs = {n: v.clone() for n, v in step.inputs.items()}
        inputs["input_ids"] = lg[:, -1].argmax(-1, keepdim=True)
        inputs["slots"] = torch.zeros_like(inputs["slots"])
        for name in ("positions", "cache_positions"):
            if name in inputs:
                inputs[name] = torch.full_like(inputs[name], prompt + t)
        out.append(inputs)
    return out


def _run(family: str, steps, graphs, runner_step):
    """Play the scenario through ``runner_step(phase, chunks, instances) -> outputs per chunk``; returns every
    step's outputs and the greedy tokens."""
    prompt = VLM_PROMPT if family == "vlm" else PROMPT
    results, tokens, last, t = [], [], None, 0
    for phase, chunks, instances in _scenario(family, steps, graphs):
        if chunks is None:
            chunks = _decode_inputs(steps[phase], last, t, prompt)
            tokens.append([int(c["input_ids"][0, 0]) for c in chunks])
            t += 1
        m = len(chunks) if phase in ("decode", "step") else 1
        outs = []
        for i in range(0, len(chunks), m):
            outs += runner_step(phase, chunks[i: i + m], instances[i: i + m])
        results.append((phase, outs))
        if phase == "prefill":
            last = (last or []) + [o["logits"] for o in outs]
        elif phase == "decode" and family != "diffusion":
            last = [o["logits"] for o in outs]
    return results, tokens


@pytest.fixture(scope="module")
def references(model_dirs):
    """Per family: the graphs' shapes' eager steps, weights and the eager scenario's outputs, state, tokens."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = model_dirs[family]
            setup = _setup(model, family, 2, "alternate")
            steps = _cpu_steps(model, setup.graphs)
            shapes = {n: t for s in steps.values() for n, t in s.state.items()}
            state = [{n: torch.zeros_like(t) for n, t in shapes.items()} for _ in range(M)]

            def eager(phase, chunks, instances):
                step = steps[phase]
                with torch.no_grad():
                    return [{k: v.clone() for k, v in step.fn(c, state[i], step.constants).items()}
                            for c, i in zip(chunks, instances, strict=True)]

            before = torch.get_num_threads()
            torch.set_num_threads(1)  # the workers' thread count
            try:
                results, tokens = _run(family, steps, setup.graphs, eager)
            finally:
                torch.set_num_threads(before)
            weights, _ = unique_state({k: v for s in steps.values() for k, v in s.modules.items()})
            cache[family] = (steps, weights, results, tokens, state)
        return cache[family]

    return get


def _check_case(pool: WorkerPool, model_dirs, references, family: str, workers: int, how: str, seed: int = 0):
    model = model_dirs[family]
    steps, weights, expected, tokens, state = references(family)
    setup = _setup(model, family, workers, how, seed)
    runner = DistributedRunner(pool, setup.graphs, setup.placements, setup.micro_batches, weights=weights,
                               state_instances=M)
    got, got_tokens = _run(family, steps, setup.graphs, runner.step_chunks)
    assert got_tokens == tokens
    for (phase, outs), (ephase, eouts) in zip(got, expected, strict=True):
        assert phase == ephase
        for o, e in zip(outs, eouts, strict=True):
            assert o.keys() == e.keys()
            for name in o:
                assert torch.equal(o[name], e[name]), f"{family} {how}: {phase} output {name} differs"
    final = runner.get_state()
    for i in range(M):
        for name, t in state[i].items():
            if name in final[i]:
                assert torch.equal(final[i][name], t), f"{family} {how}: state {name} of instance {i} differs"
    return runner


CASES_2 = ["tessera", "attention-ffn", "prefill-decode", "layer-pipeline", "alternate", "random"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", CASES_2)
def test_tiny_families_on_two_workers_equal_eager(pool, model_dirs, references, family, how):
    if how == "prefill-decode" and family == "diffusion":
        pytest.skip("a diffusion model has no prefill and decode phases")
    runner = _check_case(pool, model_dirs, references, family, 2, how, seed=7)
    if how == "prefill-decode":
        assert runner.moved_bytes > 0  # the KV / SSM state went from the prefill worker to the decode worker


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how,seed", [("tessera", 0), ("alternate", 0), ("random", 1), ("random", 2)])
def test_tiny_families_on_three_workers_equal_eager(pool, model_dirs, references, family, how, seed):
    _check_case(pool, model_dirs, references, family, 3, how, seed)


def test_runtime_inputs_are_checked(pool, model_dirs, references):
    from tessera.runtime.distributed import RuntimeInputError

    steps, weights, *_ = references("llm")
    setup = _setup(model_dirs["llm"], "llm", 2, "alternate")
    runner = DistributedRunner(pool, setup.graphs, setup.placements, setup.micro_batches, weights=weights,
                               state_instances=M)
    with pytest.raises(RuntimeInputError, match="no graph for phase 'encode'"):
        runner.step("encode", {})
    with pytest.raises(RuntimeInputError, match="inputs .* are missing"):
        runner.step("decode", {"input_ids": torch.zeros(2, 1, dtype=torch.long)})
    with pytest.raises(RuntimeInputError, match="runs 2 micro-batches per step"):
        runner.step_chunks("decode", [steps["decode"].inputs], [0])
    with pytest.raises(RuntimeInputError, match="only 3 workers"):
        DistributedRunner(pool, setup.graphs, {p: [3] * len(g.kernels) for p, g in setup.graphs.items()},
                          weights=weights)


def test_model_dirs_are_plannable(model_dirs):
    assert all(Path(d).is_dir() for d in model_dirs.values())


def test_a_step_moves_exactly_the_state_rows_it_reads(pool, model_dirs):
    """Under prefill-decode the KV a prefill wrote moves to the decode worker when a decode step reads it, and
    only the rows that step reads: a slot prefilled but not decoded stays where it was written, and a second
    decode of the same rows moves nothing (the simulator charges one move per request)."""
    from tessera.runtime.session import runtime_context

    model = model_dirs["llm"]
    ctx = runtime_context(model, 2, PROMPT, DECODES, CTX, 2 * M, M)  # two slots per state instance
    plan = plan_policy(ctx, "prefill-decode")
    by_phase = {ph.phase: ph for ph in ctx.phases}
    graphs = {s.phase: ctx.graph(by_phase[s.phase], s.micro_batches) for s in plan.steps}
    steps = _cpu_steps(model, graphs)
    weights, _ = unique_state({k: v for st in steps.values() for k, v in st.modules.items()})
    runner = DistributedRunner(pool, graphs, {s.phase: s.assignment for s in plan.steps},
                               {s.phase: s.micro_batches for s in plan.steps}, weights=weights, state_instances=M)
    state = [n for n in graphs["decode"].state if n in runner.holder["decode"]]
    assert state and runner._rows(state[0]) == 2
    for slot in (0, 1):  # two requests prefilled into instance 0
        inputs = _random_inputs(steps["prefill"], "prefill", 200 + slot, 200)
        inputs["slots"] = torch.full_like(inputs["slots"], slot)
        runner.step_chunks("prefill", [inputs], [0])
        assert runner.last_moves == []  # the prefill worker fetches nothing: no one else wrote these rows
    decode = {n: v.clone() for n, v in steps["decode"].inputs.items()}
    decode["slots"] = torch.zeros_like(decode["slots"])  # every row of the step decodes request 0 (slot 0)
    m = runner.micro_batches["decode"]
    chunks = [{n: v.clone() for n, v in decode.items()} for _ in range(m)]
    instances = [0] * m
    runner.step_chunks("decode", chunks, instances)
    prefill_worker = next(iter(runner.holder["prefill"].values()))
    decode_worker = next(iter(runner.holder["decode"].values()))
    assert sorted(runner.last_moves) == sorted((n, 0, prefill_worker, decode_worker, (0,)) for n in state)
    runner.step_chunks("decode", chunks, instances)
    assert runner.last_moves == []  # row 0 is on the decode worker now; row 1 was never read, so never moved


def _prompt_in_slot_0(step, seed: int) -> dict[str, torch.Tensor]:
    """A prefill's inputs with a prompt of its own (every token drawn from ``seed``) into slot 0."""
    inputs = _random_inputs(step, "prefill", seed, 200)
    g = torch.Generator().manual_seed(seed)
    inputs["input_ids"] = torch.randint(1, 200, inputs["input_ids"].shape, generator=g)
    inputs["slots"] = torch.zeros_like(inputs["slots"])
    return inputs


def test_a_prefill_fetches_no_rows_of_the_slot_it_reuses(pool, model_dirs):
    """A prefill writes its slot's KV without reading the row's earlier contents (`graph.state_reads`): after
    the decode worker decoded a slot, a new prompt prefilled into it moves nothing back to the prefill worker
    (before, it waited for the decode worker's step in flight and 1 row of KV), and the decode after it reads
    the new prompt's row from the prefill worker and gives exactly what a runner that never used the slot does."""
    from tessera.graph.state_reads import state_read
    from tessera.runtime.session import runtime_context

    model = model_dirs["llm"]
    ctx = runtime_context(model, 2, PROMPT, DECODES, CTX, 2 * M, M)
    plan = plan_policy(ctx, "prefill-decode")
    by_phase = {ph.phase: ph for ph in ctx.phases}
    graphs = {s.phase: ctx.graph(by_phase[s.phase], s.micro_batches) for s in plan.steps}
    assert state_read(graphs["prefill"]) == frozenset()
    assert state_read(graphs["decode"]) == frozenset(graphs["decode"].state)
    steps = _cpu_steps(model, graphs)
    weights, _ = unique_state({k: v for st in steps.values() for k, v in st.modules.items()})

    def runner():
        return DistributedRunner(pool, graphs, {s.phase: s.assignment for s in plan.steps},
                                 {s.phase: s.micro_batches for s in plan.steps}, weights=weights, state_instances=M)

    m = next(s.micro_batches for s in plan.steps if s.phase == "decode")
    decode = {n: v.clone() for n, v in steps["decode"].inputs.items()}
    decode["slots"] = torch.zeros_like(decode["slots"])  # every row decodes the request in slot 0
    decode["positions"] = torch.full_like(decode["positions"], PROMPT)  # after its prompt: attends to its KV
    chunks = [{n: v.clone() for n, v in decode.items()} for _ in range(m)]
    first, second = (_prompt_in_slot_0(steps["prefill"], seed) for seed in (300, 301))

    used = runner()
    used.step_chunks("prefill", [first], [0])
    used.step_chunks("decode", chunks, [0] * m)  # slot 0's row now lives on the decode worker
    used.step_chunks("prefill", [second], [0])
    assert used.last_moves == []  # the reused row is overwritten where the prefill runs: nothing fetched
    reused = used.step_chunks("decode", chunks, [0] * m)
    prefill_worker = next(iter(used.holder["prefill"].values()))
    decode_worker = next(iter(used.holder["decode"].values()))
    state = [n for n in graphs["decode"].state if n in used.holder["decode"]]
    assert sorted(used.last_moves) == sorted((n, 0, prefill_worker, decode_worker, (0,)) for n in state)

    fresh = runner()
    fresh.step_chunks("prefill", [second], [0])
    expected = fresh.step_chunks("decode", chunks, [0] * m)
    for got, want in zip(reused, expected, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_a_push_in_transit_lands_before_a_step_that_overwrites_its_rows_there(pool, model_dirs):
    """A prefill's KV pushed on to the decode worker, and the slot prefilled again *on the decode worker* (another
    objective's prefill placement; its request ended with its prefill) while the first step is in flight: the push
    must be received before that prefill, or it would land after it and overwrite the new prompt's KV with the
    old one at the next decode."""
    from tessera.runtime.session import runtime_context

    model = model_dirs["llm"]
    ctx = runtime_context(model, 2, PROMPT, DECODES, CTX, 2 * M, M)
    plan = plan_policy(ctx, "prefill-decode")
    by_phase = {ph.phase: ph for ph in ctx.phases}
    graphs = {s.phase: ctx.graph(by_phase[s.phase], s.micro_batches) for s in plan.steps}
    steps = _cpu_steps(model, graphs)
    weights, _ = unique_state({k: v for st in steps.values() for k, v in st.modules.items()})
    assignments = {s.phase: list(s.assignment) for s in plan.steps}
    decode_worker = assignments["decode"][0]
    assert set(assignments["decode"]) == {decode_worker} and set(assignments["prefill"]) == {1 - decode_worker}
    graphs["prefill-there"] = graphs["prefill"]  # the same step placed where the decode runs
    assignments["prefill-there"] = [decode_worker] * len(graphs["prefill"].kernels)
    m = next(s.micro_batches for s in plan.steps if s.phase == "decode")
    micro = {s.phase: s.micro_batches for s in plan.steps} | {"prefill-there": 1}

    def runner():
        return DistributedRunner(pool, graphs, assignments, micro, weights=weights, state_instances=M)

    decode = {n: v.clone() for n, v in steps["decode"].inputs.items()}
    decode["slots"] = torch.zeros_like(decode["slots"])
    decode["positions"] = torch.full_like(decode["positions"], PROMPT)  # after its prompt: attends to its KV
    chunks = [{n: v.clone() for n, v in decode.items()} for _ in range(m)]
    old, new = (_prompt_in_slot_0(steps["prefill"], seed) for seed in (310, 311))

    used = runner()
    first = used.submit_chunks("prefill", [old], [0], push_to=("decode",))  # its push is received once it is back
    assert used._transit
    second = used.submit_chunks("prefill-there", [new], [0])  # submitted while the first is still in flight
    assert not used._transit  # the push is received before the step that overwrites its rows there
    used.result(first), used.result(second)
    got = used.step_chunks("decode", chunks, [0] * m)

    fresh = runner()
    fresh.step_chunks("prefill-there", [new], [0])
    want = fresh.step_chunks("decode", chunks, [0] * m)
    for g, w in zip(got, want, strict=True):
        for name in w:
            assert torch.equal(g[name], w[name]), name
