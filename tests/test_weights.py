"""Weights files: loaded tensors are copies of their own (not a map of the file) and aliases share one tensor."""

import pytest
import torch
from torch import nn

from tessera.weights import WeightsError, load_weights, save_weights


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight


def test_loaded_weights_do_not_change_when_the_file_is_rewritten(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    path = save_weights({"m": model}, tmp_path / "w.safetensors")
    loaded = load_weights(path)
    before = {n: t.clone() for n, t in loaded.items()}
    data = path.read_bytes()
    with open(path, "r+b") as f:  # overwrite every tensor byte in place (same size, same header)
        header = 8 + int.from_bytes(data[:8], "little")
        f.seek(header)
        f.write(bytes(len(data) - header))
    assert all(torch.equal(loaded[n], before[n]) for n in loaded)
    assert torch.count_nonzero(load_weights(path)["m.embed.weight"]) == 0  # the file did change


def test_aliases_resolve_to_one_tensor(tmp_path):
    model = Tied()
    path = save_weights({"m": model}, tmp_path / "w.safetensors")
    w = load_weights(path, ["m.embed.weight", "m.head.weight"])
    assert w["m.embed.weight"] is w["m.head.weight"]
    assert torch.equal(w["m.head.weight"], model.head.weight.detach())


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(WeightsError, match="does not exist"):
        load_weights(tmp_path / "nope.safetensors")
