"""The kernel profiler: every kernel timed once on real tensors, signatures shared by equal-shape kernels,
a versioned profile file with clear format errors, and the `tessera profile` command."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from typer.testing import CliRunner

from tessera.capture.build import instantiate
from tessera.capture.phases import build_model, make_step
from tessera.capture.step import Step
from tessera.capture.tiny import tiny_config
from tessera.capture.trace import trace
from tessera.cli.main import app
from tessera.cost.profile import Profile, ProfileFormatError, kernel_signature
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor
from tessera.runtime.profiler import (
    ProfileError,
    _gpu_id,
    build_profile_step,
    profile_graph,
    profile_model,
    resolve_target,
)
from tessera.weights import save_weights

runner = CliRunner()


@pytest.fixture(scope="module")
def smollm2_profile(smollm2_step):
    step, graph, weights, state0 = smollm2_step
    state = {n: t.clone() for n, t in state0.items()}
    prof = profile_graph(graph, weights, step.inputs, state, device="cpu", threads=2, warmup=1, repeats=3)
    return prof, state


@pytest.fixture()
def tiny_dir(tmp_path):
    folder = tmp_path / "tiny-llm"
    tiny_config("llm").save_pretrained(folder)
    return folder


def _kernel(graph, kernel_id):
    return next(k for k in graph.kernels if k.id == kernel_id)


def test_profile_times_every_kernel_once(smollm2_step, smollm2_profile):
    _, graph, _, _ = smollm2_step
    prof, _ = smollm2_profile
    assert [t.index for t in prof.kernels] == list(range(len(graph.kernels)))
    for t, k in zip(prof.kernels, graph.kernels, strict=True):
        assert (t.id, t.op, t.op_class, t.signature) == (k.id, k.op, k.op_class, kernel_signature(k))
        assert 0 < t.min_s <= t.median_s and t.repeats == 3
    assert (prof.device, prof.threads, prof.model, prof.phase) == ("cpu", 2, "smollm2-135m", "decode")
    assert prof.graph_hash == graph.hash and prof.shape == {"batch": 2, "seq": 1, "ctx": graph.meta["ctx"]}
    assert (prof.warmup, prof.repeats, prof.version) == (1, 3, 1)
    assert prof.total_s == pytest.approx(sum(n for _, n in prof.by_op_class().values()))
    assert sum(n for n, _ in prof.by_op_class().values()) == len(graph.kernels)
    assert torch.get_num_threads() == max(1, min(2, os.cpu_count() or 1))  # restored (conftest's setting)


def test_repeated_in_place_kernels_leave_the_state_of_one_step(smollm2_step, smollm2_profile):
    step, graph, weights, state0 = smollm2_step
    _, profiled_state = smollm2_profile
    state = {n: t.clone() for n, t in state0.items()}
    Executor(graph, single_device_program(graph), weights).run(step.inputs, state)
    assert any(not torch.equal(state[n], state0[n]) for n in state)
    for name, t in state.items():
        assert torch.equal(profiled_state[name], t), name


def test_kernels_writing_in_place_are_restored_after_timing():
    def fn(inp, st, _consts):
        st["acc"].mul_(2)  # compounds when rerun
        h = inp["x"] * 3
        h.add_(1)
        return {"y": st["acc"] + h}

    x, acc = torch.arange(4.0), torch.ones(4)
    step = Step(model="unit", family="test", phase="unit", modules={}, fn=fn, inputs={"x": x},
                state={"acc": acc.clone()})
    graph = trace(step)
    assert sum(k.op.endswith("_.Tensor") or k.op.endswith("_.Scalar") for k in graph.kernels) == 2
    state = {"acc": acc.clone()}
    prof = profile_graph(graph, {}, {"x": x}, state, threads=1, warmup=2, repeats=3)
    assert len(prof.kernels) == len(graph.kernels)
    assert torch.equal(state["acc"], acc * 2)  # one step's write, not 2 ** 6


def test_save_and_load_round_trip(smollm2_profile, tmp_path):
    prof, _ = smollm2_profile
    path = tmp_path / "profile.json"
    prof.save(path)
    raw = json.loads(path.read_text())
    assert raw["kind"] == "tessera-profile" and raw["version"] == 1
    loaded = Profile.load(path)
    assert loaded == prof
    assert loaded.by_signature() == prof.by_signature()


def test_signatures_are_shared_by_equal_shape_kernels_only(smollm2_step, smollm2_profile):
    _, graph, _, _ = smollm2_step
    q0 = _kernel(graph, "model.layers.0.self_attn.o_proj:aten.mm.default#0")
    q1 = _kernel(graph, "model.layers.1.self_attn.o_proj:aten.mm.default#0")
    gate = _kernel(graph, "model.layers.0.mlp.down_proj:aten.mm.default#0")
    att0 = _kernel(graph, "model.layers.0.self_attn:tessera.decode_attention.default#0")
    att1 = _kernel(graph, "model.layers.1.self_attn:tessera.decode_attention.default#0")
    assert q0.args != q1.args  # different weight buffers...
    assert kernel_signature(q0) == kernel_signature(q1)  # ...same time
    assert kernel_signature(att0) == kernel_signature(att1)
    assert kernel_signature(q0) != kernel_signature(gate)
    # 30 identical layers: a handful of signatures cover the graph's 300+ kernels
    prof, _ = smollm2_profile
    assert len(prof.by_signature()) < len(graph.kernels) // 10

    # another graph (traced on meta, larger cache): equal projections, different attention
    other = trace(make_step("smollm2-135m", "decode", batch=2, ctx=2 * graph.meta["ctx"], device="meta"))
    assert kernel_signature(_kernel(other, q0.id)) == kernel_signature(q0)
    assert kernel_signature(_kernel(other, att0.id)) != kernel_signature(att0)


def _with_first_tensor(kernel, change):
    args = json.loads(json.dumps(kernel.args))
    ref = next(a for a in args if isinstance(a, dict) and "$t" in a)["$t"]
    change(ref)
    return dataclasses.replace(kernel, args=args)


def test_signature_follows_sizes_strides_dtypes_and_scalars(smollm2_step):
    _, graph, _, _ = smollm2_step
    mm = _kernel(graph, "model.layers.0.self_attn.o_proj:aten.mm.default#0")
    att = _kernel(graph, "model.layers.0.self_attn:tessera.decode_attention.default#0")
    base = kernel_signature(mm)

    def rename(ref):
        ref[0] = "some.other.buffer"

    def resize(ref):
        ref[3] = [ref[3][0] + 1, *ref[3][1:]]

    def restride(ref):
        ref[4] = list(reversed(ref[4]))

    def retype(ref):
        ref[1] = "float32"

    assert kernel_signature(_with_first_tensor(mm, rename)) == base
    for change in (resize, restride, retype):
        assert kernel_signature(_with_first_tensor(mm, change)) != base, change.__name__
    scalars = [i for i, a in enumerate(att.args) if isinstance(a, (int, float)) and not isinstance(a, bool)]
    assert scalars, att.args
    args = list(att.args)
    args[scalars[0]] = args[scalars[0]] * 2 + 1
    assert kernel_signature(dataclasses.replace(att, args=args)) != kernel_signature(att)


def _write(path, data):
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_profile_format_errors_say_what_and_where(smollm2_profile, tmp_path):
    prof, _ = smollm2_profile
    good = prof.to_dict()
    cases = {
        "not JSON": ("{not json", "not a JSON file"),
        "a list": ([1, 2], "not a Tessera profile"),
        "a graph": ({"version": 1, "kernels": []}, "not a Tessera profile"),
        "version 2": (good | {"version": 2}, "version 2 is not supported"),
        "no device": ({k: v for k, v in good.items() if k != "device"}, "lacks field(s) device"),
        "kernels not a list": (good | {"kernels": {}}, "'kernels' must be a list"),
        "kernel without time": (good | {"kernels": [{k: v for k, v in good["kernels"][0].items()
                                                     if k != "median_s"}]}, "kernels[0] lacks field(s) median_s"),
        "kernel bad type": (good | {"kernels": [good["kernels"][0] | {"repeats": "3"}]},
                            "kernels[0].repeats must be int"),
    }
    for name, (data, expected) in cases.items():
        path = _write(tmp_path / f"{name.replace(' ', '_')}.json", data)
        with pytest.raises(ProfileFormatError) as e:
            Profile.load(path)
        assert str(path) in str(e.value) and expected in str(e.value), (name, str(e.value))
    with pytest.raises(ProfileFormatError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")


def test_device_strings_and_threads():
    from tessera.hardware.host import host_cores

    cores = host_cores()  # physical cores, as `cpu:N` devices and clusters count them
    assert resolve_target("cpu").threads == cores
    assert resolve_target("cpu:4").threads == max(1, cores // 4)
    assert resolve_target("CPU:2", threads=3).threads == 3
    assert resolve_target("cpu:64").threads == max(1, cores // 64)  # 64: the most workers allowed
    for bad in ("gpu", "cpu:", "cpu:0", "cuda:x", "tpu:1"):
        with pytest.raises(ProfileError):
            resolve_target(bad)
    with pytest.raises(ProfileError, match="--threads"):
        resolve_target("cpu", threads=0)
    if not torch.cuda.is_available():
        with pytest.raises(ProfileError, match="CUDA is not available"):
            resolve_target("cuda")


def test_cuda_device_names_map_to_catalog_ids():
    assert _gpu_id("NVIDIA H200") == "H200"
    assert _gpu_id("NVIDIA H100 80GB HBM3") == "H100"
    assert _gpu_id("NVIDIA A100-SXM4-80GB") == "A100"
    assert _gpu_id("NVIDIA GeForce RTX 4090") == "RTX4090"
    assert _gpu_id("Imaginary GPU 9000") == "Imaginary GPU 9000"


def test_profile_model_of_a_local_directory_uses_its_safetensors(tiny_dir):
    module, _ = instantiate(lambda: build_model("llm", tiny_config("llm")), "cpu", seed=3)
    save_weights({"": module}, tiny_dir / "model.safetensors")
    step = build_profile_step(str(tiny_dir), "decode", batch=2, ctx=16)
    for name, t in module.state_dict().items():
        assert torch.equal(step.modules[""].state_dict()[name], t), name
    prof, graph = profile_model(str(tiny_dir), "decode", batch=2, ctx=16, threads=1, warmup=0, repeats=2)
    assert [t.index for t in prof.kernels] == list(range(len(graph.kernels)))
    assert prof.model == str(tiny_dir.resolve())  # a local model is named by its path: it can be traced again
    assert prof.threads == 1 and prof.graph_hash == graph.hash


def test_cli_writes_a_loadable_profile(tiny_dir, tmp_path):
    out = tmp_path / "p.json"
    r = runner.invoke(app, ["profile", str(tiny_dir), "--phase", "prefill", "--seq", "8", "--ctx", "16",
                            "--device", "cpu:2", "--threads", "1", "--warmup", "0", "--repeats", "2", "-o", str(out)])
    assert r.exit_code == 0, r.output
    prof = Profile.load(out)
    assert prof.phase == "prefill" and prof.threads == 1 and prof.repeats == 2 and prof.kernels
    assert prof.shape == {"batch": 1, "seq": 8, "ctx": 16}
    assert "total" in r.output and "gemm" in r.output and str(out) in r.output


@pytest.mark.parametrize("args,expected", [
    (["llama-9000"], "unknown model"),
    (["smollm2-135m", "--phase", "encode"], "phases are prefill, decode"),
    (["smollm2-135m", "--device", "gpu"], "--device must be cpu"),
    (["smollm2-135m", "--device", "cpu:0"], "at least 1"),
    (["smollm2-135m", "--repeats", "0"], "--repeats must be at least 1"),
    (["smollm2-135m", "--warmup", "-1"], "--warmup must be 0 or more"),
    (["smollm2-135m", "--threads", "0"], "--threads must be at least 1"),
])
def test_cli_errors_exit_2(args, expected, tmp_path):
    r = runner.invoke(app, ["profile", *args, "-o", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and expected in r.output, r.output
    assert not (tmp_path / "p.json").exists()


def test_cli_cuda_without_cuda_and_missing_output(tmp_path):
    if not torch.cuda.is_available():
        r = runner.invoke(app, ["profile", "smollm2-135m", "--device", "cuda", "-o", str(tmp_path / "p.json")])
        assert r.exit_code == 2 and "CUDA is not available" in r.output, r.output
    r = runner.invoke(app, ["profile", "smollm2-135m"])
    assert r.exit_code == 2 and "--output" in r.output, r.output
