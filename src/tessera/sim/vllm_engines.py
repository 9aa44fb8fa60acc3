"""Requests served by vLLM engines, as vLLM's scheduler runs them: the simulator of `--engine vllm`.

Each engine runs one step at a time. A step has a token budget (``max_num_batched_tokens``): the running
requests go first, in admission order (a decode takes one token, an unfinished prompt the rest of its prompt
up to the budget), then waiting requests join first come first served while the budget, the sequence cap
(``max_num_seqs``) and free KV blocks last, their prompts cut into chunks by what is left of the budget
(chunked prefill). A request whose next block does not fit preempts the latest admitted request, which
starts again from its prompt (recompute). A prompt's last chunk samples its first token at the step's end;
each later step adds a token per decoding request. The step's time comes from the engine's step times
(:class:`~tessera.cost.engine_steps.EngineStepTimes`): measured on a real engine, or predicted.

Engines that share a device (two vLLM processes on one GPU) take turns, one step at a time, the one
that waited longest first. Each request takes a route when it arrives, by the same rules as Tessera's router
(`tessera.plan.shares`): the plan's shares by smooth weighted round robin, or the shares the router's share
switch chooses from the requests in flight. A route of two hops prefills on its first engine (one output token, discarded) and hands the KV to
its second, where the request waits for the handoff, then computes its last prompt token and decodes. Each
engine call adds the engine's request overhead to the time to first token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tessera.cost.engine_steps import EngineStepTimes
from tessera.errors import TesseraError
from tessera.plan.shares import ShareSwitch, SmoothRoundRobin, key


class VLLMSimulationError(TesseraError):
    """A deployment or workload the vLLM simulator cannot serve."""


@dataclass
class SimRequest:
    """One request and its times (seconds from the start)."""

    id: int
    arrival_s: float
    prompt: int
    output: int
    hops: tuple[int, ...] = ()  # engine indexes along its route
    hop: int = 0
    computed: int = 0  # prefill tokens in the current engine's cache
    generated: int = 0
    recompute: int = 0  # generated tokens to compute again with the prompt (preempted by recompute)
    blocks: int = 0
    ready_s: float = 0.0  # the KV handoff it waits for
    first_s: float | None = None
    finish_s: float | None = None
    rejected: str | None = None

    @property
    def prefill_tokens(self) -> int:
        """Tokens its prefill computes on this engine: the prompt, and after a preemption its output so far."""
        return self.prompt + self.recompute

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_tokens

    @property
    def last_hop(self) -> bool:
        return self.hop == len(self.hops) - 1

    @property
    def target_output(self) -> int:
        """Tokens it generates on its current engine (a prefill hop: one, discarded)."""
        return self.output if self.last_hop else 1


@dataclass
class EngineSim:
    """One vLLM engine: its step times, limits and queues."""

    name: str
    times: EngineStepTimes
    max_num_seqs: int
    max_tokens: int  # max_num_batched_tokens
    block_size: int
    kv_blocks: int | None  # None: never short of blocks
    handoff_s: float = 0.0  # the KV handoff into this engine, per request
    devices: frozenset[str] = frozenset()  # engines sharing a device take turns, step by step
    waiting: deque[SimRequest] = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)
    busy_until: float = 0.0
    step: list[tuple[SimRequest, int]] | None = None
    steps: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    used_blocks: int = 0  # the running requests' blocks, kept as they change (checked once per request a step)

    @property
    def free_blocks(self) -> float:
        if self.kv_blocks is None:
            return float("inf")
        return self.kv_blocks - self.used_blocks

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self.used_blocks -= victim.blocks
        victim.blocks = 0
        victim.recompute = victim.generated if victim.last_hop else 0
        victim.computed = victim.prompt - 1 if victim.hop > 0 else 0  # a handed-on cache is loaded again
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def schedule(self, now: float) -> list[tuple[SimRequest, int]]:
        """The requests of the next step and the tokens each computes (vLLM's V1 order)."""
        budget = self.max_tokens
        out: list[tuple[SimRequest, int]] = []
        preempted = False
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:  # preempted by an earlier request of this step
                continue
            n = min(req.prefill_tokens - req.computed if req.prefilling else 1, budget)
            need = self._blocks_for(req.prompt + req.generated + n if not req.prefilling else req.computed + n) \
                - req.blocks
            while need > self.free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req not in self.running:
                continue
            req.blocks += max(need, 0)
            self.used_blocks += max(need, 0)
            out.append((req, n))
            budget -= n
        if preempted:
            return out
        skipped: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            if req.ready_s > now:  # its KV is still on its way: later requests may go first
                skipped.append(req)
                continue
            n = min(req.prefill_tokens - req.computed, budget)
            need = self._blocks_for(req.computed + n)
            if need > self.free_blocks:
                self.waiting.appendleft(req)
                break
            req.blocks = need
            self.used_blocks += need
            self.running.append(req)
            out.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return out

    def step_time(self, step: list[tuple[SimRequest, int]]) -> float:
        """Seconds of one step: its prompt tokens and its decodes at their mean context."""
        chunks = [(n, r.computed) for r, n in step if r.prefilling]  # a chunk attends to what is cached before it
        prompt = sum(n for n, _ in chunks)
        squares = sum(n * n + 2 * n * before for n, before in chunks)
        decodes = [r.prompt + r.generated for r, _ in step if not r.prefilling]
        return self.times.step_s(prompt, len(decodes), float(np.mean(decodes)) if decodes else 0.0, squares,
                                 len(chunks))

    def finish(self, now: float) -> list[SimRequest]:
        """End the running step at ``now``; the requests done on this engine (finished or moving on)."""
        leaving = []
        for req, n in self.step or []:
            if req.prefilling:
                req.computed += n
                if req.prefilling:
                    continue  # more chunks to come
                req.recompute = 0
            req.generated += 1
            if req.last_hop and req.generated == 1:
                req.first_s = now
            if req.generated >= req.target_output:
                self.running.remove(req)
                self.used_blocks -= req.blocks
                req.blocks = 0
                leaving.append(req)
        self.step = None
        return leaving


@dataclass(frozen=True)
class SimRoute:
    """A route of the plan: the engines it visits (indexes) and its share of the requests."""

    name: str
    share: float
    hops: tuple[int, ...]


@dataclass
class VLLMSimResult:
    """What the simulated vLLM deployment achieved, and every request's times."""

    requests: list[SimRequest]
    engines: list[EngineSim]
    makespan_s: float

    def summary(self) -> dict[str, float | int | None]:
        """Throughput (output tokens/s), TTFT and TPOT percentiles, counts (the keys of `tessera bench`)."""
        done = [r for r in self.requests if r.finish_s is not None]
        ttft = [self._ttft(r) for r in done]
        tpot = [(r.finish_s - r.first_s) / (r.output - 1) for r in done if r.output > 1]
        latency = [r.finish_s - r.arrival_s + self._overhead(r) for r in done]
        tokens = sum(r.output for r in done)

        def pct(v: list[float], q: float) -> float | None:
            return float(np.percentile(v, q)) if v else None

        return {"throughput": tokens / self.makespan_s if self.makespan_s > 0 else None,
                "completed": len(done), "rejected": len(self.requests) - len(done), "duration_s": self.makespan_s,
                "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_s": pct(tpot, 50),
                "tpot_p99_s": pct(tpot, 99), "latency_p50_s": pct(latency, 50),
                "steps": sum(e.steps for e in self.engines), "preemptions": sum(e.preemptions for e in self.engines)}

    def _overhead(self, r: SimRequest) -> float:
        return sum(self.engines[h].times.overhead_s for h in r.hops)

    def _ttft(self, r: SimRequest) -> float:
        return r.first_s - r.arrival_s + self._overhead(r)


def simulate_vllm(engines: list[EngineSim], routes: list[SimRoute], draws: list[tuple[float, int, int]],
                  switch: ShareSwitch | None = None) -> VLLMSimResult:
    """Serve ``draws`` (arrival seconds, prompt tokens, output tokens) on ``engines`` along ``routes``: each
    request takes a route when it arrives, by the routes' shares, or by the shares ``switch`` (over the same
    routes, in the same order) chooses from the requests then in flight, as the router does."""
    if not routes:
        raise VLLMSimulationError("the deployment has no routes to send requests along")
    if sum(r.share for r in routes) <= 0:
        raise VLLMSimulationError("the routes' shares add up to zero")
    if switch is not None and len(switch.routes) != len(routes):
        raise VLLMSimulationError(f"the share switch has {len(switch.routes)} routes, the deployment {len(routes)}")
    requests = [SimRequest(i, float(t), max(int(a), 1), max(int(b), 1)) for i, (t, a, b) in enumerate(sorted(draws))]
    _check_fits(engines, requests, sorted({h for r in routes for h in r.hops}))
    robin = SmoothRoundRobin()
    in_flight = 0
    pending = deque(requests)
    now = 0.0
    while True:
        for e in engines:
            if e.step is not None and e.busy_until <= now:
                for req in e.finish(now):
                    _leave(engines, req, now)
                    if req.finish_s is not None:  # its last hop is over, not just its prefill
                        in_flight -= 1
        while pending and pending[0].arrival_s <= now:
            req = pending.popleft()
            req.hops = routes[_pick(routes, robin, switch, req.arrival_s, in_flight)].hops
            in_flight += 1
            engines[req.hops[0]].waiting.append(req)
        for e in sorted(engines, key=lambda x: x.busy_until):  # on a shared device, who waited longest goes first
            if e.step is None and not any(o.step is not None and o.devices & e.devices for o in engines):
                step = e.schedule(now)
                if step:
                    dur = e.step_time(step)
                    e.step, e.busy_until = step, now + dur
                    e.steps += 1
                    e.busy_s += dur
        times = [e.busy_until for e in engines if e.step is not None]
        if pending:
            times.append(pending[0].arrival_s)
        times += [r.ready_s for e in engines for r in e.waiting if r.ready_s > now]
        if not times:
            break
        now = max(now, min(times))
    stuck = [r for r in requests if r.finish_s is None]
    if stuck:
        raise VLLMSimulationError(f"{len(stuck)} requests never finished (first: {stuck[0].id}, prompt "
                                  f"{stuck[0].prompt}, output {stuck[0].output}); the engines cannot serve them")
    start = min((r.arrival_s for r in requests), default=0.0)
    end = max((r.finish_s for r in requests), default=start)
    return VLLMSimResult(requests, engines, end - start)


def _leave(engines: list[EngineSim], req: SimRequest, now: float) -> None:
    """A request done on its engine: finished, or handed on to its next hop with its prompt's KV."""
    if req.last_hop:
        req.finish_s = now
        return
    req.hop += 1
    nxt = engines[req.hops[req.hop]]
    req.computed = req.prompt - 1  # the handed-on cache; the last prompt token is computed again
    req.generated = 0
    req.ready_s = now + nxt.handoff_s
    nxt.waiting.append(req)


def _pick(routes: list[SimRoute], robin: SmoothRoundRobin, switch: ShareSwitch | None, now: float,
          in_flight: int) -> int:
    """The route (index) of a request arriving at ``now`` with ``in_flight`` requests unfinished."""
    if switch is None:
        return robin.pick({k: r.share for k, r in enumerate(routes) if r.share > 0})
    if switch.observe(now, in_flight) is not None:
        robin.reset()
    shares = switch.shares()
    return robin.pick({k: v for k, r in enumerate(switch.routes) if (v := shares[key(r)]) > 0})


def _check_fits(engines: list[EngineSim], requests: list[SimRequest], visited: list[int]) -> None:
    """Every request fits the KV cache of every engine a route may send it to."""
    for e_index in visited:
        e = engines[e_index]
        if e.kv_blocks is None:
            continue
        for r in requests:
            if -(-(r.prompt + r.output) // e.block_size) > e.kv_blocks:
                raise VLLMSimulationError(f"request {r.id} ({r.prompt} prompt + {r.output} output tokens) needs "
                                          f"more KV blocks than engine {e.name} has ({e.kv_blocks} of "
                                          f"{e.block_size} tokens); give it more KV memory or shorter requests")
