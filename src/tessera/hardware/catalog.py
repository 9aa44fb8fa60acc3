"""The device catalog: datasheet figures of each GPU type, and measured figures of this host's CPU.

`devices.yaml` (next to this file) holds one row per device type in readable units; `load_devices` checks
every row and converts it to a `DeviceSpec` in SI units (bytes, bytes/s, FLOP/s, Hz, seconds).
`tessera.hardware.devices.resolve_device` turns a name ("a100", "H100 SXM", "cpu:4") into a spec; lookup ignores case, '-', '_'
and spaces. The `cpu` device is this host: `tessera.hardware.host` measures it once (matmul FLOP/s, copy
bandwidth, op dispatch latency) and caches the result as JSON.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from tessera.documents import read_yaml
from tessera.errors import TesseraError
from tessera.hardware.sources import (
    HALF_RATE,
    Citation,
    CitationError,
    Document,
    parse_citation,
    parse_document,
)

DEVICES_FILE = Path(__file__).with_name("devices.yaml")
HOST_ID = "cpu"
FLOP_PATHS = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")
PRICE_SCENARIOS = ("relative", "cloud_usd")
VENDORS = ("nvidia", "amd", "host")
# Which tensor figure a row uses for bf16/fp16/fp8 (all with FP32 accumulate, what the kernels use):
ACCUMULATE = {
    "fp32": "the printed FP32-accumulate rate (data-centre and professional parts run it at full rate)",
    "fp32-half-rate": "half the printed FP16-accumulate rate (GeForce parts run FP32 accumulate at half rate)",
}


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
    sources: dict[str, Citation] = dataclasses.field(default_factory=dict)  # YAML figure -> where it comes from
    accumulate: str | None = None  # key of ACCUMULATE: which tensor figure bf16/fp16/fp8 use; None for cpu

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
                                                         "compute_capability", "accumulate", "sources"}
_HOST_FIELDS = frozenset({"id", "vendor", "prices", "aliases", "source", "as_of", "sources"})
# Figures a GPU row cites besides one `tflops.<path>` per path it lists; the `cpu` row cites what it measures.
_GPU_FIGURES = ("memory_gb", "bandwidth_tb_s", "sm_count", "compute_capability", "boost_clock_mhz", "l2_mib",
                "launch_latency_us", "nvlink_gb_s", "pcie_gb_s", "prices")
HOST_FIGURES = ("memory_gb", "bandwidth_tb_s", "tflops", "sm_count", "boost_clock_mhz", "l2_mib",
                "launch_latency_us", "pcie_gb_s", "prices")


@dataclass(frozen=True)
class _HostRow:
    """The static part of the `cpu` row: what is not measured."""

    vendor: str
    prices: dict[str, float]
    aliases: tuple[str, ...]
    source: str
    as_of: str
    sources: dict[str, Citation]


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

    def figure_value(self, figure: str) -> Any:
        """The YAML value of a cited figure ("tflops.bf16" -> the row's tflops bf16 entry)."""
        head, _, path = figure.partition(".")
        value = self.data.get(head)
        return value.get(path) if path and isinstance(value, dict) else value

    def citations(self, figures: list[str], documents: dict[str, Document]) -> dict[str, Citation]:
        """The row's `sources`: one citation per figure in `figures`, none missing, none extra, each matching
        the row's value where it quotes a number."""
        value = self.data["sources"]
        if not isinstance(value, dict):
            raise self.fail("sources", f"expected a mapping of figure -> citation, got {value!r}")
        extra = sorted(set(value) - set(figures), key=str)
        if extra:
            raise self.fail(f"sources.{extra[0]}", f"cites a figure the row does not have (figures: {', '.join(figures)})")
        out = {}
        for figure in figures:
            if figure not in value:
                raise self.fail(f"sources.{figure}", "missing citation: every figure names its document and the "
                                                     "figure as printed there (or says it is derived, unconfirmed, "
                                                     "an estimate or measured)")
            try:
                cite = parse_citation(figure, value[figure], documents)
            except CitationError as e:
                raise self.fail(f"sources.{figure}", str(e)) from None
            got = self.figure_value(figure)
            if figure == "compute_capability" and got is not None:
                got = float(got)  # "8.9" -> 8.9, as the CUDA table prints it
            if isinstance(got, dict):  # prices: two scenarios, cited as a whole
                if cite.number is not None:
                    raise self.fail(f"sources.{figure}", "cites one number for a mapping of values")
            elif not cite.matches(got):
                raise self.fail(f"sources.{figure}", f"the row says {got!r} but the citation gives "
                                                     f"{_expected(cite)} ({cite.printed!r})")
            out[figure] = cite
        return out

    def accumulate(self, citations: dict[str, Citation]) -> str:
        """The row's `accumulate` key, checked against the conversions of its bf16/fp16/fp8 citations."""
        value = self.data["accumulate"]
        if value not in ACCUMULATE:
            raise self.fail("accumulate", f"expected one of {', '.join(ACCUMULATE)}, got {value!r}")
        for path in ("bf16", "fp16", "fp8"):
            cite = citations.get(f"tflops.{path}")
            if cite is None or cite.number is None:
                continue
            halved = HALF_RATE in cite.convert
            if halved != (value == "fp32-half-rate"):
                raise self.fail(f"sources.tflops.{path}",
                                f"accumulate is {value!r} ({ACCUMULATE[value]}), so the citation "
                                f"{'must' if value == 'fp32-half-rate' else 'must not'} convert {HALF_RATE!r}")
        return value


def _expected(cite: Citation) -> str:
    if cite.number is None:
        return "no number"
    steps = "".join(f" x {c!r}" for c in cite.convert)
    return f"{cite.number:g}{steps} = {cite.expected():g}" if steps else f"{cite.number:g}"


def _gpu_spec(row: _Row, documents: dict[str, Document]) -> DeviceSpec:
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
    capability = row.capability("compute_capability", vendor)
    figures = [*_GPU_FIGURES[:2], *(f"tflops.{p}" for p in FLOP_PATHS if p in flops), *_GPU_FIGURES[2:]]
    sources = row.citations(figures, documents)
    return DeviceSpec(id=row.text("id"), name=row.text("name"), vendor=vendor, arch=row.text("arch"),
                      flops=flops, sm_count=sm, prices=prices, aliases=row.names("aliases"),
                      source=row.text("source"), as_of=row.day("as_of"), compute_capability=capability,
                      sources=sources, accumulate=row.accumulate(sources), **si)


def _host_row(row: _Row, documents: dict[str, Document]) -> _HostRow:
    row.check_fields(_HOST_FIELDS)
    if row.text("vendor") != "host":
        raise row.fail("vendor", "the cpu row's vendor must be 'host'")
    return _HostRow(vendor="host", prices=row.numbers("prices", PRICE_SCENARIOS, 1.0),
                    aliases=row.names("aliases"), source=row.text("source"), as_of=row.day("as_of"),
                    sources=row.citations(list(HOST_FIGURES), documents))


def _documents(path: Path, value: Any) -> dict[str, Document]:
    if not isinstance(value, dict) or not value:
        raise DeviceCatalogError(f"{path}: 'documents' must map document keys to title / url / copies")
    try:
        return {str(key): parse_document(str(key), data) for key, data in value.items()}
    except CitationError as e:
        raise DeviceCatalogError(f"{path}: documents: {e}") from None


def _read_catalog(path: Path) -> _Catalog:
    doc = read_yaml(path, "devices file", DeviceCatalogError)
    if not isinstance(doc, dict) or set(doc) != {"documents", "devices"} or not isinstance(doc["devices"], list):
        raise DeviceCatalogError(f"{path}: expected a mapping with two keys, 'documents' (the cited documents) "
                                 "and 'devices' (a list of rows)")
    documents = _documents(path, doc["documents"])
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
            host = _host_row(row, documents)
            aliases = host.aliases
        else:
            spec = _gpu_spec(row, documents)
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
    known compute paths and price scenarios, no id or alias used twice, and a citation for every figure
    (`sources`) whose quoted number, after its conversions, equals the row's value.

    Args:
        path: a devices YAML file; default the packaged `devices.yaml`.

    Raises:
        DeviceCatalogError: the file breaks the schema (the message names the file, row and field).
    """
    return dict(_catalog(path).specs)


def figure_values(spec: DeviceSpec) -> dict[str, float | None]:
    """A GPU spec's cited figures in devices.yaml's units (TB/s, TFLOP/s, MHz, MiB, ...), read back from its SI
    fields: the keys of `spec.sources`. `prices` (two scenarios) and absent links are None."""
    cc = spec.compute_capability
    return {
        "memory_gb": spec.memory_bytes / 1e9,
        "bandwidth_tb_s": spec.memory_bandwidth / 1e12,
        **{f"tflops.{path}": spec.flops[path] / 1e12 for path in FLOP_PATHS if path in spec.flops},
        "sm_count": float(spec.sm_count),
        "compute_capability": None if cc is None else float(f"{cc[0]}.{cc[1]}"),
        "boost_clock_mhz": spec.boost_clock_hz / 1e6,
        "l2_mib": spec.l2_bytes / 2**20,
        "launch_latency_us": spec.launch_latency_s / 1e-6,
        "nvlink_gb_s": None if spec.nvlink_bandwidth is None else spec.nvlink_bandwidth / 1e9,
        "pcie_gb_s": spec.pcie_bandwidth / 1e9,
        "prices": None,
    }


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
