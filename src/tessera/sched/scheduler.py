"""The batching Scheduler: admission, state slots, static shape buckets and which requests join a step.

One module, two users: the simulator's request level (:mod:`tessera.sim.requests`) and the serving
engine make every batching decision here, so a prediction and a served run batch the same way.

A request goes through its family's stages in order (``stages_for``): for an LLM ``prefill`` (its prompt
except the last token, which fills the cache; one request per step, or several with ``prompt_rows``, below) then ``decode`` (rows of
many requests share a step; a request's first decode step feeds its last prompt token and yields its
first output token, each later one feeds the token before: ``output`` decode steps in all). Prefill
steps run at static prompt buckets and the prefill step's logits are at the bucket's last position,
so the request's first token comes from a decode step, where every row has its own position; a
one-token prompt needs no prefill. A vision-language model first ``encode``s its image; a diffusion
request is ``encode`` (text encoders), ``step`` (the denoising steps, batched across images) and
``decode`` (VAE, which yields the image). A request
holds a state slot (its KV / conv / SSM cache rows, or its latents) from the start of its first stage
to the end of its last, so at most ``slots`` requests are in flight; the others wait in arrival order.

Steps never mix stages: a prefill step and a decode step are different step plans (possibly on
different devices, as prefill-decode disaggregation places them), each traced at static shapes. A
step's shape is its bucket: the rows rounded up to a batch bucket, the prompt rounded up to a
sequence bucket, the longest context rounded up to a context bucket. No chunked prefill: a prompt is
one step, which keeps each step one graph at one static shape.

Admission. Without a KV budget (``kv`` None: the serving engine's physical KV slots, an SSM's
fixed-size state, diffusion latents) a request is admitted while one of the ``slots`` is free. With one
(:class:`KVBudget`: paged KV in blocks of ``block_size`` tokens, as a serving engine such as vLLM holds
it) ``slots`` is the most sequences in flight (an engine's ``max_num_seqs``) and a request also needs
KV blocks for the tokens in its cache, ceil(tokens / block_size). Admission is first come, first served
(no request skips ahead of the first waiting one): it is admitted when fewer than ``slots`` run and the
free blocks cover its whole prompt, ceil(input / block_size) blocks: the input - 1 tokens its prefill
writes plus the last prompt token its first decode step writes (what vLLM allocates for a prompt).
Before each batched step every row gets the block its next token needs (a new block each time its
context crosses a block boundary); when none is free the most recently admitted running request is
preempted by recompute: its blocks and slot are freed and it goes back to the front of the waiting
queue, keeping the tokens it generated (when that request is inside a step on another lane, a
disaggregated prefill, the row waits for the step to end instead). Readmitted, it runs its stages again from
the first, its prefill over prompt + generated tokens but the last (which its next decode step feeds)
at that length's prompt bucket, then decodes the outputs it still owes (each output counts once). A
request whose whole context (input + output) needs more blocks than the budget is rejected at submit.

Batched prompts (``prompt_rows`` > 1, what `tessera serve` runs): a prefill step holds several requests,
one row each, at the rows bucket of their count and the prompt bucket of the longest (shorter prompts are
padded after their last token, which causal attention never lets them read). It takes the requests ready for a
prefill (earliest first), then admits waiting ones first come first served into the same step while slots
are free and the step stays within ``prompt_rows`` requests and ``prompt_tokens`` tokens (rows bucket x
prompt bucket; one request always fits): continuous batching, since prompts join after every step without
waiting for the running requests to finish. `prompt_shapes` lists the shapes such steps can take.

Priorities: among the stages a lane may run, single-request stages go first, the latest stage first (a
finished diffusion image is decoded at once, an encoded image is prefilled before another request is
admitted and encoded, so admitted requests do not hold slots while they queue for their prompt steps;
the first stage admits new work, so slots freed by finished requests are filled at once), then the
batched stage runs every request that is ready for it. A request inside a step is not offered to another
lane (two lanes of one engine may both prefill); a lane that admits a request runs its single-request
stages, and a lane may be told not to admit (a decode device that prefills only its share of the prompts).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from tessera.errors import TesseraError

DEFAULT_MAX_CONTEXT = 8192


class SchedulerError(TesseraError, ValueError):
    """A scheduler set up with impossible limits (no slots, empty buckets, unknown stages, no KV blocks)."""


@dataclass(frozen=True)
class KVBudget:
    """An engine's paged KV cache: ``blocks`` blocks of ``block_size`` tokens each."""

    blocks: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SchedulerError(f"a KV budget needs a positive whole number of {name.replace('_', ' ')} "
                                     f"(got {value!r})")

    @property
    def tokens(self) -> int:
        """Cache tokens the blocks hold."""
        return self.blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` cache tokens."""
        return -(-max(tokens, 0) // self.block_size)


@dataclass(frozen=True)
class Stage:
    """One stage of a request: its phase, whether rows of many requests share its steps, and how many
    steps a request takes in it: a number, ``"prompt"`` (one step when the prompt has more than one token,
    else none) or ``"output"`` (one per output token)."""

    phase: str
    batched: bool
    steps: int | str = 1


def stages_for(family: str, denoising_steps: int = 28) -> tuple[Stage, ...]:
    """A family's stages in order."""
    if family == "diffusion":
        return (Stage("encode", False), Stage("step", True, denoising_steps), Stage("decode", False))
    text = (Stage("prefill", False, "prompt"), Stage("decode", True, "output"))
    return (Stage("encode", False), *text) if family == "vlm" else text


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... up to the first value >= hi (hi itself when it is not a power of two times lo)."""
    out, v = [], max(1, lo)
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return tuple(out)


@dataclass(frozen=True)
class Buckets:
    """The static shapes steps run at: rows per batched step, prompt lengths, cache contexts."""

    batch: tuple[int, ...]
    seq: tuple[int, ...] = ()
    ctx: tuple[int, ...] = ()
    paged: bool = False  # a step's context is its rows' mean (paged attention reads each row's own), not the longest

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "ctx"):
            values = getattr(self, name)
            if list(values) != sorted(set(values)) or any(v < 1 for v in values):
                raise SchedulerError(f"{name} buckets must be positive and strictly increasing (got {values})")
        if not self.batch:
            raise SchedulerError("at least one batch bucket is needed")

    @staticmethod
    def default(max_batch: int, max_context: int | None = None, min_seq: int = 128) -> Buckets:
        """Powers of two: rows 1 .. max_batch, prompts min_seq .. max_context, contexts 2 min_seq .. max_context."""
        if max_context is None:
            return Buckets(powers_of_two(1, max_batch))
        return Buckets(powers_of_two(1, max_batch), powers_of_two(min_seq, max_context),
                       powers_of_two(min(2 * min_seq, max_context), max_context))

    @staticmethod
    def fine(max_batch: int, max_context: int, granule: int = 16, min_seq: int = 1) -> Buckets:
        """An engine's shapes, with no padding to speak of: every row count 1 .. max_batch, prompts and
        contexts rounded up to ``granule`` tokens (a KV block), from ``min_seq`` (a VLM prompt holds its
        image's tokens) up to max_context; a decode step's context is its rows' mean (paged attention)."""
        first = min(max(min_seq, granule), max_context)
        sizes = (first, *range(-(-first // granule) * granule, max_context, granule), max_context)
        sizes = tuple(sorted(set(sizes)))
        return Buckets(tuple(range(1, max_batch + 1)), sizes, sizes, paged=True)

    @staticmethod
    def _fit(values: tuple[int, ...], n: int, what: str) -> int:
        i = bisect.bisect_left(values, n)
        if i < len(values):
            return values[i]
        raise SchedulerError(f"{what} {n} is above the largest bucket ({values[-1] if values else 'none'})")

    def rows(self, n: int) -> int:
        return self._fit(self.batch, n, "rows")

    def prompt(self, n: int) -> int:
        return self._fit(self.seq, n, "prompt length") if self.seq else n

    def context(self, n: int) -> int:
        return self._fit(self.ctx, n, "context") if self.ctx else n


@dataclass(eq=False)
class Request:
    """One request as the scheduler sees it. ``output`` is the number of tokens to generate (images: 1);
    serving may end a request earlier (stop strings) with :meth:`Scheduler.finish`."""

    id: int | str
    arrival_s: float
    input: int = 0
    output: int = 1
    stage: int = -1  # index into the stages; -1: waiting for a slot
    left: int = 0  # steps left in the current stage
    slot: int | None = None
    ready_s: float = 0.0  # when it may take its next step (after a state move, for instance)
    generated: int = 0
    first_output_s: float | None = None
    finish_s: float | None = None
    busy_s: float = 0.0  # the durations of the steps it took part in
    rejected: str | None = None
    blocks: int = 0  # KV blocks it holds (a scheduler with a KV budget)
    preemptions: int = 0  # times it was preempted (by recompute) for lack of KV blocks
    in_step: bool = False  # part of a step handed out and not completed yet (not preempted then)
    step_since: float = 0.0  # when the step it is in (``in_step``) was handed out
    owner: object = None  # the lane that admitted it and runs its single-request stages (None: any lane)

    @property
    def context(self) -> int:
        """Tokens in its cache after its next decode step (its prompt, then one more per output token)."""
        return self.input + self.generated


@dataclass
class ScheduledStep:
    """What the next step runs: one stage's phase for these requests at this bucket."""

    phase: str
    requests: list[Request]
    rows: int  # bucket rows (>= len(requests))
    seq: int | None = None  # prompt bucket (prefill)
    ctx: int | None = None  # context bucket

    @property
    def bucket(self) -> tuple[str, int, int | None, int | None]:
        return (self.phase, self.rows, self.seq, self.ctx)


@dataclass
class Scheduler:
    """Admission, slots and step decisions for one replica of a deployment (see the module docstring)."""

    stages: tuple[Stage, ...]
    slots: int
    buckets: Buckets
    max_context: int | None = DEFAULT_MAX_CONTEXT
    max_queue: int | None = None  # waiting requests beyond this are rejected (None: unbounded)
    kv: KVBudget | None = None  # paged KV admission (None: slots alone)
    prompt_rows: int = 1  # the most requests one prefill step holds (batched prompts, see the module docstring)
    prompt_tokens: int | None = None  # the most tokens (rows bucket x prompt bucket) of a prefill step of several
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    done: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)
    preemptions: int = 0

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise SchedulerError(f"a scheduler needs at least one slot (got {self.slots})")
        if not self.stages or sum(s.batched for s in self.stages) > 1:
            raise SchedulerError("a request needs stages, at most one of them batched")
        if self.prompt_rows < 1 or (self.prompt_tokens is not None and self.prompt_tokens < 1):
            raise SchedulerError(f"a prefill step needs at least one row and one token (got prompt_rows "
                                 f"{self.prompt_rows}, prompt_tokens {self.prompt_tokens})")
        self._free = list(range(self.slots - 1, -1, -1))
        self._free_blocks = self.kv.blocks if self.kv is not None else 0

    @property
    def free_blocks(self) -> int | None:
        """KV blocks no request holds (None without a KV budget)."""
        return None if self.kv is None else self._free_blocks

    @property
    def phases(self) -> list[str]:
        return [s.phase for s in self.stages]

    def submit(self, req: Request) -> bool:
        """Queue a request, or reject it (reason in ``req.rejected``) when it can never run."""
        reason = None
        if req.output < 1:
            reason = f"asks for {req.output} outputs; at least 1 is needed"
        elif self.max_context is not None and req.input + req.output > self.max_context:
            reason = (f"needs a context of {req.input + req.output} tokens (prompt {req.input} + output "
                      f"{req.output}), above the deployment's {self.max_context}")
        elif self.kv is not None and self.kv.blocks_for(req.input + req.output) > self.kv.blocks:
            reason = (f"needs {self.kv.blocks_for(req.input + req.output)} KV blocks of {self.kv.block_size} tokens "
                      f"for its context of {req.input + req.output} tokens (prompt {req.input} + output "
                      f"{req.output}), above the engine's {self.kv.blocks} blocks ({self.kv.tokens} tokens)")
        elif self.max_queue is not None and len(self.waiting) >= self.max_queue:
            reason = f"the queue is full ({self.max_queue} waiting)"
        if reason is not None:
            req.rejected = reason
            self.rejected.append(req)
            return False
        self.waiting.append(req)
        return True

    @staticmethod
    def _steps_in(stage: Stage, req: Request) -> int:
        if stage.steps == "prompt":  # after a preemption the prompt is recomputed with the tokens generated
            return 1 if req.context > 1 else 0
        if stage.steps == "output":
            return req.output - req.generated
        return int(stage.steps)

    def _enter(self, req: Request, index: int) -> None:
        """Move ``req`` to stage ``index`` (skipping stages it needs no steps of), or finish it."""
        while index < len(self.stages) and self._steps_in(self.stages[index], req) <= 0:
            index += 1
        req.stage = index
        if index < len(self.stages):
            req.left = self._steps_in(self.stages[index], req)

    def pending(self) -> int:
        """Requests not finished yet (waiting or running)."""
        return len(self.waiting) + len(self.running)

    def next_step(self, now: float, phases: set[str] | None = None, max_rows: int | None = None,
                  admit: bool = True, owner: object = None) -> ScheduledStep | None:
        """The step to run now among ``phases`` (all when None), or None when nothing is ready. ``max_rows``
        caps the requests in flight and the rows of a batched step (a latency plan's low-load bucket). With
        a KV budget, the rows of a batched step get their next token's block first (preempting when none
        is free, see the module docstring). ``admit``: whether the step may admit a waiting request (a lane
        that decodes and prefills some of the prompts leaves the others to the engine's prefill lanes);
        ``owner``: the lane asking, which then runs the single-request stages of the requests it admits (and
        only those: an encoded image's prefill stays where its encoder output is)."""
        allowed = set(self.phases) if phases is None else phases
        cap = min(max_rows or self.slots, self.buckets.batch[-1])
        order = [i for i, s in reversed(list(enumerate(self.stages))) if not s.batched] + \
            [i for i, s in enumerate(self.stages) if s.batched]
        for i in order:
            stage = self.stages[i]
            if stage.phase not in allowed:
                continue
            if stage.batched:
                # not the rows of a step in flight: after an objective switch another lane runs this phase too
                rows = [r for r in self.running if r.stage == i and r.ready_s <= now and not r.in_step][:cap]
                if self.kv is not None:
                    rows = self._grow(rows, now)
                if rows:
                    longest = (-(-sum(r.context for r in rows) // len(rows)) if self.buckets.paged else
                               max(r.context for r in rows))
                    ctx = self.buckets.context(longest) if self.buckets.ctx else None
                    return self._handed(ScheduledStep(stage.phase, rows, self.buckets.rows(len(rows)), None, ctx), now)
                continue
            if stage.phase == "prefill" and self.prompt_rows > 1:
                prompts = self._prompts(i, now, cap, admit, owner)
                if prompts is not None:
                    return self._handed(prompts, now)
                continue
            ready = [r for r in self.running if r.stage == i and r.ready_s <= now and not r.in_step
                     and (owner is None or r.owner is None or r.owner is owner)]
            if not ready and admit and i == 0 and self._admissible(now, cap):
                req = self._admit(owner)
                ready = [req] if req.stage == 0 else []
            if ready:
                req = min(ready, key=lambda r: (r.ready_s, r.arrival_s))
                # a prefill writes the prompt (after a preemption: with the tokens generated) but its last token
                seq = self.buckets.prompt(req.context - 1) if stage.phase == "prefill" and self.buckets.seq else None
                ctx = self.buckets.context(req.context) if stage.phase == "prefill" and self.buckets.ctx else None
                return self._handed(ScheduledStep(stage.phase, [req], 1, seq, ctx), now)
        return None

    def _admissible(self, now: float, cap: int) -> bool:
        """Whether the first waiting request may be admitted now (a free slot, its KV blocks, the cap)."""
        return bool(self.waiting and self._free and self.waiting[0].arrival_s <= now and len(self.running) < cap
                    and self._fits(self.waiting[0]))

    def _admit(self, owner: object) -> Request:
        """Admit the first waiting request into its first stage (one it needs steps of)."""
        req = self.waiting.popleft()
        req.slot, req.owner = self._free.pop(), owner
        if self.kv is not None:
            req.blocks = self.kv.blocks_for(req.context)
            self._free_blocks -= req.blocks
        self._enter(req, 0)
        self.running.append(req)
        return req

    def prompt_fits(self, rows: int, longest: int) -> bool:
        """Whether a prefill step of ``rows`` requests, the longest writing ``longest`` tokens, fits
        ``prompt_rows`` and ``prompt_tokens`` (one request always does)."""
        if rows <= 1:
            return True
        if rows > min(self.prompt_rows, self.buckets.batch[-1]):
            return False
        return self.prompt_tokens is None or \
            self.buckets.rows(rows) * self.buckets.prompt(longest) <= self.prompt_tokens

    def prompt_shapes(self) -> list[tuple[int, int]]:
        """Every (rows bucket, prompt bucket) a prefill step may take (the graphs a server traces for them)."""
        shapes = {(self.buckets.rows(n), s) for n in range(1, min(self.prompt_rows, self.buckets.batch[-1]) + 1)
                  for s in self.buckets.seq if self.prompt_fits(n, s)}
        return sorted(shapes)

    def _prompts(self, index: int, now: float, cap: int, admit: bool, owner: object) -> ScheduledStep | None:
        """A prefill step of several requests: those ready for it (earliest first), then waiting requests
        admitted first come first served, while the step fits (`prompt_fits`) and slots are free."""
        ready = sorted((r for r in self.running if r.stage == index and r.ready_s <= now and not r.in_step
                        and (owner is None or r.owner is None or r.owner is owner)),
                       key=lambda r: (r.ready_s, r.arrival_s))
        rows: list[Request] = []
        for req in ready:
            if not self.prompt_fits(len(rows) + 1, max(r.context - 1 for r in [*rows, req])):
                break
            rows.append(req)
        while admit and index == 0 and self._admissible(now, cap):
            nxt = self.waiting[0]
            if nxt.context > 1 and not self.prompt_fits(len(rows) + 1, max(r.context - 1 for r in [*rows, nxt])):
                break
            req = self._admit(owner)
            if req.stage == index:  # a one-token prompt needs no prefill: it waits for the next decode step
                rows.append(req)
        if not rows:
            return None
        seq = self.buckets.prompt(max(r.context - 1 for r in rows)) if self.buckets.seq else None
        ctx = self.buckets.context(max(r.context for r in rows)) if self.buckets.ctx else None
        return ScheduledStep("prefill", rows, self.buckets.rows(len(rows)), seq, ctx)

    @staticmethod
    def _handed(step: ScheduledStep, now: float) -> ScheduledStep:
        for req in step.requests:
            req.in_step, req.step_since = True, now
        return step

    def _fits(self, req: Request) -> bool:
        """Whether the free KV blocks cover ``req``'s cache at admission (its prompt and generated tokens)."""
        return self.kv is None or self.kv.blocks_for(req.context) <= self._free_blocks

    def _grow(self, rows: list[Request], now: float) -> list[Request]:
        """``rows`` (in admission order) that hold the block their next token needs, preempting the most
        recently admitted running requests while none is free."""
        assert self.kv is not None
        kept: list[Request] = []
        gone: set[int] = set()
        for req in rows:
            if id(req) in gone:
                continue
            need = self.kv.blocks_for(req.context) - req.blocks
            while need > self._free_blocks:
                victim = self.running[-1]
                if victim.in_step:  # inside a step on another lane (a prefill): ``req`` waits for it to end
                    gone.add(id(req))
                    break
                self._preempt(victim, now)
                gone.add(id(victim))
                if victim is req:
                    break
            if id(req) not in gone:
                req.blocks += need
                self._free_blocks -= need
                kept.append(req)
        return kept

    def _preempt(self, req: Request, now: float) -> None:
        """Preempt a running request by recompute: free its slot and blocks, queue it first (its recompute may
        start at once: a state move it was waiting for is void)."""
        self.running.remove(req)
        self._free.append(req.slot)
        self._free_blocks += req.blocks
        req.slot, req.blocks, req.stage, req.left, req.ready_s = None, 0, -1, 0, min(req.ready_s, now)
        req.owner = None
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def complete(self, step: ScheduledStep, start_s: float, end_s: float,
                 delays: dict[str, float] | None = None) -> list[Request]:
        """Account a finished step (every request in it advanced one step); ``delays[phase]`` holds a
        request back before its next stage's phase (a state move). Returns the requests that finished."""
        finished = []
        for req in step.requests:
            req.in_step = False
            req.busy_s += end_s - start_s
            stage = self.stages[req.stage]
            if stage.phase == "decode":  # a token (the image, for the VAE decode of diffusion)
                req.generated += 1
                if req.first_output_s is None:
                    req.first_output_s = end_s
            req.left -= 1
            req.ready_s = end_s
            if req.left <= 0:
                self._enter(req, req.stage + 1)
                if req.stage < len(self.stages):
                    req.ready_s = end_s + (delays or {}).get(self.stages[req.stage].phase, 0.0)
            if req.stage >= len(self.stages):
                finished.append(req)
        for req in finished:
            self.finish(req, end_s)
        return finished

    def finish(self, req: Request, now: float) -> None:
        """End a request (its last step, a stop string, a client gone): free its slot."""
        if req in self.running:
            self.running.remove(req)
            self._free.append(req.slot)
            self._free_blocks += req.blocks
            req.blocks = 0
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish_s = now
        if req.first_output_s is None:
            req.first_output_s = now
        self.done.append(req)
