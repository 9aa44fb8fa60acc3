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


def test_ranges_by_hand():
    a = Ranges(((0, 10),))
    assert a & Ranges(((5, 20),)) == Ranges(((5, 10),))
    assert a - Ranges(((3, 5),)) == Ranges(((0, 3), (5, 10)))
    assert a - Ranges(((0, 10),)) == Ranges() and (a & Ranges(((10, 12),))) == Ranges()
    assert (Ranges(((0, 4), (8, 12))) - Ranges(((2, 9),))).spans == ((0, 2), (9, 12))
