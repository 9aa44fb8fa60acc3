"""Intersections and differences of byte ranges: the two-interval shortcut agrees with the general sweep."""

from __future__ import annotations

import numpy as np

from tessera.graph.ranges import Ranges


def test_two_intervals_combine_as_the_sweep_combines_them():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        a0, b0 = (int(x) for x in rng.integers(0, 40, 2))
        a, b = Ranges(((a0, a0 + int(rng.integers(1, 20))),)), Ranges(((b0, b0 + int(rng.integers(1, 20))),))
        assert a & b == a._sweep(b, keep_other=True)
        assert a - b == a._sweep(b, keep_other=False)


def _random_ranges(rng, most: int) -> Ranges:
    starts = rng.integers(0, 200, int(rng.integers(1, most + 1)))
    return Ranges.of((int(s), int(s) + int(rng.integers(1, 12))) for s in starts)


def test_shortcuts_combine_as_the_sweep_combines():
    """Many intervals against one (either side), and a set against itself, take shortcuts: the same sets."""
    rng = np.random.default_rng(1)
    for _ in range(3000):
        a = _random_ranges(rng, 12)
        b = _random_ranges(rng, 1) if rng.random() < 0.6 else a
        for x, y in ((a, b), (b, a)):
            assert x & y == x._sweep(y, keep_other=True)
            assert x - y == x._sweep(y, keep_other=False)


def test_ranges_by_hand():
    a = Ranges(((0, 10),))
    assert a & Ranges(((5, 20),)) == Ranges(((5, 10),))
    assert a - Ranges(((3, 5),)) == Ranges(((0, 3), (5, 10)))
    assert a - Ranges(((0, 10),)) == Ranges() and (a & Ranges(((10, 12),))) == Ranges()
    assert (Ranges(((0, 4), (8, 12))) - Ranges(((2, 9),))).spans == ((0, 2), (9, 12))
