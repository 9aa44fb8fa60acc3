"""Measured kernel and step times a user gives `tessera validate`, read from four formats:

- the documented CSV ``device,model,op,shape,seconds`` (see docs/commands.md): one row per measured step,
  or per cost class within a step (``op`` = ``PHASE`` or ``PHASE/CLASS``);
- a Tessera profile (`tessera profile` JSON): every kernel of one step measured on one device;
- an Nsight Systems ``cuda_gpu_trace`` CSV export: kernel launches, classed by name as the GPU calibration
  classes them, their median per kernel name and device;
- the calibration set's kernel tables (``gptoss20b_a100_l40s_kernel_{pairs,points}.tsv``): kernels measured on
  an A100-PCIE and an L40S.

Shape-less measurements (Nsight, calibration) can only be predicted from the same kernel measured on
another device; they carry the key that pairs them. Every bad row raises :class:`MeasurementError`
naming the file and line.
"""

from __future__ import annotations

import csv
import io
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from tessera.cost.features import COST_CLASSES
from tessera.cost.gpu_calibration import (
    MISMATCH_RATIO,
    REFERENCE,
    TARGET,
    classify_kernel_name,
    kernel_identity,
)
from tessera.errors import TesseraError

CSV_COLUMNS = ("device", "model", "op", "shape", "seconds")
SHAPE_KEYS = ("batch", "seq", "ctx", "image", "resolution")
_INT_KEYS = ("batch", "seq", "ctx")
STEP, KERNEL, TRACE, PAIRED = "step", "kernel", "trace", "paired"  # Measurement.kind
STEP_CLASS = "step"  # the op class of a whole-step measurement
_NSYS_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_FORMATS = ("the CSV `device,model,op,shape,seconds` (docs/commands.md), a `tessera profile` JSON, an Nsight "
            "Systems `cuda_gpu_trace` CSV export (`nsys stats --report cuda_gpu_trace --format csv`), or the "
            "calibration set's kernel_pairs/kernel_points TSV")


class MeasurementError(TesseraError, ValueError):
    """A measurement file or row that cannot be read: the message names the file, line and what to do."""


@dataclass(frozen=True)
class Measurement:
    """One measured time, with what it was measured on and what Tessera compares it with.

    ``key`` is equal for the same kernel or step measured on another device (cross-device ratios);
    ``reference`` (calibration pairs) is the measurement on the other part it is predicted from."""

    device: str  # canonical device id
    op_class: str  # the cost class it is grouped by ("step" for a whole step)
    seconds: float
    where: str  # file:line
    kind: str  # step | kernel (a profiled kernel) | trace (Nsight) | paired (calibration set)
    key: tuple
    op: str = ""  # as measured: "decode", "decode/gemm", a kernel name or a profiled kernel id
    model: str | None = None
    phase: str | None = None
    shape: tuple[tuple[str, int | str], ...] = ()
    part: str | None = None  # step rows: the cost class within the step (None: the whole step)
    signature: str | None = None  # profiled kernels
    threads: int | None = None  # CPU threads: a profile's, or a CSV row's cpu:N (None: all cores)
    block: str | None = None  # calibration rows
    identity: str | None = None  # the Tessera fused op a measured GPU kernel stands for
    launches: int = 1
    reference: Measurement | None = None


@dataclass
class MeasurementSet:
    """What one file holds: its format, the usable measurements and why others were left out."""

    path: Path
    format: str  # csv | profile | nsys | calibration
    measurements: list[Measurement] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)


def _device(name: str, where: str) -> str:
    from tessera.hardware.catalog import UnknownDeviceError, canonical_id

    try:
        return canonical_id(name.strip().partition(":")[0])
    except UnknownDeviceError as e:
        raise MeasurementError(f"{where}: {e}") from None


def _host_threads(name: str, where: str) -> int | None:
    """CPU threads of ``cpu:N`` (one of N workers sharing this host); None for ``cpu`` (all cores) and GPUs."""
    base, sep, count = name.strip().partition(":")
    if not sep:
        return None
    if not count.isdigit() or int(count) < 1:
        raise MeasurementError(f"{where}: device {name!r}: write cpu or cpu:N with N a whole number >= 1 (workers)")
    from tessera.hardware.host import worker_threads

    return worker_threads(int(count))


def _seconds(text: str, where: str, column: str = "seconds", scale: float = 1.0) -> float:
    try:
        value = float(text) * scale
    except (TypeError, ValueError):
        raise MeasurementError(f"{where}: {column} {text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise MeasurementError(f"{where}: {column} must be a positive time (got {text!r})")
    return value


def parse_shape(text: str, where: str) -> tuple[tuple[str, int | str], ...]:
    """``batch=64 ctx=2048`` (separated by spaces or ';') -> sorted (key, value) pairs, checked."""
    out: dict[str, int | str] = {}
    for item in re.split(r"[;\s]+", text.strip()):
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or key not in SHAPE_KEYS or not value:
            raise MeasurementError(f"{where}: shape item {item!r} is not KEY=VALUE with KEY one of "
                                   f"{', '.join(SHAPE_KEYS)} (e.g. 'batch=64 ctx=2048')")
        if key in _INT_KEYS:
            if not value.isdigit() or int(value) < 1:
                raise MeasurementError(f"{where}: shape {key}={value!r} must be a whole number >= 1")
            out[key] = int(value)
        else:
            out[key] = value
    return tuple(sorted(out.items()))


def _parse_op(op: str, where: str) -> tuple[str, str | None]:
    phase, slash, part = op.strip().partition("/")
    if not phase:
        raise MeasurementError(f"{where}: op is empty; write a phase (decode, prefill...) or PHASE/CLASS")
    if slash and part not in COST_CLASSES:
        raise MeasurementError(f"{where}: op {op!r}: unknown cost class {part!r}; write PHASE/CLASS with CLASS "
                               f"one of {', '.join(COST_CLASSES)}, or the phase alone for the whole step")
    return phase, part if slash else None


def read_csv(path: Path, text: str) -> MeasurementSet:
    """The documented CSV: ``device,model,op,shape,seconds`` (other columns ignored, ``#`` lines comments)."""
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import check_phase

    lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip() and
             not line.lstrip().startswith("#")]
    header_line, header = lines[0][0], next(csv.reader([lines[0][1]]))
    header = [h.strip().lower() for h in header]
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise MeasurementError(f"{path}:{header_line}: the header lacks column(s) {', '.join(missing)}; the "
                               f"measurement CSV has columns {','.join(CSV_COLUMNS)}")
    out = MeasurementSet(path, "csv")
    checked: set[tuple[str, str]] = set()
    for number, line in lines[1:]:
        where = f"{path}:{number}"
        cells = next(csv.reader([line]))
        if len(cells) < len(header):
            raise MeasurementError(f"{where}: {len(cells)} fields, the header has {len(header)} "
                                   f"({','.join(header)}); quote a shape that holds commas")
        row = {h: c.strip() for h, c in zip(header, cells, strict=False)}
        device = _device(row["device"], where)
        threads = _host_threads(row["device"], where) if device == "cpu" else None
        phase, part = _parse_op(row["op"], where)
        if (row["model"], phase) not in checked:
            try:
                check_phase(resolve_model(row["model"]), phase)
            except TesseraError as e:
                raise MeasurementError(f"{where}: {e}") from None
            checked.add((row["model"], phase))
        shape = parse_shape(row["shape"], where)
        seconds = _seconds(row["seconds"], where)
        out.measurements.append(Measurement(device, part or STEP_CLASS, seconds, where, STEP,
                                            ("step", row["model"], phase, shape, part), row["op"], row["model"],
                                            phase, shape, part, threads=threads))
    return out


def read_profile(path: Path) -> MeasurementSet:
    """Every kernel of a `tessera profile` file, keyed by the step and the kernel's id."""
    from tessera.cost.profile import Profile, ProfileFormatError

    try:
        prof = Profile.load(path)
    except ProfileFormatError as e:
        raise MeasurementError(str(e)) from None
    device = _device(prof.device, f"{path}: device")
    shape = tuple(sorted((k, "x".join(map(str, v)) if isinstance(v, list) else v)
                         for k, v in prof.shape.items() if k in SHAPE_KEYS and v is not None))
    out = MeasurementSet(path, "profile")
    for i, k in enumerate(prof.kernels):
        where = f"{path}: kernels[{i}]"
        if k.median_s <= 0:
            out.excluded.append(f"{where} ({k.id}): median time 0")
            continue
        # the profile records the op class; the cost class (gemv, reduction...) is set once the kernel is retraced
        cls = k.op_class if k.op_class in COST_CLASSES else "elementwise"
        out.measurements.append(Measurement(device, cls, k.median_s, where, KERNEL,
                                            ("kernel", prof.model, prof.phase, shape, k.id), k.id, prof.model,
                                            prof.phase, shape, signature=k.signature, threads=prof.threads))
    return out


def _nsys_header(lines: list[str]) -> int:
    for i, line in enumerate(lines):
        if "Duration (" in line and "Name" in line:
            return i
    return -1


def read_nsys(path: Path, text: str, phase: str = "decode") -> MeasurementSet:
    """An Nsight Systems ``cuda_gpu_trace`` CSV export: per device and kernel name, the median duration of
    its launches (memory copies and sets are left out). ``phase`` sets how GEMMs are costed (decode: they
    stream their weights), since the trace records no shapes."""
    from tessera.hardware.devices import gpu_id

    lines = text.splitlines()
    h = _nsys_header(lines)
    reader = csv.reader(io.StringIO("\n".join(lines[h:])))
    header = [c.strip() for c in next(reader)]
    duration = next((c for c in header if c.startswith("Duration (")), None)
    unit = duration[len("Duration ("):-1] if duration else ""
    if duration is None or unit not in _NSYS_UNITS or "Name" not in header:
        raise MeasurementError(f"{path}:{h + 1}: an Nsight Systems cuda_gpu_trace export needs 'Duration (ns)' "
                               "(or us/ms/s) and 'Name' columns")
    if "Device" not in header:
        raise MeasurementError(f"{path}:{h + 1}: no 'Device' column: export with `nsys stats --report "
                               "cuda_gpu_trace --format csv`, which names each kernel's GPU")
    col = {c: header.index(c) for c in (duration, "Name", "Device")}
    times: dict[tuple[str, str], list[float]] = {}
    first: dict[tuple[str, str], str] = {}
    skipped = 0
    for number, cells in enumerate(reader, h + 2):
        if not cells or not any(c.strip() for c in cells):
            continue
        where = f"{path}:{number}"
        if len(cells) < len(header):
            raise MeasurementError(f"{where}: {len(cells)} fields, the header has {len(header)}")
        name = cells[col["Name"]].strip()
        if name.startswith("[CUDA"):  # memcpy / memset rows: no kernel
            skipped += 1
            continue
        device_name = re.sub(r"\s*\(\d+\)\s*$", "", cells[col["Device"]].strip())
        device = gpu_id(device_name)
        if device == device_name:
            raise MeasurementError(f"{where}: unknown device {device_name!r}; add it to the device catalog "
                                   "(`tessera devices`) or rename it to a catalog id")
        key = (device, name)
        times.setdefault(key, []).append(_seconds(cells[col[duration]], where, duration, _NSYS_UNITS[unit]))
        first.setdefault(key, where)
    out = MeasurementSet(path, "nsys")
    if skipped:
        out.excluded.append(f"{skipped} memory copy/set rows (not kernels)")
    for (device, name), ts in times.items():
        out.measurements.append(Measurement(device, classify_kernel_name(name), statistics.median(ts), first[(device, name)],
                                            TRACE, ("trace", name, phase), name, phase=phase, block="-",
                                            identity=kernel_identity(name, phase, "-"), launches=len(ts)))
    return out


def read_calibration(path: Path, text: str) -> MeasurementSet:
    """The calibration set's TSV (pairs: ``a100_us_median``, ``ratio_median``; points: ``a100_us``, ``l40s_us``):
    each kernel on the A100-PCIE (the reference) and on the L40S. Positions whose times differ by more than
    the calibration's mismatch ratio ran different kernels on each part and are left out, as in the fit."""
    rows = [(i, line.split("\t")) for i, line in enumerate(text.splitlines(), 1)
            if line and not line.startswith("#")]
    header = rows[0][1]
    pairs = "a100_us_median" in header
    need = (("phase", "category", "launches", "a100_us_median", "ratio_median", "name_a100", "name_l40s") if pairs
            else ("phase", "category", "a100_us", "l40s_us", "kernel"))
    missing = [c for c in need if c not in header]
    if missing:
        raise MeasurementError(f"{path}:{rows[0][0]}: the calibration table lacks column(s) {', '.join(missing)}")
    out = MeasurementSet(path, "calibration")
    for number, cells in rows[1:]:
        where = f"{path}:{number}"
        if len(cells) < len(header):
            raise MeasurementError(f"{where}: {len(cells)} fields, the header has {len(header)}")
        r = dict(zip(header, cells, strict=False))
        if pairs:
            ref_s = _seconds(r["a100_us_median"], where, "a100_us_median", 1e-6)
            tgt_s = ref_s * _seconds(r["ratio_median"], where, "ratio_median")
            names, launches = (r["name_a100"], r["name_l40s"]), int(r["launches"]) if r["launches"].isdigit() else 1
        else:
            ref_s = _seconds(r["a100_us"], where, "a100_us", 1e-6)
            tgt_s = _seconds(r["l40s_us"], where, "l40s_us", 1e-6)
            names, launches = (r["kernel"],), 1
        if not 1 / MISMATCH_RATIO <= tgt_s / ref_s <= MISMATCH_RATIO:
            out.excluded.append(f"{where}: L40S/A100 time ratio {tgt_s / ref_s:.3g} beyond {MISMATCH_RATIO:g}x "
                                "(different kernels on each part)")
            continue
        cls = classify_kernel_name(names[0])
        ident = kernel_identity(names, r["phase"], r["category"])
        key = ("paired", number, r["phase"], r["category"], names[0])
        common = dict(kind=PAIRED, key=key, op=names[0], phase=r["phase"], block=r["category"], identity=ident,
                      launches=launches)
        ref = Measurement(REFERENCE, cls, ref_s, where, **common)
        out.measurements.append(ref)
        out.measurements.append(Measurement(TARGET, cls, tgt_s, where, reference=ref, **common))
    return out


def read_measurements(path: str | Path, phase: str = "decode") -> MeasurementSet:
    """The measurements of one file, its format told from its content (``phase``: Nsight kernels' phase)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise MeasurementError(f"{p}: cannot read the measurement file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise MeasurementError(f"{p}: the measurement file is not text ({e.reason} at byte {e.start})") from None
    if text.lstrip().startswith("{"):
        return read_profile(p)
    content = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not content:
        raise MeasurementError(f"{p}: no measurements (the file is empty); give {_FORMATS}")
    if _nsys_header(text.splitlines()) >= 0:
        return read_nsys(p, text, phase)
    if "\t" in content[0] and ("a100_us" in content[0] or "a100_us_median" in content[0]):
        return read_calibration(p, text)
    if "seconds" in content[0].lower() and "," in content[0]:
        out = read_csv(p, text)
    else:
        number = text.splitlines().index(content[0]) + 1
        raise MeasurementError(f"{p}:{number}: not a measurement file this reads; give {_FORMATS}")
    if not out.measurements:
        raise MeasurementError(f"{p}: the header has no rows under it")
    return out
