"""Command-line options shared by the commands that trace a step (trace, profile, estimate, census)."""

from __future__ import annotations

import typer

MODEL = typer.Argument(..., help="Catalog name (see `tessera models`) or a local HF model directory.")
PHASE = typer.Option("decode", "--phase", "-p", help="prefill|decode (LLM, MoE, SSM); "
                     "encode|prefill|decode (VLM); encode|step|decode (diffusion).")
BATCH = typer.Option(None, "--batch", "-b", help="Batch size (default: 1 for prefill, 8 for decode).")
SEQ = typer.Option(None, "--seq", "-s", help="Prompt length of a prefill (default 512).")
CTX = typer.Option(None, "--ctx", "-c", help="KV-cache capacity bucket (default 2048).")
IMAGE = typer.Option(None, "--image", help="VLM image size WxH (default 504x504).")
RESOLUTION = typer.Option(None, "--resolution", help="Diffusion resolution N or WxH (default 1024).")
WEIGHTS_DTYPE = typer.Option("bf16", "--weights-dtype", help="Deployed weight dtype: bf16, fp8 or mxfp4.")
KV_DTYPE = typer.Option("bf16", "--kv-dtype", help="Deployed KV-cache dtype: bf16 or fp8.")
EAGER = typer.Option(False, "--eager", help="Kernels launched one by one (each pays the launch latency) "
                     "instead of from CUDA graphs.")
JSON = typer.Option(False, "--json", help="Print JSON instead of tables.")
