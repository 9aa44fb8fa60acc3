"""Hardware: the device catalog (datasheet GPUs, the measured host CPU) and clusters of devices."""

from tessera.hardware.catalog import (
    DeviceCatalogError,
    DeviceSpec,
    UnknownDeviceError,
    device_ids,
    load_devices,
)
from tessera.hardware.cluster import (
    Cluster,
    ClusterSpecError,
    DeviceInstance,
    Link,
    load_cluster_yaml,
    parse_cluster,
)
from tessera.hardware.devices import resolve_device
from tessera.hardware.host import host_spec

__all__ = [
    "Cluster",
    "ClusterSpecError",
    "DeviceCatalogError",
    "DeviceInstance",
    "DeviceSpec",
    "Link",
    "UnknownDeviceError",
    "device_ids",
    "host_spec",
    "load_cluster_yaml",
    "load_devices",
    "parse_cluster",
    "resolve_device",
]
