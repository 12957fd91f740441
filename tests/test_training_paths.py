"""The training step's speed paths: bf16 norms on the fused kernel's dtype, the masks each
model's attention gets, AO-GPT's adaLN in one matmul, ARMD's streams batched, compiled
training against eager."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from anyorder.layers import RMSNorm
from anyorder.orders import strided

from conftest import tiny_model

N = 12


def _batch(kind: str, blocks: int | None = None, batch: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (batch, N), generator=g)
    if kind == "gpt":
        return tokens, None, None
    if blocks:
        o = strided(batch, N, blocks)
        return tokens, o.order, o.model_blocks
    return tokens, torch.stack([torch.randperm(N, generator=g) for _ in range(batch)]), None


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("gpt", {}), ("aogpt", {}), ("armd", {}), ("mdm", {}), ("gpt", {"norm": "layernorm"})],
)
def test_bf16_autocast_training_and_eval_raise_no_warning(kind: str, extra: dict) -> None:
    """F.rms_norm warns ("Mismatch dtype ... Cannot dispatch to fused implementation") on
    every call whose weight dtype is not the input's: none may reach a bf16 run."""
    model = tiny_model(kind, **extra).train()
    tokens, order, blocks = _batch(kind if kind != "mdm" else "aogpt")
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # the warning is a TORCH_WARN_ONCE: else once per process
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(tokens, order, blocks, generator=torch.Generator().manual_seed(0))
            loss.backward()
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens, order) if kind != "mdm" else model(tokens)
    finally:
        torch.set_warn_always(always)
    assert torch.isfinite(loss) and bool(torch.isfinite(logits).all())
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def test_rms_norm_is_unchanged_in_fp32_and_close_in_bf16() -> None:
    norm = RMSNorm(16, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    x = torch.randn(3, 5, 16, generator=g)
    ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.equal(norm(x), F.rms_norm(x, (16,), norm.weight, 1e-6))
    torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=0)
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)
    assert norm.weight.dtype == torch.float32  # the parameter itself stays fp32
