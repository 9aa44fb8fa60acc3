"""The coordination plane is kept to the run: no store socket for local workers, listening sockets only on
loopback, values signed with the run's secret (unsigned, forged or moved ones refused), a private secret
file, and a clear error for an interface this host lacks."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import torch.distributed as dist
from typer.testing import CliRunner

from tessera.cli.main import app
from tessera.runtime import commands as c
from tessera.runtime.config import RunConfig
from tessera.runtime.coordination import (
    AuthenticatedStore,
    CoordinationError,
    ListeningPlane,
    LocalPlane,
    StoreTampered,
    interface_address,
    read_secret_file,
    secret_from_env,
    torchrun_plane,
)
from tessera.runtime.pool import WorkerPool
from tessera.runtime.wire import encode
from tessera.runtime.worker import WorkerConfig, worker_main

SECRET = b"s" * 32


def _listening() -> dict[int, tuple[str, int]]:
    """Listening TCP sockets of this host: inode -> (address, port), from /proc/net/tcp and tcp6."""
    found = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            hexaddr, hexport = fields[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))  # per 32-bit word, host order
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            found[int(fields[9])] = (socket.inet_ntop(family, raw), int(hexport, 16))
    return found


def _sockets_of(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _listening_of(pid: int) -> list[tuple[str, int]]:
    table = _listening()
    return [table[i] for i in _sockets_of(pid) if i in table]


def test_local_workers_meet_with_no_store_socket_and_listen_only_on_loopback():
    pool = WorkerPool.local(2, 1)
    try:
        directory = Path(pool.plane.address)
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()} == {"secret": 0o600,
                                                                                          "store": 0o600}
        pool.call({w: c.Connect(0, [0, 1]) for w in range(2)}, 60.0)  # a gloo group: its pairs listen
        driver = _listening_of(os.getpid())
        workers = [a for p in pool.processes for a in _listening_of(p.pid)]
        assert driver == []  # the store is a file: nothing of the driver's listens
        assert len(workers) >= 2  # the gloo pairs' listeners (so the check below looks at real sockets)
        assert all(addr == "127.0.0.1" for addr, _ in workers), workers
    finally:
        pool.close()
    assert not directory.exists()


def test_unsigned_forged_and_moved_values_are_refused(tmp_path):
    plane = LocalPlane.create(tmp_path / "plane")
    try:
        raw = dist.FileStore(str(Path(plane.address) / "store"), -1)
        plane.store.set("cmd/0/0", encode(c.Ping()))
        assert plane.store.get("cmd/0/0") == encode(c.Ping())
        raw.set("cmd/0/1", encode(c.Stop()))  # unsigned
        with pytest.raises(StoreTampered, match=r"'cmd/0/1' of the coordination store is not signed"):
            plane.store.get("cmd/0/1")
        AuthenticatedStore(raw, b"x" * 32).set("cmd/0/2", encode(c.Stop()))  # another secret
        with pytest.raises(StoreTampered):
            plane.store.get("cmd/0/2")
        raw.set("cmd/0/3", raw.get("cmd/0/0"))  # a signed value replayed at another key
        with pytest.raises(StoreTampered):
            plane.store.get("cmd/0/3")
        with pytest.raises(CoordinationError, match="counters cannot be signed"):
            plane.store.add("n", 1)
    finally:
        plane.close()


def test_a_listening_plane_binds_one_address_and_refuses_outsiders():
    plane = ListeningPlane("127.0.0.1", SECRET)
    try:
        mine = [addr for addr in _listening().values() if addr[1] == plane.port]
        assert mine == [("127.0.0.1", plane.port)]
        plane.store.set("tessera/hello", b"driver")
        with pytest.raises(StoreTampered):  # a client with the wrong secret cannot read the group's keys
            ListeningPlane.join("127.0.0.1", plane.port, b"w" * 32).get("tessera/hello")
        assert ListeningPlane.join("127.0.0.1", plane.port, SECRET).get("tessera/hello") == b"driver"

        # a worker taking commands through the store refuses an outsider's command instead of running it
        worker_store = ListeningPlane.join("127.0.0.1", plane.port, SECRET)
        failed: list[BaseException] = []

        def work():
            try:
                worker_main(WorkerConfig(0, "127.0.0.1", plane.port, 1, idle_timeout_s=20.0), worker_store)
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                failed.append(e)

        loop = threading.Thread(target=work, daemon=True)
        loop.start()
        outsider = dist.TCPStore("127.0.0.1", plane.port, None, False)
        outsider.set("cmd/0/0", encode(c.Ping()))
        loop.join(20.0)
        assert not loop.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], StoreTampered) and "'cmd/0/0'" in str(failed[0])
        assert not plane.store.check(["reply/0/0"])
    finally:
        plane.close()


def test_the_secret_file_must_be_private_and_long_enough(tmp_path):
    path = tmp_path / "secret"
    path.write_text("k" * 40 + "\n")
    path.chmod(0o644)
    with pytest.raises(CoordinationError, match=r"can be read or written by others \(mode 644\); `chmod 600"):
        read_secret_file(path)
    path.chmod(0o600)
    assert read_secret_file(path) == b"k" * 40
    assert secret_from_env({"TESSERA_SECRET_FILE": str(path)}) == b"k" * 40
    assert secret_from_env({"TESSERA_SECRET": "e" * 20}) == b"e" * 20
    assert secret_from_env({}) is None
    with pytest.raises(CoordinationError, match="at least 16"):
        secret_from_env({"TESSERA_SECRET": "short"})
    path.write_text("short")
    with pytest.raises(CoordinationError, match="holds 5 bytes; it needs at least 16"):
        read_secret_file(path)


def test_a_bad_interface_is_a_clear_error():
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(CoordinationError, match=r"--interface 'nope0': this host has no such network interface "
                                                r"\(it has lo"):
        interface_address("nope0")
    with pytest.raises(CoordinationError, match="no such network interface"):
        RunConfig(model="smollm2-135m", interface="nope0").check()
    with pytest.raises(CoordinationError, match="cannot listen on 192.0.2.1"):
        ListeningPlane("192.0.2.1", SECRET)  # an address of no interface here
    result = CliRunner().invoke(app, ["run", "smollm2-135m", "--prompt", "hi", "--interface", "nope0"])
    assert result.exit_code == 2 and "no such network interface" in result.output


def test_a_worker_refuses_a_plane_directory_others_can_enter(tmp_path):
    plane = LocalPlane.create(tmp_path / "plane")
    try:
        assert LocalPlane.join(plane.address).store is not None
        Path(plane.address).chmod(0o755)
        with pytest.raises(CoordinationError, match="no one else can enter \\(mode 700\\); it is mode 755"):
            LocalPlane.join(plane.address)
        Path(plane.address).chmod(0o700)
        (Path(plane.address) / "secret").chmod(0o644)
        with pytest.raises(CoordinationError, match="can be read or written by others"):
            LocalPlane.join(plane.address)
    finally:
        plane.close()


def test_torchrun_over_several_hosts_needs_an_interface_and_a_secret(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("TESSERA_SECRET", raising=False)
    monkeypatch.delenv("TESSERA_SECRET_FILE", raising=False)
    with pytest.raises(CoordinationError, match="several hosts: name the network interface .* --interface"):
        torchrun_plane(1, None)
    with pytest.raises(CoordinationError, match="needs the run's secret on every host: set TESSERA_SECRET_FILE"):
        torchrun_plane(1, "lo")
