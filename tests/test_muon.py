"""``train.optimizer=muon``: the Newton-Schulz step, the parameters Muon takes, and AdamW on
the rest exactly as torch's."""

from __future__ import annotations

import pytest
import torch

from anyorder.config import ModelConfig
from anyorder.models import build_model
from anyorder.training.muon import MuonAdamW, muon_matrices, orthogonalize


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64)])
def test_orthogonalize_is_near_the_polar_factor(shape):
    gen = torch.Generator().manual_seed(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=gen))
    s = torch.logspace(0, -1.5, k)  # a badly conditioned gradient: condition number ~32
    g = u @ torch.diag(s) @ v.T
    o = orthogonalize(g)
    assert o.shape == g.shape and o.dtype == g.dtype
    # in g's singular basis the step is diagonal, with every direction brought near 1 (the
    # polar factor u v^T would have exactly 1; five bf16 iterations land in about [0.7, 1.2])
    core = u.T @ o @ v
    diag = torch.diagonal(core)
    assert (core - torch.diag(diag)).norm() < 0.05 * diag.norm()
    assert diag.min() > 0.6 and diag.max() < 1.3, diag
    # and nothing outside g's row and column spaces
    assert (o - u @ core @ v.T).norm() < 0.05 * o.norm()


def test_a_stack_is_orthogonalized_matrix_by_matrix():
    gen = torch.Generator().manual_seed(1)
    stack = torch.randn(3, 24, 40, generator=gen) * torch.tensor([1.0, 10.0, 0.1])[:, None, None]
    together = orthogonalize(stack)
    for i in range(3):
        torch.testing.assert_close(together[i], orthogonalize(stack[i]), rtol=0, atol=2e-2)
    tall = orthogonalize(stack.mT)  # tall matrices: the transpose of the wide ones' steps
    torch.testing.assert_close(tall, together.mT, rtol=0, atol=2e-2)


def test_muon_takes_the_hidden_matrices_and_nothing_else():
    cfg = ModelConfig(kind="armd", n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=50)
    model = build_model(cfg)
    taken = {id(p) for p in muon_matrices(model)}
    names = {n for n, p in model.named_parameters() if id(p) in taken}
    assert "tok_emb.weight" not in names and "head.weight" not in names
    assert all(model.get_parameter(n).dim() == 2 for n in names)
    assert {"blocks.0.attn.qkv.weight", "blocks.1.mlp.proj.weight", "query_mlp.0.weight"} <= names
    for kind in ("gpt", "mdm"):  # an untied head: a Head, or the encoder's plain Linear
        untied = build_model(
            ModelConfig(
                kind=kind,
                n_layer=1,
                n_head=2,
                d_model=32,
                seq_len=16,
                vocab_size=50,
                tie_embeddings=False,
            )
        )
        mats = {id(q) for q in muon_matrices(untied)}
        assert untied.head.weight.dim() == 2 and id(untied.head.weight) not in mats
        assert id(untied.blocks[0].attn.qkv.weight) in mats


def test_the_adamw_groups_step_exactly_as_torch_adamw():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(7))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = {"lr": 1e-2, "betas": (0.9, 0.99)}
    ref = torch.optim.AdamW(
        [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}], **kw
    )
    ours = MuonAdamW(
        [{"params": qs[:1], "weight_decay": 0.1}, {"params": qs[1:], "weight_decay": 0.0}], **kw
    )
    for _ in range(10):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ref.step()
        ours.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_a_muon_step_has_the_size_of_an_adamw_step():
    """The scale 0.2 sqrt(max(m, n)) gives the update AdamW's typical RMS (about 0.2 lr)."""
    w = torch.nn.Parameter(torch.zeros(64, 256))
    opt = MuonAdamW([{"params": [w], "muon": True}], lr=1e-2, momentum=0.0)
    w.grad = torch.randn_like(w)
    opt.step()
    rms = w.detach().pow(2).mean().sqrt().item()
    assert 0.5 * 0.2e-2 < rms < 1.5 * 0.2e-2
    # the update descends: it correlates negatively with the gradient
    assert (w.detach() * w.grad).sum() < 0


def test_muon_refuses_a_vector():
    with pytest.raises(ValueError, match="Muon takes matrices only"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "muon": True}], lr=1e-3)


def test_muon_state_round_trips(tmp_path):
    w = torch.nn.Parameter(torch.randn(8, 16))
    b = torch.nn.Parameter(torch.randn(16))
    opt = MuonAdamW([{"params": [w], "muon": True}, {"params": [b]}], lr=1e-2)
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    w2 = torch.nn.Parameter(w.detach().clone())
    b2 = torch.nn.Parameter(b.detach().clone())
    opt2 = MuonAdamW([{"params": [w2], "muon": True}, {"params": [b2]}], lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    g, h = torch.randn_like(w), torch.randn_like(b)
    w.grad, b.grad, w2.grad, b2.grad = g, h, g.clone(), h.clone()
    opt.step()
    opt2.step()
    assert torch.equal(w, w2) and torch.equal(b, b2)
