"""Per-parameter read/write sets of PTX kernels: which kernel arguments reach a global access.

Each function is analysed in four steps, each in its own module, whose docstrings state the rules:

1. `classify` turns the body into dataflow transfers (`transfers`) over the provenance values of
   `origins`, resolving names and operands through `operands` and opcode tables of `instructions`;
2. `dataflow` iterates them to a fixpoint (shared and local memory, calls), bounding offsets into
   local arrays with the integer value ranges of `ranges`;
3. `summarize` reads the memory accesses back into a `summary.Summary`: effects and access sites;
4. for an `.entry`, `attribution` turns the effects into one `results.KernelAccess`.

Calls to `.func` bodies are analysed once per callee (a summary in terms of the callee's
parameters, with a recursion guard) and mapped into the caller through the `st.param` stores of the
call sequence. Unknown callees (extern, indirect `call %rd`, recursive, or a body that failed to
parse) make every pointer argument (and pointers stored in a local buffer passed to them)
read-write.
"""

from __future__ import annotations

import gc

from tessera.capture.ptx.attribution import conservative_access, kernel_access
from tessera.capture.ptx.classify import FunctionTransfers
from tessera.capture.ptx.dataflow import FunctionDataflow
from tessera.capture.ptx.operands import Resolved
from tessera.capture.ptx.parse import Function, Module, PtxSyntaxError, parse_ptx
from tessera.capture.ptx.results import AccessSite, KernelAccess
from tessera.capture.ptx.summarize import summarize
from tessera.capture.ptx.summary import KNOWN_EXTERNS, Summary, unknown_summary

__all__ = ["access_sites", "analyze_module", "analyze_ptx"]


class _Summaries:
    """The summaries of a module's functions, computed on first use, with the recursion guard."""

    __slots__ = ("module", "by_name", "summaries", "in_progress")

    def __init__(self, module: Module) -> None:
        self.module = module
        self.by_name = {f.name: f for f in module.functions}
        self.summaries: dict[int, Summary] = {}
        self.in_progress: set[str] = set()

    def summary_for(self, callee: str, resolved: Resolved) -> Summary:
        """The summary of the callee of a call, by its name as resolved in the caller."""
        if resolved.kind == "reg":
            return unknown_summary("?", f"indirect call through {callee}")
        fn = self.by_name.get(callee)
        if fn is None:
            return self._bodiless(callee)
        if callee in self.in_progress:
            return unknown_summary(callee, f"recursive .func {callee}")
        return self.analyze(fn)

    def _bodiless(self, name: str) -> Summary:
        """The summary of a function without a body in this module."""
        extern = KNOWN_EXTERNS.get(name)
        if extern is not None:
            s = unknown_summary(name, f"extern .func {name}")
            s.extern_mode = extern.mode
            s.extern_ret = extern.returns
            return s
        if self.module.symbols.get(name) == "bad-func":
            return unknown_summary(name, f".func {name} (its body failed to parse)")
        return unknown_summary(name, f"extern .func {name} (no body)")

    def analyze(self, fn: Function, with_sites: bool = False) -> Summary:
        """The summary of `fn` (with its access sites if `with_sites`), computed once."""
        s = self.summaries.get(id(fn))
        if s is not None and (s.has_sites or not with_sites):
            return s
        self.in_progress.add(fn.name)
        try:
            graph = FunctionTransfers(fn, self.module, self.summary_for)
            graph.build()
            flow = FunctionDataflow(graph)
            flow.solve()
            s = summarize(flow, with_sites)
            s.loaded_params = flow.loaded_params
        finally:
            self.in_progress.discard(fn.name)
        self.summaries[id(fn)] = s
        return s


def analyze_module(module: Module, *, alias_loaded: bool = False) -> list[KernelAccess]:
    """Analyse every `.entry` of a parsed module: one `KernelAccess` per kernel, in module order.
    Should the analysis of a kernel fail (a bug), that kernel gets the conservative answer (every
    parameter that may hold a pointer read-write, indirect) and the failure is added to
    `module.errors`.

    Accesses through addresses loaded from memory belong to no parameter: they set `indirect` on the
    parameter the pointer was loaded from (and on the kernel) and are summarised in
    `KernelAccess.indirect_access`. With `alias_loaded=True` they are also given to every parameter
    that may hold a pointer (the loaded pointer may alias any argument)."""
    summaries = _Summaries(module)
    out = []
    enabled = gc.isenabled()
    gc.disable()            # many small sets and tuples, no cycles worth collecting
    try:
        for fn in module.functions:
            if fn.is_entry:
                try:
                    out.append(kernel_access(module, fn, summaries.analyze(fn), alias_loaded))
                except Exception as e:  # noqa: BLE001 - a bug must not make other kernels, or this one, unsafe
                    summaries.in_progress.clear()
                    message = (f"internal error analysing .entry {fn.name} ({type(e).__name__}: {e}); "
                               f"every parameter that may hold a pointer is reported read-write")
                    module.errors.append(PtxSyntaxError(module.file, fn.start_line, message))
                    out.append(conservative_access(module, fn, message))
    finally:
        if enabled:
            gc.enable()
    return out


def access_sites(module: Module, function: str) -> list[AccessSite]:
    """The global/generic memory access sites of one function, in body order. `params` of a site are
    indices of that function's own parameters (entry parameters for a kernel) the address may
    derive from; accesses proven to hit only shared, local or parameter memory are left out."""
    summaries = _Summaries(module)
    fn = module.function(function)
    if fn is None:
        raise KeyError(f"no function {function!r} in {module.file}")
    return list(summaries.analyze(fn, with_sites=True).sites)


def analyze_ptx(text: str, file: str = "<ptx>", *, alias_loaded: bool = False
                ) -> tuple[list[KernelAccess], list[PtxSyntaxError]]:
    """Parse and analyse PTX text: the kernels that could be analysed, and the errors found (syntax
    errors, and internal errors for which a kernel got the conservative all-read-write answer)."""
    enabled = gc.isenabled()
    gc.disable()  # parse and analysis create no cycles; freeing the module before collecting saves a scan
    try:
        module = parse_ptx(text, file)
        kernels = analyze_module(module, alias_loaded=alias_loaded)
        errors = list(module.errors)
        del module
    finally:
        if enabled:
            gc.enable()
    return kernels, errors
