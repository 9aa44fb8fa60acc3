"""Where a lone request's time to first token goes through `tessera serve`'s real path, beside the simulator's
TTFT for the same request.

    PYTHONPATH=src .venv/bin/python benchmarks/ttft_breakdown.py [--policy layer-pipeline] [--requests 8]

The server runs as bench_serve.py runs it (smollm2-135m on cpu:2, one thread per worker, 8 slots, context 128,
uvicorn in a thread of this process) and lone streamed completions are sent one at a time, ``--gap`` seconds
apart (nothing else queued or in flight). Every timestamp is this process's ``time.perf_counter`` around the
real calls:

- client: the request sent (``c_send``) and the first text chunk received (``c_first``);
- HTTP: the request reaching the ASGI app (``asgi``), the prompt tokenised (``tok0``/``tok1``), ``Engine.submit``
  called (``submit``);
- engine: each step of the request started (``lanes.start``) and finished (``lanes.finish``): its phase, rows
  and prompt bucket; the first token's event emitted (``emit``: sampling taken, detokenised);
- back out: the first SSE chunk with text built on the event loop (``sse``).

Printed per request and as medians: send -> app (HTTP parse, the body), app -> submit (JSON and schema,
tokenising, checks), submit -> prefill start (admission: waking the engine thread), the prefill step, prefill
end -> decode start, the decode step, decode end -> event emitted, event -> SSE chunk (the event loop), SSE ->
client. Beside them, the simulator's TTFT of the same request alone (same plan, same buckets: its prefill
step, state move and decode step).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

MODEL = "smollm2-135m"
LENGTHS = [(8, 8), (16, 16), (24, 12), (32, 24), (48, 16), (12, 20), (40, 8), (20, 24)]


class Stamps:
    """Timestamps per request, keyed by the engine's request id (``req-N``), plus the order of requests."""

    def __init__(self) -> None:
        self.by: dict[str, dict[str, object]] = {}
        self.current: dict[str, object] = {}  # the lone request in flight (before the engine names it)
        self.lock = threading.Lock()

    def mark(self, name: str, value: object = None) -> None:
        with self.lock:
            self.current.setdefault(name, time.perf_counter() if value is None else value)


def instrument(engine, app, stamps: Stamps):
    """Wrap the real calls with timestamps (the app returned wraps ``app``)."""
    from tessera.serve import serving as serving_mod
    from tessera.serve.engine import Engine

    class Timed:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and scope.get("method") == "POST":
                stamps.mark("asgi")
            await self.inner(scope, receive, send)

    prompt = serving_mod.OpenAIServing.completion_prompt

    def completion_prompt(self, p):
        stamps.mark("tok0")
        out = prompt(self, p)
        stamps.mark("tok1")
        return out

    serving_mod.OpenAIServing.completion_prompt = completion_prompt
    submit = Engine.submit

    def timed_submit(self, prompt_ids, params, sink):
        stamps.mark("submit")
        gen = submit(self, prompt_ids, params, sink)
        stamps.mark("submitted")
        stamps.mark("prompt", len(prompt_ids))
        return gen

    Engine.submit = timed_submit
    emit = Engine._emit

    def timed_emit(self, gen, kind, payload):
        if kind == "token":
            stamps.mark("emit")
        emit(self, gen, kind, payload)

    Engine._emit = timed_emit
    sse = serving_mod.sse

    def timed_sse(data):
        if any(c.get("text") for c in data.get("choices") or []):
            stamps.mark("sse")
        return sse(data)

    serving_mod.sse = timed_sse
    for one in getattr(engine, "engines", None) or [engine]:
        lanes = one.lanes
        start, finish = lanes.start, lanes.finish

        def timed_start(step, start=start):
            t = time.perf_counter()
            out = start(step)
            stamps.mark(f"{step.phase}0", t)
            stamps.mark(f"{step.phase}_submitted")
            stamps.mark(f"{step.phase}_bucket", (step.rows, step.seq, step.ctx))
            return out

        def timed_finish(step, handle, context, finish=finish):
            t = time.perf_counter()
            finish(step, handle, context)
            stamps.mark(f"{step.phase}1")
            stamps.mark(f"{step.phase}_reply", t)
            timings = list(getattr(handle, "timings", None) or [])  # filled in when the result is taken
            stamps.mark(f"{step.phase}_driver", sum(x.seconds for x in timings))
            for w in range(2):
                name = f"cpu:{w}"
                stamps.mark(f"{step.phase}_wall{w}", sum(x.worker_seconds[x.workers.index(name)] for x in timings
                                                         if name in x.workers))
                stamps.mark(f"{step.phase}_compute{w}", sum(x.compute_s[x.workers.index(name)] for x in timings
                                                            if name in x.workers))

        lanes.start, lanes.finish = timed_start, timed_finish
    return Timed(app)


async def lone(url: str, n_in: int, n_out: int, stamps: Stamps) -> None:
    import httpx

    from tessera.serve.bench import sse_objects, synthetic_prompt

    payload = {"model": MODEL, "prompt": synthetic_prompt(n_in), "max_tokens": n_out, "temperature": 0,
               "stream": True}
    async with httpx.AsyncClient(timeout=120) as client:
        await client.get(f"{url}/health")  # the connection open before the timed request, as a bench keeps it
        stamps.mark("c_send")
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
            async for obj in sse_objects(r):
                if any(c.get("text") for c in obj.get("choices") or []):
                    stamps.mark("c_first")  # the first text chunk (later ones leave it as it is)


SEGMENTS = [  # (label, from, to)
    ("send -> app (HTTP parse)", "c_send", "asgi"),
    ("app -> tokenise start (JSON, schema, thread hop)", "asgi", "tok0"),
    ("tokenise the prompt", "tok0", "tok1"),
    ("tokenised -> Engine.submit", "tok1", "submit"),
    ("submit -> prefill start (admission)", "submit", "prefill0"),
    ("prefill: inputs + submit", "prefill0", "prefill_submitted"),
    ("prefill: submitted -> reply taken", "prefill_submitted", "prefill_reply"),
    ("prefill: finish", "prefill_reply", "prefill1"),
    ("prefill end -> decode start", "prefill1", "decode0"),
    ("decode: inputs + submit", "decode0", "decode_submitted"),
    ("decode: submitted -> reply taken", "decode_submitted", "decode_reply"),
    ("decode reply -> token event (sample, detok)", "decode_reply", "emit"),
    ("event -> SSE chunk (event loop)", "emit", "sse"),
    ("SSE chunk -> client has it", "sse", "c_first"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="layer-pipeline")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between one request's end and the next")
    args = ap.parse_args()

    import socket

    import torch
    import uvicorn

    from tessera.plan.planner import plan_policy
    from tessera.runtime.pair_costs import local_pair_costs
    from tessera.runtime.prompt_profile import serving_profile
    from tessera.runtime.session import host_profile, planned_decode_position, runtime_context, runtime_graphs
    from tessera.serve.api import create_app
    from tessera.serve.config import ServeConfig
    from tessera.serve.launch import PLAN_OUTPUT, PLAN_PROMPT, start_engine
    from tessera.sim.requests import engines_for, simulate

    torch.set_num_threads(1)
    slots, max_context = 8, 128
    say = lambda s: print(s, file=sys.stderr)  # noqa: E731
    link, feedback_s = local_pair_costs(output_bytes=4 * 49152 * slots // 2)
    base = runtime_graphs(MODEL, PLAN_PROMPT, max_context, slots)
    position = planned_decode_position(PLAN_PROMPT, PLAN_OUTPUT, max_context)
    # the simulator before (the planned prompt step profiled, the others by the roofline) and after (every served
    # prompt step profiled)
    old = host_profile(MODEL, base, 1, say, position)
    old_ctx = runtime_context(MODEL, 2, PLAN_PROMPT, PLAN_OUTPUT, max_context, slots, 1, old, say)
    old_plan = plan_policy(old_ctx, args.policy, "throughput")
    profile = serving_profile(MODEL, base, 1, slots, max_context, ServeConfig.min_prompt_bucket, say, position)
    pctx = runtime_context(MODEL, 2, PLAN_PROMPT, PLAN_OUTPUT, max_context, slots, 1, profile, say)
    plan = plan_policy(pctx, args.policy, "throughput")
    cfg = ServeConfig(MODEL, "cpu:2", slots=slots, max_context=max_context, policy=args.policy, threads=1)
    engine, how = start_engine(cfg, say)
    say(f"serving: {how}")
    stamps = Stamps()
    app = instrument(engine, create_app(engine, MODEL), stamps)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    records = []
    load0 = os.getloadavg()[0]
    try:
        for i in range(args.requests + 2):
            n_in, n_out = LENGTHS[i % len(LENGTHS)]
            stamps.current = {}
            asyncio.run(lone(url, n_in, n_out, stamps))
            if i >= 2:  # two warm-up requests
                records.append((n_in, dict(stamps.current)))
            time.sleep(args.gap)
    finally:
        server.should_exit = True
        engine.stop()
    load1 = os.getloadavg()[0]

    sims = engines_for(pctx, plan, "throughput", max_context, feedback_s, cfg.min_prompt_bucket, link)
    print(f"# {MODEL} on cpu:2, {args.policy} (served: {how}); {len(records)} lone requests; load average "
          f"{load0:.2f} -> {load1:.2f}; driver round trip {feedback_s * 1e3:.2f} ms")
    print("| segment | " + " | ".join(f"in={n}" for n, _ in records) + " | median (ms) |")
    print("|---|" + "---|" * (len(records) + 1))
    for label, a, b in SEGMENTS:
        vals = [(r[b] - r[a]) * 1e3 if a in r and b in r else None for _, r in records]
        ok = [v for v in vals if v is not None]
        print(f"| {label} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in vals)
              + f" | {statistics.median(ok) if ok else float('nan'):.1f} |")
    for what in ("prefill", "decode"):
        for part in ("driver", "wall0", "compute0", "wall1", "compute1"):
            vals = [r.get(f"{what}_{part}", 0.0) * 1e3 for _, r in records]
            print(f"| ({what} step: {part} s) | " + " | ".join(f"{v:.1f}" for v in vals)
                  + f" | {statistics.median(vals):.1f} |")
    ttft = [(r["c_first"] - r["c_send"]) * 1e3 for _, r in records]
    engine_ttft = [(r["emit"] - r["submit"]) * 1e3 for _, r in records]
    print("| TTFT measured (client) | " + " | ".join(f"{v:.1f}" for v in ttft) + f" | {statistics.median(ttft):.1f} |")
    print("| TTFT engine (submit -> event) | " + " | ".join(f"{v:.1f}" for v in engine_ttft)
          + f" | {statistics.median(engine_ttft):.1f} |")
    buckets = [r.get("prefill_bucket") for _, r in records]
    for label, c, p in (("before: planned prompt profiled", old_ctx, old_plan), ("every prompt step profiled", pctx,
                                                                                  plan)):
        pred = [simulate(c, p, max_context=max_context, feedback_s=feedback_s, link=link,
                         min_prompt=cfg.min_prompt_bucket, draws=[(0.0, int(r["prompt"]), 2)]).ttft_s[0] * 1e3
                for _, r in records]
        print(f"| TTFT simulated alone ({label}) | " + " | ".join(f"{v:.1f}" for v in pred)
              + f" | {statistics.median(pred):.1f} |")
    timer = sims[0].timer
    devices = [t.name for t in timer.targets]
    for b in sorted({b for b in buckets}):
        t = timer.time("prefill", *b)
        print(f"| simulated prefill {b[0]}x{b[1]}: busy per worker | " + ", ".join(
            f"{d} {x * 1e3:.1f}" for d, x in zip(devices, t.busy_s, strict=True)) + " |")
    pre = [timer.time("prefill", b[0], b[1], b[2]).first_s * 1e3 for b in buckets]
    dec_bucket = records[0][1].get("decode_bucket")
    dec = timer.time("decode", dec_bucket[0], dec_bucket[1], dec_bucket[2]).first_s * 1e3
    print("| simulated prefill step (bucket rows x seq) | " + " | ".join(
        f"{v:.1f} ({b[0]}x{b[1]})" for v, b in zip(pre, buckets, strict=True)) + f" | {statistics.median(pre):.1f} |")
    print(f"| simulated decode step (rows {dec_bucket[0]}, ctx {dec_bucket[2]}) | {dec:.1f} |")


if __name__ == "__main__":
    main()
