"""Prefill and decode steps of Mamba2 state-space models over engine-owned conv/SSM state slots."""

from __future__ import annotations

import torch
from torch import nn

from tessera.capture.step import Step
from tessera.errors import PhaseError


def build_mamba2(config, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A transformers Mamba2 causal LM for ``config`` (pure-PyTorch kernels, no hub kernels)."""
    from transformers import Mamba2ForCausalLM

    return Mamba2ForCausalLM._from_config(config, dtype=dtype)


def state_shapes(config, slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-layer (conv state, SSM state) shapes: [slots, conv_dim, kernel], [slots, heads, head_dim, n]."""
    inner = config.num_heads * config.head_dim
    conv_dim = inner + 2 * config.n_groups * config.state_size
    return (slots, conv_dim, config.conv_kernel), (slots, config.num_heads, config.head_dim, config.state_size)


def new_ssm_state(config, slots: int, dtype: torch.dtype, device: str | torch.device,
                  ssm_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Engine-owned state: ``cache.layer{i}.conv`` (model dtype) and ``cache.layer{i}.ssm`` (``ssm_dtype``)."""
    conv, ssm = state_shapes(config, slots)
    state = {}
    for i in range(config.num_hidden_layers):
        state[f"cache.layer{i}.conv"] = torch.zeros(conv, dtype=dtype, device=device)
        state[f"cache.layer{i}.ssm"] = torch.zeros(ssm, dtype=ssm_dtype, device=device)
    return state


def ssm_state_dtype(model: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The SSM state's dtype for a built model: the model dtype in the production graph (vLLM's
    ``mamba_ssm_cache_dtype="auto"``), float32 in the eager graph (Hugging Face's cache)."""
    return dtype if _is_production(model) else torch.float32


def _is_production(model: nn.Module) -> bool:
    from tessera.capture.production import fusion_of

    report = fusion_of(model)
    return report is not None and report.graph == "production"


class SlotStateCache:
    """The cache interface Mamba2 mixers call, backed by rows (slots) of engine-owned state.

    The production graph's mixers (`tessera.capture.production.mamba2`) read ``phase``, ``slots`` and
    ``state`` and let their fused kernels update the rows in place. For Hugging Face's eager mixers:
    prefill starts each row from a zero state and writes its final conv window and SSM state into the
    row's slot. Decode gathers the rows' slots, lets the mixer update them in place, and scatters them
    back when the mixer returns (``flush``).
    """

    def __init__(self, phase: str, slots: torch.Tensor, state: dict[str, torch.Tensor], kernel: int):
        self.phase = phase
        self.slots = slots
        self.state = state
        self.kernel = kernel
        self.gathered: dict[tuple[int, str], torch.Tensor] = {}

    def _gather(self, layer: int, kind: str) -> torch.Tensor:
        rows = self.state[f"cache.layer{layer}.{kind}"].index_select(0, self.slots)
        self.gathered[(layer, kind)] = rows
        return rows

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._gather(layer_idx, "conv") if self.phase == "decode" else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._gather(layer_idx, "ssm") if self.phase == "decode" else None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """Prefill: store the last ``kernel`` inputs of each row (left-padded with zeros)."""
        window = conv_states
        if window.shape[-1] < self.kernel:
            window = torch.nn.functional.pad(window, (self.kernel - window.shape[-1], 0), value=0)
        target = self.state[f"cache.layer{layer_idx}.conv"]
        target.index_copy_(0, self.slots, window[..., -self.kernel:].to(target.dtype))
        return conv_states

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, **kwargs) -> torch.Tensor:
        target = self.state[f"cache.layer{layer_idx}.ssm"]
        target.index_copy_(0, self.slots, recurrent_states.to(target.dtype))
        return target

    def flush(self, layer_idx: int) -> None:
        """Decode: write the rows the mixer updated back into their slots."""
        for kind in ("conv", "ssm"):
            rows = self.gathered.pop((layer_idx, kind), None)
            if rows is not None:
                self.state[f"cache.layer{layer_idx}.{kind}"].index_copy_(0, self.slots, rows)


def ssm_step(model: nn.Module, constant_values: dict[str, torch.Tensor], *, model_name: str, phase: str,
             batch: int, seq: int, ctx: int, device: str | torch.device = "meta",
             state: dict[str, torch.Tensor] | None = None,
             inputs: dict[str, torch.Tensor] | None = None, slots: int | None = None) -> Step:
    """A Mamba2 prefill step (``input_ids`` [B,S], ``slots``) or decode step (``input_ids`` [B,1],
    ``positions`` [B], ``slots``), both with the sampler's inputs; outputs the last position's logits and the
    sampled next ``tokens``. State size does not depend on
    the context length; ``ctx`` is kept for the shared bucket grammar."""
    from tessera.capture.families.llm import llm_inputs, sampled, step_meta, with_sampler_inputs

    if phase not in ("prefill", "decode"):
        raise PhaseError(f"phase {phase!r} is not a phase of an SSM (use prefill or decode)")
    config = model.config
    dtype = next(model.parameters()).dtype
    if state is None:
        state = new_ssm_state(config, slots or batch, dtype, device, ssm_state_dtype(model, dtype))
    inputs = with_sampler_inputs(llm_inputs(phase, batch, seq, device) if inputs is None else inputs, batch, device)
    # Hugging Face's eager mixers gather the rows' state and leave it to the cache to scatter it back; the
    # production mixers' kernels update the slots in place
    eager = not _is_production(model)
    mixers = [m for m in model.modules() if type(m).__name__ == "Mamba2Mixer"] if eager else []

    def fn(inp, st, _consts):
        cache = SlotStateCache(phase, inp["slots"], st, config.conv_kernel)
        hooks = [m.register_forward_hook(lambda mod, _a, _o: cache.flush(mod.layer_idx)) for m in mixers]
        try:
            out = model(input_ids=inp["input_ids"], cache=cache, use_cache=False, logits_to_keep=1)
        finally:
            for h in hooks:
                h.remove()
        return sampled(out.logits, inp)

    return Step(model=model_name, family="ssm", phase=phase, modules={"": model}, fn=fn, inputs=inputs,
                state=state, constant_values=dict(constant_values),
                meta=step_meta(batch, seq if phase == "prefill" else 1, ctx, slots))
