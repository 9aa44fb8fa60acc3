"""Greedy tokens through Tessera's router on vLLM engines against one vLLM engine alone.

First one vLLM engine on one core (`tessera serve --engine vllm --cluster cpu:1 --threads 1 --policy
homogeneous --placement-for A100:1`, as many threads as each engine of the deployments has: vLLM's CPU GEMMs
sum in another order with another thread count, and greedy tokens then differ on some prompts) answers 16
prompts, one at a time, greedy; then each deployment planned for
A100:1,L40S:1 (request-dist, prefill-decode, and the route mix at --mix-min-gain 0) answers the same prompts
through the router, and the script prints, per deployment, how many answers are identical and which routes
and engines they took. Prompts are long enough (about 200 tokens) that the prefill engine hands on real KV.
Usage: ``python benchmarks/check_vllm_tokens.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_router import start, stop  # noqa: E402

MODEL = "smollm2-135m"
TOPICS = ["the capital of France", "how water boils", "the largest planet", "the sea at night", "primary colours",
          "the moon landing", "photosynthesis", "a quick brown fox", "making tea", "the speed of light",
          "Shakespeare", "hot and cold", "the Python language", "Mount Everest", "gold", "a small village"]
FILLER = ("People have discussed it for a long time, in schools, in books and at the dinner table, and it still "
          "makes them curious. ")


def prompts() -> list[str]:
    return [f"Note {i} is about {t}. " + FILLER * 5 + f"Here is one fact about {t}:" for i, t in enumerate(TOPICS)]


def answers(url: str) -> list[tuple[str, str, str]]:
    """(text, route, engines) of each prompt, one request at a time."""
    out = []
    for p in prompts():
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 32,
                                                      "temperature": 0}, timeout=300)
        r.raise_for_status()
        out.append((r.json()["choices"][0]["text"], r.headers.get("x-tessera-route", "-"),
                    r.headers.get("x-tessera-engines", "-")))
    return out


def main() -> None:
    logs = Path("/tmp/check_vllm_tokens")
    logs.mkdir(parents=True, exist_ok=True)
    proc, url = start("vllm-1-core", logs / "vllm-1-core.log")
    try:
        (engine,) = [e["url"] for e in httpx.get(url + "/health").json()["engines"].values()]
        reference = [a for a, _, _ in answers(engine)]  # the engine itself, not through the router
    finally:
        stop(proc)
    print(f"reference: one vLLM engine alone, {len(reference)} prompts")
    for name in ("request-dist", "prefill-decode", "mix"):
        proc, url = start(name, logs / f"{name}.log")
        try:
            got = answers(url)
        finally:
            stop(proc)
        same = sum(a == b for (a, _, _), b in zip(got, reference, strict=True))
        paths: dict[str, int] = {}
        for _, route, engines in got:
            paths[f"{route} [{engines}]"] = paths.get(f"{route} [{engines}]", 0) + 1
        print(f"{name}: {same} of {len(got)} identical; " + "; ".join(f"{k}: {v}" for k, v in paths.items()))


if __name__ == "__main__":
    main()
