"""The sampler kernel (`tessera::sample`): declared accesses true, greedy equal to argmax, the distribution it
draws from equal to temperature-scaled softmax cut at top-p, and no parameter value it can be given makes it
fail or pick a token outside the vocabulary / nucleus."""

from __future__ import annotations

import math

import pytest
import torch

import tessera.kernels.sample as sample_module
from tessera.kernels.sample import sample, step_seed, with_sampling_defaults
from tests.kernels.access_truth import assert_accesses_true

ops = torch.ops.tessera


def _rows(b, temperature, top_p, seed0=0):
    return (torch.full((b,), temperature, dtype=torch.float32), torch.full((b,), top_p, dtype=torch.float32),
            torch.arange(seed0, seed0 + b, dtype=torch.int64))


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 0.9), (1.0, 1.0)])
def test_sample_accesses(temperature, top_p):
    logits = torch.randn(3, 1, 50).bfloat16()  # the step passes the last position's view
    assert_accesses_true(ops.sample, (logits[:, -1], *_rows(3, temperature, top_p)))


def test_greedy_is_the_first_largest_logit():
    logits = torch.randn(5, 300)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first one wins
    assert torch.equal(sample(logits, *_rows(5, 0.0, 1.0)), logits.argmax(-1))


def _frequencies(probs: torch.Tensor, temperature: float, top_p: float, draws: int) -> torch.Tensor:
    logits = probs.log().expand(draws, -1).contiguous()
    tokens = sample(logits, *_rows(draws, temperature, top_p))
    return torch.bincount(tokens, minlength=probs.numel()).double() / draws


def test_draws_follow_the_tempered_nucleus():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    draws = 20_000
    seen = _frequencies(probs, 1.0, 1.0, draws)
    assert (seen - probs).abs().max() < 4 * math.sqrt(0.25 / draws)
    # temperature 0.5 squares the odds
    hot = probs ** 2 / (probs ** 2).sum()
    seen = _frequencies(probs, 0.5, 1.0, draws)
    assert (seen - hot).abs().max() < 4 * math.sqrt(0.25 / draws)
    # top_p 0.6 keeps 0.4 + 0.3 (the mass before the second is 0.4 < 0.6, before the third 0.7 >= 0.6)
    seen = _frequencies(probs, 1.0, 0.6, draws)
    assert seen[2:].sum() == 0
    assert abs(seen[0] - 4 / 7) < 4 * math.sqrt(0.25 / draws)


def test_candidate_shortcut_equals_the_full_sort(monkeypatch):
    logits = torch.randn(16, 2000) * 4
    want = sample(logits, *_rows(16, 1.0, 0.95))
    monkeypatch.setattr(sample_module, "_TOP_CANDIDATES", 5)  # forces the full-sort fallback on most rows
    assert torch.equal(sample(logits, *_rows(16, 1.0, 0.95)), want)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-30, 1e30, math.inf, math.nan, -1.0, 0.0, 1.0, 1e5])
@pytest.mark.parametrize("top_p", [1e-300, 0.0, 1e-7, 0.5, 1.0, math.nan, 2.0])
def test_no_parameter_value_fails(temperature, top_p):
    logits = torch.randn(4, 97).bfloat16()
    tokens = sample(logits, *_rows(4, temperature, top_p))
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert ((tokens >= 0) & (tokens < 97)).all()
    cold = math.isnan(temperature) or temperature < 1e-30
    narrow = top_p < 1e-6 and temperature <= 1e5  # (hotter, every token is as likely: no "top" one)
    if cold or narrow:
        top = logits.float().max(-1).values  # too cold / too narrow: a top token (bf16 rows can tie at the top)
        assert torch.equal(logits.float().gather(-1, tokens[:, None])[:, 0], top)


def test_hostile_logits_do_not_fail():
    logits = torch.randn(4, 20)
    logits[0] = math.nan  # no finite logit: uniform over the row
    logits[1, 3] = math.inf  # +inf is the top token
    logits[2, :] = -math.inf
    logits[3, 5] = math.nan
    for temperature in (0.0, 1.0):
        tokens = sample(logits, *_rows(4, temperature, 0.9))
        assert ((tokens >= 0) & (tokens < 20)).all()
        assert int(tokens[1]) == 3
        assert int(tokens[3]) != 5 or temperature == 0.0 and bool(logits[3].nan_to_num(-math.inf).argmax() == 5)


def test_draws_depend_on_the_row_seed_only():
    logits = torch.randn(6, 400)
    temperature, top_p, seeds = _rows(6, 1.0, 0.9)
    whole = sample(logits, temperature, top_p, seeds)
    alone = torch.stack([sample(logits[r:r + 1], temperature[r:r + 1], top_p[r:r + 1], seeds[r:r + 1])[0]
                         for r in range(6)])
    assert torch.equal(whole, alone)  # batch-invariant
    mixed = temperature.clone()
    mixed[::2] = 0  # greedy rows beside sampled ones change nothing for the sampled ones
    out = sample(logits, mixed, top_p, seeds)
    assert torch.equal(out[1::2], whole[1::2]) and torch.equal(out[::2], logits[::2].argmax(-1))
    assert len({step_seed(7, i) for i in range(1000)}) == 1000 and step_seed(7, 3) != step_seed(8, 3)


def test_missing_sampler_inputs_default_to_greedy():
    given = {"input_ids": torch.zeros(3, 1, dtype=torch.long)}
    full = with_sampling_defaults(["input_ids", "temperature", "top_p", "seeds"], given, 3)
    assert torch.equal(full["temperature"], torch.zeros(3)) and torch.equal(full["top_p"], torch.ones(3))
    assert full["seeds"].dtype == torch.int64 and full["input_ids"] is given["input_ids"]
    assert with_sampling_defaults(["input_ids"], given, 3) is given
