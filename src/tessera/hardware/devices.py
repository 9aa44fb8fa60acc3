"""Device names to specs: a catalog GPU by id or alias, or this host (`cpu`, measured; `cpu:N` split into
N workers). The one place that joins the datasheet catalog and the host measurement."""

from __future__ import annotations

import re

from tessera.hardware.catalog import HOST_ID, DeviceSpec, UnknownDeviceError, canonical_id, datasheet_spec
from tessera.hardware.host import host_spec, worker_threads
from tessera.limits import CPU_WORKERS


def resolve_device(name: str) -> DeviceSpec:
    """The spec of device `name`: a catalog id or alias, "cpu" (this host, measured), or "cpu:N".

    "cpu:N" is this host split into N workers: each uses cores // N threads (at least 1).

    Raises:
        UnknownDeviceError: an unknown name or a malformed "cpu:N".
    """
    base, sep, count = str(name).strip().partition(":")
    rid = canonical_id(base)
    if rid != HOST_ID:
        if sep:
            raise UnknownDeviceError(f"device {name!r}: only 'cpu' takes ':N' (workers); a GPU count belongs "
                                     f"in a cluster spec such as 'A100:2,L40S:1'")
        return datasheet_spec(rid)
    if not sep:
        return host_spec()
    workers = CPU_WORKERS.parse(count, f"device {name!r}")
    if workers is None or workers < 1:
        raise UnknownDeviceError(f"device {name!r}: expected 'cpu:N' with N a whole number >= 1 (workers)")
    return host_spec(worker_threads(workers))


def gpu_id(name: str) -> str:
    """The canonical catalog id of a CUDA device name ("NVIDIA H200" -> "H200", "NVIDIA A100 80GB PCIe" ->
    "A100-PCIE"): the longest leading run of its words that names a device; the name itself if none does."""
    words = re.split(r"[\s\-_]+", re.sub(r"^(NVIDIA|AMD)\s+|GeForce\s+", "", name.strip()))
    for n in range(len(words), 0, -1):  # "H100 80GB HBM3" -> "H100 80GB" -> "H100"
        try:
            return canonical_id(" ".join(words[:n]))
        except UnknownDeviceError:
            continue
    return name
