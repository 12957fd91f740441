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
from anyorder.training.loop import train
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


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
@pytest.mark.parametrize("K", [2, 4])
def test_speculative_and_confidence_decoding_equal_the_oracle(kind: str, K: int) -> None:
    """The loops decided one pass at a time, as a GPU runs them (fixed widths, key levels
    from the counts read two passes late through pinned memory and events): every committed
    token's logits are the uncached forward's for the final order; rows finish together."""
    from anyorder.sampling.confidence import confidence_sample
    from anyorder.sampling.rounds import HostCounts
    from anyorder.sampling.speculative import speculative_sample

    model, n, B = on_device(kind, seq_len=24), 24, 3
    known = torch.zeros(B, n, dtype=torch.bool, device=DEVICE)
    known[:, [2, 7, 15]] = True
    tokens = torch.randint(0, 5, (B, n), generator=gen(4), device=DEVICE)
    kw = dict(batch=B, prompt=tokens, known=known, keep_logits=True)
    for out in (
        speculative_sample(model, n, K, generator=gen(5), **kw),
        confidence_sample(model, n, speculative=K, generator=gen(6), **kw),
    ):
        ref = model(out.tokens, out.order)
        torch.testing.assert_close(out.logits[:, 3:], ref[:, 3:], atol=ATOL, rtol=0)
        assert torch.equal(out.tokens[known], tokens[known])
        stats = out.extra["speculative"]
        assert (stats.passes <= stats.tokens).all() and (stats.tokens == n - 3).all()
        late = HostCounts.lag if DEVICE.type == "cuda" else 0
        assert stats.passes.max() <= out.forward_passes <= stats.passes.max() + late
        assert len(out.extra["attention_shapes"]) <= 8 or DEVICE.type == "cpu"


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


def _grads_under(backend: str, model, args, compiled: bool = False):
    """Logits and parameter gradients of one training forward + backward on ``backend``."""
    set_attention_backend(backend)
    try:
        model.zero_grad(set_to_none=True)
        run = model
        if compiled:  # inductor on CUDA; the graphs without codegen on the CPU (faster)
            torch._dynamo.reset()
            run = torch.compile(model, backend="inductor" if DEVICE.type == "cuda" else "aot_eager")
        logits = run(*args)
        logits.float().square().mean().backward()
    finally:
        set_attention_backend("sdpa")
    return logits.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("streams", [2, 3, 4])
def test_flex_attention_backward_equals_sdpa_with_strided_blocks(streams: int) -> None:
    """Training on block masks through FlexAttention: values and gradients of every weight
    equal the SDPA path's (strided blocks; the first block's query rows see nothing)."""
    model = on_device("armd").train()
    tokens = torch.randint(0, 11, (2, N), generator=torch.Generator().manual_seed(4))
    o = strided(2, N, streams)
    args = tokens.to(DEVICE), o.order.to(DEVICE), o.model_blocks.to(DEVICE)
    ref, g_ref = _grads_under("sdpa", model, args)
    out, g_out = _grads_under("flex", model, args)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert g_out.keys() == g_ref.keys()
    for k in g_ref:
        assert bool(torch.isfinite(g_out[k]).all()), k
        torch.testing.assert_close(g_out[k], g_ref[k], atol=ATOL, rtol=1e-3, msg=k)


@pytest.mark.parametrize("head_dim", [8, 16, 24])
def test_flex_attention_rows_that_see_nothing_give_zeros_and_finite_gradients(
    head_dim: int,
) -> None:
    """Attention alone under the strict block mask of strided blocks: the first block's rows
    are exactly zero on both backends, and q, k, v get finite gradients that agree. Heads
    below 16 wide (8) take SDPA under the flex backend too (FlexAttention's CUDA kernels
    refuse them); 16 and 24 (no power of 2) take FlexAttention on CUDA."""
    from anyorder.layers import Attention, block_visibility

    torch.manual_seed(0)
    attn = Attention(tiny_model("armd", n_head=2, d_model=2 * head_dim).cfg).to(DEVICE)
    blocks = strided(2, N, 3).model_blocks.to(DEVICE)
    g = torch.Generator().manual_seed(5)
    qkv0 = [torch.randn(2, 2, N, head_dim, generator=g).to(DEVICE) for _ in range(3)]
    outs = {}
    takes_flex = DEVICE.type == "cuda" and head_dim >= 16
    for backend in ("sdpa", "flex"):
        set_attention_backend(backend)
        try:
            q, k, v = (t.clone().requires_grad_() for t in qkv0)
            mask = block_visibility(blocks, N, True, DEVICE, head_dim)
            assert (mask.flex is not None) == (backend == "flex" and takes_flex)
            y = attn.attend(q, k, v, mask, project=False)  # (B, N, d)
            y.square().sum().backward()
        finally:
            set_attention_backend("sdpa")
        first = mask.empty[:, 0, :, 0]  # (B, N): rows of the first block
        assert bool(first.any()) and bool((y[first] == 0).all())
        assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
        outs[backend] = (y.detach(), [t.grad for t in (q, k, v)])
    torch.testing.assert_close(outs["flex"][0], outs["sdpa"][0], atol=ATOL, rtol=0)
    for a, b in zip(outs["flex"][1], outs["sdpa"][1]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-3)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_model_with_small_heads_trains_under_the_flex_backend(compiled: bool) -> None:
    """ARMD with heads 8 wide on strided blocks, the flex backend asked for, eager and
    compiled (inductor on CUDA): SDPA runs instead of failing in the compiler, values and
    gradients those of the SDPA backend."""
    model = on_device("armd", n_head=2, d_model=16).train()
    assert model.cfg.d_head == 8
    tokens = torch.randint(0, 11, (2, N), generator=torch.Generator().manual_seed(6))
    o = strided(2, N, 3)
    args = tokens.to(DEVICE), o.order.to(DEVICE), o.model_blocks.to(DEVICE)
    ref, g_ref = _grads_under("sdpa", model, args)
    out, g_out = _grads_under("flex", model, args, compiled=compiled)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert g_out.keys() == g_ref.keys()
    for k in g_ref:
        torch.testing.assert_close(g_out[k], g_ref[k], atol=ATOL, rtol=1e-3, msg=k)


def test_compiled_flex_training_equals_eager_sdpa() -> None:
    """The model compiled with FlexAttention inside (its BlockMask built in the compiled
    forward) against the eager SDPA path, values and gradients."""
    model = on_device("armd", n_layer=2).train()
    tokens = torch.randint(0, 11, (2, N), generator=torch.Generator().manual_seed(6))
    o = strided(2, N, 4)
    args = tokens.to(DEVICE), o.order.to(DEVICE), o.model_blocks.to(DEVICE)
    ref, g_ref = _grads_under("sdpa", model, args)
    out, g_out = _grads_under("flex", model, args, compiled=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    for k in g_ref:
        torch.testing.assert_close(g_out[k], g_ref[k], atol=ATOL, rtol=1e-3, msg=k)


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


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_captured_passes_reading_the_decodes_casts_equal_autocasts_own(kind, monkeypatch) -> None:
    """Under bf16 autocast a decode casts the weights once (``layers/casts.py``) and its
    graphs read the copies: the same logits and tokens as graphs that cast at each replay."""
    from anyorder.layers import casts
    from anyorder.sampling.speculative import speculative_sample

    model = on_device(kind)
    outs = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(casts, "for_decode", lambda model: None)
        with torch.autocast(DEVICE.type, torch.bfloat16):
            outs.append(
                speculative_sample(
                    model, N, 3, batch=2, generator=gen(8), keep_logits=True, graphs=GRAPHS
                )
            )
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].logits, outs[1].logits)


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
@pytest.mark.parametrize("generator_on", ["device", "cpu"])
def test_captured_speculative_rounds_equal_the_eager_rounds(kind: str, generator_on) -> None:
    """Speculative rounds captured as CUDA graphs (one per key level; the randoms drawn
    ahead, eagerly, from the generator on the device or on the host): the same tokens as
    the eager rounds from the same seed, the logits of the uncached forward."""
    from anyorder.sampling import rounds
    from anyorder.sampling.speculative import speculative_sample

    model, n, B = on_device(kind, seq_len=24), 24, 3
    kw = dict(batch=B, keep_logits=True, temperature=0.8)
    mk = gen if generator_on == "device" else (lambda s: torch.Generator().manual_seed(s))
    saved, rounds.STATIC_ON_CPU = rounds.STATIC_ON_CPU, True  # the eager GPU path on a CPU
    try:
        eager = speculative_sample(model, n, 4, generator=mk(8), graphs=False, **kw)
    finally:
        rounds.STATIC_ON_CPU = saved
    out = speculative_sample(model, n, 4, generator=mk(8), graphs=GRAPHS, **kw)
    assert out.extra["graphs"]["mode"] == GRAPHS and out.extra["graphs"]["shapes"] >= 1
    assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.step_of, eager.step_of)
    torch.testing.assert_close(out.logits, eager.logits, atol=ATOL, rtol=0)
    ref = model(out.tokens, out.order)
    torch.testing.assert_close(out.logits, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("bf16", [False, True])
def test_compiled_rounds_captured_equal_the_eager_rounds(bf16: bool, monkeypatch) -> None:
    """Speculative rounds compiled whole (inductor's Triton kernels on CUDA; aot_eager on the
    CPU), then captured as CUDA graphs and replayed: the eager rounds' tokens, logits within
    the tolerance. One key level (the widest) so that the round compiles once. Under bf16
    autocast (the recording turns the cast cache off: the warm-up must too, or the round
    compiles again while recording, which fails): the forward's logits within bf16's reach."""
    from anyorder.sampling import compiled_passes, rounds
    from anyorder.sampling.speculative import speculative_sample

    monkeypatch.setattr(rounds.Engine, "fixed_keys", lambda self, reach: self.capacity)
    model, n, B = on_device("aogpt", seq_len=24), 24, 2
    kw = dict(batch=B, keep_logits=True, temperature=0.8)
    cast = torch.autocast(DEVICE.type, torch.bfloat16, enabled=bf16)
    monkeypatch.setattr(rounds, "STATIC_ON_CPU", True)  # the eager GPU path on a CPU
    with cast:
        eager = speculative_sample(model, n, 4, generator=gen(9), graphs=False, **kw)
    monkeypatch.setattr(rounds, "STATIC_ON_CPU", False)
    torch._dynamo.reset()
    with cast, compiled_passes("inductor" if DEVICE.type == "cuda" else "aot_eager"):
        out = speculative_sample(model, n, 4, generator=gen(9), graphs=GRAPHS, **kw)
    torch._dynamo.reset()
    assert out.extra["graphs"]["compiled"] and out.extra["graphs"]["shapes"] == 1
    if bf16:  # fused bf16 kernels round otherwise: the uncached forward's logits, bf16-close
        with cast:
            ref = model(out.tokens, out.order)
        torch.testing.assert_close(out.logits, ref.float(), atol=5e-2, rtol=0)
        return
    assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.step_of, eager.step_of)
    torch.testing.assert_close(out.logits, eager.logits, atol=ATOL, rtol=0)
