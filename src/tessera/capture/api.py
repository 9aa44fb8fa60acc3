"""One call from command-line style options to a traced KernelGraph (used by trace, estimate, census)."""

from __future__ import annotations

from tessera.capture.models import resolve_model
from tessera.capture.phases import check_phase, make_step
from tessera.capture.shapes import DEFAULT_GRAPH
from tessera.errors import TesseraError
from tessera.graph.ir import KernelGraph


def trace_model(model: str, phase: str, *, batch: int | None = None, seq: int | None = None,
                ctx: int | None = None, image: str | None = None, resolution: str | None = None,
                device: str = "meta", slots: int | None = None, graph: str = DEFAULT_GRAPH) -> KernelGraph:
    """Trace one step of ``model`` (catalog name or local HF directory) as the ``graph`` kind (production
    or eager); image is 'WxH', resolution 'N' or 'WxH'."""
    from tessera.capture.families.diffusion import parse_resolution
    from tessera.capture.families.vlm import parse_image_size
    from tessera.capture.trace import trace

    spec = resolve_model(model)  # the model name is checked before anything else
    check_phase(spec, phase)
    if device not in ("meta", "cpu"):
        raise TesseraError(f"--device must be meta or cpu (got {device!r})")
    img = parse_image_size(image) if image else None
    res = parse_resolution(resolution) if resolution else None
    step = make_step(model, phase, batch=batch, seq=seq, ctx=ctx, image=img, resolution=res, device=device,
                     slots=slots, graph=graph)
    return trace(step)
