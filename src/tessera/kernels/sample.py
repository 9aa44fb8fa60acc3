"""The sampler as one kernel at the end of a generation step: the last position's logits -> next tokens.

`tessera::sample` takes per-row ``temperature``, ``top_p`` and ``seeds`` (step inputs, so one batch mixes greedy
and sampled requests, as a serving engine's sampler does) and cannot fail on any value those hold:

- a row whose temperature is 0 (or negative, or NaN) is greedy: the first largest logit; an infinite one is
  uniform;
- otherwise the logits are shifted by their maximum *before* dividing by the temperature, so every scaled value is
  at most 0 and ``exp`` never overflows, however small the temperature (1e-300 behaves like greedy, not NaN);
- top-p keeps the most likely tokens until their mass reaches ``top_p`` of the total, always at least the most
  likely one (so ``top_p`` 1e-300 or 0 keeps one token); probabilities are computed in float64;
- NaN logits count as -inf, +inf as the largest float; a row with no finite logit samples uniformly.

The random draw is a function of the row's seed alone (a generator seeded by it), so a step gives the same tokens
whatever the batch, the placement or the worker that runs the sampler. Callers derive a fresh seed per generated
token (`step_seed`).
"""

from __future__ import annotations

import math

import torch

from tessera.graph.opclass import register_fused
from tessera.kernels.bodies import custom_op

# Step inputs of the sampler and the value each takes when a caller leaves it out (greedy).
SAMPLING_DEFAULTS: dict[str, tuple[float | int, torch.dtype]] = {
    "temperature": (0.0, torch.float32),
    "top_p": (1.0, torch.float32),
    "seeds": (0, torch.int64),
}

_MASK64 = (1 << 64) - 1
_MAX_TEMPERATURE = 1e30  # hotter is uniform within float64 anyway
_TOP_CANDIDATES = 512  # tokens ranked before falling back to a full sort of the row


@custom_op("tessera::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor) -> torch.Tensor:
    """logits [B, V], temperature [B] f32, top_p [B] f32, seeds [B] i64 -> tokens [B] i64."""
    x = torch.nan_to_num(logits.float(), nan=-math.inf, posinf=torch.finfo(torch.float32).max, neginf=-math.inf)
    peak = x.max(dim=-1, keepdim=True).values
    x = torch.where(torch.isfinite(peak), x, torch.zeros_like(x))  # no finite logit: uniform
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    greedy = x.argmax(dim=-1)
    t = torch.nan_to_num(temperature.double(), nan=0.0, posinf=_MAX_TEMPERATURE).clamp(max=_MAX_TEMPERATURE)
    rows = (t > 0).nonzero().squeeze(-1).tolist()
    if not rows:
        return greedy
    tokens = greedy.clone()
    for r in rows:  # per row: the draw, and the sort only where top-p needs it
        tokens[r] = _sample_row(x[r] - peak[r], float(t[r]), float(top_p[r]), int(seeds[r]))
    return tokens


def _sample_row(shifted: torch.Tensor, temperature: float, top_p: float, seed: int) -> int:
    """One token from a row of logits already shifted by their maximum (every value <= 0, one of them 0)."""
    probs = torch.exp(shifted.double() / temperature)  # in (0, 1], the maximum exactly 1: no overflow, a positive total
    top_p = 1.0 if math.isnan(top_p) else min(max(top_p, 0.0), 1.0)
    if top_p < 1.0:
        total = float(probs.sum())
        k = min(len(probs), _TOP_CANDIDATES)
        ordered, order = probs.topk(k, sorted=True)  # usually holds the nucleus: no full sort
        if k < len(probs) and float(ordered.sum()) < top_p * total:
            ordered, order = probs.sort(descending=True, stable=True)
        mass = ordered.cumsum(0)
        kept = max(1, int(((mass - ordered) < top_p * total).sum()))  # the most likely always stays
        probs, order = ordered[:kept], order[:kept]
    else:
        order = None
    cdf = probs.cumsum(0)
    draw = torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed & _MASK64))
    at = min(int(torch.searchsorted(cdf, draw * cdf[-1], right=True)), len(cdf) - 1)
    return at if order is None else int(order[at])


@sample.register_fake
def _(logits, temperature, top_p, seeds):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def _sample_flops(args, kwargs, out) -> int:
    rows, vocab = args[0].shape
    return rows * vocab * (8 + max(1, math.ceil(math.log2(max(vocab, 2)))))  # scale, exp, sort, two scans


register_fused("sample", "reduction", flops=_sample_flops)


def step_seed(seed: int, index: int) -> int:
    """The sampler seed of a request's ``index``-th generated token (a SplitMix64 mix of the request seed and
    the index, as a non-negative int64): the same tokens whatever the batch a request runs in."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def default_sampling_inputs(rows: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Greedy sampling inputs for ``rows`` rows (what a step takes when its caller gives none)."""
    return {name: torch.full((rows,), value, dtype=dtype, device=device)
            for name, (value, dtype) in SAMPLING_DEFAULTS.items()}


def with_sampling_defaults(names: list[str], given: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """``given`` plus greedy values for the sampler inputs among ``names`` it leaves out (``rows`` rows)."""
    missing = [n for n in names if n in SAMPLING_DEFAULTS and n not in given]
    if not missing:
        return given
    defaults = default_sampling_inputs(rows)
    return {**given, **{n: defaults[n] for n in missing}}
