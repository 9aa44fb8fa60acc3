"""Splitting a grouped expert GEMM into expert parts plus a combine, and placing the parts."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.cost.features import KernelFeatures
from tessera.cost.model import CostModel
from tessera.cost.roofline import kernel_time
from tessera.cost.routing import RoutingDistribution
from tessera.hardware.devices import resolve_device
from tessera.plan.enumerate import solve_by_enumeration
from tessera.plan.experts import (
    ExpertSplitError,
    combine_times,
    expert_counts,
    expert_part_times,
    part_bytes,
    part_features,
    routed_shares,
    split_kernel,
    weight_shares,
)
from tessera.plan.milp import SolverError, solve_placement
from tessera.plan.problem import MemorySpec, PlacementProblem

E, ROWS, N, K = 64, 8192, 1536, 2048  # 64 experts; 1024 tokens x top-8 assignments (a prefill chunk)
EXPERT_BYTES = E * K * N * 2  # bf16 weights of all experts


def grouped_gemm(rows: int = ROWS) -> KernelFeatures:
    """A grouped GEMM as the feature extractor sees it: weights of the expected active experts (uniform)."""
    active = RoutingDistribution(E).expected_active(rows)
    return KernelFeatures(7, "grouped_gemm", "ffn", 2.0 * rows * N * K, EXPERT_BYTES * active / E, 0.0,
                          rows * (K + N) * 2.0, "bfloat16", (1, rows, N, K))


def models(*names: str) -> list[CostModel]:
    return [CostModel(resolve_device(n)) for n in names]


@pytest.mark.parametrize("skew", [0.0, 0.7, 1.5])
@pytest.mark.parametrize("parts", [1, 2, 3, 5, 64])
def test_routed_shares_sum_to_one(parts, skew):
    r = RoutingDistribution(E, top_k=8, skew=skew)
    shares = routed_shares(r, parts)
    assert shares.sum() == pytest.approx(1.0)
    assert sum(expert_counts(E, parts)) == E and weight_shares(E, parts).sum() == pytest.approx(1.0)
    if skew == 0.0:
        assert shares == pytest.approx(weight_shares(E, parts))


def test_skew_moves_load_into_part_zero():
    uniform, skewed = RoutingDistribution(E, 8, 0.0), RoutingDistribution(E, 8, 1.2)
    s = routed_shares(skewed, 4)
    assert list(s) == sorted(s, reverse=True) and s[0] > 0.5
    # part 0: the hottest 16 experts, sum_{r=1..16} r^-1.2 / sum_{r=1..64} r^-1.2
    ranks = np.arange(1, E + 1) ** -1.2
    assert s[0] == pytest.approx(ranks[:16].sum() / ranks.sum())
    m = models("H100")
    t_uniform = expert_part_times(grouped_gemm(), m, 4, uniform)[:, 0]
    t_skewed = expert_part_times(grouped_gemm(), m, 4, skewed)[:, 0]
    assert t_uniform == pytest.approx(np.full(4, t_uniform[0]))
    assert t_skewed[0] > t_uniform[0] > t_skewed[3]
    feats = part_features(grouped_gemm(), 4, skewed)
    assert [f.flops for f in feats] == pytest.approx(grouped_gemm().flops * s)


def test_one_part_is_the_unsplit_kernel():
    f = grouped_gemm(rows=16)
    m = models("H100", "L40S")
    t = expert_part_times(f, m, 1, RoutingDistribution(E, 8))
    expect = [kernel_time(f, x.device, x.efficiency.classes["grouped_gemm"], x.options).time_s for x in m]
    assert t.shape == (1, 2) and t[0] == pytest.approx(expect)


@pytest.mark.parametrize("rows", [16, 512, 2048])
@pytest.mark.parametrize("skew", [0.0, 1.2])
def test_parts_do_not_create_free_work(rows, skew):
    """Each part pays its own floor and reads its own experts: the parts together take at least the
    unsplit kernel's time on every device (what they gain is running on different devices). The sizes
    keep the activations within L2 whole or split: the roofline serves activations under half the L2
    from it, so a kernel whose activations fit only once split is the one way parts get cheaper."""
    f, m = grouped_gemm(rows), models("H100", "L40S", "H20")
    r = RoutingDistribution(E, 8, skew)
    whole = expert_part_times(f, m, 1, r)[0]
    for parts in (2, 4, 8):
        assert (expert_part_times(f, m, parts, r).sum(axis=0) >= whole * (1 - 1e-9)).all()


def test_split_on_identical_devices_only_spreads_the_work():
    """Identical devices, free links: a split cannot beat the unsplit kernel by more than spreading the
    parts over the devices (cycle >= M x (parts + combine) / D), nor finish before its largest part."""
    f, r = grouped_gemm(), RoutingDistribution(E, 8, 1.0)
    m = models("H100", "H100")
    pt, ct = expert_part_times(f, m, 4, r), combine_times(f, m)
    whole = expert_part_times(f, m, 1, r)[0, 0]
    free = dict(bandwidth=np.full((2, 2), np.inf), latency=np.zeros((2, 2)))
    base = PlacementProblem(["a", "b"], [[1e-5, 1e-5], [whole, whole], [1e-5, 1e-5]], [(0, 1, 1e7), (1, 2, 1e7)],
                            micro_batches=8, **free)
    in_b, out_b = part_bytes(f, 4, r)
    split, _ = split_kernel(base, 1, pt, ct, in_b, out_b)
    for objective in ("throughput", "latency"):
        best = solve_placement(split, objective, gap=1e-9)
        assert best.value == pytest.approx(solve_by_enumeration(split, objective).value, rel=1e-6)
        if objective == "throughput":
            assert best.value >= 8 * (pt[:, 0].sum() + ct[0] + 2e-5) / 2 * (1 - 1e-6)
            assert best.value >= 8 * (whole + 2e-5) / 2 * (1 - 1e-6)
        else:
            assert best.value >= 2e-5 + pt[:, 0].max() + ct[0] - 1e-12


def small_problem() -> PlacementProblem:
    """0 -> 1 (the expert GEMM) -> 2 -> 3, a skip 0 -> 2; items: experts (read by 1), shared (0 and 1), head (3)."""
    memory = MemorySpec([600.0, 50.0, 10.0], [(1, 0), (0, 1), (1, 1), (3, 2)], [1000.0, 1000.0],
                        ["experts", "shared", "head"])
    return PlacementProblem(["a", "b"], [[1, 2], [10, 20], [3, 4], [5, 6]], [(0, 1, 100.0), (0, 2, 7.0), (1, 2, 40.0),
                            (2, 3, 9.0)], np.full((2, 2), 1e3), np.full((2, 2), 1e-3), pinned={3: 1},
                            together=[(1, 3)], micro_batches=2, messages=[1, 2, 3, 4], memory=memory,
                            loop_edges=[(3, 1, 30.0, 5.0), (1, 0, 8.0, 1.0)])


def test_split_kernel_rewrites_edges_memory_and_constraints():
    p = small_problem()
    pt = np.array([[6.0, 12.0], [3.0, 1.5]])
    split, mapping = split_kernel(p, 1, pt, np.array([0.5, 0.25]), [75.0, 25.0], [30.0, 10.0],
                                  weight_shares=[0.5, 0.5])
    # kernels: 0, part 0 (1), part 1 (2), combine (3), old 2 (4), old 3 (5)
    assert mapping.origin == ((0, None), (1, 0), (1, 1), (1, "combine"), (2, None), (3, None))
    assert np.array_equal(split.times, [[1, 2], [6, 12], [3, 1.5], [0.5, 0.25], [3, 4], [5, 6]])
    assert split.edges == [(0, 1, 75.0), (0, 2, 25.0), (0, 4, 7.0), (3, 4, 40.0), (4, 5, 9.0), (1, 3, 30.0),
                           (2, 3, 10.0)]
    assert split.messages == [1, 1, 2, 3, 4, 1.0, 1.0]
    assert split.loop_edges == [(5, 1, 22.5, 5.0), (5, 2, 7.5, 5.0), (3, 0, 8.0, 1.0)]
    assert split.pinned == {5: 1} and split.together == [(3, 5)] and split.micro_batches == 2
    m = split.memory
    assert list(m.item_bytes) == [300.0, 50.0, 10.0, 300.0]
    assert m.item_names == ["experts[part 0]", "shared", "head", "experts[part 1]"]
    assert m.reads == [(0, 1), (1, 0), (1, 1), (2, 1), (2, 3), (5, 2)]
    assert list(m.capacity) == [1000.0, 1000.0]
    assert mapping.parts_of(1) == [1, 2] and mapping.index_of(1, "combine") == 3 and mapping.index_of(3) == 5
    assert mapping.assignment([0, 0, 1, 1, 1, 1]) == {0: [0], 1: [0, 1, 1], 2: [1], 3: [1]}
    # the original problem is untouched
    assert p.times.shape == (4, 2) and p.edges[0] == (0, 1, 100.0) and list(p.memory.item_bytes) == [600.0, 50.0, 10.0]


def test_splitting_twice_composes_the_mappings():
    p = small_problem()
    once, m1 = split_kernel(p, 1, np.ones((2, 2)), np.ones(2), [1, 1], [1, 1])
    twice, m2 = split_kernel(once, 4, np.ones((3, 2)), np.ones(2), [1, 1, 1], [1, 1, 1])  # old kernel 2
    both = m1.then(m2)
    assert len(both) == twice.kernels == 4 + 2 + 3
    assert both.parts_of(2) == [4, 5, 6] and both.index_of(2, "combine") == 7 and both.index_of(3) == 8
    assert both.parts_of(1) == [1, 2]
    with pytest.raises(ExpertSplitError, match="already part 0 of kernel 1"):
        m1.then(split_kernel(once, 1, np.ones((2, 2)), np.ones(2), [1, 1], [1, 1])[1])


def test_bad_splits_are_reported():
    p = small_problem()
    with pytest.raises(ExpertSplitError, match="splits into 1 to 64 parts"):
        routed_shares(RoutingDistribution(E), 65)
    with pytest.raises(ExpertSplitError, match="only grouped expert GEMMs"):
        part_features(KernelFeatures(0, "gemm", "ffn", 1.0, 1.0, 0.0, 1.0, "bfloat16", (1, 8, 8, 8)), 2,
                      RoutingDistribution(E))
    with pytest.raises(ExpertSplitError, match=r"part_times must be \[parts, 2\]"):
        split_kernel(p, 1, np.ones((2, 3)), np.ones(2), [1, 1], [1, 1])
    with pytest.raises(ExpertSplitError, match="kernel 9 does not exist"):
        split_kernel(p, 9, np.ones((2, 2)), np.ones(2), [1, 1], [1, 1])
    with pytest.raises(ExpertSplitError, match="weight_shares needs 2 non-negative shares summing to 1"):
        split_kernel(p, 1, np.ones((2, 2)), np.ones(2), [1, 1], [1, 1], weight_shares=[0.5, 0.6])


def test_milp_places_parts_where_they_run_fast_when_memory_forbids_one_device():
    """L40S has 2.4x the tensor FLOP/s of an H20, the H20 4.6x its bandwidth: with skewed routing the hot
    part (most tokens: compute-bound) runs faster on the L40S and the cold part (few tokens: reading its
    experts) on the H20. Neither device can hold every expert, so the experts must be split."""
    f, r = grouped_gemm(), RoutingDistribution(E, 8, 1.2)
    m = models("L40S", "H20")
    pt, ct = expert_part_times(f, m, 2, r), combine_times(f, m)
    assert pt[0, 0] < pt[0, 1] and pt[1, 1] < pt[1, 0]  # part 0 fast on L40S, part 1 fast on H20
    in_b, out_b = part_bytes(f, 2, r)
    router, consumer = [2e-5, 2e-5], [2e-5, 2e-5]
    link = dict(bandwidth=np.full((2, 2), 50e9), latency=np.full((2, 2), 5e-6))
    cap = 0.6 * EXPERT_BYTES + 1e6  # room for half the experts and the router, not all experts
    memory = MemorySpec([EXPERT_BYTES, 1e6], [(1, 0), (0, 1)], [cap, cap], ["experts", "router"])
    inputs, outputs = ROWS * K * 2.0, ROWS * N * 2.0
    base = PlacementProblem(["L40S", "H20"], [router, pt.sum(axis=0), consumer],
                            [(0, 1, inputs), (1, 2, outputs)], memory=memory, **link)
    split, mapping = split_kernel(base, 1, pt, ct, in_b, out_b, weight_shares=weight_shares(E, 2))
    with pytest.raises(SolverError, match="do not fit device memory"):
        solve_placement(base, "latency")  # the unsplit kernel needs every expert on one device
    for objective in ("latency", "throughput"):
        best = solve_placement(split, objective, gap=1e-9)
        assert best.value == pytest.approx(solve_by_enumeration(split, objective).value, rel=1e-6)
        a = best.assignment
        assert (a[mapping.index_of(1, 0)], a[mapping.index_of(1, 1)]) == (0, 1)


def _same_problem(a: PlacementProblem, b: PlacementProblem) -> None:
    assert np.array_equal(a.times, b.times) and a.edges == b.edges and a.messages == b.messages
    assert a.loop_edges == b.loop_edges and a.pinned == b.pinned and list(a.pinned) == list(b.pinned)
    assert a.together == b.together and a.devices == b.devices
    assert np.array_equal(a.memory.item_bytes, b.memory.item_bytes) and a.memory.reads == b.memory.reads
    assert a.memory.item_names == b.memory.item_names and np.array_equal(a.memory.capacity, b.memory.capacity)


@pytest.mark.parametrize("seed", range(4))
def test_splitting_every_kernel_at_once_is_splitting_them_one_by_one(seed):
    from tessera.plan.experts import KernelSplit, split_kernels

    rng = np.random.default_rng(seed)
    k, d = 12, 3
    edges = sorted({(int(s), int(t)) for s, t in rng.integers(0, k, (30, 2)) if s < t})
    reads = sorted({(int(i), int(w)) for i, w in zip(rng.integers(0, k, 25), rng.integers(0, 10, 25), strict=True)})
    p = PlacementProblem(["a", "b", "c"], rng.uniform(1, 2, (k, d)), [(s, t, float(rng.uniform(0, 9))) for s, t in edges],
                         np.full((d, d), 10.0), np.full((d, d), 0.1), {int(rng.integers(0, k)): 1},
                         [(1, 5), (2, 9)], 2, [float(x) for x in rng.integers(1, 3, len(edges))],
                         MemorySpec(rng.uniform(1, 5, 10), reads, np.full(d, 100.0)),
                         [(int(rng.integers(0, k)), int(rng.integers(0, k)), 3.0, 2.0) for _ in range(3)])
    splits = [KernelSplit(int(i), rng.uniform(0.1, 1, (int(n), d)), rng.uniform(0.1, 1, d), rng.uniform(0, 1, int(n)),
                          rng.uniform(0, 5, int(n)), None if n == 3 else np.full(int(n), 1 / n))
              for i, n in zip(sorted(rng.choice(k, 4, replace=False)), rng.integers(2, 4, 4), strict=True)]
    one_by_one, mapping = p, None
    for s in reversed(splits):
        one_by_one, step = split_kernel(one_by_one, s.kernel, s.part_times, s.combine_times, s.in_bytes_per_part,
                                        s.out_bytes_per_part, s.weight_shares)
        mapping = step if mapping is None else mapping.then(step)
    at_once, together = split_kernels(p, splits)
    _same_problem(at_once, one_by_one)
    assert together == mapping
