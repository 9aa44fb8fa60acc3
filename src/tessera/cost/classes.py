"""The cost classes every predicted kernel time is grouped by (its op class, GEMMs over few rows as GEMVs,
norms as reductions): one list, read by the features, the efficiency factors and the time-factor files."""

from __future__ import annotations

COST_CLASSES = ("gemm", "gemv", "grouped_gemm", "attention", "conv", "embedding", "reduction", "scan", "copy",
                "elementwise")
