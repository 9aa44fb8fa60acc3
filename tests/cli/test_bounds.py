"""Hostile sizes and output paths: every size a user types is bounded before anything is allocated, traces
beyond the host's budget are refused before the build, and output paths are checked before the work."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera.capture.budget import TraceBudgetError, check_trace_budget, estimate_trace
from tessera.capture.models import check_sizes, load_config, resolve_model
from tessera.capture.phases import resolve_shape
from tessera.capture.tiny import tiny_config
from tessera.cli.main import app
from tessera.cli.outputs import OutputPathError, check_output_folder
from tessera.graph.ir import KernelGraph
from tessera.hardware.cluster import parse_cluster
from tessera.hardware.devices import resolve_device
from tessera.limits import LimitError
from tessera.plan.config import PlanConfig
from tessera.runtime.profiler import check_counts, resolve_target
from tessera.serve.config import ServeConfig
from tessera.sim.config import SimulationConfig
from tessera.workload import parse_workload

SMOLLM2 = Path(__file__).resolve().parents[2] / "src" / "tessera" / "capture" / "catalog" / "smollm2-135m"

# Runs one command in a child process and prints its wall time and the child's peak RSS (KiB on Linux).
_MEASURE = """
import resource, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)
wall = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(repr((p.returncode, p.stderr, wall, rss)))
"""


def _measured(*args: str) -> tuple[int, str, float, int]:
    """(exit code, stderr, wall seconds, peak RSS KiB) of `tessera ARGS` in a fresh process."""
    tessera = [sys.executable, "-c", "from tessera.cli.main import main; main()"]
    out = subprocess.run([sys.executable, "-c", _MEASURE, *tessera, *args], capture_output=True, text=True,
                         timeout=150, check=True).stdout
    return eval(out)  # noqa: S307 - our own repr of a tuple


def _model_dir(folder: Path, **changes) -> Path:
    """smollm2-135m's published config with ``changes``, as a local model directory."""
    config = json.loads((SMOLLM2 / "config.json").read_text()) | changes
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_a_cluster_of_a_hundred_million_gpus_is_refused_at_once_in_bounded_memory():
    code, stderr, wall, rss_kib = _measured("plan", "smollm2-135m", "--cluster", "A100:99999999")
    print(f"tessera plan smollm2-135m --cluster A100:99999999: exit {code}, {wall:.2f} s, peak RSS "
          f"{rss_kib / 1024:.0f} MiB")
    assert code == 2, stderr
    assert "99,999,999 is beyond Tessera's limit of 4,096 devices in a cluster" in stderr
    assert "Traceback" not in stderr
    # before the bound it grew past 2.4 GB in 30 s and was killed for memory; now it is start-up only
    assert wall < 60 and rss_kib < 1024 * 1024


def test_cluster_limits_in_shorthand_and_in_files(tmp_path):
    with pytest.raises(LimitError, match=r"'cpu:65'.*65 is beyond Tessera's limit of 64 cpu workers"):
        parse_cluster("cpu:65")
    with pytest.raises(LimitError, match="4,097 is beyond Tessera's limit of 4,096 devices"):
        parse_cluster("A100:4000,L40S:97")
    with pytest.raises(LimitError, match=r"\(5000 digits\) is beyond"):
        parse_cluster("A100:" + "9" * 5000)  # int() itself would refuse to convert it
    with pytest.raises(LimitError, match="limit of 64 cpu workers"):
        resolve_device("cpu:1000")
    path = tmp_path / "big.yaml"
    path.write_text("nodes:\n" + "".join("  - devices: {A100: 1024}\n" for _ in range(5)))
    with pytest.raises(LimitError, match=r"big.yaml: nodes\[0..4\]: 5,120 is beyond"):
        parse_cluster(path)
    assert len(parse_cluster("A100:4096").devices) == 4096  # the limit itself is allowed


def test_a_hidden_size_of_four_million_is_refused_before_the_build(tmp_path):
    model = _model_dir(tmp_path / "huge", hidden_size=4_096_000, num_attention_heads=8, num_key_value_heads=4)
    result = _invoke("trace", str(model))
    assert result.exit_code == 2, result.output
    assert "field 'hidden_size': 4,096,000 is beyond Tessera's limit of 262,144 for a layer's width" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(("field", "value", "limit"), [
    ("num_hidden_layers", 5000, "1,024 layers"),
    ("num_attention_heads", 8192, "4,096 heads"),
    ("vocab_size", 2**23, "4,194,304 vocabulary entries"),
    ("max_position_embeddings", 2**25, "16,777,216 tokens"),
])
def test_each_config_size_limit(tmp_path, field, value, limit):
    model = _model_dir(tmp_path / "m", **{field: value})
    with pytest.raises(LimitError, match=f"field '{field}': {value:,} is beyond Tessera's limit of {limit}"):
        load_config(resolve_model(str(model)))


def test_nested_and_expert_fields_are_checked_too():
    with pytest.raises(LimitError, match=r"field 'vision_config.depth': 2,000 is beyond .* 1,024 layers"):
        check_sizes({"vision_config": {"depth": 2000}}, "cfg.json")
    with pytest.raises(LimitError, match="field 'num_local_experts': 5,000 is beyond .* 4,096 experts"):
        check_sizes({"num_local_experts": 5000}, "cfg.json")
    with pytest.raises(LimitError, match="field 'block_out_channels'"):
        check_sizes({"block_out_channels": [128, 2**19]}, "cfg.json")


def test_sizes_within_every_limit_whose_product_the_host_cannot_hold_are_refused_by_the_budget(tmp_path):
    # every field within its limit, but the embedding alone is 2^22 x 2^18 bf16 = 2 TiB
    model = _model_dir(tmp_path / "wide", hidden_size=2**18, num_attention_heads=1024, num_key_value_heads=1024,
                       vocab_size=2**22, intermediate_size=2**18, num_hidden_layers=1)
    result = _invoke("trace", str(model))
    assert result.exit_code == 2, result.output
    assert "its largest weight would take 2,048.0 GiB, beyond what this host can reserve" in result.output
    # on the CPU the whole step counts: a cache of 64 rows x 65,536 tokens of smollm2 is 45 GiB
    spec = resolve_model("smollm2-135m")
    config = load_config(spec)
    shape = resolve_shape(spec, config, "decode", batch=64, ctx=8192)
    estimate = estimate_trace("llm", config, "decode", shape)
    check_trace_budget(spec.name, estimate, "meta")  # nothing is allocated on meta
    with pytest.raises(TraceBudgetError, match=r"on cpu would hold about .* GiB .* beyond the 4.0 GiB"):
        check_trace_budget(spec.name, estimate, "cpu")


def test_catalog_models_fit_the_budget_at_their_default_shapes():
    for name, phase in (("qwen3-235b-a22b", "decode"), ("qwen2.5-vl-7b", "encode"), ("sd3.5-medium", "step"),
                        ("mamba-codestral-7b", "prefill")):
        spec = resolve_model(name)
        config = ({c: load_config(spec, c) for c in spec.components if c != "scheduler"}
                  if spec.family == "diffusion" else load_config(spec))
        shape = resolve_shape(spec, None if spec.family == "diffusion" else config, phase)
        estimate = estimate_trace(spec.family, config, phase, shape)
        check_trace_budget(name, estimate, "meta")
        assert estimate.weight_bytes > 1e9 and estimate.kernels > 100


def test_shape_and_option_limits():
    spec = resolve_model("smollm2-135m")
    with pytest.raises(LimitError, match="--batch: 65,537 is beyond Tessera's limit of 65,536 rows in a batch"):
        resolve_shape(spec, None, "decode", batch=65_537)
    with pytest.raises(LimitError, match="--ctx: 16,777,217 is beyond .* tokens"):
        resolve_shape(spec, load_config(spec), "decode", ctx=2**24 + 1)
    with pytest.raises(LimitError, match="--seq"):
        resolve_shape(spec, None, "prefill", seq=2**25)
    with pytest.raises(LimitError, match="--max-batch: 100,000 is beyond"):
        PlanConfig("smollm2-135m", "A100:1", max_batch=100_000).check()
    with pytest.raises(LimitError, match="--max-context: 33,554,432 is beyond"):
        SimulationConfig(PlanConfig("smollm2-135m", "A100:1"), max_context=2**25).check()
    with pytest.raises(LimitError, match="--slots: 1,000,000 is beyond"):
        ServeConfig(model="smollm2-135m", cluster="cpu:1", slots=1_000_000).check()
    with pytest.raises(LimitError, match="--threads: 5,000 is beyond Tessera's limit of 1,024 threads"):
        resolve_target("cpu", 5000)
    with pytest.raises(LimitError, match="--repeats: 1,000,000 is beyond .* calls of each kernel"):
        check_counts(3, 1_000_000)
    result = _invoke("trace", "qwen2.5-vl-7b", "--phase", "encode", "--image", "20000x504")
    assert result.exit_code == 2 and "20,000 is beyond Tessera's limit of 16,384 pixels" in result.output


def test_workload_limits():
    with pytest.raises(LimitError, match=r"workload 'fixed:in=99999999,out=8', in: 99,999,999 is beyond"):
        parse_workload("fixed:in=99999999,out=8")
    with pytest.raises(LimitError, match="requests: 2,000,000 is beyond .* requests"):
        parse_workload("fixed:in=8,out=8,requests=2000000")
    with pytest.raises(LimitError, match="steps: 20,000 is beyond .* denoising steps"):
        parse_workload("images:steps=20000,resolution=1024")
    with pytest.raises(LimitError, match="resolution: 99,999 is beyond"):
        parse_workload("images:steps=28,resolution=1024x99999")
    assert parse_workload("fixed:in=16777216,out=1,requests=1").input == 2**24


def test_plan_into_an_existing_folder_is_refused_before_planning(tmp_path):
    t0 = time.perf_counter()
    result = _invoke("plan", "smollm2-135m", "--cluster", "A100:1", "-o", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert f"--output {tmp_path}: is an existing folder, not a file; give a file path, e.g. {tmp_path}/plan.json" \
        in result.output
    assert time.perf_counter() - t0 < 10  # nothing was traced or solved
    (tmp_path / "file").write_text("")
    result = _invoke("trace", "smollm2-135m", "--output", str(tmp_path / "file" / "g.json"))
    assert result.exit_code == 2 and "is a file, not a folder" in result.output
    with pytest.raises(OutputPathError, match="is an existing file, not a folder"):
        check_output_folder(tmp_path / "file", "--output")


def test_trace_output_into_missing_folders_creates_them(tmp_path):
    target = tmp_path / "missing" / "dir" / "g.json"
    result = _invoke("trace", "smollm2-135m", "--batch", "2", "--output", str(target))
    assert result.exit_code == 0, result.output
    assert f"created folder {target.parent}" in result.output
    assert KernelGraph.load(target).kernels


def test_plan_compare_json_writes_nothing_unasked(tmp_path, monkeypatch):
    model = tmp_path / "model" / "tiny-llm"
    tiny_config("llm").save_pretrained(model)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = _invoke("plan", str(model), "--cluster", "A100:1,L40S:1", "--workload", "fixed:in=32,out=8,requests=4",
                     "--max-batch", "4", "--compare", "--json")
    assert result.exit_code == 0, result.output
    assert [e["policy"] for e in json.loads(result.stdout)][-1] == "tessera"
    result = _invoke("census", str(model), "--devices", "A100,L40S", "--phase", "decode", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plot"] is None
    assert list(cwd.iterdir()) == []  # before, plan wrote tessera-plan.json (+ PNG) and census a PNG here
