"""``train.optimizer=muon``: torch's Muon giving our update, the parameters Muon takes, and
AdamW on the rest exactly as torch's."""

from __future__ import annotations

import pytest
import torch

from anyorder.config import ModelConfig
from anyorder.errors import ConfigError
from anyorder.models import build_model
from anyorder.training.muon import MuonAdamW, muon_matrices

NS = (3.4445, -4.7750, 2.0315)  # Muon's published quintic coefficients


def previous_update(grads: list[torch.Tensor], lr: float, mu: float, wd: float, w: torch.Tensor):
    """Our Muon before torch's took over, written out in float64: a summed momentum
    ``B = mu B + g``, the Nesterov step ``g + mu B``, five Newton-Schulz iterations on it
    normalised by its Frobenius norm, decoupled weight decay, and the step scaled by
    ``0.2 sqrt(max(m, n))``. Returns the weights after every gradient."""
    w, buf = w.double().clone(), torch.zeros_like(w, dtype=torch.float64)
    a, b, c = NS
    for g in grads:
        buf = mu * buf + g.double()
        x = g.double() + mu * buf
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        x = x / x.norm()
        for _ in range(5):
            s = x @ x.T
            x = a * x + (b * s + c * (s @ s)) @ x
        x = x.T if tall else x
        w = w * (1 - lr * wd) - lr * 0.2 * max(w.shape) ** 0.5 * x
    return w


@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])
def test_torch_muon_gives_our_update(shape):
    """The same gradients on the same weights: torch's Muon in MuonAdamW against the update
    we computed ourselves before, to the bf16 round-off of the iteration."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=gen) * 0.05
    grads = [torch.randn(shape, generator=gen) for _ in range(6)]
    w = torch.nn.Parameter(w0.clone())
    opt = MuonAdamW([{"params": [w], "muon": True, "weight_decay": 0.1}], lr=1e-2, momentum=0.9)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    want = previous_update(grads, 1e-2, 0.9, 0.1, w0).float()
    step = (want - w0).norm()
    assert (w.detach() - want).norm() < 0.02 * step  # bf16 iterations: about 1% apart


def test_muon_groups_step_exactly_as_torch_muon():
    """MuonAdamW hands its Muon groups to torch.optim.Muon with our settings: the same
    weights as a torch Muon of its own, to fp32 round-off."""
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(24, 40, generator=gen)) for _ in range(2)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = torch.optim.Muon(
        ps, lr=3e-3, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw"
    )
    ours = MuonAdamW([{"params": qs, "muon": True, "weight_decay": 0.1}], lr=3e-3, momentum=0.9)
    for _ in range(5):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ref.step()
        ours.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)


def test_a_checkpoint_of_the_summed_momentum_resumes_with_the_same_updates():
    """A state dict from before torch's Muon (a summed momentum buffer, no torch keys)
    resumes to the weights an uninterrupted run reaches."""
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(16, 32, generator=gen) * 0.05
    grads = [torch.randn(16, 32, generator=gen) for _ in range(6)]
    run = torch.nn.Parameter(w0.clone())
    opt = MuonAdamW([{"params": [run], "muon": True}], lr=1e-2, momentum=0.9)
    buf = torch.zeros_like(w0)
    for g in grads:
        run.grad = g.clone()
        opt.step()
    for g in grads[:3]:
        buf = 0.9 * buf + g  # what the earlier version kept
    w = torch.nn.Parameter(w0.clone())
    part = MuonAdamW([{"params": [w], "muon": True}], lr=1e-2, momentum=0.9)
    for g in grads[:3]:
        w.grad = g.clone()
        part.step()
    old = part.state_dict()
    old["state"][0] = {"momentum_buffer": buf.clone()}
    group = old["param_groups"][0]
    old["param_groups"][0] = {k: group[k] for k in ("lr", "betas", "momentum", "muon",
                                                    "weight_decay", "params")}  # fmt: skip
    old["param_groups"][0]["eps"] = 1e-8
    resumed = MuonAdamW([{"params": [w], "muon": True}], lr=1e-2, momentum=0.9)
    resumed.load_state_dict(old)
    for g in grads[3:]:
        w.grad = g.clone()
        resumed.step()
    torch.testing.assert_close(w, run, rtol=0, atol=1e-5)


def test_muon_needs_torch_muon(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match="train.optimizer=muon needs torch.optim.Muon"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(3, 3))], "muon": True}], lr=1e-3)


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


def _half_empty(empty: str, gen: torch.Generator):
    """Groups as ``make_optimizer`` builds them (a Muon group, AdamW's decayed and undecayed
    groups) with one half holding no parameter, the parameters, and a maker of the torch
    optimizer of the other half."""
    mats = [torch.nn.Parameter(torch.randn(24, 40, generator=gen)) for _ in range(2)]
    vec = torch.nn.Parameter(torch.randn(40, generator=gen))
    if empty == "adamw":  # a LoRA run's adapters: matrices all
        params = mats
        sizes = {"muon": 2, "decayed": 0, "undecayed": 0}
    else:
        params = [mats[0], vec]
        sizes = {"muon": 0, "decayed": 1, "undecayed": 1}
    it = iter(params)
    groups = [
        {"params": [next(it) for _ in range(sizes[name])], "weight_decay": wd, **extra}
        for name, wd, extra in (("muon", 0.1, {"muon": True}), ("decayed", 0.1, {}),
                                ("undecayed", 0.0, {}))
    ]  # fmt: skip

    def reference(ps):
        if empty == "adamw":
            kw = {"momentum": 0.9, "adjust_lr_fn": "match_rms_adamw"}
            return torch.optim.Muon(ps, lr=1e-2, weight_decay=0.1, **kw)
        return torch.optim.AdamW(
            [{"params": ps[:1], "weight_decay": 0.1}, {"params": ps[1:], "weight_decay": 0.0}],
            lr=1e-2,
            betas=(0.9, 0.95),
        )

    return groups, params, reference


@pytest.mark.parametrize("empty", ["adamw", "muon"])
def test_a_half_without_parameters_steps_and_resumes_as_the_other_alone(empty, tmp_path):
    """Issue 40, item 2: a half without parameters (under LoRA every trainable tensor is a
    matrix, so AdamW's groups are empty) used to fail in the constructor. Now the other half
    steps exactly as its torch optimizer alone, under a schedule that sets every group's lr,
    and its state dict resumes exactly."""
    gen = torch.Generator().manual_seed(3)
    groups, ps, make_ref = _half_empty(empty, gen)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = make_ref(qs)
    ours = MuonAdamW(groups, lr=1e-2, betas=(0.9, 0.95), momentum=0.9)
    grads = [[torch.randn(p.shape, generator=gen) for p in ps] for _ in range(6)]
    for step, gs in enumerate(grads):
        if step == 3:  # save, and go on with a fresh optimizer that loads the state
            torch.save(ours.state_dict(), tmp_path / "opt.pt")
            again, _, _ = _half_empty(empty, torch.Generator().manual_seed(3))
            for g_new, g_old in zip(again, ours.param_groups):
                g_new["params"] = g_old["params"]
            ours = MuonAdamW(again, lr=1e-2, betas=(0.9, 0.95), momentum=0.9)
            ours.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
        lr = 1e-2 * (1 - step / 10)
        for opt in (ours, ref):
            for group in opt.param_groups:
                group["lr"] = lr
        for p, q, g in zip(ps, qs, gs):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_the_adaln_linears_take_adamw_and_older_muon_checkpoints_are_refused():
    """adaLN's linears start at zero, where Muon's first step has full size whatever the
    gradient: they take AdamW (docs/results.md: 5.3% against 7.7% above the floor). A
    checkpoint whose Muon group still holds them is refused in one line, not as damaged."""
    from anyorder.errors import CheckpointError
    from anyorder.layers.adaln import AdaLN

    cfg = ModelConfig(kind="aogpt", n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=50)
    model = build_model(cfg)
    adaln = [m.linear.weight for m in model.modules() if isinstance(m, AdaLN)]
    assert len(adaln) == 3  # two blocks and the final norm
    taken = {id(p) for p in muon_matrices(model)}
    assert taken and not taken & {id(p) for p in adaln}
    assert id(model.blocks[0].attn.qkv.weight) in taken
    rest = [p for p in model.parameters() if id(p) not in taken]
    ours = MuonAdamW([{"params": list(muon_matrices(model)), "muon": True}, {"params": rest}], 1e-3)
    older = MuonAdamW(
        [
            {"params": list(muon_matrices(model)) + adaln, "muon": True},
            {"params": [p for p in rest if all(p is not q for q in adaln)]},
        ],
        1e-3,
    )
    with pytest.raises(CheckpointError, match="written before the adaLN linears moved to AdamW"):
        ours.load_state_dict(older.state_dict())


# ---- Newton-Schulz in fp32, for a CPU without bf16 units (issue 31) ----


def _steps(opt, ws, grads_per_step):
    for grads in grads_per_step:
        for w, g in zip(ws, grads):
            w.grad = g.clone()
        opt.step()


def _problem(seed: int, shapes, n_steps: int):
    gen = torch.Generator().manual_seed(seed)
    w0 = [torch.randn(s, generator=gen) * 0.05 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(n_steps)]
    return w0, grads


@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])
def test_fp32_iteration_is_the_update_to_fp32_round_off(shape):
    """ns_dtype=float32: the float64 update written out above, to fp32's round-off (50x
    closer than torch's bf16 iteration gets to it, so the iteration really ran in fp32)."""
    (w0,), grads = _problem(0, [shape], 6)
    w = torch.nn.Parameter(w0.clone())
    opt = MuonAdamW(
        [{"params": [w], "muon": True, "weight_decay": 0.1}],
        lr=1e-2,
        momentum=0.9,
        ns_dtype=torch.float32,
    )
    _steps(opt, [w], grads)
    want = previous_update([g for (g,) in grads], 1e-2, 0.9, 0.1, w0).float()
    assert (w.detach() - want).norm() < 2e-4 * (want - w0).norm()


def test_fp32_iteration_matches_torch_muon_to_bf16_round_off():
    """Against torch.optim.Muon itself (bf16 iteration), several matrices and steps: the
    same weights to bf16's round-off of the step, the same momentum buffers to fp32's."""
    shapes = [(24, 40), (40, 24), (32, 32)]
    w0, grads = _problem(3, shapes, 5)
    ps = [torch.nn.Parameter(w.clone()) for w in w0]
    qs = [torch.nn.Parameter(w.clone()) for w in w0]
    ref = torch.optim.Muon(
        ps, lr=3e-3, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw"
    )
    group = {"params": qs, "muon": True, "weight_decay": 0.1}
    ours = MuonAdamW([group], lr=3e-3, momentum=0.9, ns_dtype=torch.float32)
    _steps(ref, ps, grads)
    _steps(ours, qs, grads)
    for p, q, w in zip(ps, qs, w0):
        assert (q - p).norm() < 0.02 * (p - w).norm()  # bf16 iterations: about 1% apart
        torch.testing.assert_close(
            ours.state[q]["momentum_buffer"], ref.state[p]["momentum_buffer"]
        )


def test_bf16_iteration_is_torch_muon_exactly():
    """ns_dtype=bfloat16 (the default, where bf16 is fast) is torch's Muon: bit for bit."""
    w0, grads = _problem(4, [(24, 40), (40, 24)], 4)
    ps = [torch.nn.Parameter(w.clone()) for w in w0]
    qs = [torch.nn.Parameter(w.clone()) for w in w0]
    ref = torch.optim.Muon(
        ps, lr=3e-3, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw"
    )
    ours = MuonAdamW(
        [{"params": qs, "muon": True, "weight_decay": 0.1}],
        lr=3e-3,
        momentum=0.9,
        ns_dtype=torch.bfloat16,
    )
    _steps(ref, ps, grads)
    _steps(ours, qs, grads)
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))


@pytest.mark.parametrize("first,then", [("float32", "float32"), ("bfloat16", "float32"),
                                        ("float32", "bfloat16")])  # fmt: skip
def test_fp32_iteration_resumes_exactly_and_checkpoints_cross_over(first, then, tmp_path):
    """A run stepped by the fp32 iteration, saved and resumed, ends on the weights of an
    uninterrupted one, bit for bit; a checkpoint written by either iteration loads into the
    other (the same keys) and continues to that iteration's round-off."""
    a, b = getattr(torch, first), getattr(torch, then)
    (w0, v0), grads = _problem(5, [(16, 32), (32,)], 6)

    def make(dtype):
        w, v = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(v0.clone())
        opt = MuonAdamW([{"params": [w], "muon": True}, {"params": [v]}], 1e-2, ns_dtype=dtype)
        return opt, [w, v]

    straight, ws = make(b)
    _steps(straight, ws, grads[:3])
    before = straight.state_dict()
    _steps(straight, ws, grads[3:])
    part, us = make(a)
    _steps(part, us, grads[:3])
    torch.save(part.state_dict(), tmp_path / "opt.pt")
    assert part.state_dict()["param_groups"] == before["param_groups"]  # nothing records it
    resumed, rs = make(b)
    for r, u in zip(rs, us):
        r.data.copy_(u.data)
    resumed.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    _steps(resumed, rs, grads[3:])
    if a == b:
        assert all(torch.equal(r, w) for r, w in zip(rs, ws))
    else:
        assert (rs[0] - ws[0]).norm() < 0.02 * (ws[0] - w0).norm()
        torch.testing.assert_close(rs[1], ws[1], rtol=0, atol=1e-5)


def test_make_optimizer_iterates_in_fp32_where_bf16_is_slow(monkeypatch):
    """training.setup.make_optimizer asks anyorder.precision: fp32 where this CPU's bf16 is
    slow, torch's bf16 where it is fast, bf16 on CUDA whatever the CPU."""
    from anyorder.config import load_config
    from anyorder.training.setup import make_optimizer

    cfg = load_config(None, ["model.preset=tiny", "model.n_layer=1", "train.optimizer=muon"])
    model = build_model(cfg.model)
    for flag, want in (("0", torch.float32), ("1", torch.bfloat16)):
        monkeypatch.setenv("ANYORDER_CPU_BF16", flag)
        assert make_optimizer(model, cfg, torch.device("cpu")).ns_dtype == want
    monkeypatch.setenv("ANYORDER_CPU_BF16", "0")
    assert make_optimizer(model, cfg, torch.device("cuda")).ns_dtype == torch.bfloat16
