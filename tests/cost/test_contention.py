"""Contention figures: a factor per kind and neighbour, bad figures refused by name, cached per key."""

from __future__ import annotations

import json

import pytest

from tessera.cost.contention import HostContention, HostContentionError, read_cached, write_cached

ROWS = (("decode", "decode", 1.25), ("decode", "prefill", 1.5), ("prefill", "decode", 1.125),
        ("prefill", "prefill", 1.0))


def test_each_pair_of_kinds_has_its_factor():
    c = HostContention(ROWS, 1, "test")
    assert [c.factor(a, b) for a, b, _ in ROWS] == [f for *_, f in ROWS]
    assert HostContention.uniform(2.0).factor("prefill", "decode") == 2.0
    assert "decode beside prefill x1.50" in c.describe()


@pytest.mark.parametrize("rows,threads,match", [
    ((("decode", "decode", 0.9), *ROWS[1:]), 1, "must be a finite number >= 1"),
    ((("decode", "decode", float("nan")), *ROWS[1:]), 1, "must be a finite number >= 1"),
    ((("encode", "decode", 1.0), *ROWS[1:]), 1, "kind 'encode' is not one of decode, prefill"),
    (ROWS[1:], 1, "lack decode beside decode"),
    ((*ROWS, ROWS[0]), 1, "given twice"),
    ((("decode", "decode"), *ROWS[1:]), 1, r"\(kind, neighbour kind, factor\) rows"),
    (ROWS, 0, "threads must be a whole number >= 1"),
])
def test_bad_figures_are_refused(rows, threads, match):
    with pytest.raises(HostContentionError, match=match):
        HostContention(rows, threads)


def test_an_unknown_kind_is_refused_when_asked():
    with pytest.raises(HostContentionError, match="no contention factor for 'encode'"):
        HostContention(ROWS).factor("encode", "decode")


def test_the_cache_returns_figures_only_for_their_key(tmp_path):
    path = tmp_path / "c.json"
    c = HostContention(ROWS, 1, "test")
    write_cached(path, {"cpu": "x"}, c)
    assert read_cached(path, {"cpu": "x"}) == c
    assert read_cached(path, {"cpu": "y"}) is None
    write_cached(path, {"cpu": "x"}, c, busy=True)
    assert read_cached(path, {"cpu": "x"}) == c and read_cached(path, {"cpu": "x"}, quiet=True) is None
    d = json.loads(path.read_text())
    d["factors"][0][2] = 0.5  # damaged: a figure below 1
    path.write_text(json.dumps(d))
    assert read_cached(path, {"cpu": "x"}) is None
    with pytest.raises(HostContentionError, match="not a version-1 tessera-host-contention file"):
        HostContention.from_dict({"kind": "other"})
