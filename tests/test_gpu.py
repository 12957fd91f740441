"""The GPU paths on a CUDA device: what the CPU tests check, again where the kernels differ
(cuBLAS, SDPA's fused kernels, FlexAttention, bf16 autocast, device-side generators).

Marked ``gpu`` and so deselected by default; on a machine with a GPU run ``pytest -m gpu``
(``benchmarks/gpu_check.sh`` runs them with the GPU benchmarks). To check the tests' own
logic where there is no GPU, ``ANYORDER_GPU_TEST_DEVICE=cpu pytest -m gpu tests/test_gpu.py``
runs them on the CPU (the FlexAttention test then checks the fallback).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from anyorder.layers import flex_enabled, set_attention_backend
from anyorder.orders import strided
from anyorder.sample import (
    encoder_sample,
    lemma1_sample,
    sample,
    sequential_sample,
    strided_sample,
)
from anyorder.train import train
from test_sample import slot_oracle
from test_train import _cfg

from conftest import tiny_model

DEVICE = torch.device(os.environ.get("ANYORDER_GPU_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
]
N = 12
ATOL = 1e-4  # fp32, but other kernels sum in other orders


@pytest.fixture(autouse=True)
def exact_matmuls():
    """TF32 would make fp32 matmuls on Ampere+ agree to 1e-3 only: keep full fp32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_device(kind: str, **overrides):
    """A tiny model with every weight moved off its initialisation (adaLN too), on DEVICE."""
    model = tiny_model(kind, **overrides)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.to(DEVICE)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(DEVICE).manual_seed(seed)


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd"])
def test_cached_sequential_decoding_equals_the_forward(kind: str) -> None:
    model = on_device(kind)
    out = sequential_sample(model, N, batch=3, generator=gen(0), keep_logits=True)
    assert out.tokens.device.type == DEVICE.type
    ref = model(out.tokens, None if kind == "gpt" else out.order)
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_lemma1_packed_and_compacted_equals_the_oracle(kind: str, monkeypatch) -> None:
    """Per-row counts (each row's entries at its own slots of the static cache) with every
    padded pass packed."""
    import anyorder.sampling.plan as plan_mod

    monkeypatch.setattr(plan_mod, "_PACK_BELOW", 1.0)
    model = on_device(kind)
    out = lemma1_sample(model, N, N // 2, batch=4, generator=gen(1), keep_logits=True)
    ref = slot_oracle(model, out.tokens, out.order, out.step_of)
    torch.testing.assert_close(out.logits.cpu(), ref, atol=ATOL, rtol=0)


def test_aogpt_with_queries_at_targets_decodes_like_its_forward() -> None:
    model = on_device("aogpt", pos_emb="rope", rope_query="target")
    out = sequential_sample(model, N, batch=3, generator=gen(2), keep_logits=True)
    torch.testing.assert_close(out.logits, model(out.tokens, out.order), atol=ATOL, rtol=0)


@pytest.mark.parametrize("streams", [2, 4])
def test_strided_decoding_equals_the_blocked_forward(streams: int) -> None:
    model = on_device("armd")
    out = strided_sample(model, N, streams, batch=2, generator=gen(3), keep_logits=True)
    o = strided(2, N, streams)
    ref = model(out.tokens, o.order.to(DEVICE), o.model_blocks.to(DEVICE))
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)
    assert out.forward_passes == streams + N // streams - 1


def test_flex_attention_equals_sdpa_for_block_masks() -> None:
    model = on_device("armd")
    tokens = torch.randint(0, 11, (2, N), generator=torch.Generator().manual_seed(4))
    o = strided(2, N, 3)
    args = tokens.to(DEVICE), o.order.to(DEVICE), o.model_blocks.to(DEVICE)
    with torch.no_grad():
        sdpa = model(*args)
        set_attention_backend("flex")
        try:
            assert flex_enabled(DEVICE) == (DEVICE.type == "cuda")
            flex = model(*args)
        finally:
            set_attention_backend("sdpa")
    torch.testing.assert_close(flex, sdpa, atol=ATOL, rtol=0)


def test_encoder_sampler_on_the_device() -> None:
    model = on_device("mdm")
    out = encoder_sample(model, N, steps=4, batch=3, generator=gen(5))
    assert out.tokens.device.type == DEVICE.type
    assert out.forward_passes <= 4
    assert bool(((out.tokens >= 0) & (out.tokens < model.cfg.vocab_size)).all())


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_bf16_training_runs_and_saves(tmp_path, kind: str) -> None:
    run = tmp_path / "run"
    on = {"train.device": DEVICE.type, "train.dtype": "bf16", "train.eval_every": 3}
    summary = train(_cfg(run, tmp_path / "cache", kind, **on), progress=False)
    assert summary["step"] == 6
    assert all(math.isfinite(v) for v in summary["val"].values() if isinstance(v, float))
    assert (run / "checkpoints").is_dir()


GRAPHS = "cuda" if DEVICE.type == "cuda" else "emulate"  # the replay logic without a GPU


@pytest.mark.parametrize(
    "kind, kw",
    [
        ("gpt", {}),
        ("aogpt", {}),
        ("armd", {}),
        ("aogpt", dict(steps=5)),
        ("armd", dict(steps=5)),
        ("aogpt", dict(steps=N, shared_counts=True)),
        ("armd", dict(streams=4)),
    ],
)
def test_cuda_graph_decoding_equals_the_oracle(kind: str, kw: dict) -> None:
    """Each pass shape captured once as a CUDA graph and replayed: the logits the tokens were
    drawn from equal the uncached forward, and the eager path's (same seed, same tokens)."""
    model = on_device(kind)
    out = sample(model, N, batch=3, generator=gen(6), keep_logits=True, graphs=GRAPHS, **kw)
    if "streams" in kw:
        o = strided(3, N, kw["streams"])
        ref = model(out.tokens, o.order.to(DEVICE), o.model_blocks.to(DEVICE))
    elif "steps" in kw:
        ref = slot_oracle(model.cpu(), out.tokens.cpu(), out.order.cpu(), out.step_of.cpu())
        model.to(DEVICE)
    else:
        ref = model(out.tokens, None if kind == "gpt" else out.order)
    torch.testing.assert_close(out.logits.cpu(), ref.cpu(), atol=ATOL, rtol=0)
    eager = sample(model, N, batch=3, generator=gen(6), keep_logits=True, **kw)
    torch.testing.assert_close(out.logits, eager.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_cuda_graphs_under_bf16_autocast(kind: str) -> None:
    """bf16 autocast with graphs: the cast cache is off while recording; the replayed passes
    agree with the eager bf16 passes."""
    model = on_device(kind)
    with torch.autocast(DEVICE.type, torch.bfloat16):
        a = lemma1_sample(model, N, 6, batch=2, generator=gen(7), keep_logits=True, graphs=GRAPHS)
        b = lemma1_sample(model, N, 6, batch=2, generator=gen(7), keep_logits=True)
    torch.testing.assert_close(a.logits, b.logits, atol=2e-2, rtol=0)
    assert bool(((a.tokens >= 0) & (a.tokens < model.cfg.vocab_size)).all())
