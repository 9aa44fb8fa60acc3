"""The Gantt chart of a traced runtime step, on a synthetic two-worker pipelined timeline."""

from __future__ import annotations

import pytest

from tessera.errors import TesseraError
from tessera.report.gantt import GanttError, bars, gantt

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pipeline(micro_batches: int = 4, kernels: int = 3, dt: float = 1e-3) -> list[list[tuple]]:
    """Worker 0 runs ``kernels`` kernels per micro-batch and sends each micro-batch to worker 1, which waits
    for it and runs the same number of kernels (a two-stage pipeline, kernel times ``dt``)."""
    w0, w1 = [], []
    t = 0.0
    for m in range(micro_batches):
        for k in range(kernels):
            w0.append(("run", k, m, t, t + dt))
            t += dt
        w0.append(("send", m, m, t, t))
        w0.append(("free", None, m, t, t))
    t1 = 0.0
    for m in range(micro_batches):
        arrive = (m + 1) * kernels * dt
        w1.append(("recv", m, m, t1, max(t1, arrive)))
        t1 = max(t1, arrive)
        for k in range(kernels, 2 * kernels):
            w1.append(("run", k, m, t1, t1 + dt))
            t1 += dt
    return [w0, w1]


def test_bars_merge_kernels_of_a_micro_batch():
    w0, w1 = _pipeline()
    b0 = bars(w0)
    assert [m for _, _, m in b0.compute] == [0, 1, 2, 3]  # 3 kernels of each micro-batch become one bar
    assert b0.compute[0] == pytest.approx((0.0, 3e-3, 0))
    assert b0.kernels == 12 and b0.busy_s == pytest.approx(12e-3)
    assert [m for _, m in b0.sends] == [0, 1, 2, 3] and not b0.recv
    b1 = bars(w1)
    assert len(b1.recv) == 4 and b1.recv_wait_s == pytest.approx(3e-3)  # only micro-batch 0 is waited for
    assert b1.span_s == pytest.approx(15e-3)
    # a gap longer than the merge gap splits a micro-batch's bar
    split = bars([("run", 0, 0, 0.0, 1e-3), ("run", 1, 0, 2e-3, 3e-3)], merge_gap_s=1e-4)
    assert len(split.compute) == 2


@pytest.mark.parametrize("micro_batches", [1, 4, 12])
def test_writes_a_png(tmp_path, micro_batches):
    out = gantt(_pipeline(micro_batches), ["cpu:0", "cpu:1"], tmp_path / "sub" / "gantt.png", "a test pipeline")
    assert out == tmp_path / "sub" / "gantt.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000


def test_draws_each_micro_batch_in_its_colour(tmp_path):
    from matplotlib.image import imread

    out = gantt(_pipeline(2), ["a", "b"], tmp_path / "g.png", "colours")
    img = (imread(out)[..., :3] * 255).round().astype(int)
    for rgb in [(0x4C, 0x72, 0xB0), (0xDD, 0x84, 0x52)]:  # micro-batches 0 and 1
        assert ((img == rgb).all(axis=-1)).sum() > 200


@pytest.mark.parametrize("timelines, devices, message", [
    ([], [], "no timelines"),
    ([[("run", 0, 0, 0.0, 1.0)]], ["a", "b"], "1 timelines but 2 device names"),
    ([[("run", 0, 0, 0.0)]], ["a"], "4 fields"),
    ([[("jump", 0, 0, 0.0, 1.0)]], ["a"], "kind 'jump'"),
    ([[("run", 0, -1, 0.0, 1.0)]], ["a"], "micro-batch -1"),
    ([[("run", 0, 0, 2.0, 1.0)]], ["a"], "start <= end"),
    ([[("run", 0, 0, 0.0, float("nan"))]], ["a"], "finite"),
    ([[("free", None, 0, 0.0, 0.0)]], ["a"], "no instruction with a duration"),
])
def test_bad_timelines_are_clear_errors(tmp_path, timelines, devices, message):
    with pytest.raises(GanttError, match=message) as err:
        gantt(timelines, devices, tmp_path / "g.png", "bad")
    assert isinstance(err.value, TesseraError)


def test_unwritable_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(GanttError, match="cannot write"):
        gantt(_pipeline(), ["a", "b"], blocker / "g.png", "t")
