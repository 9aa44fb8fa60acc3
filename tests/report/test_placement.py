"""The placement plot: a PNG of which device runs each (layer, kernel class) cell, and its errors."""

from __future__ import annotations

import pytest

from tessera.errors import TesseraError
from tessera.report.placement import (
    PlacementCell,
    PlacementPlotError,
    _cells,
    _tick_positions,
    plot_placement,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(layers: int) -> list[PlacementCell]:
    rows = [PlacementCell("embed", "embedding", {"a": 1.0}, 1e-5)]
    for i in range(layers):
        rows.append(PlacementCell(str(i), "gemm", {"a": 1.0} if i < layers // 2 else {"b": 1.0}, 1e-3))
        rows.append(PlacementCell(str(i), "attention", {"a": 0.25, "b": 0.75}, 4e-4))
    rows.append(PlacementCell("head", "gemm", {"b": 1.0}, 2e-3))
    return rows


@pytest.mark.parametrize("layers", [4, 100])
def test_writes_a_png(tmp_path, layers):
    out = plot_placement(_rows(layers), ["a", "b"], tmp_path / "sub" / "placement.png", "a test placement")
    assert out == tmp_path / "sub" / "placement.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000


def _has_colour(path, rgb: tuple[int, int, int]) -> bool:
    from matplotlib.image import imread

    img = (imread(path)[..., :3] * 255).round().astype(int)
    return bool(((img == rgb).all(axis=-1)).any())


def test_cells_take_their_device_colour(tmp_path):
    blue, orange = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # tab10's first two colours: devices a and b
    only_a = [PlacementCell("0", "gemm", {"a": 1.0}, 1e-3)]
    path = plot_placement(only_a, ["a", "b"], tmp_path / "a.png", "t")
    assert _has_colour(path, blue) and _has_colour(path, orange)  # b is still in the legend
    path = plot_placement(only_a, ["a"], tmp_path / "only_a.png", "t")
    assert _has_colour(path, blue) and not _has_colour(path, orange)


def test_repeated_cells_merge_weighted_by_time():
    rows = [PlacementCell("0", "gemm", {"a": 1.0}, 3.0), PlacementCell("0", "gemm", {"b": 2.0}, 1.0),
            PlacementCell("1", "gemm", {"a": 1.0}, 0.0), PlacementCell("1", "gemm", {"b": 1.0}, 0.0)]
    cells = _cells(rows, ["a", "b"])
    assert cells[("0", "gemm")] == ([0.75, 0.25], 4.0)  # 3 s on a, 1 s on b
    assert cells[("1", "gemm")] == ([0.5, 0.5], 0.0)  # no time: each cell counts once


def test_layer_labels_thin_past_forty():
    assert _tick_positions(34) == list(range(34))
    ticks = _tick_positions(102)  # step ceil(102 / 40) = 3: 0, 3, ..., 99, then the last, 101
    assert ticks[:3] == [0, 3, 6] and ticks[-2:] == [99, 101] and len(ticks) == 35
    assert _tick_positions(100)[-2:] == [96, 99]  # the last index, 99, is already on the step
    assert _tick_positions(101)[-2:] == [96, 100]  # 99 is one short of the last: the last replaces it


@pytest.mark.parametrize("rows,devices,expected", [
    ([], ["a"], "no cells"),
    (_rows(2), [], "no devices"),
    (_rows(2), ["a", "a"], "name a device twice"),
    (_rows(2), ["a"], r"puts time on 'b', which is not among the devices \['a'\]"),
    ([PlacementCell("0", "gemm", {"a": 0.0}, 1.0)], ["a"], "not all zero"),
    ([PlacementCell("0", "gemm", {"a": -1.0, "b": 2.0}, 1.0)], ["a", "b"], "non-negative"),
    ([PlacementCell("0", "gemm", {"a": 1.0}, float("nan"))], ["a"], "finite and non-negative"),
])
def test_errors(tmp_path, rows, devices, expected):
    with pytest.raises(PlacementPlotError, match=expected) as e:
        plot_placement(rows, devices, tmp_path / "p.png", "t")
    assert isinstance(e.value, TesseraError)
    assert not (tmp_path / "p.png").exists()


def test_unwritable_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PlacementPlotError, match="cannot write the placement plot"):
        plot_placement(_rows(2), ["a", "b"], blocker / "p.png", "t")
