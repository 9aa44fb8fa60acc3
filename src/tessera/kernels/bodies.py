"""Tessera's custom ops defined with their bodies kept: `custom_op` registers a ``tessera::`` op exactly as
``torch.library.custom_op`` does (what a trace records, its fake, its schema) and also keeps the Python
function, so a replay can call the body itself. Through the dispatcher each call of a Python custom op costs
tens of microseconds of torch's Python wrappers (and the first one imports ``torch._dynamo``, about a second);
the body computes the same thing with the same torch ops, so its results are the op's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

BODIES: dict[str, Callable] = {}  # traced op name ("tessera.rms_norm.default") -> its Python body


def custom_op(name: str, mutates_args: Iterable[str] | str):
    """``torch.library.custom_op(name, mutates_args=...)``, the decorated function also kept as the op's body
    (`body`)."""

    def register(fn: Callable):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        BODIES[name.replace("::", ".") + ".default"] = fn
        return op

    return register


def body(name: str) -> Callable | None:
    """The Python body of the traced custom op ``name`` (e.g. ``tessera.rms_norm.default``), or None for an op
    not defined with `custom_op`."""
    return BODIES.get(name)
