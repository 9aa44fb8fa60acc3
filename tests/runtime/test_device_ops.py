"""A worker's transfer staging and kernel timing per device type: on the host exactly what the runtime did
(pack, unpack, the host clock); on CUDA pinned buffers, copies on a side stream ordered by events, and busy
time from CUDA events (those tests run only where CUDA is)."""

from __future__ import annotations

import pytest
import torch

from tessera.program.program import Piece
from tessera.runtime.device_ops import CudaOps, HostBuffers, HostOps, device_ops
from tessera.runtime.wire import pack, unpack

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _storages(device: str = "cpu") -> dict[str, torch.UntypedStorage]:
    return {"a": torch.arange(16, dtype=torch.uint8, device=device).untyped_storage(),
            "b": torch.arange(100, 108, dtype=torch.uint8, device=device).untyped_storage()}


PIECES = (Piece("a", ((2, 5), (10, 12))), Piece("b", ((0, 8),)))


class _Sizes:
    buffers = {"b": type("B", (), {"nbytes": 8})()}  # "b" is allocated on arrival


def _bytes(storage: torch.UntypedStorage) -> list[int]:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).cpu().tolist()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_host_devices_get_the_host_operations(device):
    ops = device_ops(device)
    assert type(ops) is HostOps and ops.device == torch.device(device)
    assert ops.busy_timer() is None  # the worker times each kernel with the host clock, as it always did


def test_host_staging_is_pack_and_unpack():
    ops = HostOps(torch.device("cpu"))
    staged = ops.stage(_storages(), PIECES)
    assert staged.ready() and staged.event is None
    assert torch.equal(staged.flat, pack(_storages(), PIECES))
    assert staged.flat.tolist() == [2, 3, 4, 10, 11, *range(100, 108)]
    buf = ops.recv_buffer(13)
    assert buf.dtype == torch.uint8 and buf.shape == (13,) and buf.device.type == "cpu"
    dst = {"a": torch.zeros(16, dtype=torch.uint8).untyped_storage()}
    ops.unpack(dst, PIECES, staged.flat, _Sizes())
    ref = {"a": torch.zeros(16, dtype=torch.uint8).untyped_storage()}
    unpack(ref, PIECES, staged.flat, torch.device("cpu"), _Sizes())
    assert _bytes(dst["a"]) == _bytes(ref["a"]) == [0, 0, 2, 3, 4, 0, 0, 0, 0, 0, 10, 11, 0, 0, 0, 0]
    assert _bytes(dst["b"]) == list(range(100, 108))


def test_host_buffers_are_reused_per_shape_and_dtype_only_once_given_back():
    pool = HostBuffers(pin=False)
    a = pool.take((64,), torch.uint8)
    b = pool.take((64,), torch.uint8)  # a is lent: a new one
    assert a.data_ptr() != b.data_ptr() and pool.allocated == 2
    pool.give(a)
    assert pool.take((32,), torch.uint8).data_ptr() != a.data_ptr()  # another shape
    assert pool.take((64,), torch.float32).data_ptr() != a.data_ptr()  # another dtype
    assert pool.take((64,), torch.uint8) is a and pool.allocated == 4
    assert pool.take((64,), torch.uint8) is not a


# ---- CUDA -----------------------------------------------------------------------------------------------
@CUDA
def test_cuda_staging_round_trips_through_pinned_buffers():
    ops = device_ops("cuda:0")
    assert isinstance(ops, CudaOps)
    src = _storages("cuda:0")
    ops.begin_step()
    staged = ops.stage(src, PIECES)
    assert staged.flat.is_pinned()
    src_a = torch.empty(0, dtype=torch.uint8, device="cuda:0").set_(src["a"])
    src_a.fill_(0)  # after the snapshot: the staged bytes are the ones before
    staged.wait()
    assert staged.ready() and staged.flat.tolist() == [2, 3, 4, 10, 11, *range(100, 108)]
    flat = ops.recv_buffer(13)
    assert flat.is_pinned()
    flat.copy_(staged.flat)
    dst = {"a": torch.zeros(16, dtype=torch.uint8, device="cuda:0").untyped_storage()}
    ops.unpack(dst, PIECES, flat, _Sizes())
    assert _bytes(dst["a"]) == [0, 0, 2, 3, 4, 0, 0, 0, 0, 0, 10, 11, 0, 0, 0, 0]
    assert _bytes(dst["b"]) == list(range(100, 108)) and dst["b"].device.type == "cuda"
    made = ops.buffers.allocated
    ops.end_step()
    torch.cuda.synchronize()
    ops.begin_step()
    again = ops.recv_buffer(13)  # the copies are done: the same pinned buffer comes back
    assert ops.buffers.allocated == made and again.data_ptr() in {flat.data_ptr(), staged.flat.data_ptr()}


@CUDA
def test_cuda_busy_time_comes_from_events():
    ops = device_ops("cuda:0")
    timer = ops.busy_timer()
    x = torch.randn(2048, 2048, device="cuda:0")
    timer.enter()
    for _ in range(20):
        x = x @ x / 2048
    timer.enter()  # still the same run
    timer.leave()
    assert len(timer.pairs) == 1
    assert timer.seconds() > 0.0


def test_the_cuda_apis_the_worker_calls_exist_in_this_torch():
    """The CUDA path cannot run here; the torch API it is written against is checked (names and keywords)."""
    import inspect

    graph_params = inspect.signature(torch.cuda.graph.__init__).parameters
    assert {"pool", "capture_error_mode"} <= set(graph_params)
    assert "enable_timing" in inspect.signature(torch.cuda.Event.__new__).parameters
    for name in ("graph_pool_handle", "CUDAGraph", "Event", "Stream", "current_stream", "set_device", "stream",
                 "synchronize"):
        assert hasattr(torch.cuda, name), name
    assert all(hasattr(torch.cuda.Event, a) for a in ("record", "query", "synchronize", "elapsed_time"))
    assert all(hasattr(torch.cuda.Stream, a) for a in ("wait_event", "wait_stream"))
    assert hasattr(torch.cuda.CUDAGraph, "replay") and hasattr(torch.Tensor, "record_stream")


def test_a_cpu_worker_ignores_cuda_graphs_and_keeps_the_host_path():
    from tessera.capture.build import instantiate
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import StepShape, build_model, step_for
    from tessera.capture.tiny import tiny_config
    from tessera.capture.trace import trace
    from tessera.graph.codec import dtype_from_name
    from tessera.program.program import single_device_program
    from tessera.runtime import commands as c
    from tessera.runtime.worker import Worker, WorkerConfig

    meta, values = instantiate(lambda: build_model("llm", tiny_config("llm")), "meta")
    g = trace(step_for(resolve_model("smollm2-135m"), meta, values, "decode", StepShape(batch=1, seq=1, ctx=16),
                       device="meta"))
    weights = {n: torch.zeros(g.buffers[n].shape, dtype=dtype_from_name(g.buffers[n].dtype)) for n in g.weight_names()}
    worker = Worker(WorkerConfig(0, "127.0.0.1", 0, 1, device="cpu", cuda_graphs=True), store=None)
    worker.load(c.Load({"decode": c.PhaseLoad(g, single_device_program(g, "cpu"), [])}, None, weights, 1))
    assert type(worker.ops) is HostOps and worker.graphs == {}
    inputs = {"input_ids": torch.tensor([[3]]), "positions": torch.tensor([0]), "slots": torch.tensor([0])}
    result = worker.step(c.Step("decode", [inputs], [0]))
    assert result.outputs[0]["logits"].shape[-1] == g.buffers[g.outputs["logits"][0]].shape[-1]
    assert 0.0 < result.compute_s <= result.seconds  # the host clock around each kernel
