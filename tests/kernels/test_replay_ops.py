"""Replay's faster equivalents of traced aten ops give the traced op's result bit for bit."""

from __future__ import annotations

import torch

from tessera.kernels.replay import broadcast_bmm, replay_op


def test_a_broadcast_bmm_gives_bmm_s_bits_in_every_dtype_and_any_other_bmm_is_bmm():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = torch.randn(300, 64, dtype=dtype)  # a linear layer's weight [N, K]
        for rows, seq in ((1, 1), (3, 1), (8, 1), (4, 5)):
            hidden = torch.randn(rows, 7, 64, dtype=dtype)
            a = hidden[:, -seq:]  # a slice of the positions: not contiguous when rows > 1
            b = w.t().unsqueeze(0).expand(rows, 64, 300)  # the weight broadcast over the batch (stride 0)
            got = broadcast_bmm(a, b)
            assert got.shape == (rows, seq, 300) and torch.equal(got, torch.ops.aten.bmm.default(a, b)), (dtype, rows)
    # a lone prompt's LM head (smollm2-135m's, bf16): a batch of one keeps the weight's batch stride, not zero
    w = torch.randn(49152, 576, dtype=torch.bfloat16)
    a, b = torch.randn(1, 64, 576, dtype=torch.bfloat16)[:, -1:], w.t().unsqueeze(0).expand(1, 576, 49152)
    assert b.stride(0) != 0 and torch.equal(broadcast_bmm(a, b), torch.ops.aten.bmm.default(a, b))
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)  # a real batch of matrices
    assert torch.equal(broadcast_bmm(a, b), torch.bmm(a, b))
    assert replay_op("aten.bmm.default") is broadcast_bmm and replay_op("aten.mm.default") is None


def test_every_tessera_op_replays_as_its_body_with_the_op_s_bits():
    import tessera.kernels  # noqa: F401  (registers every tessera op)
    from tessera.kernels.bodies import BODIES

    registered = {f"tessera.{n}.default" for n in dir(torch.ops.tessera)
                  if isinstance(getattr(torch.ops.tessera, n), torch._ops.OpOverloadPacket)}
    # every op tessera.kernels registers; the Triton op (tessera.triton_kernels, registered once a test imports
    # it) keeps torch's own wrapper
    triton = {n for n in registered if n.startswith("tessera.triton_")}
    assert set(BODIES) == registered - triton and len(BODIES) >= 30
    for name in BODIES:
        assert replay_op(name) is BODIES[name]
    torch.manual_seed(0)
    x, res, w = torch.randn(3, 5, 64, dtype=torch.bfloat16), torch.randn(3, 5, 64, dtype=torch.bfloat16), torch.randn(64)
    assert torch.equal(replay_op("tessera.rms_norm.default")(x, w.bfloat16(), 1e-5),
                       torch.ops.tessera.rms_norm.default(x, w.bfloat16(), 1e-5))
    got = replay_op("tessera.add_rms_norm.default")(x, res, w.bfloat16(), 1e-6, True)
    want = torch.ops.tessera.add_rms_norm.default(x, res, w.bfloat16(), 1e-6, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16)
    q2, k2 = q.clone(), k.clone()
    positions, inv_freq = torch.tensor([[5, 6, 7], [0, 1, 2]]), torch.rand(8)
    replay_op("tessera.rotary_.default")(q, k, positions, inv_freq, 1.0)  # in place, as the op
    torch.ops.tessera.rotary_.default(q2, k2, positions, inv_freq, 1.0)
    assert torch.equal(q, q2) and torch.equal(k, k2) and not torch.equal(q, torch.zeros_like(q))


def test_replaying_a_tessera_op_as_its_body_does_not_import_dynamo():
    import subprocess
    import sys

    code = ("import sys, torch; import tessera.kernels; from tessera.kernels.replay import replay_op; "
            "replay_op('tessera.rms_norm.default')(torch.randn(2, 8), torch.ones(8), 1e-5); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
