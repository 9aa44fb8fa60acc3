"""Serve SmolLM2-135M on vLLM the way Tessera plans it for one A100 and one L40S, on this host's two cores.

Starts `tessera serve --engine vllm --policy prefill-decode --placement-for A100:1,L40S:1` (a prefill engine
standing in for the L40S on cpu:1 and a decode engine standing in for the A100 on cpu:0, Tessera's router in
front), sends a completion and a chat through the router, prints the route each took and the answers, the
router's /health, and stops it. Usage: ``python examples/serve_on_vllm.py`` (``make demo`` runs it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"


def main() -> int:
    cmd = [sys.executable, "-m", "tessera", "serve", MODEL, "--cluster", "cpu:2", "--engine", "vllm", "--policy",
           "prefill-decode", "--placement-for", "A100:1,L40S:1", "--port", "0", "--max-context", "512"]
    print("$ tessera " + " ".join(cmd[3:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "200"})
    url = None
    try:
        for line in proc.stdout:
            print("  " + line.rstrip(), flush=True)
            m = re.search(r"router listening at (http://\S+)", line)
            url = m.group(1) if m else url
            if "vLLM engines (up in" in line:
                break
        if proc.poll() is not None or url is None:
            print("the deployment did not come up", file=sys.stderr)
            return 1
        client = httpx.Client(base_url=url, timeout=120)
        prompt = "The capital of France is"
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                 "temperature": 0})
        print(f"\ncompletion via {r.headers['x-tessera-engines']}: {prompt!r} -> {r.json()['choices'][0]['text']!r}")
        r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 24, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "Name a planet."}]})
        print(f"chat via {r.headers['x-tessera-engines']}: {r.json()['choices'][0]['message']['content']!r}")
        print(f"/health: {client.get('/health').json()}")
        metrics = [m for m in client.get("/metrics").text.splitlines() if m.startswith("tessera_router_requests")]
        print("\n".join(metrics))
        return 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
