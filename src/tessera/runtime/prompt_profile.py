"""This host's kernel times of every prompt step a served engine runs, so that the simulator times a request's
prefill from measurements rather than the roofline.

`runtime.session.host_profile` profiles the graphs a run plans with: one prefill of the planned prompt (64
tokens on `tessera serve`) and the decode step. A served request's prefill runs at its own prompt bucket
(16, 32, 64 or 128 tokens, one row or several: `sched.Scheduler.prompt_shapes`), with a cache of its context
bucket; the simulator traces that bucket's graph and costs every kernel the profile does not hold (another
number of tokens is another kernel) by the CPU roofline. Measured on this host (`benchmarks/ttft_breakdown.py`,
benchmarks/README.md "A lone request's TTFT"), that charged a one-row prefill of 16 or 32 tokens about 110 ms
where the executor runs it in 170-220 ms: the larger part of what a lone request's simulated TTFT missed.
`serving_profile` adds a profile of each prompt step's graph (cached per graph, as `host_profile` caches its
own), keeping the host overhead `host_profile` measured for the planned graphs.
"""

from __future__ import annotations

from collections.abc import Callable

from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph
from tessera.sched.scheduler import Buckets, Scheduler, stages_for


class PromptProfileError(TesseraError, ValueError):
    """Prompt steps that cannot be listed or profiled: sizes out of range."""


def prompt_step_shapes(slots: int, max_context: int, min_prompt: int) -> list[tuple[int, int, int]]:
    """Every (rows, prompt bucket, context bucket) a prefill step of an engine of ``slots`` slots, a context of
    ``max_context`` tokens and prompt buckets from ``min_prompt`` takes: the serving scheduler's prompt shapes
    (batched prompts up to every slot and ``max_context`` tokens a step), each with the context buckets its
    longest prompt can fall into (a prompt of n tokens writes n - 1 into the prompt bucket; its cache is the
    context bucket of n)."""
    for name, value, low in (("slots", slots, 1), ("max_context", max_context, 2), ("min_prompt", min_prompt, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise PromptProfileError(f"{name} must be a whole number >= {low}, got {value!r}")
    if min_prompt > max_context:
        raise PromptProfileError(f"min_prompt {min_prompt} is above max_context {max_context}: no prompt bucket")
    buckets = Buckets.default(slots, max_context, min_prompt)
    scheduler = Scheduler(stages_for("llm"), slots, buckets, max_context, prompt_rows=slots,
                          prompt_tokens=max_context)
    shapes = set()
    for rows, seq in scheduler.prompt_shapes():
        below = max((s for s in buckets.seq if s < seq), default=0)
        for written in range(below + 1, seq + 1):  # the tokens its longest prompt writes
            if written + 1 <= max_context:  # a longer prompt leaves no room for a token
                shapes.add((rows, seq, buckets.context(written + 1)))
    return sorted(shapes)


def prompt_graphs(model: str, shapes: list[tuple[int, int, int]], slots: int) -> dict[str, KernelGraph]:
    """The prefill graph of each (rows, prompt, context) shape over state of ``slots`` rows, traced as the
    simulator traces a prompt step's bucket (on meta, through the trace cache), named
    ``prefill@{rows}x{prompt}c{context}``."""
    from tessera.capture.trace_cache import trace_model_cached

    return {f"prefill@{r}x{s}c{c}": trace_model_cached(model, "prefill", batch=r, seq=s, ctx=c, slots=slots)
            for r, s, c in shapes}


def serving_profile(model: str, graphs: dict[str, KernelGraph], threads: int, slots: int, max_context: int,
                    min_prompt: int, log: Callable[[str], None] = lambda s: None, decode_position: int = 0,
                    rows: int | None = None):
    """`host_profile` of the run's ``graphs`` (its overhead measured for them) with every kernel of the served
    prompt steps measured too (`prompt_step_shapes`; ``rows``: only prompt steps of at most that many rows,
    e.g. 1 for lone requests). Each added graph's profile is cached per graph hash, threads and a digest of the
    timed code (`overhead_probe.code_digest`: the executor, the worker, the kernels)."""
    from tessera.runtime.overhead_probe import code_digest
    from tessera.runtime.session import graph_profile, host_profile

    profile = host_profile(model, graphs, threads, log, decode_position)
    if profile is None:
        raise PromptProfileError(f"no graphs to profile for {model}")
    shapes = [s for s in prompt_step_shapes(slots, max_context, min_prompt) if rows is None or s[0] <= rows]
    code = code_digest()  # a faster kernel or executor is profiled again
    added = [graph_profile(model, "prefill", name, g, threads, code, log)
             for name, g in prompt_graphs(model, shapes, slots).items()]
    return with_prompt_kernels(profile, added)


def with_prompt_kernels(profile, prompts: list):
    """``profile`` (a :class:`~tessera.cost.profile.Profile`) with the kernels of the prompt steps' profiles
    ``prompts`` added; where both time a kernel (the same signature), the prompt steps' times stand."""
    added = [k for p in prompts for k in p.kernels]
    if any(p.device != profile.device for p in prompts):
        raise PromptProfileError(f"prompt step profiles of {sorted({p.device for p in prompts})} cannot join a "
                                 f"profile of {profile.device}")
    mine = {k.signature for k in added}
    profile.kernels = [*(k for k in profile.kernels if k.signature not in mine), *added]
    return profile
