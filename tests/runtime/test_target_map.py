"""The placement a policy plans for a GPU pair (A100 + L40S: that pair's cost model, the run's own graphs) run on
two cpu workers standing in for the GPUs: target i on cpu:i, outputs `torch.equal` to one eager process, the
transfers and state moves counted as the programs contain them, and the refusals (target count against worker
count, cpu clusters, request-dist replicas, options that do not combine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tessera.capture.phases import make_step
from tessera.capture.tiny import tiny_config
from tessera.cli.main import app
from tessera.plan.deployment import PlanFileError
from tessera.plan.planner import plan_policy
from tessera.runtime.config import RunConfig, RunSetupError
from tessera.runtime.distributed import DistributedRunner
from tessera.runtime.session import (
    describe_made,
    placement_for,
    plan_file_placement,
    runtime_context,
    runtime_graphs,
)
from tessera.runtime.target_map import TargetMapError
from tessera.weights import unique_state

PAIR = "A100:1,L40S:1"
PROMPT, CTX, NEW = 6, 16, 3
VOCAB = 200  # below the tiny llm's vocabulary


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llm as a local model directory, its runtime graphs (batch 1, M 1), eager steps at those
    shapes and their weights."""
    folder = tmp_path_factory.mktemp("pair") / "tiny-llm"
    tiny_config("llm").save_pretrained(folder)
    model = str(folder)
    graphs = runtime_graphs(model, PROMPT, CTX)
    steps = {ph: make_step(model, ph, batch=1, seq=PROMPT if ph == "prefill" else None, ctx=CTX, device="cpu")
             for ph in graphs}
    weights, _ = unique_state({k: v for s in steps.values() for k, v in s.modules.items()})
    return model, graphs, steps, weights


def _generate(step, steps) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Greedy: a prefill of fixed random ids, then NEW - 1 decode steps fed by the argmax; every step's outputs."""
    inputs = {n: v.clone() for n, v in steps["prefill"].inputs.items()}
    inputs["input_ids"] = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    inputs["slots"] = torch.zeros_like(inputs["slots"])
    out = [("prefill", step("prefill", inputs))]
    for t in range(NEW - 1):
        inputs = {n: v.clone() for n, v in steps["decode"].inputs.items()}
        inputs["input_ids"] = out[-1][1]["logits"][:, -1].argmax(-1, keepdim=True)
        inputs["positions"] = torch.full_like(inputs["positions"], PROMPT + t)
        inputs["slots"] = torch.zeros_like(inputs["slots"])
        out.append(("decode", step("decode", inputs)))
    return out


@pytest.fixture(scope="module")
def eager(tiny):
    """The tiny model's steps in this process, eagerly, at 1 thread (the workers' count)."""
    _, _, steps, _ = tiny
    state = {n: torch.zeros_like(t) for s in steps.values() for n, t in s.state.items()}

    def step(phase, inputs):
        with torch.no_grad():
            return {k: v.clone() for k, v in steps[phase].fn(inputs, state, steps[phase].constants).items()}

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _generate(step, steps)
    finally:
        torch.set_num_threads(before)


def _run_pair(pool, tiny, eager, policy: str) -> DistributedRunner:
    model, graphs, steps, weights = tiny
    placed = placement_for(model, graphs, 2, PAIR, policy, NEW)
    assert "run on stand-in workers A100 -> cpu:0, L40S -> cpu:1" in placed.how
    runner = DistributedRunner(pool, graphs, placed.placements, placed.micro_batches, weights=weights)
    sent: dict[str, list[int]] = {}

    def step(phase, inputs):
        out = runner.step(phase, inputs, trace=True)
        sent.setdefault(phase, []).append(sum(1 for tl in runner.last_timing.timelines for e in tl if e[0] == "send"))
        return out

    got = _generate(step, steps)
    for (phase, o), (ephase, e) in zip(got, eager, strict=True):
        assert phase == ephase and o.keys() == e.keys()
        for name in o:
            assert torch.equal(o[name], e[name]), f"{policy}: {phase} output {name} differs from one process"
    for phase, per_step in sent.items():  # what the workers sent is what the programs hold, and what is counted
        sp = runner.programs[phase]
        assert per_step == [len(sp.transfers)] * len(per_step)
        made = runner.made[phase]
        assert (made.steps, made.messages, made.nbytes) == (len(per_step), sum(per_step), len(per_step) * sp.cut_bytes)
    return runner


def test_prefill_decode_for_the_pair_moves_the_cache_and_equals_one_process(pool, tiny, eager):
    runner = _run_pair(pool, tiny, eager, "prefill-decode")
    assert set(runner.placements["prefill"]) == {0} and set(runner.placements["decode"]) == {1}  # A100, L40S
    assert runner.moves_made > 0 and runner.moved_bytes > 0
    assert f"{runner.moves_made} state moves, {runner.moved_bytes / 1e3:.1f} kB" in describe_made(runner)


def test_attention_ffn_for_the_pair_transfers_within_steps_and_equals_one_process(pool, tiny, eager):
    runner = _run_pair(pool, tiny, eager, "attention-ffn")
    for phase in ("prefill", "decode"):
        assert set(runner.placements[phase]) == {0, 1}
        assert runner.made[phase].messages > 0
    line = describe_made(runner)
    made = runner.made["decode"]
    assert f"decode {made.steps} steps, {made.messages} messages, {made.nbytes / 1e3:.1f} kB" in line


def test_a_homogeneous_target_runs_on_its_own_worker(tiny):
    model, graphs, _, _ = tiny
    placed = placement_for(model, graphs, 2, PAIR, "homogeneous", NEW, device="L40S")
    assert all(set(a) == {1} for a in placed.placements.values())  # L40S is the second target: cpu:1


def test_a_plan_file_for_the_pair_maps_the_same_and_checks_the_worker_count(tiny, tmp_path):
    model, graphs, _, _ = tiny
    pctx = runtime_context(model, 2, PROMPT, NEW, CTX, cluster=PAIR)
    plan = plan_policy(pctx, "prefill-decode")
    path = tmp_path / "pair.json"
    plan.save(path)
    placed = plan_file_placement(path, graphs, 2, model, NEW)
    assert placed.placements == placement_for(model, graphs, 2, PAIR, "prefill-decode", NEW).placements
    assert "run on stand-in workers A100 -> cpu:0, L40S -> cpu:1" in placed.how
    with pytest.raises(TargetMapError, match=r"has 2 targets \(A100, L40S\).*--cluster has 3 workers; use --cluster "
                                            r"cpu:2"):
        plan_file_placement(path, graphs, 3, model, NEW)


def test_a_request_dist_plan_with_replicas_is_refused(tiny, tmp_path):
    model, graphs, _, _ = tiny
    pctx = runtime_context(model, 2, PROMPT, NEW, CTX, batch=4, cluster=PAIR)
    plan = plan_policy(pctx, "request-dist")
    assert len(plan.extra["replicas"]) == 2
    path = tmp_path / "request-dist.json"
    plan.save(path)
    with pytest.raises(PlanFileError, match="divides the batch among 2 replicas"):
        plan_file_placement(path, graphs, 2, model, NEW)


def test_a_route_mix_for_another_model_is_refused(tiny):
    model, graphs, _, _ = tiny
    mix = Path(__file__).resolve().parents[1] / "fixtures" / "plans" / "smollm2-135m_A100_L40S_mix.json"
    with pytest.raises(PlanFileError, match=f"is a plan for smollm2-135m, not for {model}"):
        plan_file_placement(mix, graphs, 2, model, NEW)


@pytest.mark.parametrize("change,message", [
    ({"cluster": "cpu:3"}, r"A100:1 \+ L40S:1 .* has 2 placement targets \(A100, L40S; one per device type\) and "
                           r"each runs on one cpu worker, but --cluster has 3 workers; use --cluster cpu:2"),
    ({"placement_for": "cpu:2"}, "has cpu workers: plan for the workers themselves with --policy"),
    ({"placement": "alternate"}, "does not combine with --plan or --placement"),
    ({"profile_file": "p.json"}, "--placement-for plans with the cost model of the cluster it names"),
])
def test_runs_that_cannot_stand_in_for_the_pair_are_refused(change, message):
    config = RunConfig("smollm2-135m", **({"placement_for": PAIR} | change))
    with pytest.raises((RunSetupError, TargetMapError), match=message):
        config.check()


def test_the_run_option_reaches_the_placement(tiny):
    """`tessera run --placement-for` (a RunConfig) places through placement_for, with no host profile."""
    from tessera.runtime.launch import _placement

    model, graphs, _, _ = tiny
    config = RunConfig(model, policy="prefill-decode", placement_for=PAIR)
    placed = _placement(config, graphs, 2, 1, lambda s: None)
    assert placed.placements == placement_for(model, graphs, 2, PAIR, "prefill-decode", NEW).placements
    result = CliRunner().invoke(app, ["run", "smollm2-135m", "--cluster", "cpu:3", "--placement-for", PAIR,
                                      "--prompt", "Hello"])
    assert result.exit_code == 2 and "use --cluster cpu:2" in " ".join(result.output.split()), result.output


def test_smollm2_under_tessera_for_the_pair_splits_and_matches_one_process(pool):
    """The demo's run, shortened to 2 tokens: Tessera's own placement for A100 + L40S (unmodified) splits the
    step over the two workers; the workers send what the programs hold and the tokens equal one process."""
    from tessera.capture.eager import EagerRunner
    from tessera.capture.models import resolve_model
    from tessera.capture.pretrained import load_pretrained, load_tokenizer
    from tessera.runtime.generate import Sampling, generate
    from tessera.runtime.session import cache_context, weight_files

    model, new = "smollm2-135m", 2
    tokenizer = load_tokenizer(resolve_model(model))
    ids = tokenizer("The capital of France is").input_ids
    ctx = cache_context(len(ids), new)
    graphs = runtime_graphs(model, len(ids), ctx)
    placed = placement_for(model, graphs, 2, PAIR, "tessera", new)
    runner = DistributedRunner(pool, graphs, placed.placements, placed.micro_batches, weights_path=weight_files(model))
    sent = []

    def step(phase, inputs):
        out = runner.step(phase, inputs, trace=True)
        sent.append((phase, sum(1 for tl in runner.last_timing.timelines for e in tl if e[0] == "send")))
        return out

    tokens = generate(step, ids, new, tokenizer.eos_token_id, Sampling(0.0, 1.0, 0))
    spec, module, values = load_pretrained(model)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = generate(EagerRunner(spec, module, values, slots=1, ctx=ctx), ids, new, tokenizer.eos_token_id,
                            Sampling(0.0, 1.0, 0))
    finally:
        torch.set_num_threads(before)
    assert tokens == expected and tokenizer.decode(tokens) == " Paris."
    for phase in ("prefill", "decode"):
        sp = runner.programs[phase]
        assert {0, 1} <= set(sp.placement) and sp.transfers, f"{phase}: {placed.how}"
    assert sent == [(ph, len(runner.programs[ph].transfers)) for ph in ("prefill", "decode")]
    counts = [(len(runner.programs[ph].transfers), runner.programs[ph].cut_bytes) for ph in ("prefill", "decode")]
    plural = ["s" if n != 1 else "" for n, _ in counts]
    assert describe_made(runner) == (f"transfers made: prefill 1 step, {counts[0][0]} message{plural[0]}, "
                                     f"{counts[0][1] / 1e3:.1f} kB; decode 1 step, {counts[1][0]} message{plural[1]}, "
                                     f"{counts[1][1] / 1e3:.1f} kB; no state moves")
