"""Check that a fused op's declared accesses are true, on real tensors.

A trace records a custom op as reading every tensor argument (the strided view passed) and writing the
arguments its schema marks as mutated plus its outputs. `assert_accesses_true` checks both halves of that
claim on the CPU body:

- every byte that changes in any argument's storage lies inside a view the op declares it writes;
- perturbing every byte of the argument storages outside the views passed (the declared reads) leaves the
  outputs and the declared writes bit for bit unchanged.

Arguments that fill their whole storage are first moved into larger storages with guard bytes on both sides,
so there is always something outside the declared views to perturb and to watch.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

GUARD_ELEMENTS = 64


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def in_larger_storage(t: torch.Tensor, guard: int = GUARD_ELEMENTS, seed: int = 0) -> torch.Tensor:
    """``t`` as a view into a bigger storage (``guard`` random elements before and after it), same values."""
    g = torch.Generator().manual_seed(seed)
    n = t.numel()
    if t.dtype.is_floating_point:
        base = torch.randn(n + 2 * guard, generator=g).to(t.dtype)
    elif t.dtype == torch.bool:
        base = torch.randint(0, 2, (n + 2 * guard,), generator=g).bool()
    else:
        base = torch.randint(0, 100, (n + 2 * guard,), generator=g).to(t.dtype)
    view = base[guard:guard + n].view(t.shape)
    view.copy_(t)
    return view


def _byte_mask(t: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(storage key, boolean mask over the storage's bytes) of the bytes the view ``t`` covers."""
    nbytes = t.untyped_storage().nbytes()
    item = t.element_size()
    mask = torch.zeros(nbytes, dtype=torch.bool)
    if t.numel() == 0:
        return _storage_key(t), mask
    idx = torch.arange(nbytes // item).as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1)
    starts = idx * item
    for b in range(item):
        mask[starts + b] = True
    return _storage_key(t), mask


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.tensor([], dtype=torch.uint8).set_(storage).clone()


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _written_args(op, args, kwargs) -> list[torch.Tensor]:
    schema = op._schema
    bound = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
    out = []
    for arg, value in zip(schema.arguments, bound, strict=False):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.extend(_tensors(value))
    return out


def _clone_storages(args, kwargs):
    """Copies of the arguments whose views keep their offsets and strides in copied storages."""
    copies: dict[int, torch.UntypedStorage] = {}

    def clone(t):
        if not isinstance(t, torch.Tensor):
            return t
        key = _storage_key(t)
        if key not in copies:
            copies[key] = t.untyped_storage().clone()
        return torch.empty(0, dtype=t.dtype).set_(copies[key], t.storage_offset(), t.shape, t.stride())

    return tree_map(clone, args), tree_map(clone, kwargs)


def assert_accesses_true(op, args: tuple, kwargs: dict | None = None, seed: int = 0,
                         embed: bool = True) -> None:
    """Assert the op's declared reads and writes hold on these arguments (see the module docstring).

    ``op`` is an OpOverload (``torch.ops.tessera.rms_norm.default``) or its packet. With ``embed``, every
    tensor argument that fills its storage is first moved into a larger storage with guard bytes.
    """
    kwargs = dict(kwargs or {})
    if not hasattr(op, "_schema"):
        op = op.default
    if embed:
        def place(t):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() <= t.numel() * t.element_size():
                return in_larger_storage(t, seed=seed)
            return t

        args, kwargs = tree_map(place, tuple(args)), tree_map(place, kwargs)

    # 1. Bytes that change lie inside the declared writes.
    a1, k1 = _clone_storages(args, kwargs)
    inputs = _tensors((a1, k1))
    storages = {_storage_key(t): t.untyped_storage() for t in inputs}
    before = {key: _bytes(s) for key, s in storages.items()}
    with torch.no_grad():
        out1 = op(*a1, **k1)
    write_masks: dict[int, torch.Tensor] = {}
    for t in _written_args(op, a1, k1):
        key, mask = _byte_mask(t)
        write_masks[key] = write_masks.get(key, torch.zeros_like(mask)) | mask
    for key, s in storages.items():
        changed = _bytes(s) != before[key]
        allowed = write_masks.get(key, torch.zeros_like(changed))
        stray = changed & ~allowed
        assert not stray.any(), (f"{op}: {int(stray.sum())} bytes changed outside the declared writes "
                                 f"(first at byte {int(stray.nonzero()[0])} of a {len(changed)}-byte storage)")

    # 2. Bytes outside the declared reads do not matter.
    a2, k2 = _clone_storages(args, kwargs)
    read_masks: dict[int, torch.Tensor] = {}
    for t in _tensors((a2, k2)):
        key, mask = _byte_mask(t)
        read_masks[key] = read_masks.get(key, torch.zeros_like(mask)) | mask
    g = torch.Generator().manual_seed(seed + 1)
    perturbed = 0
    for t in _tensors((a2, k2)):
        key = _storage_key(t)
        mask = read_masks.pop(key, None)
        if mask is None:
            continue
        raw = torch.tensor([], dtype=torch.uint8).set_(t.untyped_storage())
        noise = torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8)
        raw[~mask] = noise[~mask]
        perturbed += int((~mask).sum())
    assert perturbed > 0, f"{op}: nothing outside the declared reads to perturb (pass views into larger storages)"
    with torch.no_grad():
        out2 = op(*a2, **k2)
    for x, y in zip(_tensors(out1), _tensors(out2), strict=True):
        assert torch.equal(x.view(torch.uint8) if x.dtype != torch.bool else x,
                           y.view(torch.uint8) if y.dtype != torch.bool else y), \
            f"{op}: an output depends on bytes outside the declared reads"
    for x, y in zip(_written_args(op, a1, k1), _written_args(op, a2, k2), strict=True):
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), \
            f"{op}: a written argument depends on bytes outside the declared reads"
