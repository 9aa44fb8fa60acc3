"""Measuring this host's CPU as a device: matmul FLOP/s, copy bandwidth, dispatch latency (cached)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import Any

from tessera.hardware.catalog import HOST_ID, DeviceSpec, host_row
from tessera.paths import atomic_write, default_cache_dir

_HOST_CACHE_VERSION = 2  # 2: matmuls in the x @ W.T layout
_FALLBACK_LLC = 32 * 2**20
_FALLBACK_CLOCK_HZ = 2.5e9
_SYS_CPU = Path("/sys/devices/system/cpu")


def host_cores() -> int:
    """Physical cores this process may run on (logical CPUs where the topology is not readable)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        topo = _SYS_CPU / f"cpu{c}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def worker_threads(workers: int) -> int:
    """Threads of one of ``workers`` local workers sharing this host's physical cores (at least 1)."""
    return max(1, host_cores() // workers)


def cpu_model() -> str:
    """This host's CPU model string (from /proc/cpuinfo), or the machine type when unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or f"{platform.machine()} CPU"


def _size_bytes(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def _last_level_cache() -> tuple[int, str]:
    best = (0, 0)
    for index in sorted((_SYS_CPU / "cpu0" / "cache").glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            best = max(best, (int((index / "level").read_text()), _size_bytes((index / "size").read_text())))
        except (OSError, ValueError):
            continue
    if best[1] > 0:
        return best[1], f"L{best[0]} from /sys"
    return _FALLBACK_LLC, "cache size unknown, 32 MiB assumed"


def _max_clock() -> tuple[float, str]:
    try:
        return float((_SYS_CPU / "cpu0/cpufreq/cpuinfo_max_freq").read_text()) * 1e3, "clock from cpufreq"
    except (OSError, ValueError):
        pass
    try:
        mhz = [float(line.split(":", 1)[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
        if mhz and max(mhz) > 0:
            return max(mhz) * 1e6, "clock from /proc/cpuinfo"
    except (OSError, ValueError):
        pass
    return _FALLBACK_CLOCK_HZ, "clock unknown, 2.5 GHz assumed"


def _best_time(fn: Callable[[], object], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul_flops(torch: Any, dtype: Any) -> float:
    """Best FLOP/s of square matmuls in nn.Linear's layout (x @ W.T; CPU BF16 kernels are several times
    slower on other layouts), growing n until one run takes >= 20 ms (n <= 2048)."""
    n = 256
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype).t()
        t = _best_time(lambda a=a, b=b: torch.mm(a, b), 1)
        if t >= 0.02 or n >= 2048:
            return 2 * n**3 / min(t, _best_time(lambda a=a, b=b: torch.mm(a, b), 3))
        n *= 2


def _copy_bandwidth(torch: Any, nbytes: int) -> float:
    """Bytes read plus bytes written per second by a copy of `nbytes` bytes."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), 5)


def _dispatch_latency(torch: Any) -> float:
    """Median seconds per eager torch.add on 1-element tensors."""
    a, b = torch.ones(1), torch.ones(1)
    for _ in range(200):
        torch.add(a, b)
    samples = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        for _ in range(10):
            torch.add(a, b)
        samples.append((time.perf_counter_ns() - t0) / 10)
    return statistics.median(samples) * 1e-9


def _measure_host(threads: int) -> dict[str, Any]:
    import torch

    llc, llc_note = _last_level_cache()
    clock, clock_note = _max_clock()
    copy_bytes = min(512 * 2**20, max(64 * 2**20, 4 * llc))  # well beyond the last-level cache
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = {"fp32": _matmul_flops(torch, torch.float32), "bf16": _matmul_flops(torch, torch.bfloat16)}
        bandwidth = _copy_bandwidth(torch, copy_bytes)
        latency = _dispatch_latency(torch)
    finally:
        torch.set_num_threads(before)
    return {"name": cpu_model(), "arch": platform.machine() or "unknown",
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "memory_bandwidth": bandwidth, "flops": flops, "boost_clock_hz": clock, "l2_bytes": llc,
            "launch_latency_s": latency, "measured_on": date.today().isoformat(),
            "notes": f"square matmuls (fp32, bf16) and a {copy_bytes // 2**20} MiB copy at {threads} threads, "
                     f"median torch.add dispatch; {llc_note}; {clock_note}"}


def _torch_version() -> str:
    """torch's version as installed (what ``torch.__version__`` says), read without importing torch where
    the package's metadata has it: a plan from cached measurements then never loads torch."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch

        return str(torch.__version__)


def _host_key(threads: int) -> dict[str, Any]:
    return {"version": _HOST_CACHE_VERSION, "cpu": cpu_model(), "machine": platform.machine(),
            "cores": host_cores(), "threads": threads, "torch": _torch_version()}


def _host_cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / "host" / f"{key['cores']}c-{key['threads']}t-{digest}.json"


def _read_cached(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The cached measurement at `path` if it is for `key` and complete; None otherwise (measure again)."""
    positive = ("memory_bytes", "memory_bandwidth", "boost_clock_hz", "l2_bytes", "launch_latency_s")
    try:
        data = json.loads(path.read_text())
        ok = (data.get("key") == key and all(data[f] > 0 for f in positive)
              and all(isinstance(data[f], str) for f in ("name", "arch", "measured_on", "notes"))
              and set(data["flops"]) == {"fp32", "bf16"} and all(v > 0 for v in data["flops"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return data if ok else None


def host_spec(threads: int | None = None) -> DeviceSpec:
    """This host's CPU as a device, figures measured with `threads` threads (default: all physical cores).

    The first call for a (CPU model, cores, threads, torch version) measures fp32 and bf16 matmul FLOP/s,
    copy bandwidth and op dispatch latency (about a second) and caches them as JSON under
    ``default_cache_dir()/host/``; later calls read the cache. `pcie_bandwidth` is half the copy bandwidth
    (moving n bytes between local workers is a copy: n read plus n written); there is no NVLink.

    Raises:
        ValueError: `threads` is not a whole number >= 1.
    """
    cores = host_cores()
    threads = cores if threads is None else threads
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a whole number >= 1, got {threads!r}")
    key = _host_key(threads)
    path = _host_cache_file(key)
    data = _read_cached(path, key)
    if data is None:
        data = {"key": key, **_measure_host(threads)}
        atomic_write(path, json.dumps(data, indent=2, sort_keys=True))
    row = host_row()
    return DeviceSpec(id=HOST_ID, name=data["name"], vendor=row.vendor, arch=data["arch"],
                      memory_bytes=int(data["memory_bytes"]), memory_bandwidth=float(data["memory_bandwidth"]),
                      flops={k: float(v) for k, v in data["flops"].items()}, sm_count=cores,
                      boost_clock_hz=float(data["boost_clock_hz"]), l2_bytes=int(data["l2_bytes"]),
                      launch_latency_s=float(data["launch_latency_s"]), nvlink_bandwidth=None,
                      pcie_bandwidth=float(data["memory_bandwidth"]) / 2, prices=dict(row.prices),
                      aliases=row.aliases, source=f"{row.source}; measured {data['measured_on']}: {data['notes']}",
                      as_of=data["measured_on"], measured=True, threads=threads, sources=dict(row.sources))
