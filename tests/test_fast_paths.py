"""The speed paths compute what the plain paths compute: RoPE tables, the shifted causal kernel
for strict masks, masks prepared once per forward, AO-GPT's per-position adaLN tables (in
training and in decoding), the batched ARMD decoding rows, the FlexAttention fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from anyorder.errors import ConfigError
from anyorder.layers import (
    Attention,
    PreparedMask,
    TargetCondition,
    apply_rope,
    block_mask,
    block_visibility,
    flex_enabled,
    rope_angles,
    rotary,
    rotate,
    set_attention_backend,
)
from anyorder.orders import strided
from anyorder.sample import lemma1_sample, sequential_sample, strided_sample

from conftest import tiny_model

N = 12


def randomize_adaln(model, seed: int = 0) -> None:
    """Give the zero-initialised adaLN weights random values (at init they are all zero, which
    would hide any mistake in how the target positions enter)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and getattr(m, "zero_init", False):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_rotary_tables_give_apply_rope_to_a_rounding(dtype) -> None:
    """In every dtype (bf16 and fp16 promoted by the products, not cast first), and under
    autocast, as a decode runs it: :func:`rotate`'s fused multiply-add rounds once where
    :func:`apply_rope` rounds twice, so the two differ by at most one float32 rounding of
    a term (then one rounding to ``dtype``), and both lie that close to the exact rotation
    (float64)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 5, 8, generator=g) * 4).to(dtype)
    pos = torch.stack([torch.randperm(5, generator=g) for _ in range(2)]) * 7
    cos, sin = rope_angles(pos, 8, 1e4)
    want = apply_rope(x, cos, sin)
    assert want.dtype == dtype
    x1, x2 = x.double().chunk(2, dim=-1)
    c, s = cos.double(), sin.double()
    exact = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    a, b, d, e = ((u * w).abs() for u, w in ((x1, c), (x2, s), (x1, s), (x2, c)))
    size = torch.cat([a + b, d + e], dim=-1)  # the terms' magnitude
    out = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    bound = 2 * torch.finfo(out).eps * size + torch.finfo(out).tiny
    for got in (rotate(x, rotary(pos, 8, 10000.0)), want):
        assert got.dtype == dtype
        assert ((got.double() - exact).abs() <= bound).all()
    with torch.autocast("cpu", torch.bfloat16):
        got = rotate(x, rotary(pos, 8, 10000.0))
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.equal(got, rotate(x, rotary(pos, 8, 10000.0)))


def _attention(seed: int = 0) -> Attention:
    torch.manual_seed(seed)
    from anyorder import preset

    return Attention(preset("tiny", kind="armd", n_layer=1, n_head=2, d_model=16, seq_len=16))


def test_strict_kernel_equals_the_dense_strict_mask_values_and_gradients() -> None:
    attn = _attention()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 7, 8, generator=g, requires_grad=True) for _ in range(3))
    dense = torch.ones(7, 7).tril(-1).bool()[None, None]
    a = attn.attend(q, k, v, "strict")
    b = attn.attend(q, k, v, dense)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert torch.equal(a[:, 0], attn.proj(torch.zeros(2, 16))), "row 0 sees nothing"
    ga = torch.autograd.grad(a.square().sum(), (q, k, v))
    gb = torch.autograd.grad(b.square().sum(), (q, k, v))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    one = attn.attend(q[:, :, :1], k[:, :, :1], v[:, :, :1], "strict")  # a single slot
    assert torch.equal(one, attn.proj(torch.zeros(2, 1, 16)))


@pytest.mark.parametrize("strict", [False, True])
def test_prepared_block_masks_equal_the_raw_block_mask(strict: bool) -> None:
    attn = _attention()
    g = torch.Generator().manual_seed(2)
    blocks = strided(2, N, 3).model_blocks
    q, k, v = (torch.randn(2, 2, N, 8, generator=g) for _ in range(3))
    prepared = block_visibility(blocks, N, strict, torch.device("cpu"))
    assert isinstance(prepared, PreparedMask) and prepared.flex is None
    raw = attn.attend(q, k, v, block_mask(blocks, blocks, strict))  # looks for empty rows
    torch.testing.assert_close(attn.attend(q, k, v, prepared), raw, atol=1e-6, rtol=0)
    assert block_visibility(None, N, strict, torch.device("cpu")) == (
        "strict" if strict else "causal"
    )


def test_flex_backend_falls_back_to_sdpa_on_the_cpu() -> None:
    model = tiny_model("armd")
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 11, (2, N), generator=g)
    o = strided(2, N, 3)
    before = model(tokens, o.order, o.model_blocks)
    set_attention_backend("flex")
    try:
        cpu = torch.device("cpu")
        assert not flex_enabled(cpu)
        mask = block_visibility(o.model_blocks, N, True, cpu)
        assert mask.flex is None and mask.dense is not None  # the SDPA path is taken
        assert torch.equal(model(tokens, o.order, o.model_blocks), before)
    finally:
        set_attention_backend("sdpa")
    with pytest.raises(ConfigError, match=r"attention backend 'xla' is unknown; use one of sdpa"):
        set_attention_backend("xla")


def test_adaln_tables_equal_the_per_slot_linear_in_values_and_gradients() -> None:
    model = tiny_model("aogpt")
    randomize_adaln(model)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 11, (3, N), generator=g)
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(3)])
    x_in, pos_in = model.slot_inputs(tokens, order)

    def run(cond):
        model.zero_grad()
        out = model.head(model.trunk(model.embed(x_in, pos_in), pos_in, "causal", cond))
        out.square().mean().backward()
        return out, [p.grad.clone() for p in model.parameters()]

    per_slot, g1 = run(model.tgt_emb(order))
    table, g2 = run(TargetCondition(order, model.tgt_emb.weight))
    torch.testing.assert_close(table, per_slot, atol=1e-5, rtol=0)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # the model picks the table when there are at least as many slots as positions
    assert isinstance(model.condition(order), TargetCondition)
    assert isinstance(model.condition(order[:1, :5]), torch.Tensor)
    torch.testing.assert_close(model(tokens, order), table.detach(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_decoding_with_random_adaln_and_batched_streams_matches_the_forward(kind: str) -> None:
    model = tiny_model(kind)
    randomize_adaln(model)
    a = sequential_sample(
        model, N, batch=3, generator=torch.Generator().manual_seed(5), keep_logits=True
    )
    torch.testing.assert_close(a.logits, model(a.tokens, a.order), atol=1e-5, rtol=0)
    # Lemma 1 (padded passes, the parallel prediction mask): slot t decided in a step whose
    # first slot is d is what the forward gives at slot d with t moved there
    out = lemma1_sample(
        model, N, 4, batch=3, generator=torch.Generator().manual_seed(6), keep_logits=True
    )
    step = out.step_of.gather(1, out.order)
    for b in range(3):
        for t in range(N):
            d = int((step[b] == step[b, t]).nonzero()[0])
            o = out.order[b].clone()
            o[d], o[t] = out.order[b, t], out.order[b, d]
            ref = model(out.tokens[b : b + 1], o[None])[0, d]
            torch.testing.assert_close(out.logits[b, t], ref, atol=1e-5, rtol=0)


def test_armd_strided_decoding_with_padded_rows_matches_the_blocked_forward() -> None:
    model = tiny_model("armd", n_layer=3, l2s=2)
    out = strided_sample(
        model, N, 4, batch=2, generator=torch.Generator().manual_seed(6), keep_logits=True
    )
    o = strided(2, N, 4)
    torch.testing.assert_close(
        out.logits, model(out.tokens, o.order, o.model_blocks), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("table", [False, True])
def test_joined_adaln_equals_each_layers_adaln_in_values_and_gradients(table: bool) -> None:
    """``adaln_stack`` (one matmul for every layer, one gather) against each AdaLN alone."""
    from anyorder.layers import adaln_stack

    model = tiny_model("aogpt", n_layer=3)
    randomize_adaln(model)
    g = torch.Generator().manual_seed(7)
    target = torch.stack([torch.randperm(N, generator=g) for _ in range(2)])
    emb = model.tgt_emb.weight
    cond = TargetCondition(target, emb) if table else model.tgt_emb(target)
    adas = model.adas()
    joined = adaln_stack(adas, cond, model.ada_offset)
    alone = [ada(model.tgt_emb(target)) for ada in adas]
    assert [len(m.chunks) for m in joined] == [6, 6, 6, 2]
    for a, b in zip(joined, alone):
        for x, y in zip(a.chunks, b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    w = [torch.randn(x.shape, generator=g) for c in alone for x in c]
    params = [p for ada in adas for p in ada.parameters()] + [emb]
    chunks = [x for m in joined for x in m.chunks]
    ga = torch.autograd.grad(sum((x * v).sum() for x, v in zip(chunks, w)), params)
    gb = torch.autograd.grad(sum((x * v).sum() for x, v in zip(sum(alone, ()), w)), params)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_row_modulations_pass_gradcheck_and_equal_the_plain_ops() -> None:
    """The training path that gathers the adaLN factors again in backward (saving the
    inputs, not the factors) has the gradients of the plain gather-multiply-add."""
    from anyorder.layers import Modulation

    g = torch.Generator().manual_seed(7)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    idx = torch.tensor([[0, 2, 2], [1, 0, 3]])  # repeated rows: gradients must add up
    x, a, h = t(2, 3, 5), t(2, 3, 5), t(2, 3, 5)
    cols = t(4, 5), t(4, 5), t(4, 5)  # shift, mul, gate

    def run(x, a, h, *cols):
        m = Modulation(tuple(F.embedding(idx, c) for c in cols), cols, idx)
        return m.gate(2, h, m.modulate(0, x) * a)

    def plain(x, a, h, shift, mul, gate):
        return h + gate[idx] * ((x * mul[idx] + shift[idx]) * a)

    assert torch.autograd.gradcheck(run, (x, a, h, *cols))
    torch.testing.assert_close(run(x, a, h, *cols), plain(x, a, h, *cols))
    with torch.no_grad():  # outside autograd: the plain addcmul path
        torch.testing.assert_close(run(x, a, h, *cols), plain(x, a, h, *cols))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("strict", [False, True])
def test_flex_block_mask_has_the_dense_visibility(strict: bool) -> None:
    """The block mask the CUDA path builds, run by FlexAttention's eager reference on the
    CPU (forward only: the CPU has no FlexAttention backward), sees what SDPA's mask sees."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from anyorder.layers import _flex_block_mask

    g = torch.Generator().manual_seed(8)
    blocks = strided(2, 24, 3).model_blocks
    q, k, v = (torch.randn(2, 2, 24, 16, generator=g) for _ in range(3))
    dense = block_visibility(blocks, 24, strict, torch.device("cpu"))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense.dense)
    out = flex.flex_attention(q, k, v, block_mask=_flex_block_mask(blocks, strict))
    if dense.empty is not None:
        ref, out = ref.masked_fill(dense.empty, 0.0), out.masked_fill(dense.empty, 0.0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_rotary_lookup_equals_computing_the_angles() -> None:
    from anyorder import preset
    from anyorder.layers import positions

    cfg = preset("tiny", kind="armd", n_layer=1, n_head=2, d_model=16, seq_len=40)
    pos = torch.stack([torch.randperm(40) for _ in range(3)])
    for got, want in zip(positions(cfg, pos), rotary(pos, 8, cfg.rope_base)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
