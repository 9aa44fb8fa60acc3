"""What a step on two local cpu workers costs outside their programs, measured on a pool of its own: the link
between the workers and the driver's round trip (the simulator's inputs for a local deployment)."""

from __future__ import annotations

from tessera.hardware.cluster import Link
from tessera.runtime.pool import WorkerPool
from tessera.runtime.probe import measure_link, measure_round_trip


def local_pair_costs(output_bytes: int = 0, threads: int = 1) -> tuple[Link, float]:
    """The link between two local cpu workers (`measure_link`) and the driver's round trip to both, the second
    returning ``output_bytes`` (`measure_round_trip`), on a pool started for it and closed after."""
    pool = WorkerPool.local(2, threads)
    try:
        return measure_link(pool).link, measure_round_trip(pool, pool.alive, output_bytes=output_bytes)
    finally:
        pool.close()
