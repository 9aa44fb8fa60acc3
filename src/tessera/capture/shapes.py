"""The phases of each model family and the default shapes of their steps (plain data: the CLI's help
texts read them at start-up, before torch is imported)."""

from __future__ import annotations

PHASES: dict[str, tuple[str, ...]] = {
    "llm": ("prefill", "decode"),
    "moe": ("prefill", "decode"),
    "ssm": ("prefill", "decode"),
    "vlm": ("encode", "prefill", "decode"),
    "diffusion": ("encode", "step", "decode"),
}

DEFAULT_BATCH = {"prefill": 1, "decode": 8, "encode": 1, "step": 1}
DEFAULT_SEQ = 512
DEFAULT_CTX = 2048
DEFAULT_IMAGE = (504, 504)
DEFAULT_RESOLUTION = (1024, 1024)

GRAPHS = ("production", "eager")
"""Which kernel graph a model step traces: ``production`` (fused units like a serving engine's, weights in
the model's deployed format) or ``eager`` (Hugging Face's / diffusers' reference forward, op by op)."""
DEFAULT_GRAPH = "production"
