"""The listening socket of a server command (`tessera serve`, `tessera route`): bound before the slow start,
so a taken port fails at once."""

from __future__ import annotations

import ipaddress
import socket

from tessera.serve.config import ServeOptionError


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the (slow) engine start so a taken port fails at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServeOptionError(f"--host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ServeOptionError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    """The URL clients reach the socket at."""
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def is_loopback(sock: socket.socket) -> bool:
    """Whether the socket listens on a loopback address only."""
    return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback


__all__ = ["is_loopback", "listen", "url_of"]
