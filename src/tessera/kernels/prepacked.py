"""GEMMs on weights prepacked for oneDNN: the CPU replay of a bf16 linear layer.

PyTorch's CPU ``F.linear`` / ``mm`` in bf16 runs a oneDNN matmul that reorders the weight into oneDNN's blocked
layout on every call. `PackedWeights` reorders each weight once (``mkldnn._reorder_linear_weight``) and the
GEMM then runs on the packed copy (``mkldnn._linear_pointwise``): the same kernel, so the same bits (every case
of 1-512 rows, six weight shapes and four packing hints measured equal), without the per-call reorder. A
``merged_linear``'s weights are packed as one concatenated matrix: one GEMM instead of one per projection and a
concatenation (each output column is the same dot product, bit for bit). On this host, one thread: smollm2-135m's
gate/up projection at 16 rows 192 -> 155 us, its LM head 10.7 -> 6.4 ms, its merged QKV 208 -> 113 us.

The runtime's ``Executor`` calls these in place of the traced ``aten.mm`` (a weight's transpose),
``aten.linear`` (no bias) and ``tessera::merged_linear`` (no biases) on a CPU in bf16; plain functions, so traced
graphs, their hashes and the cost model are unchanged. The cost is memory: a packed copy beside each weight a
GEMM reads (the originals stay: the graph's other kernels, an embedding lookup on a tied LM head, read them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PACK_ROWS = 32  # the rows oneDNN is told to expect; 1, 16, 32 and 128 measured the same bits and speed


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether GEMMs in ``dtype`` on ``device`` run on packed weights (a CPU with oneDNN's bf16 support).

    In fp32 PyTorch's CPU linear runs MKL's GEMM, whose bits a oneDNN one does not reproduce."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeights:
    """Packed copies of one set of weights, made on first use and shared by every executor given this object
    (a worker's phases: one packed copy per weight, like the weights themselves)."""

    def __init__(self) -> None:
        self._packed: dict[tuple[str, ...], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._packed)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed copies."""
        return sum(t.numel() * t.element_size() for t in self._packed.values())

    def gemm(self, names: tuple[str, ...], weights: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
        """A kernel computing ``x [.., K] @ cat(weights [N_i, K]).T`` on the packed copy of ``weights`` (the
        weights named ``names``); it takes the traced op's arguments and reads only the first."""
        packed = self._packed.get(names)
        if packed is None:
            merged = weights[0] if len(weights) == 1 else torch.cat(weights)
            packed = self._packed[names] = torch.ops.mkldnn._reorder_linear_weight(merged.contiguous(), PACK_ROWS)
        linear = torch.ops.mkldnn._linear_pointwise

        def run(x: torch.Tensor, *_weights) -> torch.Tensor:
            return linear(x, packed, None, "none", [], "")

        return run
