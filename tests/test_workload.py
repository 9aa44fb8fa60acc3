"""The workload grammar: fixed, offline, poisson (lengths from a file) and images specs, and their errors."""

from __future__ import annotations

import json

import pytest

from tessera.workload import (
    DEFAULT_REQUESTS,
    LENGTHS_DIR,
    OFFLINE_REQUESTS,
    FixedWorkload,
    ImagesWorkload,
    OfflineWorkload,
    PoissonWorkload,
    WorkloadError,
    default_workload,
    draw_requests,
    load_lengths,
    parse_workload,
    shipped_lengths,
)


def test_fixed_and_images():
    assert parse_workload("fixed:in=1024,out=1024,requests=192") == FixedWorkload(1024, 1024, 192)
    assert parse_workload("fixed:in=8,out=4") == FixedWorkload(8, 4, DEFAULT_REQUESTS)
    assert parse_workload("images:steps=28,resolution=1024") == ImagesWorkload(28, (1024, 1024), DEFAULT_REQUESTS)
    assert parse_workload("images:steps=4,resolution=768x512,requests=3").resolution == (768, 512)


def test_poisson_with_a_csv_trace(tmp_path):
    trace = tmp_path / "conv.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1020,129\n1,300,20\n2,2000,400\n")
    w = parse_workload(f"poisson:rate=4,lengths={trace},requests=10")
    assert isinstance(w, PoissonWorkload) and w.rate == 4.0 and w.requests == 10
    assert w.lengths.median == (1020.0, 129.0) and w.lengths.name == "conv"
    sample = w.lengths.sample(100, seed=1)
    assert len(sample) == 100 and set(sample) <= {(1020, 129), (300, 20), (2000, 400)}
    assert sample == w.lengths.sample(100, seed=1)


def test_shipped_azure_conv():
    """The Azure 2023 conversation trace: 19366 requests, median 1020 prompt and 129 generated tokens."""
    w = parse_workload("poisson:rate=4,lengths=azure-conv")
    d = w.lengths
    assert d.name == "azure-conv" and len(d.inputs) == len(d.outputs) == 19366
    assert d.median == (1020.0, 129.0)
    assert (d.inputs[:3], d.outputs[:3]) == ((374, 396, 879), (44, 109, 55))  # the trace's first rows
    assert (min(d.inputs), max(d.inputs), min(d.outputs), max(d.outputs)) == (2, 14050, 7, 1000)
    assert round(sum(d.inputs) / len(d.inputs), 1) == 1154.7 and round(sum(d.outputs) / len(d.outputs), 1) == 211.1
    assert shipped_lengths() == {"azure-conv": LENGTHS_DIR / "azure-conv.csv"}


def test_a_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "azure-conv").write_text("input,output\n5,6\n")
    assert load_lengths("azure-conv").inputs == (5,)


def test_lengths_from_json(tmp_path):
    f = tmp_path / "l.json"
    f.write_text(json.dumps([[10, 2], [20, 4]]))
    assert load_lengths(str(f)).inputs == (10, 20)


@pytest.mark.parametrize("spec,expected", [
    ("batch:in=1", "KIND one of fixed, offline, poisson, images"),
    ("fixed", "KIND one of"),
    ("fixed:in=1024", "fixed needs out"),
    ("fixed:in=1024,out=x", "out='x' is not a whole number"),
    ("fixed:in=0,out=1", "in must be at least 1"),
    ("fixed:in=1,out=1,seq=3", "unknown key 'seq'"),
    ("fixed:in=1,in=2,out=1", "in is given twice"),
    ("fixed:in=1,out", "'out' is not KEY=VALUE"),
    ("poisson:rate=-1,lengths=x.csv", "rate must be positive"),
    ("poisson:rate=4,lengths=azure-chat", "no shipped distribution of that name (shipped: azure-conv)"),
    ("images:steps=28,resolution=big", "resolution='big' must be N or WxH"),
])
def test_bad_specs(spec, expected):
    with pytest.raises(WorkloadError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        parse_workload(spec)


def test_bad_lengths_files(tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text("a,b\n1,2\n")
    with pytest.raises(WorkloadError, match="input and an output column"):
        load_lengths(str(f))
    f.write_text("input,output\n1,0\n")
    with pytest.raises(WorkloadError, match="at least 1"):
        load_lengths(str(f))
    f.write_text("input,output\n")
    with pytest.raises(WorkloadError, match="no requests"):
        load_lengths(str(f))
    j = tmp_path / "bad.json"
    j.write_text('[["x", 1]]')
    with pytest.raises(WorkloadError, match="whole-number"):
        load_lengths(str(j))


def test_offline_workload_draws_prompts_and_fixes_outputs():
    w = parse_workload("offline:prompts=azure-conv,out=384,requests=50")
    assert isinstance(w, OfflineWorkload) and w.output == 384 and w.requests == 50
    drawn = draw_requests(w, seed=3)
    assert len(drawn) == 50 and all(t == 0.0 and out == 384 for t, _, out in drawn)
    inputs = [a for _, a, _ in drawn]
    assert inputs == [a for a, _ in w.lengths.sample(50, 3)] and len(set(inputs)) > 10
    assert parse_workload("offline:prompts=azure-conv,out=8").requests == OFFLINE_REQUESTS
    assert 1000 < w.mean_input < 1300  # azure-conv: median 1020, mean about 1155


def test_default_workloads_follow_the_published_offline_setup():
    assert default_workload("llm") == "offline:prompts=azure-conv,out=1024,requests=1000"
    assert parse_workload(default_workload("moe")).output == 384
    assert parse_workload(default_workload("vlm")).output == 128
    assert parse_workload(default_workload("ssm")).output == 128
    assert parse_workload(default_workload("diffusion")) == ImagesWorkload(28, (1024, 1024), DEFAULT_REQUESTS)
