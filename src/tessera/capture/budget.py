"""How much host memory and how large a graph a trace takes, estimated from the config before anything is built.

Each size of a config is within `tessera.limits`, but their products need not fit: a 262,144-wide model with a
4M-entry vocabulary has a 2 TiB embedding. Building on ``meta`` still allocates every weight on the host for a
moment (accelerate's empty-weights build creates each parameter there and then moves it), so the largest
weight must fit this host; building on the CPU holds all weights, the engine state and the activations; and
the graph holds a record per kernel. `check_trace_budget` refuses a step beyond any of these before the build.

The estimates are deliberately rough (dense layers counted from the config's widths, not from the module
tree): they decide whether a trace can run at all, not how much it costs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tessera.capture.models import SIZE_LIMITS
from tessera.errors import ShapeError
from tessera.limits import LAYERS

# A traced graph keeps a few KB of Python records per kernel (kernel, accesses, views, edges); 250,000 kernels
# is about 1 GB of them, 25 times a 1024-layer production graph.
GRAPH_KERNELS = 250_000
# Upper bounds of kernels per layer: about 10 per Llama layer in the production graph, 40 in the eager one.
KERNELS_PER_LAYER = {"production": 16, "eager": 64}
# Random-init builds on the CPU (weights, state and activations) beyond this are refused (tests and quick
# runs build small models there; anything larger is traced on meta).
CPU_BUILD_BYTES = 4 * 2**30
_WEIGHT = 2  # bf16
_ACTIVATION = 4  # fp32 upper bound per element


class TraceBudgetError(ShapeError):
    """A step whose trace would need more host memory, or a larger graph, than this host or Tessera allows."""


@dataclass(frozen=True)
class TraceEstimate:
    """Rough sizes of one step's trace (bytes, kernels)."""

    largest_weight_bytes: int  # allocated on the host for a moment even on meta
    weight_bytes: int
    state_bytes: int  # KV or SSM cache at the step's slots and context
    activation_bytes: int
    kernels: int

    @property
    def cpu_bytes(self) -> int:
        """What a build and a step on the CPU hold at once."""
        return self.weight_bytes + self.state_bytes + self.activation_bytes


def host_reservable_bytes() -> int:
    """The most one allocation can reserve here: physical memory plus swap (what Linux's default overcommit
    heuristic grants), or the physical memory where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal") if k in fields)
    except (OSError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _get(config: Any, name: str, default: int = 0) -> int:
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _text(config: Any, family: str, batch: int, tokens: int, slots: int, ctx: int) -> TraceEstimate:
    """A decoder stack (dense or MoE) and its KV cache."""
    text = getattr(config, "text_config", None) or config
    h, layers, vocab = _get(text, "hidden_size", 1), _get(text, "num_hidden_layers", 1), _get(text, "vocab_size", 1)
    heads = _get(text, "num_attention_heads", 1)
    kv_heads = _get(text, "num_key_value_heads", heads)
    head_dim = _get(text, "head_dim", max(1, h // heads))
    inter = _get(text, "intermediate_size", h)
    experts = _get(text, "num_local_experts", _get(text, "num_experts", 0)) if family == "moe" else 0
    expert_inter = _get(text, "moe_intermediate_size", inter)
    attention = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h
    mlp = experts * 3 * h * expert_inter if experts else 3 * h * inter
    tied = getattr(text, "tie_word_embeddings", False) is True
    largest = max(vocab * h, h * inter, 2 * experts * expert_inter * h, heads * head_dim * h)
    return TraceEstimate(
        largest_weight_bytes=largest * _WEIGHT,
        weight_bytes=(vocab * h * (1 if tied else 2) + layers * (attention + mlp)) * _WEIGHT,
        state_bytes=layers * 2 * slots * ctx * kv_heads * head_dim * _WEIGHT,
        activation_bytes=batch * tokens * max(h, inter, vocab, heads * head_dim) * _ACTIVATION,
        kernels=layers,
    )


def _ssm(config: Any, batch: int, tokens: int, slots: int) -> TraceEstimate:
    """A Mamba2 stack and its conv and SSM state."""
    h, layers, vocab = _get(config, "hidden_size", 1), _get(config, "num_hidden_layers", 1), _get(config, "vocab_size", 1)
    inner = _get(config, "expand", 2) * h
    groups, state, heads = _get(config, "n_groups", 1), _get(config, "state_size", 1), _get(config, "num_heads", 1)
    head_dim = _get(config, "head_dim", max(1, inner // heads))
    in_proj = h * (2 * inner + 2 * groups * state + heads)
    return TraceEstimate(
        largest_weight_bytes=max(vocab * h, in_proj) * _WEIGHT,
        weight_bytes=(vocab * h + layers * (in_proj + inner * h)) * _WEIGHT,
        state_bytes=layers * slots * (heads * head_dim * state + _get(config, "conv_kernel", 4) *
                                      (inner + 2 * groups * state)) * _ACTIVATION,
        activation_bytes=batch * tokens * max(2 * inner + 2 * groups * state + heads, vocab) * _ACTIVATION,
        kernels=layers,
    )


def _vision(config: Any, image: tuple[int, int] | None) -> TraceEstimate:
    """A VLM's vision tower over one image."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return TraceEstimate(0, 0, 0, 0, 0)
    h, inter, depth = _get(vision, "hidden_size", 1), _get(vision, "intermediate_size", 1), _get(vision, "depth", 1)
    patch = _get(vision, "patch_size", 14)
    patches = (image[0] // patch + 1) * (image[1] // patch + 1) if image else 0
    return TraceEstimate(
        largest_weight_bytes=max(h * inter, 3 * h * h) * _WEIGHT,
        weight_bytes=depth * (4 * h * h + 3 * h * inter) * _WEIGHT,
        state_bytes=0,
        activation_bytes=patches * max(h, inter) * _ACTIVATION,
        kernels=depth,
    )


def _component(config: dict[str, Any]) -> TraceEstimate:
    """One diffusers or transformers component of a pipeline, from its model width, MLP width and depth."""
    channels = [w for w in config.get("block_out_channels") or [] if isinstance(w, int)]
    width = (_get(config, "hidden_size") or _get(config, "d_model")
             or _get(config, "num_attention_heads") * _get(config, "attention_head_dim")
             or max(channels + [_get(config, "latent_channels", 1)]))
    inter = _get(config, "intermediate_size") or _get(config, "d_ff") or 4 * width
    layers = sum(v for k, v in config.items() if SIZE_LIMITS.get(k) is LAYERS and isinstance(v, int)) or 1
    if channels:  # a UNet or VAE: its blocks at every width
        layers *= len(channels)
    vocab = _get(config, "vocab_size", 0)
    return TraceEstimate(
        largest_weight_bytes=max(vocab * width, width * inter, 9 * width * width) * _WEIGHT,
        weight_bytes=(vocab * width + layers * (4 * width * width + 2 * width * inter)) * _WEIGHT,
        state_bytes=0,
        activation_bytes=0,
        kernels=layers,
    )


def _sum(parts: list[TraceEstimate]) -> TraceEstimate:
    return TraceEstimate(
        largest_weight_bytes=max(p.largest_weight_bytes for p in parts),
        weight_bytes=sum(p.weight_bytes for p in parts),
        state_bytes=sum(p.state_bytes for p in parts),
        activation_bytes=sum(p.activation_bytes for p in parts),
        kernels=sum(p.kernels for p in parts),
    )


def estimate_trace(family: str, config: Any, phase: str, shape: Any, graph: str = "production") -> TraceEstimate:
    """Rough sizes of tracing one ``phase`` step of a model of ``family`` at ``shape`` (a `StepShape`);
    ``config`` is the model's config, or for a diffusion pipeline a dict of component configs."""
    tokens = shape.seq if phase == "prefill" else 1
    slots = shape.slots or shape.batch
    if family == "diffusion":
        parts = [_component(c) for c in config.values()]
        if shape.resolution:
            channels = max((_get(c, "in_channels", 0) for c in config.values()), default=0) or 16
            parts.append(TraceEstimate(0, 0, 0, shape.batch * shape.resolution[0] * shape.resolution[1]
                                       * channels * _ACTIVATION, 0))
    elif family == "ssm":
        parts = [_ssm(config, shape.batch, tokens, slots)]
    else:
        parts = [_text(config, family, shape.batch, tokens, slots, shape.ctx)]
        if family == "vlm":
            parts.append(_vision(config, shape.image))
    total = _sum(parts)
    per_layer = KERNELS_PER_LAYER.get(graph, max(KERNELS_PER_LAYER.values()))
    return TraceEstimate(total.largest_weight_bytes, total.weight_bytes, total.state_bytes, total.activation_bytes,
                         total.kernels * per_layer + 256)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_trace_budget(name: str, estimate: TraceEstimate, device: str) -> None:
    """Refuse a trace of ``name`` on ``device`` that this host cannot hold or whose graph is too large
    (`TraceBudgetError`, with the estimate and what to do)."""
    if estimate.kernels > GRAPH_KERNELS:
        raise TraceBudgetError(f"{name}: its graph would hold about {estimate.kernels:,} kernels, beyond Tessera's "
                               f"budget of {GRAPH_KERNELS:,} (about 1 GB of records); use fewer layers")
    reservable = host_reservable_bytes()
    if estimate.largest_weight_bytes > reservable:
        raise TraceBudgetError(f"{name}: its largest weight would take {_gib(estimate.largest_weight_bytes)}, "
                               f"beyond what this host can reserve ({_gib(reservable)} of memory and swap); every "
                               "weight is created on the host for a moment, even on meta; check the config's "
                               "widths and vocabulary")
    if device != "meta" and estimate.cpu_bytes > CPU_BUILD_BYTES:
        raise TraceBudgetError(f"{name}: building and running this step on {device} would hold about "
                               f"{_gib(estimate.cpu_bytes)} (weights {_gib(estimate.weight_bytes)}, state "
                               f"{_gib(estimate.state_bytes)}, activations {_gib(estimate.activation_bytes)}), "
                               f"beyond the {_gib(CPU_BUILD_BYTES)} allowed for random-init builds; trace it on "
                               "meta, or use a smaller batch or context")
