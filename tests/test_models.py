"""The models' invariants: strict causality, ARMD's permutation behaviour, the two-stream
attention against an explicit reference, AO-GPT vs GPT, overfitting, parameter counts."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from anyorder import build_model, orders, preset
from anyorder.errors import ConfigError
from anyorder.layers import apply_rope, rope_angles
from anyorder.models import count_params
from anyorder.models.armd import prefix_mean

from conftest import tiny_model


def random_blocks(n: int, gen: torch.Generator) -> torch.Tensor:
    """Block ids with random sizes: a cut after each slot with probability 1/2."""
    cuts = torch.rand(n - 1, generator=gen) < 0.5
    return torch.cat([torch.zeros(1, dtype=torch.long), cuts.long().cumsum(0)])


def perturb(tokens: torch.Tensor, pos: int, vocab: int) -> torch.Tensor:
    out = tokens.clone()
    out[:, pos] = (out[:, pos] + 1 + torch.arange(len(out)) % (vocab - 1)) % vocab
    return out


@pytest.mark.parametrize("kind", ["aogpt", "armd", "gpt", "mdm"])
def test_strict_causality(kind: str, gen: torch.Generator) -> None:
    """Changing a token of block >= B(t) leaves slot t's logits alone; earlier blocks matter."""
    n, B = 8, 3
    model = tiny_model(kind)
    tokens = torch.randint(0, 11, (B, n), generator=gen)
    for trial in range(3):
        o = orders.l2r(B, n) if kind == "gpt" else orders.uniform(B, n, gen)
        order = o.order
        blocks = None
        if kind in ("armd", "mdm") and trial > 0:
            blocks = random_blocks(n, gen).expand(B, n).contiguous()
        slot_blocks = blocks if blocks is not None else torch.arange(n).expand(B, n)
        base = model(tokens, order if kind != "gpt" else None, blocks)
        for s in range(n):  # perturb the token generated at slot s (same slot in every row)
            changed = tokens.clone()
            for b in range(B):
                changed[b] = perturb(tokens[b : b + 1], int(order[b, s]), 11)[0]
            out = model(changed, order if kind != "gpt" else None, blocks)
            for t in range(n):
                later = slot_blocks[:, s] >= slot_blocks[:, t]  # (B,)
                for b in range(B):
                    if later[b]:
                        assert_close(out[b, t], base[b, t], atol=1e-5, rtol=0)
                    else:
                        assert (out[b, t] - base[b, t]).abs().max() > 1e-4


def test_armd_context_order_invariance_and_target_equivariance(gen: torch.Generator) -> None:
    """Context in block 0, targets in block 1: invariant to the context's inner order,
    equivariant in the targets' order."""
    n, c = 10, 6
    model = tiny_model("armd", n_layer=3)
    tokens = torch.randint(0, 11, (2, n), generator=gen)
    perm = torch.randperm(n, generator=gen)
    ctx, tgt = perm[:c], perm[c:]
    blocks = torch.tensor([0] * c + [1] * (n - c)).expand(2, n)
    base = model(tokens, torch.cat([ctx, tgt]).expand(2, n), blocks)
    ctx2 = ctx[torch.randperm(c, generator=gen)]
    swapped = model(tokens, torch.cat([ctx2, tgt]).expand(2, n), blocks)
    assert_close(swapped[:, c:], base[:, c:], atol=1e-5, rtol=1e-5)
    tperm = torch.randperm(n - c, generator=gen)
    moved = model(tokens, torch.cat([ctx, tgt[tperm]]).expand(2, n), blocks)
    assert_close(moved[:, c:], base[:, c:][:, tperm], atol=1e-5, rtol=1e-5)
    # ... while with token-level blocks the context order does matter
    a = model(tokens, torch.cat([ctx, tgt]).expand(2, n))
    b = model(tokens, torch.cat([ctx2, tgt]).expand(2, n))
    assert (a[:, c] - b[:, c]).abs().max() > 1e-4


def reference_armd(model, tokens: torch.Tensor, order: torch.Tensor, blocks: torch.Tensor):
    """ARMD computed query by query from explicitly built visible sets (no masks)."""
    B, n = tokens.shape
    cfg = model.cfg
    H, D = cfg.n_head, cfg.d_head
    out = []
    for b in range(B):
        o, bl = order[b], blocks[b]
        x = tokens[b, o]
        h = model.tok_emb(x)  # (n, d)
        prefix = torch.stack(
            [
                h[bl < bl[t]].mean(0) if (bl < bl[t]).any() else torch.zeros_like(h[0])
                for t in range(n)
            ]
        )
        g = model.embed_query(o[None], prefix[None])[0]

        def attention(block, xq, xkv, visible, o=o):
            attn = block.attn
            q, _, _ = attn.project(block.norm1(xq)[None], o[None])
            _, k, v = attn.project(block.norm1(xkv)[None], o[None])
            q, k, v = q[0], k[0], v[0]  # (H, n, D); keys and values (Hkv, n, D)
            # grouped-query attention: key/value head j serves query heads j*G .. j*G+G-1
            k, v = (t.repeat_interleave(H // t.shape[0], dim=0) for t in (k, v))
            rows = []
            for i in range(n):
                idx = [j for j in range(n) if visible(i, j)]
                if not idx:
                    rows.append(torch.zeros(H, D))
                    continue
                kk, vv = k[:, idx], v[:, idx]
                w = torch.softmax(q[:, i : i + 1] @ kk.transpose(-1, -2) / math.sqrt(D), dim=-1)
                rows.append((w @ vv)[:, 0])
            y = torch.stack(rows, dim=1).transpose(0, 1).reshape(n, H * D)
            return attn.proj(y)

        def strict(i, j, bl=bl):
            return bl[j] < bl[i]

        def causal(i, j, bl=bl):
            return bl[j] <= bl[i]

        for li, block in enumerate(model.blocks):
            if li < model.l2s:
                g_new = g + attention(block, g, h, strict)
                h = h + attention(block, h, h, causal)
                h = h + block.mlp(block.norm2(h))
                g = g_new + block.mlp(block.norm2(g_new))
            else:
                g = g + attention(block, g, g, causal)
                g = g + block.mlp(block.norm2(g))
        out.append(model.head(model.norm_f(g)))
    return torch.stack(out)


@pytest.mark.parametrize("l2s", [1, 2, 3])
def test_two_stream_attention_matches_explicit_reference(l2s: int, gen: torch.Generator) -> None:
    n = 9
    model = tiny_model("armd", n_layer=3, l2s=l2s)
    tokens = torch.randint(0, 11, (2, n), generator=gen)
    order = orders.uniform(2, n, gen).order
    for blocks in (torch.arange(n).expand(2, n), random_blocks(n, gen).expand(2, n)):
        ref = reference_armd(model, tokens, order, blocks)
        token_level = bool((blocks.diff(dim=-1) > 0).all())
        got = model(tokens, order, None if token_level else blocks.contiguous())
        assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_prefix_mean_is_a_normalised_prefix_sum() -> None:
    h = torch.arange(12, dtype=torch.float32).view(1, 6, 2)
    blocks = torch.tensor([[0, 0, 1, 2, 2, 2]])
    got = prefix_mean(h, blocks)
    assert_close(got[0, :2], torch.zeros(2, 2))
    assert_close(got[0, 2], h[0, :2].mean(0))
    assert_close(got[0, 3:], h[0, :3].mean(0).expand(3, 2))
    assert_close(prefix_mean(h, None)[0, 4], h[0, :4].mean(0))


def test_rope_uses_given_positions() -> None:
    """RoPE on explicit, non-monotone positions: scores depend on position differences only."""
    x = torch.randn(1, 1, 2, 8)
    pos_a = torch.tensor([[3, 7]])
    pos_b = torch.tensor([[10, 14]])
    ra = apply_rope(x, *rope_angles(pos_a, 8, 10000.0))
    rb = apply_rope(x, *rope_angles(pos_b, 8, 10000.0))
    score_a = (ra[..., 0, :] * ra[..., 1, :]).sum(-1)
    score_b = (rb[..., 0, :] * rb[..., 1, :]).sum(-1)
    assert_close(score_a, score_b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ra, rb)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_aogpt_with_zero_modulation_equals_gpt(pos_emb: str, gen: torch.Generator) -> None:
    """adaLN starts at zero, so AO-GPT on the identity order computes exactly what the GPT
    with the same trunk weights computes."""
    gpt = tiny_model("gpt", pos_emb=pos_emb)
    ao = tiny_model("aogpt", seed=1, pos_emb=pos_emb)
    missing, unexpected = ao.load_state_dict(gpt.state_dict(), strict=False)
    assert not unexpected
    assert all(k.startswith(("tgt_emb", "final_ada")) or ".ada." in k for k in missing)
    tokens = torch.randint(0, 11, (3, 12), generator=gen)
    assert_close(ao(tokens, orders.l2r(3, 12).order), gpt(tokens), atol=1e-5, rtol=1e-5)
    # a non-zero modulation makes the target position matter
    with torch.no_grad():
        for p in ao.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    assert (ao(tokens, orders.l2r(3, 12).order) - gpt(tokens)).abs().max() > 1e-3


def test_aogpt_additive_injection_runs_and_depends_on_target(gen: torch.Generator) -> None:
    model = tiny_model("aogpt", target_injection="add")
    tokens = torch.randint(0, 11, (1, 6), generator=gen)
    a = model(tokens, torch.tensor([[0, 1, 2, 3, 4, 5]]))
    b = model(tokens, torch.tensor([[0, 1, 2, 3, 5, 4]]))
    assert_close(a[:, :4], b[:, :4])  # same slots, same targets
    assert (a[:, 4] - b[:, 4]).abs().max() > 1e-4  # slot 4 now targets position 5


def test_aogpt_queries_rotated_to_their_targets(gen: torch.Generator) -> None:
    """``rope_query=target``: in a fresh model (adaLN zero) a slot's prediction depends on its
    target position only through its query's rotation. It moves when the target moves;
    rotated at the input position (as published) nothing else carries the target."""
    tokens = torch.randint(0, 11, (2, 6), generator=gen)
    o1, o2 = torch.tensor([[0, 1, 2, 3, 4, 5]]), torch.tensor([[0, 1, 2, 3, 5, 4]])
    for rope_query in ("input", "target"):
        model = tiny_model("aogpt", pos_emb="rope", rope_query=rope_query)
        with torch.no_grad():
            a, b = model(tokens, o1.expand(2, 6)), model(tokens, o2.expand(2, 6))
        assert_close(a[:, :4], b[:, :4], atol=1e-6, rtol=0)  # same slots, same targets
        moved = float((a[:, 4] - b[:, 4]).abs().max())
        assert moved > 1e-4 if rope_query == "target" else moved < 1e-6
    for kw in ({"kind": "gpt", "pos_emb": "rope"}, {"kind": "aogpt"}):  # not aogpt; not rope
        with pytest.raises(ConfigError, match="model.rope_query=target rotates aogpt's queries"):
            preset("tiny", rope_query="target", **kw)
    with pytest.raises(ConfigError, match="model.rope_query='key': use input or target"):
        preset("tiny", kind="aogpt", rope_query="key")


def test_gpt_refuses_other_orders_and_blocks(gen: torch.Generator) -> None:
    gpt = tiny_model("gpt")
    tokens = torch.randint(0, 11, (1, 5), generator=gen)
    with pytest.raises(ConfigError, match="gpt is a left-to-right model"):
        gpt(tokens, torch.tensor([[1, 0, 2, 3, 4]]))
    with pytest.raises(ConfigError, match="aogpt predicts one token per slot"):
        tiny_model("aogpt")(tokens, torch.arange(5)[None], torch.tensor([[0, 0, 1, 1, 2]]))
    with pytest.raises(ConfigError, match="longer than the model's context"):
        gpt(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd", "mdm"])
def test_overfits_one_batch_and_every_parameter_learns(kind: str) -> None:
    """Loss on one repeated sequence falls below 0.05 nats/token within 600 steps, with
    random orders every step; every parameter receives gradient."""
    torch.manual_seed(0)
    model = tiny_model(kind, seq_len=12).train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (1, 12), generator=g).expand(8, 12)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sampler = orders.OrderSampler(orders.OrderConfig(kind="l2r" if kind == "gpt" else "uniform"))
    losses = []
    for step in range(600):
        o = sampler(8, 12, step, g)
        loss = model.loss(tokens, None if kind == "gpt" else o.order, generator=g)
        opt.zero_grad()
        loss.backward()
        if step == 5:
            no_grad = [
                n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0
            ]
            assert not no_grad, f"parameters without gradient: {no_grad}"
        opt.step()
        losses.append(loss.item())
        if len(losses) > 10 and max(losses[-10:]) < 0.05:
            break
    assert max(losses[-10:]) < 0.05, f"{kind} did not overfit: last losses {losses[-10:]}"


def test_loss_is_cross_entropy_of_slot_aligned_logits(gen: torch.Generator) -> None:
    model = tiny_model("armd")
    tokens = torch.randint(0, 11, (2, 7), generator=gen)
    order = orders.uniform(2, 7, gen).order
    logits = model(tokens, order)
    expected = F.cross_entropy(logits.flatten(0, 1), tokens.gather(1, order).flatten())
    assert_close(model.loss(tokens, order), expected)


def test_param_counts_match_gpt2() -> None:
    """gpt small/medium within 5% of GPT-2 small (124M) and medium (355M)."""
    small = count_params(preset("small", kind="gpt"))
    medium = count_params(preset("medium", kind="gpt"))
    assert abs(small / 124.4e6 - 1) < 0.05, small
    assert abs(medium / 354.8e6 - 1) < 0.05, medium


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd", "mdm"])
def test_count_params_is_the_built_models_count(kind: str) -> None:
    extra = {"pos_emb": "rope", "rope_query": "target"} if kind == "aogpt" else {}
    for cfg in (preset("tiny", kind=kind), preset("tiny", kind=kind, n_layer=3, **extra)):
        assert count_params(cfg) == build_model(cfg).num_params()
    # torch.nn.init is back in place afterwards
    w = torch.empty(64)
    torch.nn.init.normal_(w)
    assert w.std() > 0.5


def _draws(fn) -> bool:
    """Whether ``fn`` (a ``torch.nn.init`` function, or the module's current one) changed
    a tensor of sevens."""
    t = torch.full((256,), 7.0)
    fn(t)
    return not bool((t == 7.0).all())


def test_loads_in_two_threads_at_once_leave_the_init_functions_in_place() -> None:
    """Two loads (``build_model(init=False)``) overlapping in two threads, the first to
    start finishing first: afterwards torch.nn.init draws again. Each context saving and
    restoring the functions itself left the second's no-ops in place for good, and every
    model built later had uninitialised (NaN) weights (a CI run: 445 failures)."""
    from torch.nn import init

    from anyorder.models import _inits_off

    real = {name: getattr(init, name) for name in ("normal_", "zeros_", "trunc_normal_")}
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with _inits_off():
            a_in.set()
            assert b_in.wait(30)
            seen["first, inside"] = _draws(lambda t: init.normal_(t))
        a_out.set()

    def second() -> None:
        assert a_in.wait(30)
        with _inits_off():
            b_in.set()
            assert a_out.wait(30)
            seen["second, inside, after the first closed"] = _draws(lambda t: init.normal_(t))
            seen["another thread meanwhile"] = _other_thread_draws()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert seen == {
        "first, inside": False,
        "second, inside, after the first closed": False,
        "another thread meanwhile": True,
    }
    assert all(getattr(init, name) is fn for name, fn in real.items())
    model = build_model(preset("tiny", kind="aogpt", vocab_size=11, seq_len=8, d_model=32))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.tok_emb.weight.std() > 0.01


def _other_thread_draws() -> bool:
    """Whether a thread outside any load draws (its models are initialised as usual)."""
    from torch.nn import init

    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(_draws(lambda x: init.normal_(x))))
    t.start()
    t.join(30)
    return out == [True]


def test_count_params_imports_no_dynamo() -> None:
    """`anyorder info` stays instant: counting on the meta device must not pull in
    torch._dynamo (a second of start-up), for any model at the papers' size."""
    import subprocess
    import sys

    code = (
        "import sys; from anyorder.config import preset; from anyorder.models import "
        "count_params; [count_params(preset('small', kind=k)) for k in "
        "('gpt', 'aogpt', 'armd', 'mdm')]; assert 'torch._dynamo' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="model.d_model=100 is not divisible by model.n_head=3"):
        preset("tiny", d_model=100, n_head=3)
    with pytest.raises(ConfigError, match="model.kind='bert' is not a model"):
        preset("tiny", kind="bert")
    with pytest.raises(ConfigError, match="model.l2s=9 must be between 1 and model.n_layer=4"):
        preset("tiny", kind="armd", l2s=9)
