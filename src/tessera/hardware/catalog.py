"""The device catalog: datasheet figures of each GPU type, and measured figures of this host's CPU.

`devices.yaml` (next to this file) holds one row per device type in readable units; `load_devices` checks
every row and converts it to a `DeviceSpec` in SI units (bytes, bytes/s, FLOP/s, Hz, seconds).
`tessera.hardware.devices.resolve_device` turns a name ("a100", "H100 SXM", "cpu:4") into a spec; lookup ignores case, '-', '_'
and spaces. The `cpu` device is this host: `tessera.hardware.host` measures it once (matmul FLOP/s, copy
bandwidth, op dispatch latency) and caches the result as JSON.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from tessera.documents import read_yaml
from tessera.errors import TesseraError

DEVICES_FILE = Path(__file__).with_name("devices.yaml")
HOST_ID = "cpu"
FLOP_PATHS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")
PRICE_SCENARIOS = ("relative", "cloud_usd")
VENDORS = ("nvidia", "amd", "host")


class UnknownDeviceError(TesseraError):
    """A device name that is not in the catalog (the message lists close matches and the known ids)."""


class DeviceCatalogError(TesseraError):
    """A devices file that breaks the schema (the message names the file, the row and the field)."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device type, in SI units. See devices.yaml for where each figure comes from."""

    id: str
    name: str
    vendor: str
    arch: str
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    flops: dict[str, float]  # dense FLOP/s per compute path present on the part
    sm_count: int  # SMs / CUs; physical cores for cpu
    boost_clock_hz: float
    l2_bytes: int  # last-level cache
    launch_latency_s: float
    nvlink_bandwidth: float | None  # bytes/s per direction; None without NVLink
    pcie_bandwidth: float  # bytes/s per direction of the host link
    prices: dict[str, float]  # scenario -> price per device-hour
    aliases: tuple[str, ...]
    source: str
    as_of: str
    measured: bool = False
    threads: int | None = None
    compute_capability: tuple[int, int] | None = None  # NVIDIA SM version (8.0 = A100); None for AMD and CPU

    def peak_flops(self, path: str) -> float | None:
        """Dense peak FLOP/s of compute path `path` ("fp32", "bf16", ...); None when the part lacks it."""
        if path not in FLOP_PATHS:
            raise ValueError(f"unknown compute path {path!r}; known paths: {', '.join(FLOP_PATHS)}")
        return self.flops.get(path)

    def price(self, scenario: str = "relative") -> float:
        """Price per device-hour under `scenario` ("relative" or "cloud_usd")."""
        if scenario not in self.prices:
            raise TesseraError(f"device {self.id} has no price for scenario {scenario!r}; "
                               f"scenarios: {', '.join(sorted(self.prices))}")
        return self.prices[scenario]


# ---------------------------------------------------------------------------------------------------------
# Loading and checking devices.yaml

# YAML field -> (SI field, scale). Numbers must be positive; `nvlink_gb_s` may be null.
_NUMBERS = {
    "memory_gb": ("memory_bytes", 1e9),
    "bandwidth_tb_s": ("memory_bandwidth", 1e12),
    "boost_clock_mhz": ("boost_clock_hz", 1e6),
    "l2_mib": ("l2_bytes", 2**20),
    "launch_latency_us": ("launch_latency_s", 1e-6),
    "nvlink_gb_s": ("nvlink_bandwidth", 1e9),
    "pcie_gb_s": ("pcie_bandwidth", 1e9),
}
_TEXT = ("id", "name", "vendor", "arch", "source", "as_of")
_GPU_FIELDS = frozenset(_TEXT) | frozenset(_NUMBERS) | {"tflops", "sm_count", "prices", "aliases",
                                                         "compute_capability"}
_HOST_FIELDS = frozenset({"id", "vendor", "prices", "aliases", "source", "as_of"})


@dataclass(frozen=True)
class _HostRow:
    """The static part of the `cpu` row: what is not measured."""

    vendor: str
    prices: dict[str, float]
    aliases: tuple[str, ...]
    source: str
    as_of: str


@dataclass(frozen=True)
class _Catalog:
    specs: dict[str, DeviceSpec]
    host: _HostRow
    index: dict[str, str]  # normalized id or alias -> canonical id


def _norm(name: str) -> str:
    return "".join(c for c in str(name).lower() if c not in "-_ ")


class _Row:
    """Typed access to one YAML row; every failure names the file, the row and the field."""

    def __init__(self, file: Path, position: int, data: dict):
        self.file, self.data = file, data
        rid = data.get("id")
        self.label = f"{position} (id {rid!r})" if isinstance(rid, str) else str(position)

    def fail(self, field: str | None, problem: str) -> DeviceCatalogError:
        where = f"row {self.label}" + (f", field '{field}'" if field else "")
        return DeviceCatalogError(f"{self.file}: {where}: {problem}")

    def check_fields(self, allowed: frozenset[str]) -> None:
        missing = sorted(allowed - set(self.data))
        extra = sorted(set(self.data) - allowed, key=str)
        if missing:
            raise self.fail(missing[0], f"missing (required fields: {', '.join(sorted(allowed))})")
        if extra:
            raise self.fail(str(extra[0]), f"unknown field (allowed: {', '.join(sorted(allowed))})")

    def text(self, field: str) -> str:
        value = self.data[field]
        if not isinstance(value, str) or not value.strip():
            raise self.fail(field, f"expected a non-empty string, got {value!r}")
        return value.strip()

    def number(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(field, f"expected a number, got {value!r}")
        if not value > 0:
            raise self.fail(field, f"must be positive, got {value!r}")
        return float(value)

    def numbers(self, field: str, allowed: tuple[str, ...], scale: float) -> dict[str, float]:
        value = self.data[field]
        if not isinstance(value, dict) or not value:
            raise self.fail(field, f"expected a mapping of {'/'.join(allowed)} to numbers, got {value!r}")
        out = {}
        for key, v in value.items():
            if key not in allowed:
                raise self.fail(f"{field}.{key}", f"unknown key (allowed: {', '.join(allowed)})")
            out[key] = self.number(v, f"{field}.{key}") * scale
        return out

    def day(self, field: str) -> str:
        value = self.data[field]
        if isinstance(value, date):
            return value.isoformat()
        if not isinstance(value, str) or not value.strip():
            raise self.fail(field, f"expected a date such as '2025-06-01', got {value!r}")
        return value.strip()

    def capability(self, field: str, vendor: str) -> tuple[int, int] | None:
        value = self.data[field]
        if value is None and vendor != "nvidia":
            return None
        text = str(value).strip() if isinstance(value, str | int | float) and not isinstance(value, bool) else ""
        major, dot, minor = text.partition(".")
        if not (major.isdigit() and dot and minor.isdigit()):
            raise self.fail(field, f"expected an NVIDIA compute capability such as '8.0'"
                                   f"{' (null for non-NVIDIA parts)' if vendor != 'nvidia' else ''}, got {value!r}")
        return int(major), int(minor)

    def names(self, field: str) -> tuple[str, ...]:
        value = self.data[field]
        if not isinstance(value, list) or not all(isinstance(v, str | int) for v in value):
            raise self.fail(field, f"expected a list of names, got {value!r}")
        return tuple(str(v) for v in value)


def _gpu_spec(row: _Row) -> DeviceSpec:
    row.check_fields(_GPU_FIELDS)
    vendor = row.text("vendor")
    if vendor not in VENDORS[:2]:
        raise row.fail("vendor", f"expected one of nvidia, amd, got {vendor!r}")
    flops = row.numbers("tflops", FLOP_PATHS, 1e12)
    if "fp32" not in flops:
        raise row.fail("tflops.fp32", "missing (every part has an fp32 rate)")
    sm = row.data["sm_count"]
    if isinstance(sm, bool) or not isinstance(sm, int) or sm <= 0:
        raise row.fail("sm_count", f"expected a positive whole number, got {sm!r}")
    si: dict[str, Any] = {}
    for field, (name, scale) in _NUMBERS.items():
        value = row.data[field]
        si[name] = None if value is None and field == "nvlink_gb_s" else row.number(value, field) * scale
    for name in ("memory_bytes", "l2_bytes"):
        si[name] = round(si[name])
    prices = row.numbers("prices", PRICE_SCENARIOS, 1.0)
    return DeviceSpec(id=row.text("id"), name=row.text("name"), vendor=vendor, arch=row.text("arch"),
                      flops=flops, sm_count=sm, prices=prices, aliases=row.names("aliases"),
                      source=row.text("source"), as_of=row.day("as_of"),
                      compute_capability=row.capability("compute_capability", vendor), **si)


def _host_row(row: _Row) -> _HostRow:
    row.check_fields(_HOST_FIELDS)
    if row.text("vendor") != "host":
        raise row.fail("vendor", "the cpu row's vendor must be 'host'")
    return _HostRow(vendor="host", prices=row.numbers("prices", PRICE_SCENARIOS, 1.0),
                    aliases=row.names("aliases"), source=row.text("source"), as_of=row.day("as_of"))


def _read_catalog(path: Path) -> _Catalog:
    doc = read_yaml(path, "devices file", DeviceCatalogError)
    if not isinstance(doc, dict) or set(doc) != {"devices"} or not isinstance(doc["devices"], list):
        raise DeviceCatalogError(f"{path}: expected a mapping with one key, 'devices', holding a list of rows")
    specs: dict[str, DeviceSpec] = {}
    host: _HostRow | None = None
    index: dict[str, str] = {}
    owner: dict[str, int] = {}  # normalized name -> row that claimed it
    for position, data in enumerate(doc["devices"]):
        if not isinstance(data, dict):
            raise DeviceCatalogError(f"{path}: row {position}: expected a mapping of fields, got {data!r}")
        row = _Row(path, position, data)
        if "id" not in data:
            raise row.fail("id", "missing")
        rid = row.text("id")
        if rid == HOST_ID:
            host = _host_row(row)
            aliases = host.aliases
        else:
            spec = _gpu_spec(row)
            specs[rid] = spec
            aliases = spec.aliases
        for name, field in [(rid, "id"), *((a, "aliases") for a in aliases)]:
            key = _norm(name)
            if owner.get(key, position) != position:
                raise row.fail(field, f"{name!r} is already used by device {index[key]!r} (row {owner[key]}); "
                                      "ids and aliases must be unique ignoring case, '-', '_' and spaces")
            index[key], owner[key] = rid, position
    if host is None:
        raise DeviceCatalogError(f"{path}: no row with id 'cpu' (the host's static fields: vendor, prices, ...)")
    return _Catalog(specs=specs, host=host, index=index)


@functools.lru_cache(maxsize=1)
def _default_catalog() -> _Catalog:
    return _read_catalog(DEVICES_FILE)


def _catalog(path: Path | None = None) -> _Catalog:
    return _default_catalog() if path is None else _read_catalog(Path(path))


def load_devices(path: Path | None = None) -> dict[str, DeviceSpec]:
    """The datasheet devices (every row but `cpu`, which is measured: see `host_spec`), by canonical id.

    Every row is checked, the `cpu` row included: missing or unknown fields, types, positive numbers,
    known compute paths and price scenarios, and no id or alias used twice.

    Args:
        path: a devices YAML file; default the packaged `devices.yaml`.

    Raises:
        DeviceCatalogError: the file breaks the schema (the message names the file, row and field).
    """
    return dict(_catalog(path).specs)


def datasheet_spec(device_id: str) -> DeviceSpec:
    """The packaged catalog's spec of a canonical GPU id (see `canonical_id`)."""
    return _default_catalog().specs[device_id]


def device_ids() -> list[str]:
    """Canonical ids of every known device, `cpu` last."""
    return [*_default_catalog().specs, HOST_ID]


def canonical_id(name: str) -> str:
    """The canonical id of a device name or alias ("a100-sxm" -> "A100", "host" -> "cpu").

    Raises:
        UnknownDeviceError: no device has that name (the message lists close matches).
    """
    cat = _default_catalog()
    rid = cat.index.get(_norm(name))
    if rid is not None:
        return rid
    names = {_norm(n): rid for rid, spec in cat.specs.items() for n in (rid, *spec.aliases)}
    names.update({_norm(n): HOST_ID for n in (HOST_ID, *cat.host.aliases)})
    close = difflib.get_close_matches(_norm(name), list(names), n=6, cutoff=0.6)
    matches = list(dict.fromkeys(names[c] for c in close))
    hint = f"; did you mean {', '.join(matches)}?" if matches else ""
    raise UnknownDeviceError(f"unknown device {name!r}{hint} Known devices: {', '.join(device_ids())} "
                             "(names ignore case, '-', '_' and spaces; 'cpu:N' = this host split N ways)")


def host_row():
    """The catalog's `cpu` row: what is not measured about this host (vendor, aliases, prices, source)."""
    return _default_catalog().host
