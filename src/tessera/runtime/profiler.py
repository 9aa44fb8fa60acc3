"""Measure every kernel of a model step on a real device: the data behind a measured cost model.

The whole program runs once with every activation kept, so each kernel's arguments hold the values
the step gives them; then each kernel is called alone on those tensors: warm-up calls, then timed
calls, of which the median and the minimum are kept. Kernels that write in place (into the KV cache,
into an activation) are rerun on the same tensors and their written views are restored afterwards,
so the kernels after them still see the step's values.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from tessera.cost.profile import KernelTiming, Profile, kernel_signature
from tessera.errors import TesseraError
from tessera.graph.codec import tensor_refs
from tessera.graph.ir import Kernel, KernelGraph, TensorRef
from tessera.hardware.devices import gpu_id
from tessera.limits import CPU_WORKERS, PROFILE_CALLS, THREADS
from tessera.program.program import single_device_program
from tessera.runtime.executor import Executor

Progress = Callable[[int, int], None]  # (kernels timed, kernels in the graph)
_SHAPE_KEYS = ("batch", "seq", "ctx", "image", "resolution")


class ProfileError(TesseraError, ValueError):
    """A profile cannot be taken: a bad device string, no CUDA, or impossible warm-up/repeat counts."""


@dataclass(frozen=True)
class ProfileTarget:
    """Where kernels are timed: the torch device, its canonical id and name, and CPU threads."""

    torch_device: str  # "cpu" or "cuda:I"
    id: str  # canonical device id ("cpu", "H200", ...)
    name: str  # CPU model string or CUDA device name
    threads: int | None  # CPU threads (None on a GPU)


_gpu_id = gpu_id  # the catalog id of a CUDA device name (kept under its old name)


def resolve_target(device: str, threads: int | None = None) -> ProfileTarget:
    """Parse ``cpu``, ``cpu:N`` (one of N workers sharing this host), ``cuda`` or ``cuda:I``.

    CPU threads default to all cores, or ``max(1, cores // N)`` for ``cpu:N``; ``threads`` overrides.
    """
    m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", device.strip().lower())
    if m is None:
        raise ProfileError(f"--device must be cpu, cpu:N (one of N workers sharing this host), cuda or cuda:I "
                           f"(got {device!r})")
    if threads is not None and threads < 1:
        raise ProfileError(f"--threads must be at least 1 (got {threads})")
    if threads is not None:
        THREADS.check(threads, "--threads")
    kind, number = m.group(1), m.group(2)
    if kind == "cpu":
        from tessera.hardware.host import cpu_model, worker_threads

        workers = 1 if number is None else int(number)
        if workers < 1:
            raise ProfileError(f"--device {device}: the number of CPU workers must be at least 1")
        CPU_WORKERS.check(workers, f"--device {device}")
        return ProfileTarget("cpu", "cpu", cpu_model(), threads or worker_threads(workers))
    if not torch.cuda.is_available():
        raise ProfileError(f"--device {device}: CUDA is not available here (torch {torch.__version__}); profile "
                           "with --device cpu, or run on a machine with an NVIDIA GPU and a CUDA build of torch")
    index = int(number or 0)
    if index >= torch.cuda.device_count():
        raise ProfileError(f"--device {device}: there is no CUDA device {index} (this machine has "
                           f"{torch.cuda.device_count()})")
    name = torch.cuda.get_device_name(index)
    return ProfileTarget(f"cuda:{index}", _gpu_id(name), name, None)


def check_counts(warmup: int, repeats: int) -> None:
    """Reject impossible warm-up and repeat counts (at least 0 warm-up calls, 1 timed call)."""
    if repeats < 1:
        raise ProfileError(f"--repeats must be at least 1 (got {repeats})")
    if warmup < 0:
        raise ProfileError(f"--warmup must be 0 or more (got {warmup})")
    PROFILE_CALLS.check(repeats, "--repeats")
    PROFILE_CALLS.check(warmup, "--warmup")


@contextmanager
def _threads(target: ProfileTarget):
    if target.threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(target.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _denormals_flushed(target: ProfileTarget):
    """Time CPU kernels with denormals flushed to zero, as inference runtimes and GPU fast paths do:
    otherwise identical kernels of different layers differ by 20-35% with the values they happen to
    hold. PyTorch has no getter for the mode; its default (off) is restored."""
    if target.torch_device != "cpu":
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _written_views(kernel: Kernel, written: set[str]) -> list[TensorRef]:
    """Views a kernel writes into one of its own arguments (in place), which a rerun overwrites: in-place aten
    ops return them; custom ops that mutate arguments (``written``: the buffers it writes) are passed them."""
    refs = tensor_refs(kernel.args) + tensor_refs(list(kernel.kwargs.values()))
    args = {r.buffer for r in refs}
    views = [TensorRef.from_json(o) for o in kernel.outputs if o is not None and o[0] in args]
    return views + [r for r in refs if r.buffer in written and r not in views]


def _time_kernel(ex: Executor, kernel: Kernel, target: ProfileTarget, warmup: int, repeats: int,
                 written: set[str]) -> list[float]:
    """Seconds of ``repeats`` calls of one kernel (writing the buffers ``written``) on the executor's tensors."""
    func, args, kwargs = ex.bind_kernel(kernel.index)
    saved = [(v, v.clone()) for v in (ex.view(r) for r in _written_views(kernel, written))]
    for _ in range(warmup):
        func(*args, **kwargs)
    if target.torch_device == "cpu":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            func(*args, **kwargs)
            times.append((time.perf_counter_ns() - t0) * 1e-9)
    else:
        device = torch.device(target.torch_device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
            for start, end in events:
                start.record()
                func(*args, **kwargs)
                end.record()
            torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) * 1e-3 for start, end in events]
    for view, value in saved:
        view.copy_(value)
    return times


def _timing(ex: Executor, k: Kernel, target: ProfileTarget, warmup: int, repeats: int,
            written: set[str]) -> KernelTiming:
    times = _time_kernel(ex, k, target, warmup, repeats, written)
    return KernelTiming(index=k.index, id=k.id, signature=kernel_signature(k), op=k.op, op_class=k.op_class,
                        median_s=statistics.median(times), min_s=min(times), repeats=repeats)


def profile_graph(graph: KernelGraph, weights: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                  state: Mapping[str, torch.Tensor], *, device: str = "cpu", threads: int | None = None,
                  warmup: int = 3, repeats: int = 10, progress: Progress | None = None) -> Profile:
    """Time every kernel of ``graph`` alone on ``device``: ``warmup`` untimed calls, then ``repeats`` timed.

    The program first runs once with every activation kept, so each kernel's inputs hold real values;
    CPU kernels are then timed with denormals flushed to zero.
    ``state`` tensors already on the device are written in place, as one step would; others are copied.
    ``progress(done, total)`` is called as kernels are timed.
    """
    target = resolve_target(device, threads)
    check_counts(warmup, repeats)
    dev = torch.device(target.torch_device)
    program = single_device_program(graph, target.torch_device)
    ex = Executor(graph, program, weights, dev)
    state = {n: t if t.device == dev and t.is_contiguous() and t.storage_offset() == 0 else
             t.to(dev).contiguous().clone() for n, t in state.items()}
    total = len(graph.kernels)
    timings: list[KernelTiming] = []
    if progress:
        progress(0, total)
    with _threads(target), torch.no_grad():
        ex.prepare(inputs, state)
        for k in graph.kernels:  # the whole step, no frees: every activation keeps its value
            ex.run_kernel(k.index)
        writes: dict[int, set[str]] = {}
        for a in graph.accesses:
            if a.mode == "write":
                writes.setdefault(a.kernel, set()).add(a.buffer)
        with _denormals_flushed(target):
            for k in graph.kernels:
                timings.append(_timing(ex, k, target, warmup, repeats, writes.get(k.index, set())))
                if progress:
                    progress(k.index + 1, total)
    return Profile(device=target.id, device_name=target.name, threads=target.threads, model=graph.model,
                   phase=graph.phase, graph_hash=graph.hash,
                   shape={key: graph.meta[key] for key in _SHAPE_KEYS if key in graph.meta},
                   warmup=warmup, repeats=repeats, created=datetime.now(UTC).isoformat(timespec="seconds"),
                   kernels=timings)


def _has_real_weights(spec) -> bool:
    from tessera.capture.pretrained import weights_dir

    if spec.family == "diffusion":  # pipelines are built component by component, with random weights
        return False
    try:
        weights_dir(spec)
    except TesseraError:
        return False
    return True


def build_profile_step(model: str, phase: str, *, batch: int | None = None, seq: int | None = None,
                       ctx: int | None = None, image: tuple[int, int] | None = None,
                       resolution: tuple[int, int] | None = None, device: str = "cpu", slots: int | None = None):
    """The Step to profile on ``device`` (a torch device string): real weights where Tessera has them
    (smollm2-135m, local directories with safetensors), random weights otherwise."""
    from tessera.capture.models import resolve_model
    from tessera.capture.phases import check_phase, make_step, resolve_shape, step_for
    from tessera.capture.pretrained import load_pretrained

    spec = resolve_model(model)
    check_phase(spec, phase)
    if not _has_real_weights(spec):
        return make_step(model, phase, batch=batch, seq=seq, ctx=ctx, image=image, resolution=resolution,
                         device=device, slots=slots)
    spec, module, values = load_pretrained(model)
    shape = resolve_shape(spec, module.config, phase, batch, seq, ctx, image, resolution, slots)
    if device != "cpu":
        module.to(device)
    return step_for(spec, module, values, phase, shape, device=device)


def _place_rows_at(step, phase: str, position: int, ctx: int | None) -> None:
    """Put every row of a decode ``step`` (a cache of ``ctx`` positions) at ``position``."""
    positions = step.inputs.get("positions")
    if phase != "decode" or positions is None:
        raise ProfileError(f"position {position}: only a decode step of a model with a KV cache has positions "
                           f"(got the {phase} step)")
    if position < 0 or (ctx is not None and position >= ctx):
        raise ProfileError(f"position {position} is outside the step's cache of {ctx} positions")
    positions.fill_(position)


def profile_model(model: str, phase: str, *, batch: int | None = None, seq: int | None = None,
                  ctx: int | None = None, image: tuple[int, int] | None = None,
                  resolution: tuple[int, int] | None = None, device: str = "cpu", threads: int | None = None,
                  warmup: int = 3, repeats: int = 10, progress: Progress | None = None,
                  slots: int | None = None, position: int = 0) -> tuple[Profile, KernelGraph]:
    """Build ``model``'s ``phase`` step on ``device``, trace it there and time every kernel.

    smollm2-135m and local directories with safetensors run their real weights; other catalog models
    are built with random weights (models too large for the host are refused). A decode step runs with every
    row at ``position`` (its attention reads the cache up to there; a step's kernels, and so its profile's
    keys, are the same at every position).
    """
    from tessera.capture.models import resolve_model
    from tessera.capture.trace import trace
    from tessera.weights import unique_state

    target = resolve_target(device, threads)
    check_counts(warmup, repeats)
    step = build_profile_step(model, phase, batch=batch, seq=seq, ctx=ctx, image=image, resolution=resolution,
                              device=target.torch_device, slots=slots)
    if position:
        _place_rows_at(step, phase, position, ctx)
    with _threads(target):
        graph = trace(step)
    weights, _ = unique_state(step.modules)
    profile = profile_graph(graph, weights, step.inputs, step.state, device=device, threads=threads,
                            warmup=warmup, repeats=repeats, progress=progress)
    spec = resolve_model(model)
    if spec.local:  # a local directory is named by its path, so the profile's model can be traced again
        profile.model = str(spec.config_dir.resolve())
    return profile, graph
