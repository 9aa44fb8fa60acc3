"""Fault drill: the prefill engine of the route mix killed during a `tessera bench` run.

Starts the mix planned for A100:1,L40S:1 (whole on the L40S, prefill on the L40S and decode on the A100) as
vLLM engines behind the router, runs `tessera bench` with Poisson arrivals, kills the prefill engine's process
group (SIGKILL) a few seconds in, and prints: what the bench measured (completed, failed, errors), /health and
the router's metrics right after the kill, and how long the engine took to come back.
Usage: ``python benchmarks/drill_vllm_failover.py [--kill-after 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_router import MODEL, ROOT, TESSERA, start, stop  # noqa: E402

WORKLOAD = "poisson:rate=2,lengths={lengths},requests=80"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kill-after", type=float, default=5.0)
    args = ap.parse_args()
    logs = Path("/tmp/drill_vllm_failover")
    logs.mkdir(parents=True, exist_ok=True)
    proc, url = start("mix", logs / "mix.log")
    try:
        pid = int(re.findall(r"starting engine prefill@L40S .*\(pid (\d+),", (logs / "mix.log").read_text())[-1])
        lengths = logs / "lengths.csv"  # 256-token prompts (the KV handed on is real), 64 tokens out
        lengths.write_text("input,output\n256,64\n")
        workload = WORKLOAD.format(lengths=lengths)
        bench = subprocess.Popen([*TESSERA, "bench", "--url", url, "--workload", workload, "--model", MODEL, "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
        time.sleep(args.kill_after)
        killed = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        print(f"killed prefill@L40S (pid {pid}) {args.kill_after:g} s into {workload}")
        seen = back = None
        while seen is None and time.monotonic() - killed < 60:
            health = httpx.get(url + "/health").json()
            if health["engines"]["prefill@L40S"]["state"] != "up":
                seen = time.monotonic() - killed
                print(f"/health {seen:.1f} s after the kill:", json.dumps(health))
            else:
                time.sleep(0.2)
        while back is None and time.monotonic() - killed < 600:
            if httpx.get(url + "/health").json()["status"] == "ok":
                back = time.monotonic() - killed
            else:
                time.sleep(0.5)
        print(f"prefill@L40S back (restarted, healthy, /health ok) {back:.1f} s after the kill" if back else
              "prefill@L40S not back within 600 s")
        out, _ = bench.communicate(timeout=1800)
        s = json.loads(out)
        print(f"bench: {s['completed']} of {s['requests']} completed, {s['failed']} failed, {s['throughput']:.1f} "
              f"tokens/s, TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms; errors: {s['errors']}")
        metrics = [m for m in httpx.get(url + "/metrics").text.splitlines()
                   if m.startswith(("tessera_router_requests", "tessera_router_fallbacks", "tessera_engine_exits",
                                    "tessera_engine_restarts", "tessera_engine_failures"))]
        print("\n".join(metrics))
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
