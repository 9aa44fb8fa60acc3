"""The workload grammar shared by plan, simulate, evaluate and bench.

    fixed:in=1024,out=1024,requests=192        every request the same lengths, all at once
    offline:prompts=azure-conv,out=1024[,requests=1000]   all at once, prompts drawn from a distribution,
                                                 every request generating ``out`` tokens (steady-state throughput)
    poisson:rate=4,lengths=FILE[,requests=N]   Poisson arrivals (requests/s), lengths drawn from a file
    images:steps=28,resolution=1024[,requests=N]   diffusion requests (resolution N or WxH)

A lengths FILE is a CSV with a header naming `input` and `output` columns (one row per request, as
published request traces are), or a JSON list of [input, output] pairs. A name instead of a path picks a
distribution shipped in ``LENGTHS_DIR`` (its README says where each came from):

    azure-conv    the Azure LLM inference conversation trace, 2023 (19366 requests; median 1020 in, 129 out)
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera.errors import TesseraError
from tessera.limits import DENOISING_STEPS, IMAGE_SIDE, REQUESTS, TOKENS, Limit

LENGTHS_DIR = Path(__file__).parent / "data" / "lengths"
DEFAULT_REQUESTS = 256
OFFLINE_REQUESTS = 1000  # enough to fill every engine of a pair at memory-bound admission
_LENGTH_SUFFIXES = (".csv", ".json")


class WorkloadError(TesseraError, ValueError):
    """A workload spec that does not parse, or a lengths file that cannot be used."""


@dataclass(frozen=True)
class LengthDistribution:
    """(input, output) token lengths of requests, sampled as published traces record them."""

    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def sample(self, n: int, seed: int = 0) -> list[tuple[int, int]]:
        """``n`` (input, output) pairs drawn with replacement (deterministic for a seed)."""
        idx = np.random.default_rng(seed).integers(0, len(self.inputs), size=n)
        return [(self.inputs[i], self.outputs[i]) for i in idx]

    @property
    def median(self) -> tuple[float, float]:
        return float(np.median(self.inputs)), float(np.median(self.outputs))


@dataclass(frozen=True)
class FixedWorkload:
    """``requests`` requests of ``input`` prompt and ``output`` generated tokens, all arriving at once."""

    input: int
    output: int
    requests: int


@dataclass(frozen=True)
class OfflineWorkload:
    """``requests`` requests arriving at once, prompt lengths drawn from ``lengths`` (their inputs only),
    each generating ``output`` tokens: the offline throughput setting of published evaluations."""

    lengths: LengthDistribution
    output: int
    requests: int = OFFLINE_REQUESTS

    @property
    def mean_input(self) -> float:
        """The mean prompt length of the distribution (what a request's prefill and cache cost follow)."""
        return float(np.mean(self.lengths.inputs))


@dataclass(frozen=True)
class PoissonWorkload:
    """Requests arriving as a Poisson process of ``rate`` per second, lengths from a distribution."""

    rate: float
    lengths: LengthDistribution
    requests: int = DEFAULT_REQUESTS


@dataclass(frozen=True)
class ImagesWorkload:
    """Diffusion requests: ``steps`` denoising steps at ``resolution`` (width, height)."""

    steps: int
    resolution: tuple[int, int]
    requests: int = DEFAULT_REQUESTS


Workload = FixedWorkload | OfflineWorkload | PoissonWorkload | ImagesWorkload
_KEYS = {"fixed": ({"in", "out", "requests"}, {"in", "out"}),
         "offline": ({"prompts", "out", "requests"}, {"prompts", "out"}),
         "poisson": ({"rate", "lengths", "requests"}, {"rate", "lengths"}),
         "images": ({"steps", "resolution", "requests"}, {"steps", "resolution"})}
# Outputs per request of the published evaluation's offline setup, by model family: Llama 1024 tokens,
# GPT-oss (MoE) 384, Qwen2.5-VL and Mamba 128; SD3.5 one 1024x1024 image in 28 steps.
DEFAULT_OUTPUTS = {"llm": 1024, "moe": 384, "vlm": 128, "ssm": 128}
DEFAULT_TEXT_WORKLOAD = f"offline:prompts=azure-conv,out={DEFAULT_OUTPUTS['llm']},requests={OFFLINE_REQUESTS}"
DEFAULT_IMAGE_WORKLOAD = "images:steps=28,resolution=1024"
_EXAMPLES = (f"fixed:in=1024,out=1024,requests=192 | {DEFAULT_TEXT_WORKLOAD} | poisson:rate=4,lengths=FILE | "
             f"{DEFAULT_IMAGE_WORKLOAD}")


def default_workload(family: str) -> str:
    """The steady-state workload planned and simulated for a model family when none is given."""
    if family == "diffusion":
        return DEFAULT_IMAGE_WORKLOAD
    out = DEFAULT_OUTPUTS.get(family, DEFAULT_OUTPUTS["llm"])
    return f"offline:prompts=azure-conv,out={out},requests={OFFLINE_REQUESTS}"


_LIMITS: dict[str, Limit] = {"in": TOKENS, "out": TOKENS, "requests": REQUESTS, "steps": DENOISING_STEPS}


def _int(spec: str, key: str, value: str) -> int:
    shown = spec if len(spec) <= 80 else spec[:72] + "..."
    n = _LIMITS[key].parse(value.removeprefix("+"), f"workload {shown!r}, {key}")
    if n is None:
        try:
            int(value)
        except ValueError:
            raise WorkloadError(f"workload {spec!r}: {key}={value!r} is not a whole number") from None
        n = int(value)  # a negative number, refused below
    if n < 1:
        raise WorkloadError(f"workload {spec!r}: {key} must be at least 1 (got {n})")
    return n


def _rate(spec: str, value: str) -> float:
    try:
        r = float(value)
    except ValueError:
        raise WorkloadError(f"workload {spec!r}: rate={value!r} is not a number (requests per second)") from None
    if not r > 0:
        raise WorkloadError(f"workload {spec!r}: rate must be positive (got {r})")
    return r


def _resolution(spec: str, value: str) -> tuple[int, int]:
    parts = value.lower().split("x")
    shown = spec if len(spec) <= 80 else spec[:72] + "..."
    sides = [IMAGE_SIDE.parse(p, f"workload {shown!r}, resolution") for p in parts] if len(parts) in (1, 2) else []
    if not sides or not all(side is not None and side > 0 for side in sides):
        raise WorkloadError(f"workload {spec!r}: resolution={value!r} must be N or WxH, e.g. 1024 or 1024x768")
    return (sides[0], sides[-1])


def shipped_lengths() -> dict[str, Path]:
    """The distributions shipped in ``LENGTHS_DIR``, by name (the file stem), sorted by name."""
    if not LENGTHS_DIR.is_dir():
        return {}
    files = [p for p in LENGTHS_DIR.iterdir() if p.is_file() and p.suffix in _LENGTH_SUFFIXES]
    return {p.stem: p for p in sorted(files)}


def load_lengths(ref: str) -> LengthDistribution:
    """A length distribution: a shipped name (``LENGTHS_DIR``, e.g. ``azure-conv``) or a CSV / JSON file path."""
    path = Path(ref)
    if not path.exists():
        shipped = shipped_lengths()
        if ref not in shipped:
            names = ", ".join(shipped) if shipped else "none shipped"
            raise WorkloadError(f"lengths={ref!r}: no such file, and no shipped distribution of that name "
                                f"(shipped: {names}); give a shipped name, a CSV with input and output columns, "
                                "or a JSON list of [input, output] pairs")
        path = shipped[ref]
    try:
        text = path.read_text()
    except OSError as e:
        raise WorkloadError(f"lengths file {path}: cannot read it ({e.strerror})") from None
    pairs: list[tuple[int, int]] = []
    try:
        if path.suffix == ".json":
            data = json.loads(text)
            rows = data["requests"] if isinstance(data, dict) else data
            pairs = [(int(a), int(b)) for a, b in rows]
        else:
            reader = csv.DictReader(text.splitlines())
            fields = {f.lower().strip(): f for f in reader.fieldnames or []}
            col_in = next((fields[k] for k in ("input", "input_tokens", "contexttokens", "prompt_tokens")
                           if k in fields), None)
            col_out = next((fields[k] for k in ("output", "output_tokens", "generatedtokens", "completion_tokens")
                            if k in fields), None)
            if col_in is None or col_out is None:
                raise WorkloadError(f"lengths file {path}: the header needs an input and an output column "
                                    f"(got {', '.join(reader.fieldnames or [])})")
            pairs = [(int(r[col_in]), int(r[col_out])) for r in reader]
    except WorkloadError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise WorkloadError(f"lengths file {path}: not a list of whole-number (input, output) lengths ({e})") from None
    if not pairs:
        raise WorkloadError(f"lengths file {path}: no requests in it")
    if any(a < 1 or b < 1 for a, b in pairs):
        raise WorkloadError(f"lengths file {path}: every input and output length must be at least 1")
    for row, (a, b) in enumerate(pairs, 1):
        TOKENS.check(max(a, b), f"lengths file {path}, request {row}")
    return LengthDistribution(path.stem, tuple(a for a, _ in pairs), tuple(b for _, b in pairs))


def parse_workload(spec: str) -> Workload:
    """Parse a workload spec (see the module docstring for the grammar)."""
    kind, sep, rest = spec.strip().partition(":")
    if kind not in _KEYS or not sep:
        raise WorkloadError(f"workload {spec!r}: expected KIND:KEY=VALUE,... with KIND one of "
                            f"{', '.join(_KEYS)}; e.g. {_EXAMPLES}")
    allowed, required = _KEYS[kind]
    values: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise WorkloadError(f"workload {spec!r}: {item!r} is not KEY=VALUE")
        if key not in allowed:
            raise WorkloadError(f"workload {spec!r}: unknown key {key!r} for {kind} (keys: {', '.join(sorted(allowed))})")
        if key in values:
            raise WorkloadError(f"workload {spec!r}: {key} is given twice")
        values[key] = value.strip()
    missing = sorted(required - set(values))
    if missing:
        raise WorkloadError(f"workload {spec!r}: {kind} needs {', '.join(missing)}; e.g. {_EXAMPLES}")
    requests = _int(spec, "requests", values["requests"]) if "requests" in values else None
    if kind == "fixed":
        return FixedWorkload(_int(spec, "in", values["in"]), _int(spec, "out", values["out"]),
                             requests or DEFAULT_REQUESTS)
    if kind == "offline":
        return OfflineWorkload(load_lengths(values["prompts"]), _int(spec, "out", values["out"]),
                               requests or OFFLINE_REQUESTS)
    if kind == "poisson":
        return PoissonWorkload(_rate(spec, values["rate"]), load_lengths(values["lengths"]),
                               requests or DEFAULT_REQUESTS)
    return ImagesWorkload(_int(spec, "steps", values["steps"]), _resolution(spec, values["resolution"]),
                          requests or DEFAULT_REQUESTS)


def draw_requests(workload: Workload, seed: int = 0) -> list[tuple[float, int, int]]:
    """The workload's requests as (arrival seconds, input tokens, output tokens): all at 0 for ``fixed:``,
    ``offline:`` (prompts sampled, deterministic for a seed) and ``images:`` (0 input, 1 output: the image), Poisson arrivals with lengths sampled for ``poisson:``
    (deterministic for a seed; the simulator and ``tessera bench`` draw the same requests)."""
    if isinstance(workload, FixedWorkload):
        return [(0.0, workload.input, workload.output)] * workload.requests
    if isinstance(workload, ImagesWorkload):
        return [(0.0, 0, 1)] * workload.requests
    if isinstance(workload, OfflineWorkload):
        return [(0.0, a, workload.output) for a, _ in workload.lengths.sample(workload.requests, seed)]
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / workload.rate, size=workload.requests))
    lengths = workload.lengths.sample(workload.requests, seed)
    return [(float(t), a, b) for t, (a, b) in zip(times, lengths, strict=True)]
