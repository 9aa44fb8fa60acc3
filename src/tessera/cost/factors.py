"""Time-factor files: per device and cost class, a multiplier on the cost model's predicted kernel times,
fitted on measurements by `tessera validate --fit` and taken by `estimate`, `plan`, `simulate` and
`census` with `--factors FILE`.

The file is JSON::

    {"kind": "tessera-time-factors", "version": 1,
     "source": "what the factors were fitted on",
     "devices": {"L40S": {"gemm": 1.12, "attention": 0.93, "*": 1.05}},
     "fit": {...}}                       # optional: per device and class, the measurements behind each factor

A factor multiplies the predicted time of every kernel of that class on that device (measured kernels of a
`--profile` are not touched); ``*`` applies to the device's classes that have no factor of their own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.cost.classes import COST_CLASSES
from tessera.documents import read_json
from tessera.errors import TesseraError

FACTORS_KIND = "tessera-time-factors"
FACTORS_VERSION = 1
ANY_CLASS = "*"
FACTOR_RANGE = (1e-3, 1e3)  # a factor outside this is a unit error (ns given as s), not an efficiency
MIN_FIT_MEASUREMENTS = 3  # `--fit` gives no factor to a device and class measured fewer times: one kernel is no class
_REDO = "write it with `tessera validate MEASUREMENTS --fit FILE`"


class TimeFactorsError(TesseraError, ValueError):
    """A time-factors file is unreadable, of another kind or version, or holds a bad device, class or factor."""


@dataclass(frozen=True)
class TimeFactors:
    """Per device id, per cost class (or ``*``), a multiplier on predicted kernel times."""

    devices: tuple[tuple[str, tuple[tuple[str, float], ...]], ...]  # hashable: part of CostOptions
    source: str
    path: str = ""  # the file it was read from ("" when built in memory)
    fit: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_mapping(cls, factors: dict[str, dict[str, float]], source: str, path: str = "",
                     fit: dict[str, Any] | None = None) -> TimeFactors:
        """Factors from ``{device: {class: factor}}`` (checked)."""
        _check(factors, path or "<factors>")
        return cls(tuple((d, tuple(sorted(c.items()))) for d, c in sorted(factors.items())), source, path,
                   fit or {})

    def as_mapping(self) -> dict[str, dict[str, float]]:
        """``{device: {class: factor}}``."""
        return {d: dict(c) for d, c in self.devices}

    def for_device(self, device_id: str, classes: tuple[str, ...] | None = None) -> dict[str, float]:
        """The multipliers of one device per cost class (``*`` spread over ``classes`` without their own)."""
        own = dict(self.as_mapping().get(device_id, {}))
        default = own.pop(ANY_CLASS, None)
        if default is not None:
            own = {c: own.get(c, default) for c in (classes or COST_CLASSES)}
        return own

    def describe(self) -> str:
        """Where the factors came from, as printed beside an estimate."""
        return f"{self.path or 'memory'} ({self.source})"

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON object."""
        d: dict[str, Any] = {"kind": FACTORS_KIND, "version": FACTORS_VERSION, "source": self.source,
                             "devices": self.as_mapping()}
        if self.fit:
            d["fit"] = self.fit
        return d

    def save(self, path: str | Path) -> None:
        """Write the JSON file (atomically)."""
        from tessera.paths import atomic_write

        atomic_write(path, json.dumps(self.to_dict(), indent=2))


def _check(factors: Any, where: str) -> None:
    from tessera.hardware.catalog import UnknownDeviceError, canonical_id

    if not isinstance(factors, dict):
        raise TimeFactorsError(f"{where}: 'devices' must be an object {{device: {{class: factor}}}}, not "
                               f"{type(factors).__name__}; {_REDO}")
    for device, classes in factors.items():
        try:
            known = canonical_id(device)
        except UnknownDeviceError as e:
            raise TimeFactorsError(f"{where}: devices.{device}: {e}") from None
        if known != device:
            raise TimeFactorsError(f"{where}: devices.{device}: write the device's canonical id {known!r}")
        if not isinstance(classes, dict) or not classes:
            raise TimeFactorsError(f"{where}: devices.{device} must be a non-empty object {{class: factor}}")
        for cls, value in classes.items():
            if cls != ANY_CLASS and cls not in COST_CLASSES:
                raise TimeFactorsError(f"{where}: devices.{device}.{cls}: unknown cost class; use one of "
                                       f"{', '.join(COST_CLASSES)} or {ANY_CLASS!r} (every other class)")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TimeFactorsError(f"{where}: devices.{device}.{cls} must be a number, not {value!r}")
            if not FACTOR_RANGE[0] <= value <= FACTOR_RANGE[1]:
                raise TimeFactorsError(f"{where}: devices.{device}.{cls} = {value:g} is outside "
                                       f"{FACTOR_RANGE[0]:g}..{FACTOR_RANGE[1]:g}: a factor multiplies predicted "
                                       "times; check the measurements' units (seconds)")


def load_time_factors(path: str | Path) -> TimeFactors:
    """Read and check a factors file written by :meth:`TimeFactors.save`."""
    d = read_json(path, "factors file", TimeFactorsError, hint=_REDO)
    where = str(path)
    if not isinstance(d, dict) or d.get("kind") != FACTORS_KIND:
        found = d.get("kind") if isinstance(d, dict) else type(d).__name__
        raise TimeFactorsError(f"{where}: not a Tessera time-factors file (kind is {found!r}, expected "
                               f"{FACTORS_KIND!r}); {_REDO}")
    if d.get("version") != FACTORS_VERSION:
        raise TimeFactorsError(f"{where}: version {d.get('version')!r} is not supported (expected "
                               f"{FACTORS_VERSION}); {_REDO}")
    if "devices" not in d:
        raise TimeFactorsError(f"{where}: lacks 'devices'; {_REDO}")
    source = d.get("source", "")
    if not isinstance(source, str):
        raise TimeFactorsError(f"{where}: 'source' must be a string, not {source!r}")
    fit = d.get("fit", {})
    return TimeFactors.from_mapping(d["devices"], source, where, fit if isinstance(fit, dict) else {})
