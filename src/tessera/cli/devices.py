"""`tessera devices`: the device catalog, or one cluster spec with its nodes and links."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from tessera.console import fail
from tessera.console import out as _out
from tessera.errors import TesseraError


def _tflops(spec, path: str) -> str:
    v = spec.peak_flops(path)
    if not v:
        return "-"
    return f"{v / 1e12:.0f}" if v >= 100e12 else f"{v / 1e12:.3g}"


def devices(
    cluster: str = typer.Option(None, "--cluster", help="Describe a cluster instead: shorthand such as "
                                "'A100:2,L40S:1' or 'cpu:2', or a cluster YAML file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
) -> None:
    """List the device catalog (datasheet figures with their source), or describe a cluster spec."""
    from tessera.hardware.catalog import load_devices
    from tessera.hardware.cluster import parse_cluster

    try:
        if cluster:
            c = parse_cluster(cluster)
            if as_json:
                print(json.dumps(c.to_dict() | {"devices": [d.id for d in c.devices]}, indent=2))
                return
            table = Table(title=c.describe())
            for col in ("device", "type", "node", "link in node", "GB/s", "latency"):
                table.add_column(col)
            for d in c.devices:
                link = c.intra[d.node]
                table.add_row(d.id, d.spec.name, d.node, link.kind, f"{link.bandwidth / 1e9:g}",
                              f"{link.latency_s * 1e6:g} us")
            _out.print(table)
            _out.print(f"between nodes: {c.inter.kind}, {c.inter.bandwidth / 1e9:g} GB/s, "
                       f"{c.inter.latency_s * 1e6:g} us per message")
            return
        specs = load_devices()
    except TesseraError as e:
        fail(e)
    if as_json:
        print(json.dumps([{"id": s.id, "name": s.name, "aliases": list(s.aliases), "memory_bytes": s.memory_bytes,
                           "memory_bandwidth": s.memory_bandwidth, "flops": s.flops, "sm_count": s.sm_count,
                           "boost_clock_hz": s.boost_clock_hz, "l2_bytes": s.l2_bytes, "prices": s.prices,
                           "source": s.source, "as_of": s.as_of, "accumulate": s.accumulate,
                           "sources": {f: c.to_dict() for f, c in s.sources.items()}} for s in specs.values()],
                         indent=2))
        return
    table = Table(title="Tessera device catalog (dense peak figures from datasheets)")
    for col in ("id", "GB", "TB/s", "bf16", "fp8", "fp4", "fp32", "SMs", "GHz", "L2", "$"):
        table.add_column(col, justify="left" if col == "id" else "right", no_wrap=col == "id")
    for s in specs.values():
        table.add_row(s.id, f"{s.memory_bytes / 1e9:g}", f"{s.memory_bandwidth / 1e12:.3g}",
                      _tflops(s, "bf16"), _tflops(s, "fp8"), _tflops(s, "fp4"), _tflops(s, "fp32"), str(s.sm_count),
                      f"{s.boost_clock_hz / 1e9:.2f}", f"{s.l2_bytes / 2**20:g}", f"{s.price():.2g}")
    _out.print(table)
    _out.print("TFLOP/s dense per path (bf16/fp8/fp4 tensor, fp32 vector); L2 in MiB; $ = relative price per device-hour. "
               "cpu = this host, measured on first use (cpu:N = one of N workers sharing its cores). Sources and "
               "as_of dates: src/tessera/hardware/devices.yaml (or --json); one citation per figure: "
               "benchmarks/catalog_audit.py.")


def register(app: typer.Typer) -> None:
    """Add the hardware commands to the main CLI."""
    app.command()(devices)
