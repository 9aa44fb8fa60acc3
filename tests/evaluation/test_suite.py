"""`tessera evaluate`: the suite on tiny models (every section), the report it writes, and bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.evaluation.config import SECTIONS, SuiteConfig, SuiteError, check_sections, split_pair
from tessera.evaluation.report import write_report
from tessera.evaluation.suite import run_suite
from tessera.hardware.devices import resolve_device

runner = CliRunner()
POLICIES = ("homogeneous", "prefill-decode", "attention-ffn", "layer-pipeline")  # no MILP search: fast


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from tessera.capture.tiny import tiny_config

    root = tmp_path_factory.mktemp("models")
    paths = {}
    for family in ("llm", "ssm"):
        paths[family] = str(root / f"tiny-{family}")
        config = tiny_config(family)
        if family == "llm":  # the simulator's context buckets start at 256 tokens
            config.max_position_embeddings = 8192
        config.save_pretrained(paths[family])
    lengths = root / "lengths.json"
    lengths.write_text(json.dumps([[24, 8], [40, 12], [16, 20], [56, 6], [32, 16], [48, 10]]))
    return paths, str(lengths)


@pytest.fixture(scope="module")
def suite(tiny_models, tmp_path_factory):
    paths, lengths = tiny_models
    llm, ssm = paths["llm"], paths["ssm"]
    config = SuiteConfig.quick(models=(llm, ssm), llm_workload="fixed:in=32,out=16,requests=16", max_batch=8,
                               online_models=(llm,), online_lengths=lengths, online_requests=16,
                               bisection_steps=1, clusters=((llm, "A100:2,L40S:1"),), network_models=(llm,),
                               bandwidths_gbps=(25, 200), policies=POLICIES)
    assert config.pairs == ("A100+L40S",) and config.budget_s > 0
    lines = []
    result = run_suite(config, SECTIONS, progress=lines.append, jobs=2)  # tasks in two worker processes
    folder = tmp_path_factory.mktemp("report")
    written = write_report(result, folder, "tessera evaluate --test")
    return result, written, folder, lines, paths


def test_the_report_has_every_section_and_plot(suite):
    result, written, folder, lines, _ = suite
    assert set(written) == {"README.md", "results.json", "offline_throughput.png", "per_cost.png",
                            "online_latency.png", "clusters.png", "network.png", "pair_vs_two.png"}
    for path in written.values():
        assert path.parent == folder and path.stat().st_size > 1000
    text = (folder / "README.md").read_text()
    head = text.splitlines()[:8]
    assert head[0].startswith("# ") and "predicted" in head[0]
    assert "tessera evaluate --test" in head  # the command that regenerates it comes first
    assert "No GPU was used" in text and "prediction, not a measurement" in text
    for title in ("Offline throughput", "Throughput per cost", "Online serving", "Clusters", "Network sensitivity",
                  "two of its expensive GPU"):
        assert title in text
    for png in ("offline_throughput.png", "per_cost.png", "online_latency.png", "network.png", "pair_vs_two.png"):
        assert f"]({png})" in text
    data = json.loads((folder / "results.json").read_text())
    assert data["sections"] == list(SECTIONS) and data["seconds"]["total"] > 0
    assert lines == ["4 tasks on 2 worker processes"] and not result.skipped and result.jobs == 2
    assert set(result.seconds) == {*SECTIONS, "total"}


def test_offline_cases_are_consistent(suite):
    result, _, folder, _, paths = suite
    assert [(c.model, c.cluster) for c in result.offline] == [(paths["llm"], "A100+L40S"), (paths["ssm"], "A100+L40S")]
    for case in result.offline:
        assert case.expensive == "A100"
        alone = case.run("homogeneous", "A100")
        assert alone.ok and alone.per_cost_vs_expensive == pytest.approx(1.0)
        assert alone.cost_per_hour == resolve_device("A100").price("relative")
        for r in case.runs:
            if r.ok:
                assert r.simulated > 0 and r.planned > 0 and r.completed == 16 and r.rejected == 0
                assert r.per_cost_vs_expensive == pytest.approx(
                    (r.simulated / r.cost_per_hour) / (alone.simulated / alone.cost_per_hour))
    ssm = result.offline[1]
    assert ssm.run("attention-ffn").status == "n/a" and ssm.run("attention-ffn").simulated is None
    row = next(line for line in (folder / "README.md").read_text().splitlines()
               if line.startswith(f"| {paths['ssm']} |"))
    assert "n/a" in row


def test_online_rates_and_tails(suite):
    result, *_ = suite
    (case,) = result.online
    assert case.expensive == "A100" and case.fixed_rate and case.fixed_rate > 0
    for r in case.runs:
        assert r.status == "ok" and r.samples
        lo, hi = r.bracket
        assert lo is None or all(lat <= 0.05 for x, lat in r.samples if x <= lo)
        if lo is not None and hi is not None:  # the lowest miss: above the target, or above the plan's capacity
            assert lo < hi and (any(lat > 0.05 for x, lat in r.samples if x == hi)
                                or hi * case.mean_output > r.planned)
        assert lo is None or lo * case.mean_output <= r.planned * (1 + 1e-9)  # never above what the plan processes
        assert r.at_fixed is not None and r.at_fixed["ttft_p99_s"] > 0
    alone = next(r for r in case.runs if r.policy == "homogeneous" and r.device == "A100")
    assert case.fixed_rate <= alone.sustained_rps


def test_clusters_network_and_two_gpus(suite):
    result, *_ = suite
    (cl,) = result.clusters
    assert "A100:2 + L40S:1" in cl.described and any(r.ok for r in cl.runs)
    (net,) = result.network
    assert sorted(net.points) == [25.0, 200.0]
    assert net.points[200.0] is result.offline[0].runs  # the shorthand's own 200 Gb/s: the offline case, reused
    homo = [next(r for r in net.points[g] if r.policy == "homogeneous" and r.device == "L40S") for g in (25, 200)]
    assert homo[0].simulated == pytest.approx(homo[1].simulated)  # one GPU alone never uses the network
    assert len(result.two_gpus) == 2
    for e in result.two_gpus:
        assert e.expensive == "A100" and e.two.device == "A100"
        assert e.two.cost_per_hour == pytest.approx(2 * resolve_device("A100").price("relative"))
        assert e.status == "ok" and e.pair is e.best and e.best.ok  # no Tessera plan: the best one is compared
        assert e.best.simulated == max(r.simulated for c in result.offline if c.model == e.model
                                       for r in c.runs if r.ok)


def test_sections_and_pairs_are_checked():
    assert check_sections(None) == SECTIONS
    assert check_sections(["network", "offline"]) == ("offline", "network")
    with pytest.raises(SuiteError, match="unknown section 'bogus'"):
        check_sections(["bogus"])
    assert split_pair("a100+l40s") == ("A100", "L40S")
    for bad, msg in (("A100", "TYPE\\+TYPE"), ("A100+A100", "different types"), ("A100+Z9", "Z9")):
        with pytest.raises(SuiteError, match=msg):
            split_pair(bad)
    with pytest.raises(SuiteError, match="bisection"):
        SuiteConfig(bisection_steps=-1).check()
    with pytest.raises(SuiteError, match="bandwidths"):
        SuiteConfig(bandwidths_gbps=(0,)).check()
    with pytest.raises(SuiteError, match="serves images"):
        SuiteConfig(online_models=("sd3.5-medium",)).check()


@pytest.mark.parametrize("args, message", [
    (["--only", "bogus"], "unknown section 'bogus'"),
    (["--pairs", "A100"], "TYPE+TYPE"),
    (["--pairs", "A100+A100"], "different types"),
    (["--models", "no-such-model"], "no-such-model"),
    (["--prices", "free"], "relative or cloud_usd"),
    (["--policies", "fastest"], "unknown policy 'fastest'"),
    (["--online-requests", "0"], "at least 1"),
    (["--budget", "0"], "budget must be positive"),
])
def test_bad_input_exits_2_before_any_planning(tmp_path, args, message):
    r = runner.invoke(app, ["evaluate", "-o", str(tmp_path / "out"), *args])
    assert r.exit_code == 2, r.output
    assert message in r.stderr
    assert not (tmp_path / "out").exists()


def test_the_report_names_the_command_that_regenerates_it():
    from pathlib import Path

    from tessera.cli.evaluate import _command

    assert _command(Path("docs/results"), None, False, None, None, None, None, None, "relative") == \
        ".venv/bin/tessera evaluate -o docs/results"
    assert _command(Path("out dir"), ["online"], True, "a,b", None, "homogeneous", 40, 300.0, "cloud_usd") == \
        (".venv/bin/tessera evaluate -o 'out dir' --only online --quick --models a,b --policies homogeneous "
         "--online-requests 40 --budget 300 --prices cloud_usd")
