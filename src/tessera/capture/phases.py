"""From (model, phase, shapes) to a traceable Step: the phases of each family and their defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.capture.budget import TraceBudgetError, check_trace_budget, estimate_trace
from tessera.capture.build import instantiate
from tessera.capture.models import ModelSpec, load_config, resolve_model
from tessera.capture.production import FusionReport, apply_production, check_graph, fusion_of
from tessera.capture.shapes import (
    DEFAULT_BATCH,
    DEFAULT_CTX,
    DEFAULT_GRAPH,
    DEFAULT_IMAGE,
    DEFAULT_RESOLUTION,
    DEFAULT_SEQ,
    PHASES,
)
from tessera.capture.step import Step
from tessera.errors import PhaseError, ShapeError
from tessera.limits import BATCH_ROWS, TOKENS

MAX_HOST_BUILD_BYTES = 4 * 2**30  # random-init builds on a real device beyond this are refused
META_BUILDS_KEPT = 2  # models built on meta kept for the next trace (a planner traces one model many times)
_meta_builds: dict[tuple, tuple] = {}


@dataclass(frozen=True)
class StepShape:
    """The static shapes of a step: batch, prompt length, cache capacity, image size or resolution."""

    batch: int
    seq: int
    ctx: int
    image: tuple[int, int] | None = None
    resolution: tuple[int, int] | None = None
    slots: int | None = None  # rows of the engine state (KV / SSM cache); default: the batch


def resolve_shape(spec: ModelSpec, config, phase: str, batch: int | None = None, seq: int | None = None,
                  ctx: int | None = None, image: tuple[int, int] | None = None,
                  resolution: tuple[int, int] | None = None, slots: int | None = None) -> StepShape:
    """Fill defaults and check the shapes against the model (clear errors for impossible ones)."""
    if batch is None:
        batch = 1 if spec.family == "diffusion" else DEFAULT_BATCH.get(phase, 1)
    seq = DEFAULT_SEQ if seq is None else seq
    if batch < 1:
        raise ShapeError(f"--batch must be at least 1 (got {batch})")
    if seq < 1:
        raise ShapeError(f"--seq must be at least 1 (got {seq})")
    BATCH_ROWS.check(batch, "--batch")
    TOKENS.check(seq, "--seq")
    if slots is not None:
        BATCH_ROWS.check(slots, "the cache's slots")
    if slots is not None and slots < batch:
        raise ShapeError(f"the cache needs at least one slot per row: {slots} slots for a batch of {batch}")
    if spec.family == "diffusion":
        return StepShape(batch, seq, 0, resolution=resolution or DEFAULT_RESOLUTION)
    text = getattr(config, "text_config", config)
    max_pos = getattr(text, "max_position_embeddings", None)
    ctx = (max(DEFAULT_CTX, seq) if max_pos is None else min(max(DEFAULT_CTX, seq), max_pos)) if ctx is None else ctx
    if ctx < 1:
        raise ShapeError(f"--ctx must be at least 1 (got {ctx})")
    TOKENS.check(ctx, "--ctx")
    if phase == "prefill" and seq > ctx:
        raise ShapeError(f"prompt length --seq {seq} exceeds the cache capacity --ctx {ctx}; raise --ctx to at "
                         f"least {seq}")
    if max_pos is not None and spec.family != "ssm" and ctx > max_pos:
        raise ShapeError(f"context {ctx} is beyond {spec.name}'s max_position_embeddings ({max_pos}); use "
                         f"--ctx {max_pos} or less")
    return StepShape(batch, seq, ctx, image=(image or DEFAULT_IMAGE) if spec.family == "vlm" else None,
                     slots=None if slots == batch else slots)


def check_phase(spec: ModelSpec, phase: str) -> None:
    phases = PHASES[spec.family]
    if phase not in phases:
        raise PhaseError(f"{spec.name} is a {spec.family} model; its phases are {', '.join(phases)} "
                         f"(got {phase!r})")


def build_modules(spec: ModelSpec, device: str = "meta", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                  config=None, graph: str = DEFAULT_GRAPH):
    """The model's modules (one root, or a pipeline's components) and their constants' host values,
    rewired for the ``graph`` kind (`tessera.capture.production`)."""
    check_graph(graph)
    if spec.family == "diffusion":
        from tessera.capture.families.diffusion import build_sd3_components

        configs = {c: load_config(spec, c) for c in spec.components if c != "scheduler"}
        modules, values = build_sd3_components(configs, device=device, dtype=dtype, seed=seed)
        # Diffusion pipelines are served as diffusers runs them (eager, SDPA): its graph is the production one.
        for component in modules.values():
            component.tessera_fusion = FusionReport(graph)
        return modules, values
    config = load_config(spec) if config is None else config
    return instantiate(lambda: build_model(spec.family, config, dtype, graph), device, seed=seed)


def build_model(family: str, config, dtype: torch.dtype = torch.bfloat16, graph: str = DEFAULT_GRAPH):
    """A transformers model of ``family`` for ``config``, wired to Tessera's kernels for the ``graph`` kind."""
    if family in ("llm", "moe"):
        from tessera.capture.families.llm import build_causal_lm

        model = build_causal_lm(config, dtype)
    elif family == "ssm":
        from tessera.capture.families.ssm import build_mamba2

        model = build_mamba2(config, dtype)
    elif family == "vlm":
        from tessera.capture.families.vlm import build_vlm

        model = build_vlm(config, dtype)
    else:
        raise PhaseError(f"family {family!r} has no single-model builder")
    apply_production(model, config, graph)
    return model


def step_for(spec: ModelSpec, modules, constant_values, phase: str, shape: StepShape, device: str = "meta",
             inputs: dict[str, torch.Tensor] | None = None,
             state: dict[str, torch.Tensor] | None = None) -> Step:
    """The Step of ``phase`` for already-built modules (its meta says which graph kind they run)."""
    step = _family_step(spec, modules, constant_values, phase, shape, device, inputs, state)
    report = fusion_of(modules)
    if report is not None:
        step.meta.update(report.to_meta())
    return step


def _family_step(spec: ModelSpec, modules, constant_values, phase: str, shape: StepShape, device: str,
                 inputs: dict[str, torch.Tensor] | None, state: dict[str, torch.Tensor] | None) -> Step:
    check_phase(spec, phase)
    common = dict(model_name=spec.name, phase=phase, batch=shape.batch, device=device, inputs=inputs)
    if spec.family in ("llm", "moe"):
        from tessera.capture.families.llm import llm_step

        return llm_step(modules, constant_values, family=spec.family, seq=shape.seq, ctx=shape.ctx, state=state,
                        slots=shape.slots, **common)
    if spec.family == "ssm":
        from tessera.capture.families.ssm import ssm_step

        return ssm_step(modules, constant_values, seq=shape.seq, ctx=shape.ctx, state=state, slots=shape.slots,
                        **common)
    if spec.family == "vlm":
        from tessera.capture.families.vlm import vlm_step

        return vlm_step(modules, constant_values, seq=shape.seq, ctx=shape.ctx, image=shape.image, state=state,
                        slots=shape.slots, **common)
    from tessera.capture.families.diffusion import diffusion_step

    return diffusion_step(modules, constant_values, resolution=shape.resolution, **common)


def _modules(spec: ModelSpec, device: str, config, graph: str):
    """``build_modules``, reusing the last builds on meta of the same model, config and graph kind (a meta
    build holds no values a trace changes: tracing it again at another shape gives that shape's graph)."""
    if device != "meta" or spec.family == "diffusion":
        return build_modules(spec, device, config=config, graph=graph)
    key = (spec.name, graph, config.to_json_string(use_diff=False))
    if key not in _meta_builds:
        if len(_meta_builds) >= META_BUILDS_KEPT:
            _meta_builds.pop(next(iter(_meta_builds)))
        _meta_builds[key] = build_modules(spec, device, config=config, graph=graph)
    return _meta_builds[key]


def make_step(model: str, phase: str, *, batch: int | None = None, seq: int | None = None,
              ctx: int | None = None, image: tuple[int, int] | None = None,
              resolution: tuple[int, int] | None = None, device: str = "meta", slots: int | None = None,
              graph: str = DEFAULT_GRAPH) -> Step:
    """Resolve ``model`` (checked first), validate phase and shapes, build it for the ``graph`` kind and
    return the Step (its state with ``slots`` rows, default the batch)."""
    spec = resolve_model(model)
    check_phase(spec, phase)
    check_graph(graph)
    config = load_config(spec)
    shape = resolve_shape(spec, config, phase, batch, seq, ctx, image, resolution, slots)
    if device != "meta" and spec.params and spec.params * 2 > MAX_HOST_BUILD_BYTES:
        raise ShapeError(f"{spec.name} has {spec.params:,} parameters ({spec.params * 2 / 2**30:.1f} GiB in "
                         f"bf16): too large to build with random weights on {device}; trace it on meta")
    configs = ({c: load_config(spec, c) for c in spec.components if c != "scheduler"}
               if spec.family == "diffusion" else config)
    check_trace_budget(spec.name, estimate_trace(spec.family, configs, phase, shape, graph), device)
    try:
        modules, values = _modules(spec, device, None if spec.family == "diffusion" else config, graph)
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "allocate" not in str(e):
            raise
        raise TraceBudgetError(f"{spec.name}: building it on {device} ran out of host memory ({e}); trace it "
                               "on meta, or check the config's widths") from None
    return step_for(spec, modules, values, phase, shape, device)

