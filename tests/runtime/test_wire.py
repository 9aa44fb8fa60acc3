"""The wire: every command and reply of the worker protocol comes back equal (types included) from its bytes,
through a pipe and through the key-value store the way the pool and the worker carry them; bytes that are no
message are refused clearly; a transfer's pieces are packed and unpacked exactly. No worker processes."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tessera.program.program import Piece, build_programs
from tessera.runtime import commands as c
from tessera.runtime.pool import WorkerPool
from tessera.runtime.wire import decode, encode, pack, unpack
from tessera.runtime.worker import _PipeCommands, _StoreCommands
from tests.sim.test_programs import _chain


def samples() -> list[c.Command | c.Reply]:
    """One instance of every message type, with every field set (tensors, nested dataclasses, tuples)."""
    graph = _chain()
    sp = build_programs(graph, [0, 1, 1], ["cpu:0", "cpu:1"], 2)
    x = {"x": torch.arange(6, dtype=torch.float32).view(2, 3), "ids": torch.tensor([[1, 2]], dtype=torch.int64)}
    shared = {"logits": c.SharedTensor("psm_1", 128, "float32", [1, 8])}
    return [
        c.Ping(), c.Connect(3, [0, 2]),
        c.Load({"unit": c.PhaseLoad(graph, sp.programs[1], sp.transfers)}, ["a.safetensors", "b.safetensors"],
               {"w": torch.ones(2, dtype=torch.bfloat16)}, 2),
        c.SetState([x, {}]), c.GetState(), c.GetState(["cache.k"]),
        c.Move([c.StateMove("cache.k", 1, [(0, 64), (128, 192)], 1, 7, True)]),
        c.Step("decode", [x, x], [0, 1], trace=True), c.Job("decode", 1, x, 1, key=(1, 4)),
        c.ProbeLink(1, [64, 4096], 20, lead=True), c.ProbeMessages(0, 200, 4096), c.Echo(4096, 2),
        c.TimeProgram(graph, sp.programs[0], "model.safetensors", [x], 5, 2, 0.5, 2e-4), c.Stop(),
        c.Done(), c.Failure("ValueError: bad", "Traceback ..."), c.Pong(123, 2, "cpu"), c.Connected(1),
        c.Loaded(10, 4096, 2), c.StateValues([x]), c.Moved(256),
        c.StepResult([x, shared], 0.25, 0.125, [("run", 0, 0, 0.0, 0.5)], 12.5, (0, 3)),
        c.RoundTrips([1e-4, 2e-4]), c.MessageTimes(1e-6, 2e-6, 3e-6), c.Echoed([shared]),
        c.KernelSeconds({(0, 0): [1e-3, 2e-3], (2, 1): [3e-3]}),
    ]


def same(a, b) -> bool:
    """Equal values of the same types all the way down (tensors: same dtype, shape and elements)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_the_samples_cover_every_message_type():
    assert {type(m) for m in samples()} == set(c.COMMANDS) | set(c.REPLIES)
    assert not set(c.COMMANDS) & set(c.REPLIES)


@pytest.mark.parametrize("message", samples(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips_over_the_wire(message):
    assert same(decode(encode(message)), message)


def test_messages_travel_the_pipe_and_the_store_as_the_pool_and_worker_carry_them():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    driver_end, worker_end = multiprocessing.Pipe(duplex=True)
    over_pipe = WorkerPool(store, ["cpu:0"], None, 1, pipes=[driver_end])
    over_store = WorkerPool(store, ["rank1"], None, 1)
    messages = samples()
    cmds = [m for m in messages if isinstance(m, c.Command)]
    # replies whose outputs lie in a shared-memory arena are read from it by the pool (tests/runtime/test_distributed)
    replies = [m for m in messages if isinstance(m, c.Reply) and not isinstance(m, c.Echoed | c.StepResult)]
    replies.append(c.StepResult([{"x": torch.ones(3)}], 0.5, 0.25, [], 1.0, (2, 0)))
    store.set("hb/0", repr(time.time()))  # the worker's heartbeat, should the pool look for it
    ends = ((over_pipe, _PipeCommands(worker_end)), (over_store, _StoreCommands(store, 0)))
    for i in range(max(len(cmds), len(replies))):
        cmd, reply = cmds[i % len(cmds)], replies[i % len(replies)]
        for pool, channel in ends:
            pool.submit(0, cmd)
            assert channel.wait(5.0)
            assert same(decode(channel.receive()), cmd)
            channel.reply(encode(reply))
            w, back = pool.next_reply([0], 5.0, raise_failed=False)
            assert w == 0 and same(back, reply)
    driver_end.close()
    worker_end.close()


@pytest.mark.parametrize(("data", "match"), [
    (b"not a pickle", "unreadable message"),
    (pickle.dumps({"op": "ping"}), "unreadable message"),
    (pickle.dumps(("Teleport", {})), "unknown message 'Teleport'"),
    (pickle.dumps(("Connect", [3, [0, 1]])), r"Connect came with the fields \[\], this side's has"),
    (pickle.dumps(("Connect", {"epoch": 3})), r"Connect came with the fields \['epoch'\], this side's has \['epoch', 'members'\]"),
])
def test_bytes_that_are_no_message_are_refused(data, match):
    with pytest.raises(c.ProtocolError, match=match):
        decode(data)


def test_only_protocol_messages_are_encoded():
    with pytest.raises(c.ProtocolError, match="dict is not a message"):
        encode({"op": "ping"})


def test_pack_and_unpack_move_exactly_the_pieces_bytes():
    src = {"a": torch.arange(16, dtype=torch.uint8).untyped_storage(),
           "b": torch.arange(100, 108, dtype=torch.uint8).untyped_storage()}
    pieces = (Piece("a", ((2, 5), (10, 12))), Piece("b", ((0, 8),)))
    flat = pack(src, pieces)
    assert flat.tolist() == [2, 3, 4, 10, 11, *range(100, 108)]
    dst = {"a": torch.zeros(16, dtype=torch.uint8).untyped_storage()}
    graph = type("G", (), {"buffers": {"b": type("B", (), {"nbytes": 8})()}})()  # "b" is allocated on arrival
    unpack(dst, pieces, flat, torch.device("cpu"), graph)
    a = torch.empty(0, dtype=torch.uint8).set_(dst["a"])
    assert a.tolist() == [0, 0, 2, 3, 4, 0, 0, 0, 0, 0, 10, 11, 0, 0, 0, 0]
    assert torch.empty(0, dtype=torch.uint8).set_(dst["b"]).tolist() == list(range(100, 108))
