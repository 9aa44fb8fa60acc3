"""Per-device, per-class efficiency factors: analytic priors, GPU factors fitted on measurements,
and host (CPU) factors fitted on this machine's profiles."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path

import yaml

from tessera.cost.features import COST_CLASSES
from tessera.documents import read_json
from tessera.errors import TesseraError
from tessera.hardware.catalog import DeviceSpec

DATA_DIR = Path(__file__).parent / "data"
PRIORS_FILE = DATA_DIR / "efficiency_priors.yaml"
GPU_FACTORS_FILE = DATA_DIR / "gpu_factors.json"


class FactorsError(TesseraError):
    """An efficiency-factor file is malformed."""


@dataclass(frozen=True)
class ClassEfficiency:
    """How close kernels of one class get to a device's peaks, and their shortest duration."""

    compute: float
    memory: float
    floor_cycles: float
    overhead_s: float | None = None  # fixed host cost per kernel; None: the device's launch latency
    scale: float = 1.0  # time multiplier from a factors file (`tessera validate --fit`); 1: none

    def to_dict(self) -> dict:
        """The JSON object of these factors (``scale`` only when set)."""
        d = asdict(self)
        if d["scale"] == 1.0:
            d.pop("scale")
        return d


@dataclass(frozen=True)
class DeviceEfficiency:
    """The factors the cost model uses for one device, with where they came from."""

    device: str
    classes: dict[str, ClassEfficiency]
    source: str
    fitted: tuple[str, ...] = field(default=())  # classes whose factors were fitted on measurements
    ops: dict[str, ClassEfficiency] = field(default_factory=dict)  # fitted per fused-op identity (merged_linear...)
    scales: dict[str, float] = field(default_factory=dict)  # time multiplier per cost class (a factors file)

    def for_kernel(self, cost_class: str, op: str | None = None) -> ClassEfficiency:
        """The factors of one kernel: its fused op's (identity) where fitted, else its class's; with its class's
        time multiplier (``scales``) where a factors file gives one. Every predicted kernel time takes its
        factors from here."""
        eff = self.ops.get(op, self.classes[cost_class]) if op else self.classes[cost_class]
        scale = self.scales.get(cost_class)
        return replace(eff, scale=eff.scale * scale) if scale is not None else eff

    def with_scales(self, scales: dict[str, float], source: str) -> DeviceEfficiency:
        """These factors with per-class time multipliers (``source`` says where they came from)."""
        if not scales:
            return self
        return replace(self, scales=dict(scales), source=f"{self.source}; time factors from {source}")

    def to_dict(self) -> dict:
        d = {"device": self.device, "source": self.source, "fitted": list(self.fitted),
             "classes": {c: e.to_dict() for c, e in self.classes.items()}}
        if self.ops:
            d["ops"] = {o: e.to_dict() for o, e in self.ops.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str) -> DeviceEfficiency:
        try:
            classes = {c: ClassEfficiency(**e) for c, e in d["classes"].items()}
            unknown = set(classes) - set(COST_CLASSES)
            if unknown:
                raise FactorsError(f"{where}: unknown cost classes {sorted(unknown)} (known: {COST_CLASSES})")
            ops = {o: ClassEfficiency(**e) for o, e in d.get("ops", {}).items()}
            return cls(device=d["device"], classes=classes, source=d["source"], fitted=tuple(d.get("fitted", ())),
                       ops=ops)
        except (KeyError, TypeError) as e:
            raise FactorsError(f"{where}: malformed device factors ({e}); expected device, source and "
                               "classes: {class: {compute, memory, floor_cycles[, overhead_s]}}") from e


@cache
def _priors() -> dict:
    data = yaml.safe_load(PRIORS_FILE.read_text())
    out = {}
    for kind in ("gpu", "cpu"):
        out[kind] = {c: ClassEfficiency(e["compute"], e["memory"], e["floor_cycles"],
                                        e["overhead_us"] * 1e-6 if "overhead_us" in e else None)
                     for c, e in data[kind].items()}
        missing = set(COST_CLASSES) - set(out[kind])
        if missing:
            raise FactorsError(f"{PRIORS_FILE}: {kind} priors miss classes {sorted(missing)}")
    out["source"] = " ".join(data["source"].split())
    return out


def prior_efficiency(device: DeviceSpec) -> DeviceEfficiency:
    """The analytic priors for a device's kind (GPU or host CPU)."""
    kind = "cpu" if device.vendor == "host" else "gpu"
    return DeviceEfficiency(device.id, dict(_priors()[kind]), _priors()["source"])


@cache
def _gpu_factors() -> dict[str, DeviceEfficiency]:
    if not GPU_FACTORS_FILE.exists():
        return {}
    data = json.loads(GPU_FACTORS_FILE.read_text())
    return {d: DeviceEfficiency.from_dict(v, f"{GPU_FACTORS_FILE} device {d}") for d, v in data["devices"].items()}


def gpu_factors_provenance() -> dict:
    """What the shipped GPU factors were fitted on, and their held-out error."""
    return json.loads(GPU_FACTORS_FILE.read_text())["provenance"] if GPU_FACTORS_FILE.exists() else {}


def host_factors_file() -> Path:
    """Where `tessera calibrate` keeps this host's fitted CPU factors."""
    from tessera.paths import default_cache_dir

    return default_cache_dir() / "host" / "cpu_factors.json"


def load_factors(path: str | Path) -> DeviceEfficiency:
    """Device factors written by :func:`save_factors` (e.g. by `tessera calibrate`)."""
    return DeviceEfficiency.from_dict(read_json(path, "factors file", FactorsError), str(path))


def save_factors(factors: DeviceEfficiency, path: str | Path) -> None:
    """Write device factors as JSON (atomically)."""
    from tessera.paths import atomic_write

    atomic_write(path, json.dumps(factors.to_dict(), indent=2))


def efficiency_for(device: DeviceSpec) -> DeviceEfficiency:
    """The factors for ``device``: fitted ones where measured (GPU: per device, else inherited from a
    fitted part of the same architecture; CPU: this host's calibration), else the priors."""
    priors = prior_efficiency(device)
    if device.vendor == "host":
        f = host_factors_file()
        fitted = load_factors(f) if f.exists() else None
    else:
        factors = _gpu_factors()
        fitted = factors.get(device.id)
        if fitted is None:
            from tessera.hardware.catalog import load_devices

            specs = load_devices()
            same_arch = [d for d in factors if d in specs and specs[d].arch == device.arch]
            if same_arch:
                base = factors[same_arch[0]]
                fitted = DeviceEfficiency(device.id, base.classes, f"inherited from {base.device} "
                                          f"({device.arch}): {base.source}", base.fitted, base.ops)
    if fitted is None:
        return priors
    classes = dict(priors.classes) | {c: e for c, e in fitted.classes.items() if c in fitted.fitted}
    return DeviceEfficiency(device.id, classes, fitted.source, fitted.fitted, dict(fitted.ops))
