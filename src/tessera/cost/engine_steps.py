"""Step times of a serving engine (vLLM) as a table: a prefill step by its prompt tokens, a decode step by
its rows and their context, measured on a running engine (`tessera profile-engine`) or predicted by the
cost model for a GPU the user does not have. The simulator's vLLM scheduler times every step from it.

A prefill step's time is fitted as ``fixed + per_token * tokens + per_pair * squares + per_sequence *
prompts`` (`PrefillFit`): a fixed part, the GEMMs per token, attention per pair (``squares``: a prompt of n
tokens adds n^2, a chunk of n tokens after a context of m adds n^2 + 2nm), and what each prompt adds beyond
its tokens (its last position's logits over the vocabulary, its sampling), least squares with non-negative
coefficients over every prefill measured (lone prompts of several lengths, and many short prompts in one
step, which tell the parts apart). A vLLM step mixes prompt chunks and decodes under one token budget: its
time here is the decode part's time (from the decode table) plus what its prompt chunks add."""

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
class PrefillFit:
    """Seconds of a prefill step: fixed, per prompt token, per attention pair, per prompt in the step."""

    fixed: float
    per_token: float
    per_pair: float
    per_sequence: float

    def added(self, tokens: float, squares: float, sequences: int) -> float:
        """What prompt chunks add to a step beyond its fixed part."""
        return self.per_token * tokens + self.per_pair * squares + self.per_sequence * sequences


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
    batched: tuple[tuple[int, int, float], ...] = ()  # (prompts, tokens each, seconds) of one step
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
        object.__setattr__(self, "batched", tuple(sorted((int(k), int(n), float(s)) for k, n, s in self.batched)))
        object.__setattr__(self, "_fit", _fit_prefill(self.prefill, self.batched))
        by_rows: dict[int, tuple[list[int], list[float]]] = {}  # rows -> (contexts, seconds): grouped once
        for r, c, sec in self.decode:
            by_rows.setdefault(r, ([], []))[0].append(c)
            by_rows[r][1].append(sec)
        object.__setattr__(self, "_by_rows", by_rows)

    @property
    def prefill_fit(self) -> PrefillFit:
        """The prefill step's fitted parts."""
        return self._fit  # type: ignore[attr-defined]

    def prefill_s(self, tokens: float, squares: float | None = None, sequences: int = 1) -> float:
        """A step of ``tokens`` prompt tokens in ``sequences`` prompts with ``squares`` attention pairs
        (default: one prompt of ``tokens``)."""
        fit = self.prefill_fit
        return fit.fixed + fit.added(tokens, tokens * tokens if squares is None else squares, sequences)

    def decode_s(self, rows: int, ctx: float) -> float:
        """A decode step of ``rows`` rows at mean context ``ctx``: linear in context at each measured row
        count, then linear in rows (extended along the outer segments)."""
        by_rows = self._by_rows  # type: ignore[attr-defined]
        at = [(r, _linear(*by_rows[r], ctx)) for r in sorted(by_rows)]
        if len(at) == 1:  # one row count measured: scale by the prefill's cost per token
            r0, s0 = at[0]
            return s0 + self.prefill_fit.per_token * (rows - r0)
        return _linear([r for r, _ in at], [s for _, s in at], rows)

    def step_s(self, prompt_tokens: int, decode_rows: int, decode_ctx: float, prompt_squares: float | None = None,
               prompts: int = 1) -> float:
        """One engine step running ``prompt_tokens`` prompt tokens (chunks of ``prompts`` prompts, with
        ``prompt_squares`` attention pairs; default one prompt) and ``decode_rows`` decodes at mean context
        ``decode_ctx``."""
        squares = prompt_tokens * prompt_tokens if prompt_squares is None else prompt_squares
        if decode_rows <= 0:
            return self.prefill_s(max(prompt_tokens, 1), squares, max(prompts, 1))
        added = self.prefill_fit.added(prompt_tokens, squares, prompts) if prompt_tokens > 0 else 0.0
        return self.decode_s(decode_rows, decode_ctx) + added

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = STEP_TIMES_VERSION
        d["prefill"] = [list(p) for p in self.prefill]
        d["decode"] = [list(p) for p in self.decode]
        d["batched"] = [list(p) for p in self.batched]
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
            batched = tuple((int(k), int(n), float(s)) for k, n, s in d.get("batched") or ())
            known = {k: d[k] for k in ("overhead_s", "max_num_batched_tokens", "max_num_seqs", "block_size",
                                       "kv_blocks", "source", "extra") if k in d}
            return cls(str(d["engine"]), str(d["model"]), str(d["device"]), prefill, decode, batched, **known)
        except (TypeError, ValueError) as e:
            raise EngineStepTimesError(f"{source}: malformed step times ({e}); prefill rows are [tokens, seconds] "
                                       "and decode rows [rows, context, seconds]") from None

    @classmethod
    def load(cls, path: str | Path) -> EngineStepTimes:
        """Read a file written by :meth:`save` (clear errors for a missing, malformed or old file)."""
        return cls.from_dict(read_json(Path(path), "step-times file", EngineStepTimesError,
                                       "measure one with `tessera profile-engine -o FILE`"), str(path))


def _fit_prefill(lone: tuple[tuple[int, float], ...], batched: tuple[tuple[int, int, float], ...]) -> PrefillFit:
    """The `PrefillFit` (every part >= 0) closest to every measured prefill step, each weighted by 1 / its
    time (relative error counts, so short steps are fitted as well as long ones). With lone prompts only,
    the per-prompt part cannot be told from the fixed one and stays zero."""
    import itertools

    import numpy as np

    rows = [(1.0, n, n * n, 1.0, s) for n, s in lone] + [(1.0, k * n, k * n * n, float(k), s) for k, n, s in batched]
    a = np.array([[x / r[-1] for x in r[:-1]] for r in rows])
    if not batched:
        a[:, 3] = 0.0
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    best, coef = np.inf, np.zeros(4)
    for k in range(1, 5):
        for used in itertools.combinations(range(4), k):  # every set of free parts, the rest held at zero
            cols = list(used)
            x = np.linalg.lstsq(a[:, cols], np.ones(len(rows)), rcond=None)[0]
            if (x < 0).any():
                continue
            residual = float(np.sum((a[:, cols] @ x - 1.0) ** 2))
            if residual < best - 1e-12:
                best, coef = residual, np.zeros(4)
                coef[cols] = x
    coef = coef / scale
    return PrefillFit(*(float(v) for v in coef))


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
