"""CPU seconds each process of a served deployment spends on one bench: the server and each worker.

Usage: ``python benchmarks/bench_cpu_share.py CELL [CELL ...] [--workload fixed:in=64,out=32,requests=32]``,
CELL one of bench_vllm_router.py's deployments (e.g. ``tessera-cpu2 tessera-cpu2-rd-s32 tessera-local1-s32``).

On a VM shared with other jobs a deployment's tokens/s says how much CPU it got as much as how fast it is;
CPU per token and how evenly the workers are busy carry over to a quiet machine. Each cell is started with
`tessera serve`, warmed up with bench_vllm_router.py's warm-up bench, then benched once while utime + stime of
the server process and every process under it are read from ``/proc`` before and after.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vllm_router as deployments  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            children = []
        for child in children:
            out += descendants(int(child))
    return out


def cpu_seconds(pids: list[int]) -> dict[int, tuple[float, str]]:
    """utime + stime in seconds and the command line of each process still running."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:70].decode(errors="replace")
        except OSError:
            continue
        out[pid] = ((int(fields[11]) + int(fields[12])) / TICK, cmd)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cells", nargs="+", choices=sorted(deployments.DEPLOYMENTS))
    ap.add_argument("--workload", default="fixed:in=64,out=32,requests=32")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/bench_cpu_share"))
    args = ap.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    for name in args.cells:
        proc, url = deployments.start(name, args.logs / f"{name}.log")
        try:
            deployments.bench(url, deployments.WARM_UP)
            pids = descendants(proc.pid)
            before, t0, load = cpu_seconds(pids), time.time(), os.getloadavg()[0]
            stats = deployments.bench(url, args.workload)
            after, wall = cpu_seconds(pids), time.time() - t0
        finally:
            deployments.stop(proc)
        tokens = stats["output_tokens"]
        print(f"{name}: {stats['throughput']:.1f} tok/s, TTFT p50 {stats['ttft_p50_s']:.2f} s, wall {wall:.1f} s, "
              f"load {load:.1f}")
        total = 0.0
        for pid in pids:
            if pid in before and pid in after:
                spent = after[pid][0] - before[pid][0]
                total += spent
                if spent > 0.05:
                    print(f"   pid {pid:>7} {spent:6.2f} cpu s  {after[pid][1]}")
        print(f"   all: {total:.2f} cpu s, {total / tokens * 1e3:.1f} cpu ms per token, {total / wall:.2f} cores busy")


if __name__ == "__main__":
    main()
