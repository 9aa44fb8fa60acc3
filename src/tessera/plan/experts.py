"""Split an MoE layer's grouped expert GEMM into expert parts so that experts can live on different devices.

A grouped GEMM over E experts becomes P **parts** and one **combine**:

* Part p holds a contiguous block of experts by popularity: part 0 the hottest ``counts[0]`` experts,
  part 1 the next, ... (``np.array_split`` sizes, so counts differ by at most one). It serves the
  token-expert assignments routed to its experts (``routed_shares``: the routing distribution's
  probabilities summed over the block), so skew puts the load on part 0. Its FLOPs and activations
  are the kernel's times that share; its weight bytes are those of the expected distinct experts of
  its block the rows touch (as :class:`tessera.cost.features.FeatureExtractor` counts them for the
  whole kernel). Times come from the roofline (:func:`tessera.cost.roofline.kernel_time`) with each
  device's ``grouped_gemm`` efficiency, so every part pays its floor in full.
* The combine assembles the parts' outputs (row-disjoint: each assignment is computed by exactly one
  part) into the kernel's output activation: an elementwise kernel reading and writing the output
  once, one operation per output element.

:func:`split_kernel` rewrites a :class:`PlacementProblem` accordingly (see its docstring) and returns
a :class:`SplitMapping` from the new kernel indices to the original kernel and part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from tessera.cost.features import KernelFeatures
from tessera.cost.model import CostModel
from tessera.cost.options import TRACE_DTYPE_BITS
from tessera.cost.roofline import kernel_time
from tessera.cost.routing import RoutingDistribution
from tessera.errors import TesseraError
from tessera.plan.problem import MemorySpec, PlacementProblem

COMBINE = "combine"


class ExpertSplitError(TesseraError, ValueError):
    """An expert split that cannot be made: not a grouped GEMM, a part count out of range, bad shapes."""


def expert_counts(experts: int, parts: int) -> list[int]:
    """Experts in each part (contiguous popularity blocks, hottest first; sizes differ by at most one)."""
    if not 1 <= parts <= experts:
        raise ExpertSplitError(f"an expert GEMM over {experts} experts splits into 1 to {experts} parts (got {parts})")
    return [len(block) for block in np.array_split(np.arange(experts), parts)]


def _blocks(routing: RoutingDistribution, parts: int) -> list[np.ndarray]:
    expert_counts(routing.experts, parts)
    return np.array_split(np.arange(routing.experts), parts)


def routed_shares(routing: RoutingDistribution, parts: int) -> np.ndarray:
    """[P] share of token-expert assignments each part serves (part 0: the hottest experts; sums to 1)."""
    probs = np.array(routing.probabilities())
    return np.array([probs[block].sum() for block in _blocks(routing, parts)])


def weight_shares(experts: int, parts: int) -> np.ndarray:
    """[P] share of the expert weights each part holds (its expert count / experts)."""
    return np.array(expert_counts(experts, parts), dtype=float) / experts


def _check(feature: KernelFeatures) -> tuple[int, int, int, int]:
    if feature.cost_class != "grouped_gemm" or feature.gemm is None:
        raise ExpertSplitError(f"kernel {feature.index} is a {feature.cost_class} kernel; only grouped expert GEMMs "
                               "(cost class grouped_gemm, with GEMM dims) split into expert parts")
    return feature.gemm


def _itemsize(f: KernelFeatures) -> float:
    return TRACE_DTYPE_BITS.get(f.compute_dtype, 16) / 8


def part_features(feature: KernelFeatures, parts: int, routing: RoutingDistribution) -> list[KernelFeatures]:
    """The roofline features of each expert part (see the module docstring). ``routing.experts`` must be
    the kernel's expert count."""
    batch, rows, n, k = _check(feature)
    probs = np.array(routing.probabilities())
    uniform = RoutingDistribution(routing.experts).expected_active(rows)
    total_weights = feature.weight_bytes * routing.experts / uniform if uniform > 0 else feature.weight_bytes
    out = []
    for block in _blocks(routing, parts):
        share = float(probs[block].sum())
        active = float(np.sum(1.0 - (1.0 - probs[block]) ** rows)) if rows > 0 else 0.0
        out.append(replace(feature, gemm=(batch, max(1, math.ceil(rows * share - 1e-9)), n, k),
                           flops=feature.flops * share, weight_bytes=total_weights * active / routing.experts,
                           kv_bytes=feature.kv_bytes * share, other_bytes=feature.other_bytes * share))
    return out


def expert_part_times(feature: KernelFeatures, models: list[CostModel], parts: int,
                      routing: RoutingDistribution) -> np.ndarray:
    """[P, D] seconds of each expert part (part 0 the hottest experts) on each model's device."""
    feats = part_features(feature, parts, routing)
    return np.array([[kernel_time(f, m.device, m.efficiency.for_kernel(f.cost_class, f.op), m.options).time_s for m in models]
                     for f in feats])


def output_bytes(feature: KernelFeatures) -> float:
    """Bytes of a grouped GEMM's output activation (assignments x N in the compute dtype)."""
    _, rows, n, _ = _check(feature)
    return rows * n * _itemsize(feature)


def part_bytes(feature: KernelFeatures, parts: int, routing: RoutingDistribution) -> tuple[np.ndarray, np.ndarray]:
    """([P] input, [P] output) activation bytes of each part: its routed share of the kernel's input
    (assignments x K) and output (assignments x N)."""
    _, rows, _, k = _check(feature)
    shares = routed_shares(routing, parts)
    return shares * rows * k * _itemsize(feature), shares * output_bytes(feature)


def combine_features(feature: KernelFeatures) -> KernelFeatures:
    """The combine of a split expert GEMM: an elementwise kernel reading the parts' rows and writing the
    output activation (one operation per output element)."""
    out = output_bytes(feature)
    return KernelFeatures(index=feature.index, cost_class="elementwise", block=feature.block,
                          flops=out / _itemsize(feature), weight_bytes=0.0, kv_bytes=0.0, other_bytes=2 * out,
                          compute_dtype=feature.compute_dtype, gemm=None)


def combine_times(feature: KernelFeatures, models: list[CostModel]) -> np.ndarray:
    """[D] seconds of the combine of a split expert GEMM on each model's device."""
    f = combine_features(feature)
    return np.array([kernel_time(f, m.device, m.efficiency.for_kernel(f.cost_class, f.op), m.options).time_s for m in models])


# ---------------------------------------------------------------------------------------------------------
# Rewriting a placement problem


@dataclass(frozen=True)
class SplitMapping:
    """Kernel ``i`` of the split problem is ``origin[i] = (original kernel, tag)``: tag ``None`` for an
    unchanged kernel, the part number for an expert part, ``"combine"`` for the combine."""

    origin: tuple[tuple[int, int | str | None], ...]

    def __len__(self) -> int:
        return len(self.origin)

    def index_of(self, original: int, tag: int | str | None = None) -> int:
        """The new index of original kernel ``original`` (with ``tag``: of that part or its combine)."""
        for i, entry in enumerate(self.origin):
            if entry == (original, tag):
                return i
        raise ExpertSplitError(f"kernel {original} has no {'kernel' if tag is None else repr(tag)} in this split")

    def parts_of(self, original: int) -> list[int]:
        """New indices of the expert parts of ``original`` in part order (empty if it was not split)."""
        return list(self._parts.get(original, ()))

    @cached_property
    def _parts(self) -> dict[int, list[int]]:
        found: dict[int, list[tuple[int, int]]] = {}
        for i, (o, tag) in enumerate(self.origin):
            if isinstance(tag, int):
                found.setdefault(o, []).append((tag, i))
        return {o: [i for _, i in sorted(parts)] for o, parts in found.items()}

    def then(self, later: SplitMapping) -> SplitMapping:
        """The mapping of this split followed by ``later`` (a split of the problem this one produced)."""
        out = []
        for j, tag in later.origin:
            original, first = self.origin[j]
            if tag is not None and first is not None:
                raise ExpertSplitError(f"kernel {j} is already part {first!r} of kernel {original}; split it once")
            out.append((original, first if tag is None else tag))
        return SplitMapping(tuple(out))

    def assignment(self, split_assignment: Sequence[int]) -> dict[int, list[int]]:
        """Original kernel -> devices its new kernels run on (one entry per new kernel, in order)."""
        out: dict[int, list[int]] = {}
        for (original, _), dev in zip(self.origin, split_assignment, strict=True):
            out.setdefault(original, []).append(int(dev))
        return out


def _fractions(values: Sequence[float], parts: int, what: str) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    if v.shape != (parts,) or (v < 0).any():
        raise ExpertSplitError(f"{what} needs {parts} non-negative entries, one per part (got {list(values)})")
    return v / v.sum() if v.sum() > 0 else np.full(parts, 1.0 / parts)


def split_kernel(problem: PlacementProblem, kernel: int, part_times: np.ndarray, combine_times: np.ndarray,
                 in_bytes_per_part: Sequence[float], out_bytes_per_part: Sequence[float],
                 weight_shares: Sequence[float] | None = None) -> tuple[PlacementProblem, SplitMapping]:
    """Replace kernel ``kernel`` by P expert parts (new indices kernel .. kernel+P-1) and a combine
    (kernel+P); later kernels shift by P.

    * Times: ``part_times`` [P, D] and ``combine_times`` [D].
    * Edges into the kernel go to every part, their bytes split in proportion to ``in_bytes_per_part``
      (each part receives its tokens); edges out of it leave from the combine; each part sends
      ``out_bytes_per_part[p]`` to the combine (one message). Loop edges are remapped alike.
    * Memory: an item only this kernel reads (its expert weights) becomes one item per part of
      ``weight_shares[p]`` x its bytes (default: equal shares; see :func:`weight_shares`), part 0 keeping
      the item's index and parts 1.. appended; an item other kernels read too is read whole by every part.
    * A pinned kernel pins its parts and combine to the same device; ``together`` pairs naming the kernel
      name its combine (the kernel that hands its output to the rest of the step).
    """
    k_old, nd = problem.times.shape
    if not 0 <= kernel < k_old:
        raise ExpertSplitError(f"kernel {kernel} does not exist (the problem has {k_old} kernels)")
    pt = np.asarray(part_times, dtype=float)
    if pt.ndim != 2 or pt.shape[1] != nd or pt.shape[0] < 1:
        raise ExpertSplitError(f"part_times must be [parts, {nd}] seconds (got shape {pt.shape})")
    ct = np.asarray(combine_times, dtype=float)
    if ct.shape != (nd,):
        raise ExpertSplitError(f"combine_times needs one entry per device ({nd}; got shape {ct.shape})")
    p = pt.shape[0]
    into = _fractions(in_bytes_per_part, p, "in_bytes_per_part")
    outs = np.asarray(out_bytes_per_part, dtype=float)
    if outs.shape != (p,) or (outs < 0).any():
        raise ExpertSplitError(f"out_bytes_per_part needs {p} non-negative entries (got {list(out_bytes_per_part)})")
    shares = (np.full(p, 1.0 / p) if weight_shares is None else np.asarray(weight_shares, dtype=float))
    if shares.shape != (p,) or (shares < 0).any() or not math.isclose(shares.sum(), 1.0, rel_tol=1e-6):
        raise ExpertSplitError(f"weight_shares needs {p} non-negative shares summing to 1 (got {list(shares)})")

    combine = kernel + p

    def new(i: int) -> int:
        return i if i < kernel else combine if i == kernel else i + p

    times = np.concatenate([problem.times[:kernel], pt, ct[None, :], problem.times[kernel + 1:]])
    edges, messages = [], []
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        if dst == kernel:
            for q in range(p):
                edges.append((new(src), kernel + q, float(nbytes * into[q])))
                messages.append(count)
        else:
            edges.append((new(src), new(dst), nbytes))
            messages.append(count)
    for q in range(p):
        edges.append((kernel + q, combine, float(outs[q])))
        messages.append(1.0)
    loops = []
    for src, dst, nbytes, count in problem.loop_edges:
        if dst == kernel:
            loops += [(new(src), kernel + q, float(nbytes * into[q]), count) for q in range(p)]
        else:
            loops.append((new(src), new(dst), nbytes, count))
    pinned = {}
    for i, dev in problem.pinned.items():
        for j in ([*range(kernel, combine + 1)] if i == kernel else [new(i)]):
            pinned[j] = dev
    together = [(new(i), new(j)) for i, j in problem.together]
    memory = _split_memory(problem.memory, kernel, p, shares, new) if problem.memory is not None else None
    split = PlacementProblem(list(problem.devices), times, edges, problem.bandwidth.copy(), problem.latency.copy(),
                             pinned, together, problem.micro_batches, messages, memory, loops)
    origin = ([(i, None) for i in range(kernel)] + [(kernel, q) for q in range(p)] + [(kernel, COMBINE)]
              + [(i, None) for i in range(kernel + 1, k_old)])
    return split, SplitMapping(tuple(origin))


def _split_memory(m: MemorySpec, kernel: int, parts: int, shares: np.ndarray, new) -> MemorySpec:
    readers = m.readers()
    names = list(m.item_names) if m.item_names is not None else [f"item{w}" for w in range(len(m.item_bytes))]
    sizes = list(m.item_bytes)
    reads = []
    for i, w in sorted(set(m.reads)):
        if i != kernel:
            reads.append((new(i), w))
        elif set(readers[w]) != {kernel}:  # shared with other kernels: every part reads it whole
            reads += [(kernel + q, w) for q in range(parts)]
        else:  # the kernel's own item (its experts' weights): one share per part
            base, whole = names[w], sizes[w]
            for q in range(parts):
                item = w if q == 0 else len(sizes)
                if q == 0:
                    sizes[w], names[w] = whole * shares[0], f"{base}[part 0]"
                else:
                    sizes.append(whole * shares[q])
                    names.append(f"{base}[part {q}]")
                reads.append((kernel + q, item))
    return MemorySpec(np.array(sizes, dtype=float), sorted(reads), m.capacity.copy(), names)


@dataclass(frozen=True)
class KernelSplit:
    """One kernel's split as :func:`split_kernel` takes it."""

    kernel: int
    part_times: np.ndarray
    combine_times: np.ndarray
    in_bytes_per_part: Sequence[float]
    out_bytes_per_part: Sequence[float]
    weight_shares: Sequence[float] | None = None


def split_kernels(problem: PlacementProblem, splits: list[KernelSplit]) -> tuple[PlacementProblem, SplitMapping]:
    """Every kernel of ``splits`` (distinct kernels) split at once: the problem and mapping that
    :func:`split_kernel` applied to each, the last kernel first, gives (the same kernels, edges, items and
    orders), in one pass over the problem instead of one per split."""
    k_old, nd = problem.times.shape
    by_kernel: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
    for s in splits:
        if not 0 <= s.kernel < k_old or s.kernel in by_kernel:
            raise ExpertSplitError(f"kernel {s.kernel} does not exist or is split twice (the problem has "
                                   f"{k_old} kernels)")
        pt, ct = np.asarray(s.part_times, dtype=float), np.asarray(s.combine_times, dtype=float)
        if pt.ndim != 2 or pt.shape[1] != nd or pt.shape[0] < 1 or ct.shape != (nd,):
            raise ExpertSplitError(f"kernel {s.kernel}: part_times must be [parts, {nd}] and combine_times [{nd}] "
                                   f"seconds (got shapes {pt.shape}, {ct.shape})")
        p = pt.shape[0]
        outs = np.asarray(s.out_bytes_per_part, dtype=float)
        if outs.shape != (p,) or (outs < 0).any():
            raise ExpertSplitError(f"out_bytes_per_part needs {p} non-negative entries (got {list(outs)})")
        shares = np.full(p, 1.0 / p) if s.weight_shares is None else np.asarray(s.weight_shares, dtype=float)
        if shares.shape != (p,) or (shares < 0).any() or not math.isclose(shares.sum(), 1.0, rel_tol=1e-6):
            raise ExpertSplitError(f"weight_shares needs {p} non-negative shares summing to 1 (got {list(shares)})")
        by_kernel[s.kernel] = (pt, ct, _fractions(s.in_bytes_per_part, p, "in_bytes_per_part"), outs, shares)
    first = np.zeros(k_old, dtype=int)  # each original kernel's first new index (a split kernel's part 0)
    new = np.zeros(k_old, dtype=int)  # each original kernel's new index (a split kernel's combine)
    shift, rows, origin = 0, [], []
    for i in range(k_old):
        first[i] = i + shift
        if i in by_kernel:
            pt, ct = by_kernel[i][:2]
            shift += pt.shape[0]
            rows += [pt, ct[None, :]]
            origin += [(i, q) for q in range(pt.shape[0])] + [(i, COMBINE)]
        else:
            rows.append(problem.times[i:i + 1])
            origin.append((i, None))
        new[i] = i + shift
    edges, messages = [], []
    for (src, dst, nbytes), count in zip(problem.edges, problem.messages, strict=True):
        if dst in by_kernel:
            into = by_kernel[dst][2]
            edges += [(int(new[src]), int(first[dst]) + q, float(nbytes * into[q])) for q in range(len(into))]
            messages += [count] * len(into)
        else:
            edges.append((int(new[src]), int(new[dst]), nbytes))
            messages.append(count)
    for k in sorted(by_kernel, reverse=True):  # split_kernel appends each kernel's part -> combine edges
        outs = by_kernel[k][3]
        edges += [(int(first[k]) + q, int(new[k]), float(outs[q])) for q in range(len(outs))]
        messages += [1.0] * len(outs)
    loops = []
    for src, dst, nbytes, count in problem.loop_edges:
        if dst in by_kernel:
            into = by_kernel[dst][2]
            loops += [(int(new[src]), int(first[dst]) + q, float(nbytes * into[q]), count) for q in range(len(into))]
        else:
            loops.append((int(new[src]), int(new[dst]), nbytes, count))
    pinned = {}
    for i, dev in problem.pinned.items():
        for j in (range(int(first[i]), int(new[i]) + 1) if i in by_kernel else [int(new[i])]):
            pinned[j] = dev
    together = [(int(new[i]), int(new[j])) for i, j in problem.together]
    memory = None
    if problem.memory is not None:
        memory = _split_memories(problem.memory, by_kernel, first, new)
    split = PlacementProblem(list(problem.devices), np.concatenate(rows), edges, problem.bandwidth.copy(),
                             problem.latency.copy(), pinned, together, problem.micro_batches, messages, memory, loops)
    return split, SplitMapping(tuple(origin))


def _split_memories(m: MemorySpec, by_kernel: dict, first: np.ndarray, new: np.ndarray) -> MemorySpec:
    """:func:`_split_memory` for every split kernel at once (appended part items in the order the splits,
    last kernel first, append them)."""
    readers = m.readers()
    names = list(m.item_names) if m.item_names is not None else [f"item{w}" for w in range(len(m.item_bytes))]
    sizes = list(m.item_bytes)
    reads = []
    own: dict[int, list[int]] = {}
    for i, w in sorted(set(m.reads)):
        if i not in by_kernel:
            reads.append((int(new[i]), w))
        elif set(readers[w]) != {i}:  # shared with other kernels: every part reads it whole
            reads += [(int(first[i]) + q, w) for q in range(len(by_kernel[i][4]))]
        else:
            own.setdefault(i, []).append(w)
    for k in sorted(own, reverse=True):
        shares = by_kernel[k][4]
        for w in own[k]:  # the kernel's own items (its experts' weights): one share per part
            base, whole = names[w], sizes[w]
            sizes[w], names[w] = whole * shares[0], f"{base}[part 0]"
            reads.append((int(first[k]), w))
            for q in range(1, len(shares)):
                reads.append((int(first[k]) + q, len(sizes)))
                sizes.append(whole * shares[q])
                names.append(f"{base}[part {q}]")
    return MemorySpec(np.array(sizes, dtype=float), sorted(reads), m.capacity.copy(), names)
