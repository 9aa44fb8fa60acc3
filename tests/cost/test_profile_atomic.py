"""Cache files are written atomically (an interrupted write leaves the old file), and a damaged cached profile
is measured again instead of only reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.capture.tiny import tiny_config
from tessera.cost.profile import Profile, cached_profile
from tessera.paths import atomic_path, atomic_write
from tessera.runtime.profiler import profile_model
from tessera.runtime.session import host_profile


def _interrupt_after_half(monkeypatch):
    """Make every Path.write_bytes write half its data, then raise (a process killed mid-write)."""
    real = Path.write_bytes

    def half(self, data):
        real(self, data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", half)


def test_interrupted_atomic_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "file.json"
    atomic_write(path, '{"old": true}')
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    _interrupt_after_half(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, json.dumps({"new": list(range(1000))}))
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in path.parent.iterdir()] == ["file.json"]  # no temporary left behind


def test_interrupted_first_write_leaves_no_file(tmp_path):
    path = tmp_path / "weights.bin"
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_bytes(b"x" * 100)
        raise RuntimeError("writer failed")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-llm"
    tiny_config("llm").save_pretrained(folder)
    prof, graph = profile_model(str(folder), "decode", batch=1, ctx=16, threads=1, warmup=0, repeats=1)
    return folder, prof, graph


def test_interrupted_profile_save_leaves_the_old_profile(tiny_profile, tmp_path, monkeypatch):
    _, prof, _ = tiny_profile
    path = tmp_path / "p.json"
    prof.save(path)
    before = path.read_text()
    _interrupt_after_half(monkeypatch)
    prof.device_name = "changed"
    with pytest.raises(KeyboardInterrupt):
        prof.save(path)
    assert path.read_text() == before
    assert Profile.load(path).kernels == prof.kernels


def test_damaged_cached_profile_is_measured_again(tiny_profile, tmp_path, monkeypatch):
    folder, prof, graph = tiny_profile
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    lines: list[str] = []
    first = host_profile(str(folder), {"decode": graph}, 1, lines.append)  # measures and caches
    (cached,) = (tmp_path / "profiles").rglob("*.json")
    assert any("measuring decode kernels" in line for line in lines)
    assert Profile.load(cached).graph_hash == graph.hash == first.graph_hash
    text = cached.read_text()
    cached.write_text(text[: len(text) // 3])  # a truncated write of an older Tessera
    lines.clear()
    again = host_profile(str(folder), {"decode": graph}, 1, lines.append)
    assert "cached profile unusable" in lines[0] and str(cached) in lines[0] and "not a JSON file" in lines[0]
    assert any("measuring decode kernels" in line for line in lines[1:])
    assert [k.signature for k in again.kernels] == [k.signature for k in prof.kernels]
    assert Profile.load(cached).graph_hash == graph.hash  # replaced by the new measurement
    lines.clear()
    host_profile(str(folder), {"decode": graph}, 1, lines.append)
    assert lines == []  # now read from the cache


def _cached(tiny_profile, tmp_path):
    """A saved tiny profile and ``cached_profile`` over it, counting measurements and logging lines."""
    _, prof, graph = tiny_profile
    path = tmp_path / "p.json"
    prof.save(path)
    calls, lines = [], []

    def measure():
        calls.append(1)
        return prof

    def cached(graph_hash: str = graph.hash, repeats: int | None = None):
        return cached_profile(path, measure, graph_hash, lines.append, repeats)

    return prof, path, cached, calls, lines


def test_cached_profile_of_another_graph_is_measured_again(tiny_profile, tmp_path):
    prof, _, cached, calls, lines = _cached(tiny_profile, tmp_path)
    assert cached() is not prof  # read, not measured
    assert calls == [] and lines == []
    cached("0" * 64)
    assert calls == [1] and "is for graph" in lines[0]


def test_cached_profile_of_fewer_timed_calls_than_asked_is_measured_again(tiny_profile, tmp_path):
    prof, path, cached, calls, lines = _cached(tiny_profile, tmp_path)
    cached(repeats=prof.repeats)  # as many: read
    assert calls == [] and lines == []
    cached(repeats=prof.repeats + 1)
    assert calls == [1] and lines == [f"cached profile {path} timed each kernel {prof.repeats} times, fewer than "
                                      f"{prof.repeats + 1}; measuring again"]


def test_decode_is_profiled_at_a_short_and_the_longest_position_and_cached_apart(tiny_profile, tmp_path,
                                                                                 monkeypatch):
    import tessera.runtime.profiler as profiler
    from tessera.cost.positions import PositionError
    from tessera.runtime.profiler import ProfileError
    from tessera.runtime.session import planned_decode_position

    folder, prof, graph = tiny_profile
    seen: list[list[int]] = []
    import tessera.capture.trace as capture_trace

    original = capture_trace.trace

    def spy(step, *a, **kw):  # the positions the profiled step runs with
        seen.append(step.inputs["positions"].tolist())
        return original(step, *a, **kw)

    monkeypatch.setattr(capture_trace, "trace", spy)
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    lines: list[str] = []
    at = host_profile(str(folder), {"decode": graph}, 1, lines.append, decode_position=9)
    # a cache of 16 positions: an eighth into it and its last (then the host's overhead probe)
    assert seen[:2] == [[1], [15]] and at.positions.positions == (1, 15)
    assert any("at position 1 " in line for line in lines) and any("at position 15 " in line for line in lines)
    assert [k.signature for k in at.kernels] == [k.signature for k in prof.kernels]  # the same keys
    files = lambda: sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "profiles").rglob("*.json"))  # noqa: E731
    assert files() == ["p1.json", "p15.json"]
    measured = len(seen)
    lines.clear()
    again = host_profile(str(folder), {"decode": graph}, 1, lines.append, decode_position=3)  # another plan's mean
    assert len(seen) == measured and not any("measuring" in line for line in lines)  # both positions from the cache
    assert again.positions.fits == at.positions.fits and (again.positions.planned, at.positions.planned) == (3, 9)
    host_profile(str(folder), {"decode": graph}, 1, lines.append)  # no planned position: at 0, its own file
    assert seen[-1] == [0] and len(files()) == 3
    with pytest.raises(PositionError, match="position 16 is outside the decode step's cache of 16 positions"):
        host_profile(str(folder), {"decode": graph}, 1, lines.append, decode_position=16)
    with pytest.raises(ProfileError, match="outside the step's cache of 16 positions"):
        profiler.profile_model(str(folder), "decode", batch=1, ctx=16, threads=1, warmup=0, repeats=1, position=16)
    with pytest.raises(ProfileError, match="only a decode step"):
        profiler.profile_model(str(folder), "prefill", batch=1, seq=4, ctx=16, threads=1, warmup=0, repeats=1,
                               position=3)
    assert planned_decode_position(64, 64, 512) == 96 and planned_decode_position(500, 64, 512) == 511
