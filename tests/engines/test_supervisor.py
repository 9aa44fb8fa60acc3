"""`tessera.engines.process.Supervisor` with real child processes that stand in for vLLM (a few lines of
``http.server`` answering 200 on /health): ``start()`` returns once every engine is healthy; an engine
killed is reported down to the listeners, restarted after the back-off and up again, with its exits and
restarts counted; an engine that ends or never gets healthy while starting makes ``start()`` raise
`EngineStartError` (quoting the end of its log) and stops the others; ``stop()`` leaves no process of any
engine running, helpers in its process group and a restart under way included. And the example connector's
store: `StoreCleaner` removes only entries older than its maximum age, `new_store` makes a fresh folder."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tessera.engines.kvstore as kvstore
import tessera.engines.process as process
from tessera.engines.kvstore import StoreCleaner, new_store
from tessera.engines.process import EngineStartError, Supervisor
from tessera.engines.vllm import EngineLaunch, Placement
from tessera.plan.deployment import WHOLE, PlannedEngine
from tessera.router.launch import free_ports

DEADLINE_S = 15.0  # for what the watcher does in about a second; generous for a loaded host

# A stand-in engine: answers 200 on /health at the port given; with a second argument, first starts a helper
# process (as vLLM starts its engine core) and writes the helper's pid to that file.
SERVER = """
import http.server, subprocess, sys
if len(sys.argv) > 2:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(sys.argv[2], "w").write(str(helper.pid))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
print("stand-in engine listening", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def _engine(name: str) -> PlannedEngine:
    return PlannedEngine(name=name, roles=(WHOLE,), targets=("cpu",), devices=("cpu:0",), nodes=("cpu:0",),
                         max_num_seqs=4, kv_tokens=1024, block_size=16, memory_fraction=0.5)


def launch(name: str, port: int, *extra: str, code: str = SERVER) -> EngineLaunch:
    argv = (sys.executable, "-c", code, str(port), *extra)
    return EngineLaunch(_engine(name), argv, {}, Placement("cpu:0", cores=(0,)), "127.0.0.1", port)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie waiting for its parent has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(check, what: str, timeout: float = DEADLINE_S):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(process, "POLL_S", 0.05)  # the back-off itself stays as shipped unless a test says


@pytest.fixture
def supervisors():
    """Make supervisors that are stopped after the test, whatever happens."""
    made: list[Supervisor] = []

    def make(launches: list[EngineLaunch], log_dir: Path) -> Supervisor:
        sup = Supervisor(launches, log_dir, say=lambda s: None)
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.stop()


def test_start_returns_once_every_engine_is_healthy(tmp_path, supervisors):
    ports = free_ports(2)
    said: list[str] = []
    sup = supervisors([launch("a", ports[0]), launch("b", ports[1])], tmp_path)
    sup.say = said.append
    took = sup.start(timeout_s=30)
    assert 0 < took < 30
    for name, port in zip(("a", "b"), ports, strict=True):
        assert sup.status[name].state == "up"
        assert sup.processes[name].healthy()
        assert sup.processes[name].launch.url == f"http://127.0.0.1:{port}"
        assert running(sup.status[name].pid)
        assert "stand-in engine listening" in (tmp_path / f"{name}.log").read_text()
    assert any("engine a is up" in s for s in said) and any("engine b is up" in s for s in said)


def test_a_killed_engine_goes_down_then_restarts_after_the_backoff(tmp_path, supervisors):
    ports = free_ports(2)
    sup = supervisors([launch("a", ports[0]), launch("b", ports[1])], tmp_path)
    sup.start(timeout_s=30)
    told: list[tuple[str, str, str, float]] = []
    sup.listeners.append(lambda name, state, detail: told.append((name, state, detail, time.monotonic())))
    first_pid = sup.status["a"].pid

    sup.kill("a")
    wait_for(lambda: sup.status["a"].state == "up" and sup.status["a"].restarts == 1, "engine a to be back up")
    states = [(name, state) for name, state, _, _ in told]
    assert states == [("a", "down"), ("a", "restarting"), ("a", "up")]
    assert "exited with status -9" in told[0][2]  # SIGKILL
    waited = told[1][3] - told[0][3]
    assert waited >= process.BACKOFF_S[0] - 0.1, f"restarted {waited:.2f} s after going down"
    assert sup.status["a"].restarts == 1 and sup.status["a"].exits == 1
    assert sup.status["a"].pid != first_pid and running(sup.status["a"].pid)
    assert not running(first_pid)
    assert sup.processes["a"].healthy()
    assert sup.status["b"].state == "up" and sup.status["b"].restarts == 0 and sup.status["b"].exits == 0
    assert (tmp_path / "a.log").read_text().count("=== tessera: starting a") == 2


def test_an_engine_that_exits_while_starting_raises_quoting_its_log(tmp_path, supervisors):
    port_ok, port_bad = free_ports(2)
    crash = "import sys; print('loading the model'); print('CUDA out of memory: tried 9 GiB'); sys.exit(3)"
    sup = supervisors([launch("good", port_ok), launch("bad", port_bad, code=crash)], tmp_path)
    with pytest.raises(EngineStartError) as err:
        sup.start(timeout_s=30)
    message = str(err.value)
    assert "engine bad exited with status 3 while starting" in message
    assert "CUDA out of memory: tried 9 GiB" in message
    assert str(tmp_path / "bad.log") in message
    # every engine is stopped
    assert all(s.state == "stopped" for s in sup.status.values())
    assert not running(sup.status["good"].pid)


def test_an_engine_never_healthy_raises_after_the_timeout(tmp_path, supervisors):
    (port,) = free_ports(1)
    silent = "import time; time.sleep(120)"  # runs, never listens
    sup = supervisors([launch("mute", port, code=silent)], tmp_path)
    with pytest.raises(EngineStartError, match="engines mute not healthy after"):
        sup.start(timeout_s=0.5)
    assert not running(sup.status["mute"].pid)


def test_stop_leaves_no_process_running(tmp_path, supervisors):
    ports = free_ports(2)
    helper_file = tmp_path / "helper.pid"
    sup = supervisors([launch("a", ports[0], str(helper_file)), launch("b", ports[1])], tmp_path)
    sup.start(timeout_s=30)
    helper = int(wait_for(lambda: helper_file.exists() and helper_file.read_text(), "the helper's pid"))
    pids = [sup.status["a"].pid, sup.status["b"].pid, helper]
    assert all(running(pid) for pid in pids)
    sup.stop()
    wait_for(lambda: not any(running(pid) for pid in pids), "every process to end", timeout=5)
    assert all(s.state == "stopped" for s in sup.status.values())


def test_stop_during_a_restart_leaves_no_process_running(tmp_path, supervisors, monkeypatch):
    monkeypatch.setattr(process, "BACKOFF_S", (0.05, 0.1))
    (port,) = free_ports(1)
    sup = supervisors([launch("a", port)], tmp_path)
    sup.start(timeout_s=30)
    engine = sup.processes["a"]
    restarting, restarted = threading.Event(), threading.Event()
    real_start = engine.start

    def slow_start() -> int:  # the watcher is starting the engine again when stop() comes
        restarting.set()
        time.sleep(0.5)
        pid = real_start()
        restarted.set()
        return pid

    engine.start = slow_start
    first_pid = sup.status["a"].pid
    sup.kill("a")
    assert restarting.wait(DEADLINE_S)
    sup.stop()
    assert restarted.wait(DEADLINE_S)
    assert engine.proc is not None and engine.proc.pid != first_pid
    wait_for(lambda: not running(engine.proc.pid), "the restarted engine to be stopped", timeout=5)
    assert sup.status["a"].state == "stopped"


def _age(path: Path, seconds: float, now: float) -> None:
    os.utime(path, (now - seconds, now - seconds))


def test_store_cleaner_removes_only_entries_older_than_max_age(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    now = time.time()
    for name, age in (("old-prompt", 120), ("new-prompt", 10)):  # a prompt's KV: a folder of layer files
        (store / name).mkdir()
        (store / name / "layer0.safetensors").write_bytes(b"kv")
        _age(store / name, age, now)
    for name, age in (("old.bin", 61), ("new.bin", 59)):
        (store / name).write_bytes(b"kv")
        _age(store / name, age, now)

    cleaner = StoreCleaner(store, max_age_s=60)
    assert cleaner.sweep(now) == 2
    assert sorted(p.name for p in store.iterdir()) == ["new-prompt", "new.bin"]
    assert (store / "new-prompt" / "layer0.safetensors").read_bytes() == b"kv"
    assert cleaner.sweep(now) == 0
    assert cleaner.sweep(now + 100) == 2
    assert list(store.iterdir()) == []
    cleaner.stop()
    assert not store.exists()
    assert cleaner.sweep() == 0  # no store: nothing to do


def test_store_cleaner_thread_sweeps_on_its_own(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "entry").write_bytes(b"kv")
    _age(store / "entry", 10, time.time())
    cleaner = StoreCleaner(store, max_age_s=0.2).start()
    try:
        wait_for(lambda: not (store / "entry").exists(), "the cleaner to remove the old entry", timeout=5)
    finally:
        cleaner.stop()
    assert not store.exists()


def test_new_store_is_a_fresh_folder(tmp_path, monkeypatch):
    first, second = new_store(tmp_path), new_store(tmp_path)
    try:
        assert first != second and first.is_dir() and list(first.iterdir()) == []
        assert first.name.startswith("tessera-kv-")
        assert first.parent == (kvstore.SHM if kvstore.SHM.is_dir() else tmp_path)
    finally:
        shutil.rmtree(first)
        shutil.rmtree(second)
    monkeypatch.setattr(kvstore, "SHM", tmp_path / "no-shm")
    store = new_store(tmp_path / "logs")
    assert store.parent == tmp_path / "logs" and store.is_dir()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one")
def test_an_engine_starts_on_its_host_cores_and_pin_this_process_moves_every_thread(tmp_path):
    cores = tuple(sorted(os.sched_getaffinity(0)))
    ours = dataclasses.replace(launch("pinned", 1, code="import os; print(sorted(os.sched_getaffinity(0)))"),
                               host_cores=cores[-1:])
    anywhere = launch("free", 1, code="import os; print(sorted(os.sched_getaffinity(0)))")
    for ln in (ours, anywhere):
        p = process.EngineProcess(ln, tmp_path / f"{ln.engine.name}.log")
        p.start()
        assert p.proc.wait(30) == 0
    assert (tmp_path / "pinned.log").read_text().splitlines()[-1] == str([cores[-1]])
    assert (tmp_path / "free.log").read_text().splitlines()[-1] == str(list(cores))
    # in a child of its own, so this test process keeps its cores
    code = ("import os, threading, time; from tessera.engines.process import pin_this_process; "
            "t = threading.Thread(target=time.sleep, args=(5,)); t.start(); "
            f"pin_this_process(({cores[0]},)); "
            "print(sorted({c for tid in os.listdir('/proc/self/task') for c in os.sched_getaffinity(int(tid))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str([cores[0]]), out.stderr
