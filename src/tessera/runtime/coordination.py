"""The coordination plane: the key-value store on which a driver and its workers meet (gloo process-group
rendezvous; for torchrun ranks also commands, replies and heartbeats), kept to the processes of one run.

Every value is signed with the run's secret (:class:`AuthenticatedStore`), so a process without it can
neither forge a command nor join a process group. Local workers share a :class:`LocalPlane`: a
torch FileStore in a private directory, no listening socket at all. torchrun ranks share a
:class:`ListeningPlane`: a TCP store bound to loopback (one host) or to the address of the interface the user
names, with the secret from ``TESSERA_SECRET`` / ``TESSERA_SECRET_FILE`` (on one host, if unset, rank 0
makes one in a private file).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import ipaddress
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tessera.errors import TesseraError

SECRET_ENV = "TESSERA_SECRET"
SECRET_FILE_ENV = "TESSERA_SECRET_FILE"
MIN_SECRET_BYTES = 16
LOOPBACK = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=60)
_TAG = b"tessera-coordination-v1\0"
_MAC = hashlib.sha256().digest_size
_PLANE_KEY = "tessera/plane"  # where a torchrun driver publishes its listening plane's address


class CoordinationError(TesseraError):
    """The coordination plane cannot be set up or joined as asked (secret, interface, directory)."""


class StoreTampered(CoordinationError):
    """A value in the coordination store is not signed with this run's secret."""


class AuthenticatedStore(dist.Store):
    """A store whose values are signed (HMAC-SHA256 of key and value with the run's secret) when written and
    checked when read: an unsigned or forged value raises :class:`StoreTampered`. Counters (``add``) and
    compare-and-set cannot be signed and are refused."""

    def __init__(self, inner: dist.Store, secret: bytes):
        super().__init__()
        if len(secret) < MIN_SECRET_BYTES:
            raise CoordinationError(f"the coordination secret has {len(secret)} bytes; it needs at least "
                                    f"{MIN_SECRET_BYTES}")
        self.inner, self._secret = inner, secret

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, _TAG + key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        """Write ``value`` (bytes or str) at ``key``, signed."""
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self._mac(key, value) + value)

    def get(self, key: str) -> bytes:
        """The value at ``key`` (waiting for it as the inner store does), once its signature checks."""
        raw = bytes(self.inner.get(key))
        mac, value = raw[:_MAC], raw[_MAC:]
        if len(raw) < _MAC or not hmac.compare_digest(mac, self._mac(key, value)):
            raise StoreTampered(f"the value at {key!r} of the coordination store is not signed with this run's "
                                "secret: a process outside the run wrote it, or this process was given another "
                                f"secret ({SECRET_ENV} / {SECRET_FILE_ENV} must be the same on every host); "
                                "refusing it")
        return value

    def check(self, keys: list[str]) -> bool:
        """Whether every key of ``keys`` is there (signatures are checked when read)."""
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until every key of ``keys`` is there."""
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        """Remove ``key``."""
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        """How many keys the store holds."""
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        """How long reads and waits wait."""
        self.inner.set_timeout(timeout)

    def add(self, key: str, amount: int) -> int:
        """Refused: a counter the store increments cannot carry a signature."""
        raise CoordinationError(f"add({key!r}) on the authenticated coordination store: counters cannot be signed")

    def compare_set(self, key: str, expected, desired) -> bytes:
        """Refused: the store compares raw values, which are signed."""
        raise CoordinationError(f"compare_set({key!r}) on the authenticated coordination store is not supported")

    def clone(self) -> AuthenticatedStore:
        """Another connection to the same store with the same secret (for another thread)."""
        return AuthenticatedStore(self.inner.clone(), self._secret)


# secrets ------------------------------------------------------------------------------------------------
def _private_file(path: Path, what: str) -> None:
    """Raise unless ``path`` is a regular file of this user that no one else can read or write."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise CoordinationError(f"{what} {path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise CoordinationError(f"{what} {path} is not a regular file")
    if st.st_uid != os.getuid():
        raise CoordinationError(f"{what} {path} belongs to user {st.st_uid}, not to this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise CoordinationError(f"{what} {path} can be read or written by others (mode {st.st_mode & 0o777:o}); "
                                f"`chmod 600 {path}`")


def read_secret_file(path: str | Path) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped), which must be private to this user."""
    path = Path(path)
    _private_file(path, f"the secret file ({SECRET_FILE_ENV})")
    secret = path.read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise CoordinationError(f"the secret file {path} holds {len(secret)} bytes; it needs at least "
                                f"{MIN_SECRET_BYTES} (e.g. `python -c 'import secrets; print(secrets.token_hex(32))' "
                                f"> {path}`)")
    return secret


def secret_from_env(env: dict[str, str] | None = None) -> bytes | None:
    """The run's secret from ``TESSERA_SECRET_FILE`` (a private file) or ``TESSERA_SECRET``; None if neither
    is set."""
    env = os.environ if env is None else env
    if env.get(SECRET_FILE_ENV):
        return read_secret_file(env[SECRET_FILE_ENV])
    if env.get(SECRET_ENV):
        secret = env[SECRET_ENV].encode()
        if len(secret) < MIN_SECRET_BYTES:
            raise CoordinationError(f"{SECRET_ENV} has {len(secret)} bytes; it needs at least {MIN_SECRET_BYTES}")
        return secret
    return None


# interfaces ---------------------------------------------------------------------------------------------
def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (``lo``, ``eth0``...)."""
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise CoordinationError(f"--interface {name!r}: this host has no such network interface (it has "
                                f"{', '.join(names)})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR: the interface's IPv4 address
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            raise CoordinationError(f"--interface {name!r} has no IPv4 address; name an interface that has "
                                    "one") from None
    return socket.inet_ntoa(packed[20:24])


def gloo_device(address: str):
    """A gloo device whose pairs listen on ``address`` only."""
    return dist.ProcessGroupGloo.create_device(hostname=address)


# planes -------------------------------------------------------------------------------------------------
def _private_dir(path: Path) -> None:
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise CoordinationError(f"the coordination directory {path} must be a directory of this user that no one "
                                f"else can enter (mode 700); it is mode {st.st_mode & 0o777:o} of user {st.st_uid}")


class LocalPlane:
    """Driver and workers on one host: a torch FileStore and a random secret in a private (0700) directory;
    no socket listens for the store. The workers join with the directory's path."""

    def __init__(self, directory: Path, secret: bytes, owner: bool):
        self.directory, self.owner = directory, owner
        self.store = AuthenticatedStore(dist.FileStore(str(directory / "store"), -1), secret)

    @classmethod
    def create(cls, directory: str | Path | None = None) -> LocalPlane:
        """A new plane (in a fresh temporary directory, or ``directory``, which must not exist yet)."""
        if directory is None:
            path = Path(tempfile.mkdtemp(prefix="tessera-plane-"))  # mode 0700
        else:
            path = Path(directory)
            path.mkdir(mode=0o700)
        _private_dir(path)
        secret = secrets.token_bytes(32)
        for name, data in (("secret", secret), ("store", b"")):
            fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return cls(path, secret, owner=True)

    @classmethod
    def join(cls, directory: str | Path, wait_s: float = 0.0) -> LocalPlane:
        """The plane in ``directory`` (waiting at most ``wait_s`` for its creator), checked to be private."""
        path = Path(directory)
        deadline = time.monotonic() + wait_s
        while not (path / "store").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not path.exists():
            raise CoordinationError(f"no coordination directory at {path} (did the driver start?)")
        _private_dir(path)
        for name in ("secret", "store"):
            _private_file(path / name, "the coordination file")
        return cls(path, (path / "secret").read_bytes(), owner=False)

    @property
    def address(self) -> str:
        """What a worker needs to join: the directory."""
        return str(self.directory)

    def close(self) -> None:
        """Remove the directory (the creator only)."""
        if self.owner:
            shutil.rmtree(self.directory, ignore_errors=True)


class ListeningPlane:
    """Workers on several hosts: a TCP store listening on one address (that of the named interface), every
    value signed with the secret all hosts were given."""

    def __init__(self, address: str, secret: bytes, private_dir: Path | None = None):
        ipaddress.ip_address(address)
        self.private_dir = private_dir  # a directory made for the run's secret (removed on close)
        # torch's TCPStore listens on every interface whatever host it is given; a socket bound here first
        # and handed over (master_listen_fd) keeps it to this address
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((address, 0))
        except OSError as e:
            self._socket.close()
            raise CoordinationError(f"cannot listen on {address} for the coordination store: {e}") from None
        self._socket.listen(128)
        self.host, self.port = address, self._socket.getsockname()[1]
        server = dist.TCPStore(address, self.port, None, True, timeout=STORE_TIMEOUT, wait_for_workers=False,
                               master_listen_fd=self._socket.fileno(), use_libuv=True)
        self.store = AuthenticatedStore(server, secret)

    @staticmethod
    def join(host: str, port: int, secret: bytes) -> AuthenticatedStore:
        """A client of the plane at ``host:port``."""
        return AuthenticatedStore(dist.TCPStore(host, port, None, False, timeout=STORE_TIMEOUT), secret)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop listening (and remove the secret's directory)."""
        with contextlib.suppress(OSError):
            self._socket.close()
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)


# torchrun -----------------------------------------------------------------------------------------------
def _torchrun_dir() -> Path:
    """The private directory of a one-host torchrun job (named by its run id, under a per-user directory)."""
    base = Path(tempfile.gettempdir()) / f"tessera-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        base.mkdir(mode=0o700)
    _private_dir(base)  # made by someone else, or opened up: refuse
    run_id = "".join(c for c in os.environ.get("TORCHELASTIC_RUN_ID", "none") if c.isalnum() or c in "-_")
    return base / f"torchrun-{run_id}"


def _one_host() -> bool:
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


def _one_host_secret(rank: int) -> tuple[bytes, Path]:
    """A secret rank 0 makes for the ranks of a one-host job, in a private file named by the run id."""
    path = _torchrun_dir()
    if rank == 0:
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            raise CoordinationError(f"{path} exists already: another torchrun job with this run id (--rdzv-id) "
                                    "runs, or one was killed; use another id or remove it") from None
        secret = secrets.token_hex(32).encode()
        fd = os.open(path / "secret.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        os.rename(path / "secret.tmp", path / "secret")  # whole, or not there
        return secret, path
    deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
    while not (path / "secret").exists():
        if time.monotonic() > deadline:
            raise CoordinationError(f"rank 0 made no secret at {path / 'secret'} within "
                                    f"{STORE_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.05)
    _private_dir(path)
    return read_secret_file(path / "secret"), path


def torchrun_plane(rank: int, interface: str | None) -> tuple[ListeningPlane | None, AuthenticatedStore, str]:
    """This torchrun rank's side of the coordination plane: (the plane, which rank 0 makes and must close;
    the authenticated store; the address this rank's gloo pairs listen on). Rank 0 listens on the address of
    ``interface`` (default: loopback, one host only) and publishes it, signed, in torchrun's own store. The
    secret comes from the environment; on one host, if none is set, rank 0 makes one in a private file."""
    if interface is None and not _one_host():
        raise CoordinationError("torchrun over several hosts: name the network interface the workers reach each "
                                "other on with --interface (e.g. eth0)")
    address = interface_address(interface) if interface is not None else LOOPBACK
    secret, made = secret_from_env(), None
    if secret is None and _one_host():
        secret, made = _one_host_secret(rank)
    elif secret is None:
        raise CoordinationError(f"torchrun over several hosts needs the run's secret on every host: set "
                                f"{SECRET_FILE_ENV} to a file only you can read (`python -c 'import secrets; "
                                f"print(secrets.token_hex(32))' > FILE; chmod 600 FILE`), or {SECRET_ENV}")
    rendezvous, _, _ = next(dist.rendezvous("env://"))
    published = AuthenticatedStore(rendezvous, secret)
    if rank == 0:
        plane = ListeningPlane(address, secret, made)
        published.set(_PLANE_KEY, plane.address)
        return plane, plane.store, address
    host, port = published.get(_PLANE_KEY).decode().rsplit(":", 1)
    return None, ListeningPlane.join(host, int(port), secret), address
