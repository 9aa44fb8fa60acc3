"""Compile a Triton kernel to PTX for a given signature, without a GPU, with an on-disk cache.

Triton's interpreter mode (``TRITON_INTERPRET=1``, used to run kernels on the CPU) replaces the
language's own functions and cannot compile at the same time, so in that mode the compiler runs in
a subprocess that imports the kernel's module from its file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tessera.errors import TesseraError
from tessera.paths import atomic_write, default_cache_dir


class TritonCompileError(TesseraError):
    """A Triton kernel could not be compiled to PTX."""


def cache_dir() -> Path:
    return default_cache_dir() / "triton-ptx"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _source_of(kernel: Any) -> tuple[str, str, str]:
    fn = getattr(kernel, "fn", kernel)
    return inspect.getsourcefile(fn), fn.__name__, inspect.getsource(fn)


def compile_ptx(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any],
                target: tuple[int, int] = (90, 32)) -> str:
    """PTX of ``kernel`` (a @triton.jit function) for ``signature``/``constexprs`` on ``sm_<target>``."""
    path, name, source = _source_of(kernel)
    import triton

    key = hashlib.sha256(json.dumps([source, signature, repr(sorted(constexprs.items())), target,
                                     triton.__version__]).encode()).hexdigest()[:24]
    cached = cache_dir() / f"{name}-{key}.ptx"
    if cached.is_file():
        return cached.read_text()
    if _interpreting():
        request = json.dumps({"file": path, "name": name, "signature": signature,
                              "constexprs": constexprs, "target": list(target)})
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run([sys.executable, "-m", "tessera.capture.triton_ptx"], input=request, text=True,
                              capture_output=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise TritonCompileError(f"cannot compile Triton kernel {name} ({path}) to PTX: "
                                     f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no output'}")
        ptx = proc.stdout
    else:
        ptx = _compile_here(kernel, signature, constexprs, target)
    atomic_write(cached, ptx)
    return ptx


def _compile_here(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any],
                  target: tuple[int, int]) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(getattr(kernel, "fn", kernel))
    try:
        compiled = triton.compile(ASTSource(fn=jit, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", target[0], target[1]))
    except Exception as e:  # noqa: BLE001 - any compiler failure is reported to the user
        raise TritonCompileError(f"cannot compile Triton kernel {jit.__name__} to PTX: {e}") from e
    return compiled.asm["ptx"]


def _main() -> None:
    request = json.loads(sys.stdin.read())
    spec = importlib.util.spec_from_file_location("_tessera_triton_kernel_module", request["file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = getattr(module, request["name"])
    sys.stdout.write(_compile_here(kernel, request["signature"], request["constexprs"],
                                   tuple(request["target"])))


if __name__ == "__main__":
    _main()
