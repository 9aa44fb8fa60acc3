"""`tessera bench` against vLLM engines behind Tessera's router, beside the same engines reached directly and
Tessera's own engine, on the same cores in the same run.

Deployments (smollm2-135m, each GPU target of a plan stood in for by one cpu worker of this host):
- ``vllm-1``: one vLLM engine on every core (a homogeneous plan on cpu:1), benched directly AND through the
  router in front of it (the router's own cost: same engine, back to back);
- ``vllm-1-core`` (only when asked for): the same on one core, the router on the other, as on a GPU host,
  where the engine's work is on the GPU and the router has host cores of its own;
  for both, first 24 lone requests (one at a time, alternating between the engine and the router): the
  router's own latency per request, which a burst's TTFT p50 (quantised by the engine's steps) cannot resolve;
- ``request-dist``: two replicas, one core each, behind the router (planned for A100:1,L40S:1);
- ``prefill-decode``: prefill engine and decode engine, one core each, KV handed over (planned for A100:1,L40S:1);
- ``mix``: the route mix planned for A100:1,L40S:1 at --mix-min-gain 0 (whole on the L40S, prefill on the
  L40S and decode on the A100: three engines on two cores);
- ``tessera``: `tessera serve --cluster cpu:2 --slots 64` (Tessera's own kernel-level runtime, its default policy);
- ``tessera-cpu2``: `tessera serve --cluster cpu:2` with its defaults (issue 32's must-show), and
  ``tessera-local``: `tessera serve --local --threads 2` (one process on both cores), its peer; the same with
  ``--slots 32`` (``tessera-cpu2-s32``, ``tessera-local-s32``, and ``tessera-local1-s32`` at one thread; cpu:2 under a
  named policy: ``tessera-cpu2-rd-s32`` request-dist, ``-pd-`` prefill-decode, ``-lp-`` layer-pipeline); not in
  the default set: ``--only tessera-cpu2,tessera-local --workloads "fixed:in=64,out=32,requests=32"``.

Every vLLM engine runs with prefix caching off (the bench's prompts repeat one word) and eager mode; each
deployment gets a short warm-up bench first (not recorded).
Usage: ``python benchmarks/bench_vllm_router.py [--only vllm-1,mix] [--skip tessera] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TESSERA = [sys.executable, "-m", "tessera"]
MODEL = "smollm2-135m"
WORKLOADS = ("fixed:in=64,out=32,requests=32", "fixed:in=256,out=128,requests=64")
WARM_UP = "fixed:in=64,out=16,requests=8"
MIX_PLAN = ROOT / "tests" / "fixtures" / "plans" / "smollm2-135m_A100_L40S_mix.json"
# the plan's shares (throughput) throughout: the benches load every route; `--shares auto` would start on the
# fastest route alone
VLLM = ["--engine", "vllm", "--no-prefix-caching", "--max-context", "1024", "--shares", "throughput"]
DEPLOYMENTS = {
    "vllm-1": ["--cluster", "cpu:1", *VLLM, "--policy", "homogeneous", "--placement-for", "A100:1"],
    "vllm-1-core": ["--cluster", "cpu:1", "--threads", "1", *VLLM, "--policy", "homogeneous", "--placement-for",
                    "A100:1"],
    "request-dist": ["--cluster", "cpu:2", *VLLM, "--policy", "request-dist", "--placement-for", "A100:1,L40S:1"],
    "prefill-decode": ["--cluster", "cpu:2", *VLLM, "--policy", "prefill-decode", "--placement-for",
                       "A100:1,L40S:1"],
    "mix": ["--cluster", "cpu:2", *VLLM, "--plan", str(MIX_PLAN)],
    "tessera": ["--cluster", "cpu:2", "--slots", "64", "--max-context", "512"],
    "tessera-cpu2": ["--cluster", "cpu:2"],
    "tessera-local": ["--local", "--threads", "2"],
    "tessera-cpu2-s32": ["--cluster", "cpu:2", "--slots", "32"],
    "tessera-local-s32": ["--local", "--threads", "2", "--slots", "32"],
    "tessera-local1-s32": ["--local", "--threads", "1", "--slots", "32"],
    # cpu:2 under each named policy instead of the planner's choice (`tessera`)
    "tessera-cpu2-rd-s32": ["--cluster", "cpu:2", "--slots", "32", "--policy", "request-dist"],
    "tessera-cpu2-pd-s32": ["--cluster", "cpu:2", "--slots", "32", "--policy", "prefill-decode"],
    "tessera-cpu2-lp-s32": ["--cluster", "cpu:2", "--slots", "32", "--policy", "layer-pipeline"],
}
OPTIONAL = ("vllm-1-core", "tessera-cpu2", "tessera-local", "tessera-cpu2-s32", "tessera-local-s32",
            "tessera-local1-s32", "tessera-cpu2-rd-s32", "tessera-cpu2-pd-s32",
            "tessera-cpu2-lp-s32")  # run when named in --only


def start(name: str, log: Path) -> tuple[subprocess.Popen, str]:
    """Start deployment ``name``; (process, router URL) once /health says ok."""
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([*TESSERA, "serve", MODEL, "--port", "0", *DEPLOYMENTS[name]], stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "COLUMNS": "300"})
    deadline = time.monotonic() + 900
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log.read_text()[-3000:]}")
        m = re.search(r"(?:router )?listening at (http://\S+)", log.read_text())
        if m:
            url = m.group(1)
            try:
                r = httpx.get(url + "/health", timeout=5)
                if r.status_code == 200 and r.json().get("status") in ("ok", "serving"):
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(1)
    raise RuntimeError(f"{name} not up after 900 s (url {url})")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()


def bench(url: str, workload: str) -> dict:
    """`tessera bench --json` of ``workload`` against ``url``."""
    r = subprocess.run([*TESSERA, "bench", "--url", url, "--workload", workload, "--model", MODEL, "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"bench {workload} at {url} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def lone_ttft_pairs(direct: str, routed: str, n: int = 24, prompt_tokens: int = 64) -> list[tuple[float, float]]:
    """(direct, via router) TTFT of ``n`` lone streamed requests, sent one at a time and alternating between the
    engine and the router, so that the engine's drift falls on both alike: the router's own latency per request."""
    payload = {"model": MODEL, "prompt": " ".join(["hello"] * prompt_tokens), "max_tokens": 4, "temperature": 0,
               "stream": True}
    pairs = []
    with httpx.Client(timeout=120) as client:
        for _ in range(n):
            pair = []
            for base in (direct, routed):
                t0 = time.perf_counter()
                with client.stream("POST", base + "/v1/completions", json=payload) as r:
                    r.raise_for_status()
                    first = None
                    for line in r.iter_lines():  # the whole stream is read; the first token's time is kept
                        if first is None and line.startswith("data:") and '"text"' in line:
                            first = time.perf_counter() - t0
                    pair.append(first)
            pairs.append((pair[0], pair[1]))
    return pairs


def row(name: str, workload: str, s: dict) -> str:
    return (f"{name:<28} {workload:<36} {s['throughput']:>8.1f} {s['ttft_p50_s'] * 1e3:>10.0f} "
            f"{s['tpot_p50_s'] * 1e3:>9.1f} {s['completed']:>4}/{s['requests']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(n for n in DEPLOYMENTS if n not in OPTIONAL))
    ap.add_argument("--workloads", default=";".join(WORKLOADS), help="workloads separated by ';'")
    ap.add_argument("--skip", default="")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeat", type=int, default=3, help="vllm-1, vllm-1-core: benches directly and through the router, "
                    "alternating, each this many times")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/bench_vllm_router"))
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n and n not in args.skip.split(",")]
    workloads = [w for w in args.workloads.split(";") if w]
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'deployment':<28} {'workload':<36} {'tok/s':>8} {'TTFT p50':>10} {'TPOT p50':>9} done")
    results = []
    for name in names:
        proc, url = start(name, args.logs / f"{name}.log")
        try:
            engines = httpx.get(url + "/health", timeout=5).json().get("engines", {})
            bench(url, WARM_UP)  # an engine's first requests after start run slower (not recorded)
            if name.startswith("vllm-1"):
                (engine_url,) = [e["url"] for e in engines.values()]
                pairs = lone_ttft_pairs(engine_url, url)
                extra = sorted(r - d for d, r in pairs)
                d50 = sorted(d for d, _ in pairs)[len(pairs) // 2]
                print(f"router latency ({name}): lone requests (64-token prompts, one at a time, alternating), TTFT "
                      f"direct p50 {d50 * 1e3:.1f} ms; router minus direct p50 {extra[len(extra) // 2] * 1e3:+.1f} ms, "
                      f"p10 {extra[len(extra) // 10] * 1e3:+.1f} ms, p90 {extra[len(extra) * 9 // 10] * 1e3:+.1f} ms "
                      f"({len(pairs)} pairs)", flush=True)
                results.append({"deployment": f"{name} lone pairs", "workload": "lone", "pairs": pairs})
            for workload in workloads:
                if name.startswith("vllm-1"):  # the same engine directly and through the router, alternating
                    (engine_url,) = [e["url"] for e in engines.values()]
                    for attempt in range(1, args.repeat + 1):
                        for label, target in ((f"{name} direct", engine_url), (f"{name} via router", url)):
                            s = bench(target, workload)
                            results.append({"deployment": label, "attempt": attempt, "workload": workload, **s})
                            print(row(f"{label} #{attempt}", workload, s), flush=True)
                else:
                    s = bench(url, workload)
                    results.append({"deployment": name, "workload": workload, **s})
                    print(row(name, workload, s), flush=True)
        finally:
            stop(proc)
    for name in (n for n in names if n.startswith("vllm-1")):
        for w in workloads:
            direct = [r for r in results if r["workload"] == w and r["deployment"] == f"{name} direct"]
            routed = [r for r in results if r["workload"] == w and r["deployment"] == f"{name} via router"]
            if direct and routed:
                d_tp = sum(r["throughput"] for r in direct) / len(direct)
                r_tp = sum(r["throughput"] for r in routed) / len(routed)
                d_ttft = sum(r["ttft_p50_s"] for r in direct) / len(direct)
                r_ttft = sum(r["ttft_p50_s"] for r in routed) / len(routed)
                print(f"router cost ({name}) at {w}: throughput {r_tp / d_tp - 1:+.1%}, TTFT p50 "
                      f"{(r_ttft - d_ttft) * 1e3:+.0f} ms (mean of {len(direct)} runs each)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
