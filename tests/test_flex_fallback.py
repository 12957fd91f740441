"""Which attention path a model takes on a device (``layers/flex.py``): FlexAttention only
where its CUDA kernels take the heads, SDPA everywhere else. Decided from the arguments,
so checked here on the CPU for a CUDA device (the GPU runs both paths in test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import anyorder.layers.flex as flex_mod
import anyorder.layers.masks as masks
from anyorder.layers import flex_enabled, set_attention_backend
from anyorder.orders import strided

from conftest import tiny_model

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def flex():
    set_attention_backend("flex")
    try:
        yield
    finally:
        set_attention_backend("sdpa")


@pytest.mark.parametrize(
    ("head_dim", "takes_flex"),
    [(1, False), (8, False), (15, False), (16, True), (24, True), (48, True), (64, True)],
)
def test_heads_below_16_on_cuda_take_sdpa(flex, head_dim: int, takes_flex: bool) -> None:
    """inductor's FlexAttention refuses head dimensions below 16 on CUDA ("NYI: embedding
    dimension ... must be at least 16"); one not a power of 2 (24, 48) it pads and takes."""
    assert getattr(flex_mod, "FLEX_MIN_HEAD_DIM", None) == 16
    assert flex_enabled(CUDA, head_dim) is takes_flex
    assert flex_enabled(CPU, head_dim) is False  # no FlexAttention backward on the CPU


def test_without_the_flex_backend_nothing_takes_flex() -> None:
    for head_dim in (8, 16, 64, None):
        assert flex_enabled(CUDA, head_dim) is False


def test_armd_asks_with_its_own_head_dim(flex, monkeypatch) -> None:
    """ARMD's forward builds its block masks for its heads: 8 wide here, so on CUDA it would
    take SDPA; the CPU run gives the same logits as without the flex backend."""
    asked = []
    real = masks.flex_enabled
    monkeypatch.setattr(
        masks,
        "flex_enabled",
        lambda device, head_dim=None: asked.append(head_dim) or real(device, head_dim),
    )
    model = tiny_model("armd", n_head=2, d_model=16)
    assert model.cfg.d_head == 8
    tokens = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(0))
    o = strided(2, 12, 3)
    with torch.no_grad():
        got = model(tokens, o.order, o.model_blocks)
        assert asked == [8, 8]  # the content stream's mask and the query stream's
        set_attention_backend("sdpa")
        want = model(tokens, o.order, o.model_blocks)
    assert torch.equal(got, want)
