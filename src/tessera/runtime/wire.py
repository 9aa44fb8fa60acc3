"""What travels between processes of the runtime, as bytes: the driver's commands and the workers' replies
(over a pipe to a local worker, or through the key-value store to a torchrun rank), and the activations and
state bytes workers send each other over gloo.

A message (:mod:`tessera.runtime.commands`) is pickled as its type's name and its fields by name, so the
bytes name no module and the reading side rebuilds the dataclass without calling its ``__init__``: nearly as
cheap as the plain dicts the protocol was made of before it was typed, and a message the other side's code
does not have (or has with other fields) is refused by name. Tensors inside a message travel as
pickle carries them. A transfer between workers is its pieces' byte ranges packed into one flat host tensor
(:func:`pack`) and written back into the receiver's buffers (:func:`unpack`).
"""

from __future__ import annotations

import pickle
from dataclasses import fields

import torch

from tessera.graph.ir import KernelGraph
from tessera.program.program import Piece
from tessera.runtime.commands import COMMANDS, REPLIES, Command, ProtocolError, Reply

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_NAME: dict[type, str] = {cls: cls.__name__ for cls in COMMANDS + REPLIES}
_TYPE: dict[str, tuple[type, frozenset[str]]] = {
    cls.__name__: (cls, frozenset(f.name for f in fields(cls))) for cls in COMMANDS + REPLIES}
_new = object.__new__


def encode(message: Command | Reply) -> bytes:
    """``message`` as the bytes that carry it to the other side."""
    name = _NAME.get(type(message))
    if name is None:
        raise ProtocolError(f"{type(message).__name__} is not a message of tessera.runtime.commands")
    return pickle.dumps((name, message.__dict__), _PROTOCOL)


def decode(data: bytes) -> Command | Reply:
    """The message that :func:`encode` turned into ``data``."""
    try:
        name, values = pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - anything unreadable is a protocol error
        raise ProtocolError(f"unreadable message ({type(e).__name__}: {e})") from e
    entry = _TYPE.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ProtocolError(f"unknown message {name!r}: the other side runs a different tessera.runtime.commands")
    cls, names = entry
    if not isinstance(values, dict) or values.keys() != names:
        values = values if isinstance(values, dict) else {}
        raise ProtocolError(f"{name} came with the fields {sorted(values)}, this side's has {sorted(names)}: the "
                            "other side runs a different tessera.runtime.commands")
    message = _new(cls)
    message.__dict__.update(values)
    return message


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def gather(storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...]) -> torch.Tensor:
    """The bytes of ``pieces`` as one new flat tensor on their storages' device."""
    parts = [_bytes_view(storages[p.buffer])[lo:hi] for p in pieces for lo, hi in p.spans]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def pack(storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...]) -> torch.Tensor:
    """The bytes of ``pieces`` as one flat host tensor."""
    return gather(storages, pieces).cpu()


def unpack(storages: dict[str, torch.UntypedStorage], pieces: tuple[Piece, ...], flat: torch.Tensor,
           device: torch.device, graph: KernelGraph | None = None) -> None:
    """Write a received flat tensor into the pieces' buffers (allocating one not present yet: ``graph`` gives
    its size)."""
    at = 0
    for p in pieces:
        st = storages.get(p.buffer)
        if st is None:
            st = torch.zeros(graph.buffers[p.buffer].nbytes, dtype=torch.uint8, device=device).untyped_storage()
            storages[p.buffer] = st
        view = _bytes_view(st)
        for lo, hi in p.spans:
            view[lo:hi].copy_(flat[at: at + hi - lo])
            at += hi - lo
