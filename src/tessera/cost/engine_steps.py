"""Step times of a serving engine (vLLM) as a table: a prefill step by its prompt tokens, a decode step by
its rows and their context, measured on a running engine (`tessera profile-engine`) or predicted by the
cost model for a GPU the user does not have. The simulator's vLLM scheduler times every step from it.

A vLLM step mixes prompt chunks and decodes under one token budget. Its time here is the decode part's
time plus what the prompt tokens add on top of the decode rows' tokens (the prefill curve's slope between
``rows`` and ``rows + prompt tokens``): the weights are read once per step, so a few prompt tokens riding
along with a memory-bound decode cost little, and a long chunk costs what its tokens cost. The prefill
curve is measured on lone prompts (its attention grows with the prompt; chunks of several prompts are
charged as one prompt of their total, slightly high)."""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tessera.documents import read_json
from tessera.errors import TesseraError
from tessera.paths import atomic_write

STEP_TIMES_VERSION = 1


class EngineStepTimesError(TesseraError):
    """A step-times file that cannot be read or used."""


@dataclass(frozen=True)
class EngineStepTimes:
    """One engine's step times: ``prefill`` as (prompt tokens, seconds), ``decode`` as (rows, context,
    seconds), each sorted; ``overhead_s`` is what a request adds outside the engine's steps (the API
    server's parsing, tokenising and first response), seen in the time to first token only."""

    engine: str  # e.g. "vllm 0.32.0"
    model: str
    device: str  # where it was measured ("cpu, 2 threads", "A100"), or "predicted: A100"
    prefill: tuple[tuple[int, float], ...]
    decode: tuple[tuple[int, int, float], ...]
    overhead_s: float = 0.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    block_size: int = 16
    kv_blocks: int | None = None  # the engine's KV cache in blocks, where known
    source: str = ""  # the command or the cost model that made it
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prefill) < 2:
            raise EngineStepTimesError(f"step times of {self.model} on {self.device} need at least two prefill "
                                       f"points (prompt lengths), got {len(self.prefill)}")
        if not self.decode:
            raise EngineStepTimesError(f"step times of {self.model} on {self.device} have no decode points")
        for what, rows in (("prefill", self.prefill), ("decode", self.decode)):
            bad = [r for r in rows if r[-1] <= 0 or any(v < 1 for v in r[:-1])]
            if bad:
                raise EngineStepTimesError(f"{what} point {bad[0]} of {self.model} on {self.device}: sizes must be "
                                           "at least 1 and seconds positive")
        object.__setattr__(self, "prefill", tuple(sorted((int(n), float(s)) for n, s in self.prefill)))
        object.__setattr__(self, "decode", tuple(sorted((int(r), int(c), float(s)) for r, c, s in self.decode)))

    def prefill_s(self, tokens: float) -> float:
        """A step of ``tokens`` prompt tokens alone: linear between measured lengths, extended along the
        last segment's slope beyond them (and down to zero tokens along the first)."""
        xs = [n for n, _ in self.prefill]
        ys = [s for _, s in self.prefill]
        return _linear(xs, ys, tokens)

    def decode_s(self, rows: int, ctx: float) -> float:
        """A decode step of ``rows`` rows at mean context ``ctx``: linear in context at each measured row
        count, then linear in rows (extended along the outer segments)."""
        by_rows: dict[int, list[tuple[int, float]]] = {}
        for r, c, s in self.decode:
            by_rows.setdefault(r, []).append((c, s))
        row_points = sorted(by_rows)
        at = [(r, _linear([c for c, _ in by_rows[r]], [s for _, s in by_rows[r]], ctx)) for r in row_points]
        if len(at) == 1:  # one row count measured: scale by the prefill curve's tokens
            r0, s0 = at[0]
            return s0 + self.prefill_s(rows) - self.prefill_s(r0)
        return _linear([r for r, _ in at], [s for _, s in at], rows)

    def step_s(self, prompt_tokens: int, decode_rows: int, decode_ctx: float) -> float:
        """One engine step running ``prompt_tokens`` prompt tokens (chunks of any prompts) and
        ``decode_rows`` decodes at mean context ``decode_ctx``."""
        if decode_rows <= 0:
            return self.prefill_s(max(prompt_tokens, 1))
        t = self.decode_s(decode_rows, decode_ctx)
        if prompt_tokens > 0:
            t += max(0.0, self.prefill_s(decode_rows + prompt_tokens) - self.prefill_s(decode_rows))
        return t

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = STEP_TIMES_VERSION
        d["prefill"] = [list(p) for p in self.prefill]
        d["decode"] = [list(p) for p in self.decode]
        return d

    def save(self, path: str | Path) -> None:
        """Write the versioned JSON file."""
        atomic_write(Path(path), json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> EngineStepTimes:
        if not isinstance(d, dict):
            raise EngineStepTimesError(f"{source}: a step-times file is a JSON object (from `tessera profile-engine "
                                       "-o FILE`)")
        if d.get("version") != STEP_TIMES_VERSION:
            raise EngineStepTimesError(f"{source}: step-times version {d.get('version')!r}, this Tessera reads "
                                       f"version {STEP_TIMES_VERSION}; measure again with `tessera profile-engine`")
        missing = [k for k in ("engine", "model", "device", "prefill", "decode") if k not in d]
        if missing:
            raise EngineStepTimesError(f"{source}: missing {', '.join(missing)}; measure again with "
                                       "`tessera profile-engine`")
        try:
            prefill = tuple((int(n), float(s)) for n, s in d["prefill"])
            decode = tuple((int(r), int(c), float(s)) for r, c, s in d["decode"])
            known = {k: d[k] for k in ("overhead_s", "max_num_batched_tokens", "max_num_seqs", "block_size",
                                       "kv_blocks", "source", "extra") if k in d}
            return cls(str(d["engine"]), str(d["model"]), str(d["device"]), prefill, decode, **known)
        except (TypeError, ValueError) as e:
            raise EngineStepTimesError(f"{source}: malformed step times ({e}); prefill rows are [tokens, seconds] "
                                       "and decode rows [rows, context, seconds]") from None

    @classmethod
    def load(cls, path: str | Path) -> EngineStepTimes:
        """Read a file written by :meth:`save` (clear errors for a missing, malformed or old file)."""
        return cls.from_dict(read_json(Path(path), "step-times file", EngineStepTimesError,
                                       "measure one with `tessera profile-engine -o FILE`"), str(path))


def _linear(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs sorted, distinct), extended along the outer segments; never
    below a tenth of the nearest point (an extension must not reach zero or below)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0
    nearest = ys[min(range(len(xs)), key=lambda k: abs(xs[k] - x))]
    return max(y, 0.1 * nearest)
