"""This host's kernel times of every prompt step and every decode row bucket a served engine runs, so that the
simulator times a request's prefill and decode steps from measurements rather than the roofline.

`runtime.session.host_profile` profiles the graphs a run plans with: one prefill of the planned prompt (64
tokens on `tessera serve`) and the decode step. A served request's prefill runs at its own prompt bucket
(16, 32, 64 or 128 tokens, one row or several: `sched.Scheduler.prompt_shapes`), with a cache of its context
bucket; the simulator traces that bucket's graph and costs every kernel the profile does not hold (another
number of tokens is another kernel) by the CPU roofline. Measured on this host (`benchmarks/ttft_breakdown.py`,
benchmarks/README.md "A lone request's TTFT"), that charged a one-row prefill of 16 or 32 tokens about 110 ms
where the executor runs it in 170-220 ms: the larger part of what a lone request's simulated TTFT missed.

Decode is the same story at fewer rows than the slots: `host_profile` times decode at every slot, and a decode step
of 1, 2 or 4 rows of 8 slots was costed by the roofline, whose one-row GEMMs stream their weights at its
calibrated rate, and then charged the cold-weight excess on top (a read from memory counted twice): 35 ms of
GEMMs where the executor runs 24 in a step, and a light-load TPOT predicted 18-24% over (benchmarks/README.md,
"Every decode row bucket profiled"). A packed one-row or two-row GEMM on this CPU is not even monotone in its
rows: two rows run 12% slower than one, four 12% faster.

`serving_profile` adds a profile of each prompt step's graph and of each smaller decode row bucket's (cached per
graph, as `host_profile` caches its own), keeping the host overhead `host_profile` measured for the planned graphs.
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


def decode_step_rows(slots: int) -> list[int]:
    """The row buckets below ``slots`` a decode step of an engine of ``slots`` slots runs at (the serving
    scheduler's powers of two; the step of every slot is `host_profile`'s own)."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise PromptProfileError(f"slots must be a whole number >= 1, got {slots!r}")
    return [r for r in Buckets.default(slots).batch if r < slots]


def decode_graphs(model: str, rows: list[int], ctx: int, slots: int) -> dict[str, KernelGraph]:
    """The decode graph of each of ``rows`` over a cache of ``slots`` rows and ``ctx`` positions, traced as the
    served engine traces its decode buckets (on meta, through the trace cache), named ``decode@{rows}``."""
    from tessera.capture.trace_cache import trace_model_cached

    return {f"decode@{r}": trace_model_cached(model, "decode", batch=r, ctx=ctx, slots=slots if slots != r else None)
            for r in rows}


def serving_profile(model: str, graphs: dict[str, KernelGraph], threads: int, slots: int, max_context: int,
                    min_prompt: int, log: Callable[[str], None] = lambda s: None, decode_position: int = 0,
                    rows: int | None = None):
    """`host_profile` of the run's ``graphs`` (its overhead measured for them) with every kernel of the served
    prompt steps measured too (`prompt_step_shapes`; ``rows``: only prompt steps of at most that many rows,
    e.g. 1 for lone requests), and of the decode steps of fewer rows than the slots (`decode_step_rows`, up to
    ``rows`` where given; timed at the position `host_profile` times decode's other kernels at, its short one).
    Each added graph's profile is cached per graph hash, threads and a digest of the timed code
    (`overhead_probe.code_digest`: the executor, the worker, the kernels)."""
    from tessera.cost.positions import profiled_positions
    from tessera.runtime.overhead_probe import code_digest
    from tessera.runtime.session import graph_profile, host_profile

    profile = host_profile(model, graphs, threads, log, decode_position)
    if profile is None:
        raise PromptProfileError(f"no graphs to profile for {model}")
    shapes = [s for s in prompt_step_shapes(slots, max_context, min_prompt) if rows is None or s[0] <= rows]
    code = code_digest()  # a faster kernel or executor is profiled again
    added = [graph_profile(model, "prefill", name, g, threads, code, log)
             for name, g in prompt_graphs(model, shapes, slots).items()]
    if "decode" in graphs:
        position = profiled_positions(max_context)[-2] if decode_position is not None else 0
        decode_rows = [r for r in decode_step_rows(slots) if rows is None or r <= rows]
        added += [graph_profile(model, "decode", name, g, threads, code, log, position)
                  for name, g in decode_graphs(model, decode_rows, max_context, slots).items()]
    return with_prompt_kernels(profile, added)


def with_prompt_kernels(profile, prompts: list):
    """``profile`` (a :class:`~tessera.cost.profile.Profile`) with the kernels of the served steps' profiles
    ``prompts`` added; where both time a kernel (the same signature), the added steps' times stand."""
    added = [k for p in prompts for k in p.kernels]
    if any(p.device != profile.device for p in prompts):
        raise PromptProfileError(f"prompt step profiles of {sorted({p.device for p in prompts})} cannot join a "
                                 f"profile of {profile.device}")
    mine = {k.signature for k in added}
    profile.kernels = [*(k for k in profile.kernels if k.signature not in mine), *added]
    return profile
