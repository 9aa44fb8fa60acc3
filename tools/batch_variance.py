"""Batch variance of served greedy outputs, measured in process (issue #20).

1. Engine level: the same prompts served alone (one at a time) and all at once through the serving
   engine (`tessera.serve.launch.start_engine`, ``--local``: one process), greedy; counts the requests whose
   tokens differ and, for each, the top-2 logit margin of the alone run at the first differing token.
2. Kernel level: B prompts prefilled into slots 0..B-1, then one decode step at B rows and the same step
   of one row at 1 row (same cache); every kernel's output row compared bit for bit, in program order:
   the first kernel that differs, and how many do.

Both with the default kernels and with ``--batch-invariant`` (GEMMs row by row), unless ``--mode`` picks one.

    PYTHONPATH=src python tools/batch_variance.py --prompts 64 --max-tokens 8
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from tessera.graph.ir import TensorRef
from tessera.serve.config import ServeConfig
from tessera.serve.engine import GenerationParams
from tessera.serve.launch import start_engine

MODEL = "smollm2-135m"


SUBJECTS = ["the sea", "a city", "my dog", "winter", "the moon", "a robot", "music", "the forest"]
OPENINGS = ["Write a short story about {}:", "Here is a fact about {}:", "Describe {} in one sentence:",
            "The best thing about {} is", "Q: What do you think of {}? A:", "A poem about {}:\n",
            "Three words for {}:", "Once upon a time, {}"]


def prompts(n: int, kind: str = "count") -> list[str]:
    """``count``: the prompts of tests/serve/test_api.py's 64-request test (each repeats its own number);
    ``text``: short English prompts (an opening x a subject), whose continuations are less certain."""
    if kind == "text":
        return [OPENINGS[i % 8].format(SUBJECTS[(i // 8 + i) % 8]) for i in range(n)]
    return [f"{100 + 13 * i}, {100 + 13 * i}, {100 + 13 * i}, {100 + 13 * i}," for i in range(n)]


class Recorder:
    """A step backend that keeps every decode step's logits (for the margins)."""

    def __init__(self, backend):
        self.backend, self.logits = backend, []

    def run(self, phase, inputs):
        out = self.backend.run(phase, inputs)
        if phase.startswith("decode"):
            self.logits.append(out["logits"][:, -1].float().clone())
        return out

    def busy_s(self):
        return self.backend.busy_s()

    def close(self):
        self.backend.close()


def serve(engine, texts: list[str], max_tokens: int, together: bool) -> tuple[list[list[int]], list[list]]:
    """Greedy tokens per prompt; alone: also each request's decode logits in order."""
    rec = engine.backend
    tokens, logits = [None] * len(texts), [None] * len(texts)
    done = [threading.Event() for _ in texts]
    gens = []
    for i, text in enumerate(texts):
        def sink(kind, payload, i=i):
            if kind in ("done", "error"):
                if kind == "error":
                    raise RuntimeError(payload)
                done[i].set()
        start = len(rec.logits)
        gens.append(engine.submit(engine.tokenizer(text).input_ids, GenerationParams(max_tokens=max_tokens), sink))
        if not together:
            assert done[i].wait(300)
            logits[i] = rec.logits[start:]
    for i, e in enumerate(done):
        assert e.wait(600)
        tokens[i] = list(gens[i].tokens)
    return tokens, logits


def margin(row: torch.Tensor) -> float:
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def engine_level(n: int, max_tokens: int, slots: int, invariant: bool, kind: str = "count") -> dict:
    cfg = ServeConfig(MODEL, "cpu:1", slots=slots, max_context=128, local=True, batch_invariant=invariant)
    engine, _ = start_engine(cfg)
    try:
        engine.backend = Recorder(engine.backend)
        texts = prompts(n, kind)
        t0 = time.perf_counter()
        alone, logits = serve(engine, texts, max_tokens, together=False)
        t1 = time.perf_counter()
        batched, _ = serve(engine, texts, max_tokens, together=True)
        t2 = time.perf_counter()
    finally:
        engine.stop()
    diffs = []
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        if a != b:
            k = next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            diffs.append({"prompt": i, "first_diff_token": k, "alone_margin": round(margin(logits[i][k][0]), 4)})
    return {"prompts": n, "kind": kind, "max_tokens": max_tokens, "differ": len(diffs), "details": diffs, "alone_s": round(t1 - t0, 1),
            "batched_s": round(t2 - t1, 1)}


def _trace(executor, inputs, state) -> list[tuple[str, str, torch.Tensor | None]]:
    """(kernel id, op, first output) of every kernel of a one-device program, nothing freed."""
    executor.prepare(inputs, state)
    out = []
    with torch.no_grad():
        for ins in executor.program.instructions:
            if ins.kind != "run":
                continue
            executor.run_kernel(ins.kernel)
            k = executor.graph.kernels[ins.kernel]
            ref = next((r for r in k.outputs if r is not None), None)
            out.append((k.id, k.op, None if ref is None else executor.view(TensorRef.from_json(ref)).clone()))
    executor.release()
    return out


def kernel_level(rows: int, invariant: bool) -> dict:
    cfg = ServeConfig(MODEL, "cpu:1", slots=rows, max_context=128, local=True, batch_invariant=invariant)
    engine, _ = start_engine(cfg)
    engine.stop()  # only its backend (graphs, weights, cache) is used
    runner, tok = engine.backend.runner, engine.tokenizer
    ids = [tok(t).input_ids for t in prompts(rows)]
    seq = min(b for b in engine.scheduler.buckets.seq if b >= max(len(p) for p in ids) - 1)
    for slot, p in enumerate(ids):
        x = p[:-1] + [engine.pad] * (seq - len(p) + 1)
        runner(f"prefill@{seq}", {"input_ids": torch.tensor([x]), "slots": torch.tensor([slot])})
    state = {k: v.clone() for k, v in runner.state.items()}
    inputs = {"input_ids": torch.tensor([[p[-1]] for p in ids]), "positions": torch.tensor([len(p) - 1 for p in ids]),
              "slots": torch.arange(rows)}
    many = _trace(runner.executors[f"decode@{rows}"], inputs, {k: v.clone() for k, v in state.items()})
    report = {"rows": rows, "kernels": len(many), "rows_checked": rows, "first_diff": [], "differing_kernels": 0}
    for r in range(rows):
        one_in = {k: v[r:r + 1] for k, v in inputs.items()}
        one = _trace(runner.executors["decode@1"], one_in, {k: v.clone() for k, v in state.items()})
        first = None
        for (kid, op, a), (_, _, b) in zip(many, one, strict=True):
            if a is None or b is None or a.shape[0] != rows or b.shape[0] != 1 or a.shape[1:] != b.shape[1:]:
                continue
            if not torch.equal(a[r:r + 1], b):
                report["differing_kernels"] += 1
                if first is None:
                    d = (a[r:r + 1].float() - b.float()).abs().max().item()
                    first = {"row": r, "kernel": kid, "op": op, "max_abs_diff": d}
        if first is not None:
            report["first_diff"].append(first)
        if r == 0:
            row_logits = (many[-2][2], one[-2][2])  # the lm_head GEMM's output (the sampler is last)
            report["row0_logit_max_abs_diff"] = (row_logits[0][0:1].float() - row_logits[1].float()).abs().max().item()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--mode", choices=["both", "default", "invariant"], default="both")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--prompt-set", choices=["count", "text"], default="count")
    args = ap.parse_args()
    torch.set_num_threads(1)
    modes = {"both": [False, True], "default": [False], "invariant": [True]}[args.mode]
    for invariant in modes:
        result: dict = {"batch_invariant": invariant}
        if not args.skip_kernels:
            result["kernel_level"] = kernel_level(args.slots, invariant)
        if not args.skip_engine:
            result["engine_level"] = engine_level(args.prompts, args.max_tokens, args.slots, invariant,
                                                  args.prompt_set)
        print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
