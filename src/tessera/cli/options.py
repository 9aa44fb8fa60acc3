"""Command-line options shared by several commands; every default shown in a help text is read from the
object that owns it (the phase shapes of `capture.phases`, `CostOptions`, the workload grammar)."""

from __future__ import annotations

import typer

from tessera.capture.shapes import (
    DEFAULT_BATCH,
    DEFAULT_CTX,
    DEFAULT_GRAPH,
    DEFAULT_IMAGE,
    DEFAULT_RESOLUTION,
    DEFAULT_SEQ,
    GRAPHS,
)
from tessera.cost.options import CostOptions
from tessera.plan.config import DEFAULT_MAX_BATCH, POLICIES, AdmissionConfig, PlanConfig
from tessera.workload import DEFAULT_IMAGE_WORKLOAD, DEFAULT_TEXT_WORKLOAD

_COST = CostOptions()
_PLAN = PlanConfig(model="", cluster="")
_ADMISSION = AdmissionConfig()

MODEL = typer.Argument(..., help="Catalog name (see `tessera models`) or a local HF model directory.")
PHASE = typer.Option("decode", "--phase", "-p", help="prefill|decode (LLM, MoE, SSM); "
                     "encode|prefill|decode (VLM); encode|step|decode (diffusion).")
BATCH = typer.Option(None, "--batch", "-b", help=f"Batch size (default: {DEFAULT_BATCH['prefill']} for prefill, "
                     f"{DEFAULT_BATCH['decode']} for decode).")
SEQ = typer.Option(None, "--seq", "-s", help=f"Prompt length of a prefill (default {DEFAULT_SEQ}).")
CTX = typer.Option(None, "--ctx", "-c", help=f"KV-cache capacity bucket (default {DEFAULT_CTX}).")
IMAGE = typer.Option(None, "--image", help=f"VLM image size WxH (default {DEFAULT_IMAGE[0]}x{DEFAULT_IMAGE[1]}).")
RESOLUTION = typer.Option(None, "--resolution", help="Diffusion resolution N or WxH (default "
                          f"{DEFAULT_RESOLUTION[0]}x{DEFAULT_RESOLUTION[1]}).")
WEIGHTS_DTYPE = typer.Option(_COST.weights_dtype, "--weights-dtype", help="Deployed weight format: native (as "
                             "traced: the production graph's deployed formats, e.g. gpt-oss experts in MXFP4), or "
                             "an override for every matrix weight: bf16, fp16, fp8 or mxfp4.")
KV_DTYPE = typer.Option(_COST.kv_dtype, "--kv-dtype", help="Deployed KV-cache dtype: bf16 or fp8.")
EAGER = typer.Option(not _COST.cuda_graphs, "--eager", help="Kernels launched one by one (each pays the launch "
                     "latency) instead of from CUDA graphs.")
JSON = typer.Option(False, "--json", help="Print JSON instead of tables.")
GRAPH = typer.Option(DEFAULT_GRAPH, "--graph", help=f"Kernel graph to trace: {' | '.join(GRAPHS)} (production: "
                     "fused units as a serving engine runs them, weights in the deployed format; eager: the "
                     "Hugging Face reference forward, op by op).")

# planning and simulating a deployment (`tessera plan`, `tessera simulate`)
CLUSTER = typer.Option(..., "--cluster", help="Devices: shorthand such as A100:1,L40S:1 or a cluster YAML file "
                       "(see `tessera devices --cluster`).")
WORKLOAD = typer.Option(None, "--workload", "-w", help="fixed:in=..,out=..,requests=.. | "
                        "offline:prompts=azure-conv|FILE,out=..[,requests=N] | "
                        "poisson:rate=..,lengths=azure-conv|FILE[,requests=N] | images:steps=..,resolution=.. "
                        f"(default {DEFAULT_TEXT_WORKLOAD}; {DEFAULT_IMAGE_WORKLOAD} for diffusion).")
POLICY = typer.Option(_PLAN.policy, "--policy", help=" | ".join(POLICIES) + ".")
DEVICE = typer.Option(None, "--device", "-d", help="homogeneous: the device type (default: the only one).")
PRICES = typer.Option(_PLAN.prices, "--prices", help="relative (published relative prices) or cloud_usd "
                      "(estimated $/h).")
ROUTING_SKEW = typer.Option(_PLAN.routing_skew, "--routing-skew", help="MoE routing skew (Zipf exponent; "
                            "0 = uniform).")
MAX_BATCH = typer.Option(None, "--max-batch", help="A fixed batch: this many sequences (images) in flight in the "
                         "deployment, shared by its replicas, instead of memory-bound admission (diffusion: "
                         f"default {DEFAULT_MAX_BATCH['diffusion']} images per replica).")
MAX_NUM_SEQS = typer.Option(_ADMISSION.max_num_seqs, "--max-num-seqs", help="Most sequences one engine admits "
                            "(memory-bound admission: an engine admits while its devices' free memory holds the "
                            "sequences' paged state).")
MEMORY_UTILIZATION = typer.Option(_ADMISSION.memory_utilization, "--gpu-memory-utilization", help="Share of each "
                                  "device's memory an engine uses for weights, activations and state.")
BLOCK_SIZE = typer.Option(_ADMISSION.block_size, "--block-size", help="Tokens per paged KV block.")

# measured time factors (`tessera validate --fit`), taken by estimate, census, plan, simulate and validate
FACTORS = typer.Option(None, "--factors", help="Time factors per device and op class (`tessera validate --fit "
                       "FILE`) multiplying the cost model's predicted kernel times.")


def load_factors(path):
    """The checked factors file of ``--factors`` (None when not given)."""
    if path is None:
        return None
    from tessera.cost.factors import load_time_factors

    return load_time_factors(path)
