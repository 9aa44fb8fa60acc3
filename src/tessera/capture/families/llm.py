"""Prefill and decode steps of decoder-only LLMs (dense and MoE) over an engine-owned KV cache."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tessera.capture.ops import StepContext, register_hf_hooks, step_context
from tessera.capture.step import Step
from tessera.errors import PhaseError
from tessera.kernels.sample import default_sampling_inputs, sample


def build_causal_lm(config, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A transformers causal LM for ``config`` routed through Tessera's attention and experts kernels."""
    from transformers import AutoModelForCausalLM

    register_hf_hooks()
    config = copy.deepcopy(config)  # transformers keeps the config: don't rewire the caller's
    config._experts_implementation = "tessera"
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="tessera")


def kv_cache_shape(config, slots: int, ctx: int) -> tuple[int, int, int, int]:
    """Shape of one layer's K (or V) cache: [slots, kv_heads, ctx, head_dim]."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (slots, kv_heads, ctx, head_dim)


def new_kv_cache(config, slots: int, ctx: int, dtype: torch.dtype, device: str | torch.device,
                 layers: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Engine-owned KV cache: ``cache.layer{i}.k`` / ``.v`` for every attention layer, zeroed."""
    shape = kv_cache_shape(config, slots, ctx)
    layers = list(range(config.num_hidden_layers)) if layers is None else layers
    state: dict[str, torch.Tensor] = {}
    for i in layers:
        state[f"cache.layer{i}.k"] = torch.zeros(shape, dtype=dtype, device=device)
        state[f"cache.layer{i}.v"] = torch.zeros(shape, dtype=dtype, device=device)
    return state


def kv_of(state: dict[str, torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer index -> (k_cache, v_cache) from the state dict."""
    out = {}
    for name, t in state.items():
        if name.endswith(".k"):
            layer = int(name.removeprefix("cache.layer").removesuffix(".k"))
            out[layer] = (t, state[f"cache.layer{layer}.v"])
    return out


def step_meta(batch: int, seq: int, ctx: int, slots: int | None) -> dict[str, int]:
    """A text step's shape meta; ``slots`` only when the cache has more rows than the batch."""
    meta = {"batch": batch, "seq": seq, "ctx": ctx}
    if slots is not None and slots != batch:
        meta["slots"] = slots
    return meta


def llm_inputs(phase: str, batch: int, seq: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Placeholder inputs of the right shapes (real values are fed by the caller or the engine)."""
    slots = torch.arange(batch, device=device)
    if phase == "prefill":
        return {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device=device), "slots": slots}
    return {"input_ids": torch.zeros(batch, 1, dtype=torch.long, device=device),
            "positions": torch.zeros(batch, dtype=torch.long, device=device), "slots": slots}


def with_sampler_inputs(inputs: dict[str, torch.Tensor], batch: int,
                        device: str | torch.device) -> dict[str, torch.Tensor]:
    """A generation step's inputs with the sampler's per-row ``temperature``, ``top_p`` and ``seeds`` (greedy
    placeholders for those the caller leaves out), after the model's own inputs."""
    defaults = default_sampling_inputs(batch, device)
    return {k: v for k, v in inputs.items() if k not in defaults} | {k: inputs.get(k, v) for k, v in defaults.items()}


def sampled(logits: torch.Tensor, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A generation step's outputs: the last position's ``logits`` [B,1,V] and the sampler's next ``tokens`` [B]
    (one `tessera::sample` kernel over them)."""
    return {"logits": logits, "tokens": sample(logits[:, -1], inp["temperature"], inp["top_p"], inp["seeds"])}


def llm_step(model: nn.Module, constant_values: dict[str, torch.Tensor], *, model_name: str, family: str,
             phase: str, batch: int, seq: int, ctx: int, device: str | torch.device = "meta",
             state: dict[str, torch.Tensor] | None = None,
             inputs: dict[str, torch.Tensor] | None = None, slots: int | None = None) -> Step:
    """A prefill step (``input_ids`` [B,S], ``slots``) or decode step (``input_ids`` [B,1],
    ``positions`` [B], ``slots`` [B]) of ``model``, both with the sampler's ``temperature``, ``top_p`` and ``seeds``
    [B]; outputs the last position's logits [B,1,V] and the sampled next ``tokens`` [B]. The KV cache
    has ``slots`` rows (default B): a step's rows read and write the rows their ``slots`` name."""
    if phase not in ("prefill", "decode"):
        raise PhaseError(f"phase {phase!r} is not a phase of an LLM (use prefill or decode)")
    config = model.config
    dtype = next(model.parameters()).dtype
    if state is None:
        state = new_kv_cache(config, slots or batch, ctx, dtype, device)
    inputs = with_sampler_inputs(llm_inputs(phase, batch, seq, device) if inputs is None else inputs, batch, device)

    def fn(inp, st, _consts):
        sctx = StepContext(phase=phase, slots=inp["slots"], positions=inp.get("positions"), kv=kv_of(st))
        with step_context(sctx):
            position_ids = None if phase == "prefill" else inp["positions"][:, None]
            out = model(input_ids=inp["input_ids"], position_ids=position_ids, use_cache=False,
                        logits_to_keep=1)
        return sampled(out.logits, inp)

    return Step(model=model_name, family=family, phase=phase, modules={"": model}, fn=fn, inputs=inputs,
                state=state, constant_values=dict(constant_values),
                meta=step_meta(batch, seq if phase == "prefill" else 1, ctx, slots))
