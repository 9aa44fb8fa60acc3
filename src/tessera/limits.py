"""Bounds on every size a user types, checked where it is parsed, before anything is allocated.

A cluster of 99,999,999 GPUs, a batch of a billion rows or a model config with a hidden size of four million
are typos or hostile input, not deployments: each would exhaust memory long before it produced an answer.
Every size Tessera reads from a command line, a cluster file, a workload spec or a model config is checked
against one `Limit` here, and a violation is a `LimitError` naming what, where, the limit and what to do.

Each limit sits well above every published model and deployment (the reason is given beside it), so no real
input is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import TesseraError


class LimitError(TesseraError, ValueError):
    """A size beyond one of Tessera's limits (the message names the value, where it came from and the limit)."""


@dataclass(frozen=True)
class Limit:
    """An upper bound on one kind of size: ``what`` is counted, at most ``maximum``, for the reason ``why``."""

    what: str
    maximum: int
    why: str
    hint: str

    def check(self, value: int, where: str) -> int:
        """``value`` if it is at most ``maximum``; else a `LimitError` naming ``where`` it was given."""
        if value > self.maximum:
            raise LimitError(f"{where}: {value:,} is beyond Tessera's limit of {self.maximum:,} {self.what} "
                             f"({self.why}); {self.hint}")
        return value

    def parse(self, text: str, where: str) -> int | None:
        """``text`` (ASCII digits) as a whole number checked against the limit; None if it is not a whole number.

        A number of thousands of digits is refused here without converting it (``int()`` itself refuses it).
        """
        text = text.strip()
        if not (text.isascii() and text.isdigit()):
            return None
        if len(text) > 18:
            shown = text if len(text) <= 24 else text[:20] + "..."
            raise LimitError(f"{where}: {shown} ({len(text)} digits) is beyond Tessera's limit of "
                             f"{self.maximum:,} {self.what} ({self.why}); {self.hint}")
        return self.check(int(text), where)


# Devices in one cluster: the planner holds per-device state (instances, targets, memory rows) for each, and
# no single model's deployment spans more; the largest published serving deployments use a few hundred.
CLUSTER_DEVICES = Limit("devices in a cluster", 4096, "the planner keeps state per device, and no model's "
                        "deployment spans more", "plan a replica on fewer devices (replicas scale out)")

# Local cpu workers: each is a process with its own torch runtime (hundreds of MB) and at least one core;
# 64 is above the cores of common hosts and the processes one machine can hold.
CPU_WORKERS = Limit("cpu workers", 64, "each worker is a process with its own torch runtime on this host",
                    "use fewer workers (cpu:N with N at most the cores of this host is what helps)")

# Rows of one step (batch, --max-batch, --slots): serving engines batch a few hundred to a few thousand
# sequences; 65,536 rows is far beyond any KV cache that fits a GPU.
BATCH_ROWS = Limit("rows in a batch", 65_536, "no serving step batches more sequences",
                   "use a smaller batch")

# Tokens of a prompt, an output, a cache or a context window: the longest published context windows are
# about 10M tokens (2^23.3); 2^24 leaves room above them.
TOKENS = Limit("tokens", 2**24, "beyond the longest published context window (about 10M tokens)",
               "use a shorter length")

# Widths of a layer (hidden, intermediate, head, channel sizes): the widest published models use about
# 18k hidden and 74k intermediate sizes; 2^18 = 262,144 leaves room above them.
LAYER_WIDTH = Limit("for a layer's width", 2**18, "wider than any published model's layers (about 74k at most)",
                    "check the config field")

# Layers of one stack: published models have at most a few hundred (Llama-3.1-405B: 126).
LAYERS = Limit("layers", 1024, "deeper than any published model (126 for Llama-3.1-405B)",
               "check the config field")

# Attention or SSM heads: published models use at most a few hundred.
HEADS = Limit("heads", 4096, "more than any published model's attention or SSM heads", "check the config field")

# Experts of an MoE layer: published MoE models use at most a few hundred (DeepSeek-V3: 256, Kimi K2: 384).
EXPERTS = Limit("experts", 4096, "more than any published mixture of experts (a few hundred)",
                "check the config field")

# Vocabulary entries: published vocabularies reach about 262k (Gemma 3); 2^22 leaves room above them.
VOCAB = Limit("vocabulary entries", 2**22, "larger than any published vocabulary (about 262k)",
              "check the config field")

# Requests of one workload: the simulator and the benchmark hold a record per request; 2^20 is five times
# the longest published request traces replayed whole.
REQUESTS = Limit("requests", 2**20, "the simulator and the benchmark keep a record per request",
                 "simulate a shorter run (throughput and latency percentiles converge long before)")

# Denoising steps of a diffusion request: samplers use 1-100; 10,000 covers DDPM's 1,000-step schedule.
DENOISING_STEPS = Limit("denoising steps", 10_000, "beyond any diffusion sampler's schedule (DDPM: 1,000)",
                        "use fewer steps")

# Pixels along one side of an image (VLM input, diffusion resolution): 16,384 is above the largest outputs
# and inputs of published image models.
IMAGE_SIDE = Limit("pixels on a side of an image", 16_384, "larger than any published image model's input "
                   "or output", "use a smaller image")

# Warm-up and timed calls of each kernel when profiling: the median settles after tens of calls.
PROFILE_CALLS = Limit("calls of each kernel", 100_000, "the median settles after tens of calls, and a "
                      "profile would take hours", "use fewer calls (the default is 10)")

# Torch threads of one process (--threads): the largest hosts have a few hundred cores; threads beyond the
# cores only contend for them.
THREADS = Limit("threads", 1024, "more than the cores of any host (extra threads only contend)",
                "use at most the cores of this host")
