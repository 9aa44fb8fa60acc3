"""Tessera's own fused kernels, registered as `torch.library` custom ops in the ``tessera::`` namespace.

Each submodule holds the fused units of one kind (attention, projections, norms, rotary embedding,
activations, cache writes, MoE, Mamba2, the vision tower, sampling). Being custom ops, a trace records
each as a single kernel, on `meta` as on a real device, and a replay calls the same op; each op's PyTorch
body is what runs on the CPU. Every op declares its cost-model facts (class, FLOPs, GEMM shape) with
`tessera.graph.opclass.register_fused` next to its definition.

Importing this package imports (and so registers) every submodule.
"""

from __future__ import annotations

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
