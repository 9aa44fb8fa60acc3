"""Getting PTX out of whatever a kernel ships as: PTX text, cubins, fatbinaries, objects, libraries.

- A `.ptx` file (or any text file that is PTX) is read as it is.
- A cubin, fatbinary (`.fatbin`), object (`.o`), shared library (`.so`), static archive (`.a`) or
  executable goes through `cuobjdump` (the pinned PyPI package `nvidia-cuda-cuobjdump`):
  `cuobjdump -all -ptx` prints every embedded PTX with its header (arch, code version), `-lptx` names
  them, and `-symbols` lists the kernels (`STO_ENTRY`) of every embedded ELF. A kernel that is in an
  ELF but in none of the PTX is *SASS-only*: there is nothing to analyse, and the result says so in
  `sass_only` (a cubin built with `nvcc -cubin -arch=sm_90` has only those).
- A Triton kernel: `triton_ptx(compiled)` takes the PTX from the `CompiledKernel`'s `asm["ptx"]`.

A file that cannot be read, or is none of these formats, raises `ExtractError` naming the file and
what to do about it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tessera.errors import TesseraError

_ELF_MAGIC = b"\x7fELF"
_ARCHIVE_MAGIC = b"!<arch>\n"
_FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xBA55ED50, little-endian: a fatbinary file (nvcc -fatbin)
_CUOBJDUMP_TIMEOUT_S = 120

_TARGET_RE = re.compile(r"^\s*\.target\s+(\w+)", re.MULTILINE)
_ENTRY_RE = re.compile(r"\.entry\s+([\w$]+)")
_PTX_HINT_RE = re.compile(r"^\s*\.(version|entry|target)\b", re.MULTILINE)
_SECTION_RE = re.compile(r"^Fatbin (\w+) code:\s*$")
_LPTX_RE = re.compile(r"^PTX file\s+\d+:\s*(\S+)\s*$")


class ExtractError(TesseraError):
    """A file that PTX cannot be taken from: missing, unreadable, of an unsupported format, or no tool."""


@dataclass
class PtxSource:
    """One PTX module: the file it came from, its member inside that file ("" for a plain .ptx), arch."""

    file: str
    member: str
    arch: str | None
    text: str

    @property
    def name(self) -> str:
        """`file` for a plain PTX file, `file:member` for PTX taken out of a binary (for messages)."""
        return f"{self.file}:{self.member}" if self.member else self.file


@dataclass
class ExtractResult:
    """Everything taken from one file: its PTX modules, the kernels that are only SASS, and problems."""

    file: str
    ptx: list[PtxSource] = field(default_factory=list)
    sass_only: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def find_tool(name: str) -> Path | None:
    """Path of a CUDA tool (`cuobjdump`, `ptxas`): the pinned wheels' `nvidia/cu*/bin` first, then PATH."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        # cu13 before cu12: the newest toolkit that is installed wins
        for bin_dir in sorted(Path(root).glob("cu*/bin"), reverse=True):
            candidate = bin_dir / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def ptx_target(text: str) -> str | None:
    """The `.target` of a PTX module (e.g. "sm_90a"), or None if it has none."""
    match = _TARGET_RE.search(text)
    return match.group(1) if match else None


def ptx_entries(text: str) -> list[str]:
    """Names of the `.entry` kernels a PTX module defines, in order."""
    return _ENTRY_RE.findall(_strip_comments(text))


def extract_ptx(path: str | Path) -> ExtractResult:
    """All PTX in a file, plus the kernels it has only as SASS.

    `.ptx` text is read directly; binaries go through `cuobjdump`. A binary with no PTX gives a result
    whose `ptx` is empty and whose `sass_only` lists its kernels. Raises `ExtractError` for a missing
    or unreadable file, an unsupported format, or a binary when `cuobjdump` is not installed.
    """
    p = Path(path)
    data = _read(p)
    kind = _classify(p, data)
    if kind == "ptx":
        text = data.decode("utf-8", errors="replace")
        return ExtractResult(file=str(p), ptx=[PtxSource(str(p), "", ptx_target(text), text)])
    return _extract_binary(p)


def triton_ptx(compiled) -> PtxSource:
    """The PTX of a Triton `CompiledKernel` (from `compiled.asm["ptx"]`), named after the kernel."""
    asm = getattr(compiled, "asm", None)
    if asm is None or "ptx" not in asm:
        raise ExtractError(
            f"{compiled!r} has no PTX (asm['ptx']): pass a Triton CompiledKernel compiled for a CUDA target"
        )
    text = asm["ptx"]
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    metadata = getattr(compiled, "metadata", None)
    name = getattr(metadata, "name", None) or (ptx_entries(text) or ["kernel"])[0]
    return PtxSource(file=f"<triton:{name}>", member=f"{name}.ptx", arch=ptx_target(text), text=text)


# ---------------------------------------------------------------------------------------- helpers


def _read(p: Path) -> bytes:
    if not p.exists():
        raise ExtractError(f"{p}: no such file; check the path")
    if p.is_dir():
        raise ExtractError(f"{p}: is a directory; pass a .ptx, .cubin, .fatbin, .o, .so, .a or executable")
    try:
        return p.read_bytes()
    except OSError as exc:
        raise ExtractError(f"{p}: cannot be read ({exc.strerror or exc}); check its permissions") from exc


def _classify(p: Path, data: bytes) -> str:
    """"ptx" for PTX text, "binary" for what cuobjdump reads; ExtractError for anything else."""
    if data.startswith((_ELF_MAGIC, _ARCHIVE_MAGIC, _FATBIN_MAGIC)):
        return "binary"
    if p.suffix == ".ptx":
        return "ptx"
    head = data[:65536]
    if b"\0" not in head and _PTX_HINT_RE.search(head.decode("utf-8", errors="replace")):
        return "ptx"
    raise ExtractError(
        f"{p}: unsupported format: expected PTX text or a CUDA binary (cubin, fatbinary, object file, "
        "shared library, static archive or executable); compile the kernel with nvcc (-ptx or -cubin) "
        "and pass that"
    )


def _cuobjdump(tool: Path, p: Path, *flags: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [str(tool), *flags, str(p)], capture_output=True, text=True, errors="replace",
            timeout=_CUOBJDUMP_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExtractError(f"{p}: running {tool} failed ({exc}); check the cuobjdump installation") from exc


def _extract_binary(p: Path) -> ExtractResult:
    tool = find_tool("cuobjdump")
    if tool is None:
        raise ExtractError(
            f"{p}: reading PTX from a binary needs cuobjdump: pip install nvidia-cuda-cuobjdump "
            "(or put the CUDA toolkit's cuobjdump on PATH)"
        )
    result = ExtractResult(file=str(p))
    dumped = _cuobjdump(tool, p, "-all", "-ptx")
    if dumped.returncode != 0:
        message = _tool_message(dumped)
        if "does not contain device code" in message:
            result.errors.append(f"{p}: contains no device code (no PTX and no SASS)")
            return result
        raise ExtractError(f"{p}: cuobjdump cannot read it ({message}); is it a CUDA binary?")
    names = _parse_lptx(_cuobjdump(tool, p, "-all", "-lptx").stdout, str(p))
    sections = _parse_ptx_dump(dumped.stdout, str(p))
    for i, (member, arch, text) in enumerate(sections):
        name = names[i] if len(names) == len(sections) else f"{member}{p.stem}.{i + 1}.{arch or 'ptx'}.ptx"
        result.ptx.append(PtxSource(str(p), name, arch, text))
    with_ptx = {name for src in result.ptx for name in ptx_entries(src.text)}
    symbols = _cuobjdump(tool, p, "-all", "-symbols")
    if symbols.returncode != 0:
        result.errors.append(f"{p}: cannot list its SASS kernels ({_tool_message(symbols)})")
    for kernel in _parse_entry_symbols(symbols.stdout):
        if kernel not in with_ptx and kernel not in result.sass_only:
            result.sass_only.append(kernel)
    return result


def _tool_message(proc: subprocess.CompletedProcess) -> str:
    lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    return "; ".join(lines[-3:]) if lines else f"exit status {proc.returncode}"


def _archive_member(line: str, path: str) -> str:
    """`member ARCHIVE:OBJ.o:` -> "OBJ.o:" (the prefix given to PTX names from that archive member)."""
    name = line[len("member "):].rstrip().rstrip(":")
    for prefix in (path, os.path.abspath(path), str(Path(path).resolve())):  # cuobjdump prints it absolute
        if name.startswith(prefix + ":"):
            return name[len(prefix) + 1:] + ":"
    return name + ":"


def _parse_lptx(out: str, path: str) -> list[str]:
    """Names from `cuobjdump -lptx` (e.g. "kernel.1.sm_90.ptx"), archive members prefixed."""
    names, member = [], ""
    for line in out.splitlines():
        if line.startswith("member "):
            member = _archive_member(line, path)
        elif match := _LPTX_RE.match(line.strip()):
            names.append(member + match.group(1))
    return names


def _parse_ptx_dump(out: str, path: str) -> list[tuple[str, str | None, str]]:
    """Sections of `cuobjdump -ptx` output as (archive member prefix, arch, PTX text).

    Each PTX section is a `Fatbin ptx code:` line, a `====` rule, `key = value` header lines up to the
    first blank line, then the PTX text up to the next section or archive member.
    """
    sections: list[tuple[str, str | None, str]] = []
    member, kind, arch, in_header, body = "", None, None, False, []

    def close() -> None:
        if kind == "ptx":
            text = "\n".join(body).strip("\n")
            if text:
                sections.append((member, arch, text + "\n"))

    for line in out.splitlines():
        section = _SECTION_RE.match(line)
        if section or line.startswith("member "):
            close()
            kind, arch, body = None, None, []
            if section:
                kind, in_header = section.group(1), True
            else:
                member = _archive_member(line, path)
            continue
        if kind is None:
            continue
        if in_header:
            stripped = line.strip()
            if not stripped:
                in_header = False
            elif stripped.startswith("arch ="):
                arch = stripped.split("=", 1)[1].strip() or None
            continue
        body.append(line)
    close()
    return sections


def _parse_entry_symbols(out: str) -> list[str]:
    """Kernel names (`STO_ENTRY` symbols) from `cuobjdump -symbols`, in order, without repeats."""
    names: list[str] = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "STT_FUNC" and "STO_ENTRY" in parts and parts[-1] not in names:
            names.append(parts[-1])
    return names


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)
