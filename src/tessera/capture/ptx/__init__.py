"""PTX analysis: which kernel parameters reach a global load, store or atomic (the ground truth for
opaque kernels: custom CUDA extensions, Triton, NVRTC), and instrumentation that records the address
ranges a launch really touches.

- `parse_ptx(text, file)` -> `Module` (never raises on malformed input; errors carry file:line);
- `analyze_ptx(text, file)` / `analyze_module(module)` -> one `KernelAccess` per `.entry`, every
  parameter classified (pointer / scalar / descriptor / struct) with its access (none / read / write /
  read-write), `indirect` and a reason;
- `access_sites(module, function)` -> the global/generic access sites of one function (used by
  `instrument`);
- `extract` (PTX from binaries through cuobjdump, Triton kernels), `instrument` (range recording)
  and `cli` (`tessera ptx analyze|instrument`) are separate modules, imported on use.

The result records live in `results`; `analyze` is the analysis' entry point, and its docstring names
the modules of each step (and where each step's rules are written down).
"""

from tessera.capture.ptx.analyze import access_sites, analyze_module, analyze_ptx
from tessera.capture.ptx.parse import (
    Function,
    Instruction,
    Module,
    Param,
    PtxError,
    PtxSyntaxError,
    parse_ptx,
)
from tessera.capture.ptx.results import ACCESSES, KINDS, AccessSite, FieldAccess, KernelAccess, ParamAccess

__all__ = [
    "ACCESSES", "KINDS", "AccessSite", "FieldAccess", "Function", "Instruction", "KernelAccess", "Module",
    "Param", "ParamAccess", "PtxError", "PtxSyntaxError", "access_sites", "analyze_module", "analyze_ptx",
    "parse_ptx",
]
