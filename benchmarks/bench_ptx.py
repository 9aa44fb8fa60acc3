"""PTX parser and analyser throughput: MB/s over the corpus and over a large generated module.

Usage: python benchmarks/bench_ptx.py [--repeat N] [--min-mb MB]
Goal: at least 5 MB/s for parse + analysis on the 2-core development VM.

The corpus is every `tests/fixtures/ptx/**/*.ptx` (whatever exists). The large module concatenates
the corpus modules, renaming every function and module-scope symbol per copy, until it holds at least
`--min-mb` megabytes in one `.version`/`.target` module (so one parse and one analysis see all of it).
"""

from __future__ import annotations

import argparse
import platform
import re
import time
from pathlib import Path

from tessera.capture.ptx.analyze import analyze_ptx
from tessera.capture.ptx.parse import parse_ptx

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "ptx"
_HEADER_RE = re.compile(r"^\s*\.(?:version|target|address_size)\b.*$", re.M)
_FUNC_RE = re.compile(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)")
_SYM_RE = re.compile(r"^\s*(?:\.(?:visible|extern|weak)\s+)*\.(?:global|const|shared)\b[^;=]*?"
                     r"([A-Za-z_$][\w$]*)\s*(?:\[[^\]]*\])*\s*(?:=[^;]*)?;", re.M)


def corpus_files() -> list[Path]:
    """Every committed PTX sample, except the deliberately broken one."""
    return sorted(p for p in CORPUS.rglob("*.ptx") if "malformed" not in p.name)


def large_module(files: list[Path], min_bytes: int) -> str:
    """One module of at least `min_bytes`: copies of the corpus bodies with every symbol renamed."""
    bodies = []
    for i, f in enumerate(files):
        text = _HEADER_RE.sub("", f.read_text())
        names = set(_FUNC_RE.findall(text)) | set(_SYM_RE.findall(text))
        if names:
            pattern = re.compile(r"(?<![\w$])(" + "|".join(re.escape(n) for n in sorted(names, key=len,
                                                                                     reverse=True))
                                 + r")(?![\w$])")
            bodies.append((text, pattern, i))
    out = [".version 8.7\n.target sm_90a\n.address_size 64\n"]
    size = len(out[0])
    copy = 0
    while size < min_bytes:
        for text, pattern, i in bodies:
            body = pattern.sub(lambda m, c=copy, i=i: f"{m.group(1)}_f{i}c{c}", text)
            out.append(body)
            size += len(body)
        copy += 1
    return "".join(out)


def measure(texts: list[str], repeat: int) -> tuple[float, float, int, int]:
    """Best-of-`repeat` seconds for parsing, and for parsing + analysis, of all texts."""
    best_parse = best_all = float("inf")
    kernels = errors = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        modules = [parse_ptx(t) for t in texts]
        t1 = time.perf_counter()
        del modules
        t2 = time.perf_counter()
        results = [analyze_ptx(t) for t in texts]  # what `tessera ptx analyze` and the tracer call
        t3 = time.perf_counter()
        best_parse = min(best_parse, t1 - t0)
        best_all = min(best_all, t3 - t2)
        kernels = sum(len(r[0]) for r in results)
        errors = sum(len(r[1]) for r in results)
    return best_parse, best_all, kernels, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    parser.add_argument("--min-mb", type=float, default=5.0, help="size of the generated module (default 5 MB)")
    args = parser.parse_args()

    files = corpus_files()
    if not files:
        raise SystemExit(f"no PTX under {CORPUS}")
    texts = [f.read_text() for f in files]
    big = large_module(files, int(args.min_mb * 1e6))
    print(f"python {platform.python_version()} on {platform.machine()}, {len(files)} corpus files")
    print(f"{'input':34} {'MB':>7} {'kernels':>8} {'parse s':>8} {'parse MB/s':>11} {'+analysis s':>12} "
          f"{'total MB/s':>11}")
    for label, inputs in ((f"corpus ({len(files)} files)", texts), ("generated module (1 file)", [big])):
        mb = sum(len(t) for t in inputs) / 1e6
        tp, ta, kernels, errors = measure(inputs, args.repeat)
        print(f"{label:34} {mb:7.2f} {kernels:8d} {tp:8.3f} {mb / tp:11.1f} {ta:12.3f} {mb / ta:11.1f}"
              + (f"   ({errors} syntax errors)" if errors else ""))


if __name__ == "__main__":
    main()
