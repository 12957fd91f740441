"""The head's cross-entropy in chunks (``layers/head_loss.py``) against the plain
``F.cross_entropy`` of the full logits: loss and gradients of ``h``, the head's weight and
bias, under fp32 and bf16 autocast, in one chunk and in many; and what it keeps for
backward: no tensor of the logits' size."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from anyorder.layers import head_loss
from anyorder.layers.head_loss import head_cross_entropy

from conftest import tiny_model


def _plain(h, w, b, y, wt):
    logits = F.linear(h, w, b).float()
    return (
        F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none") * wt.flatten()
    ).sum()


def _grads(fn, h, w, b, y, wt):
    leaves = [t.detach().clone().requires_grad_() for t in (h, w, b)]
    loss = fn(*leaves, y, wt)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize(  # the plain path (small heads); one chunk; rows of 3; of 1
    ("plain_up_to", "chunk"), [(1 << 22, 1 << 25), (0, 1 << 25), (0, 37 * 3), (0, 37)]
)
@pytest.mark.parametrize("autocast", [False, True])
def test_equals_the_plain_cross_entropy(
    monkeypatch, plain_up_to: int, chunk: int, autocast: bool
) -> None:
    monkeypatch.setattr(head_loss, "PLAIN_UP_TO", plain_up_to)
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    B, T, d, V = 2, 5, 16, 37
    h, w, b = (
        torch.randn(B, T, d, generator=g),
        torch.randn(V, d, generator=g),
        torch.randn(V, generator=g),
    )
    y = torch.randint(0, V, (B, T), generator=g)
    wt = torch.rand(B, T, generator=g) * (torch.rand(B, T, generator=g) > 0.3)  # some rows off
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        la, ga = _grads(_plain, h, w, b, y, wt)
        lb, gb = _grads(head_cross_entropy, h, w, b, y, wt)
        with torch.no_grad():
            lc = head_cross_entropy(h, w, b, y, wt)
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-5)
    assert lb.dtype == torch.float32
    torch.testing.assert_close(lb, la, **tol)
    torch.testing.assert_close(lc, lb, atol=1e-6, rtol=1e-6)  # no-grad: the same chunks
    for a, c in zip(ga, gb):
        assert c.dtype == a.dtype == torch.float32
        torch.testing.assert_close(c, a, **tol)
    assert torch.equal(gb[0][wt == 0], torch.zeros_like(gb[0][wt == 0]))  # weight 0: no grad


@pytest.mark.parametrize(
    ("kind", "head"),
    [
        ("gpt", dict(tie_embeddings=True)),
        ("aogpt", dict(tie_embeddings=False, head_bias=True)),
        ("armd", dict(tie_embeddings=True, padded_vocab=128)),  # the head's first 97 rows
    ],
)
@pytest.mark.parametrize("plain_up_to", [0, 1 << 22])  # a large head; a small one (plain)
def test_a_decoders_loss_keeps_no_logits_for_backward(
    monkeypatch, kind: str, head: dict, plain_up_to: int
) -> None:
    """The loss equals the plain cross-entropy of ``forward``'s logits (and its gradients),
    and, above ``PLAIN_UP_TO`` logits, autograd saves no tensor with a row per token and a
    column per vocabulary id (the plain path saves two: the logits and their log-softmax)."""
    monkeypatch.setattr(head_loss, "PLAIN_UP_TO", plain_up_to)
    model = tiny_model(kind, vocab_size=97, seq_len=16, **head).train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (3, 16), generator=g)
    order = (
        None if kind == "gpt" else torch.stack([torch.randperm(16, generator=g) for _ in range(3)])
    )
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(tokens, order)
    loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(tokens, order).float()
    plain = F.cross_entropy(logits.flatten(0, 1), model.targets(tokens, order).flatten())
    plain.backward()
    torch.testing.assert_close(loss, plain, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)
    logits_kept = [s for s in saved if s and s[-1] == 97 and torch.Size(s).numel() >= 48 * 97]
    assert saved and bool(logits_kept) == (plain_up_to > 0)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_chunked_head_loss_under_two_ranks_matches_one_process(tmp_path, monkeypatch, fsdp):
    """The head's loss in chunks (inside ``forward``, so DDP's and FSDP2's hooks see the
    head's weight used) under two gloo ranks gives one process's weights and losses."""
    import json

    from anyorder.training.loop import train
    from test_train import DIST_EXTRA, WORKER, _cfg, _losses, _overrides, _weights

    from conftest import run_two_ranks

    chunks = "H.PLAIN_UP_TO = 0; H.CHUNK_ELEMENTS = 257 * 7"  # rows of 7: several chunks
    monkeypatch.setattr(head_loss, "PLAIN_UP_TO", 0)
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 257 * 7)
    cache, single, run = tmp_path / "cache", tmp_path / "single", tmp_path / "dist"
    train(_cfg(single, cache, "aogpt", **DIST_EXTRA), progress=False)
    script = tmp_path / "worker.py"
    script.write_text(
        WORKER.replace(
            "from anyorder.training.loop import train\n",
            f"from anyorder.training.loop import train\nimport anyorder.layers.head_loss as H\n"
            f"{chunks}\n",
        )
    )
    assert chunks in script.read_text()
    extra = {**DIST_EXTRA, "train.fsdp": fsdp}
    run_two_ranks(script, json.dumps(_overrides(run, cache, "aogpt", **extra)), tmp_path / "st")
    for which in ("raw", "ema"):  # the tolerance of test_train's aogpt case (adaLN at zero)
        a, b = _weights(single, which), _weights(run, which)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=5e-5, msg=k)
    for (_, x), (_, y) in zip(_losses(single), _losses(run)):
        assert abs(x - y) < 1e-5


HEAD_EXAMPLES = int(os.environ.get("ANYORDER_HEAD_LOSS_EXAMPLES", "60"))


@settings(max_examples=HEAD_EXAMPLES, derandomize=True, deadline=None, database=None)
@given(
    rows=st.integers(1, 40),
    d=st.integers(1, 24),
    V=st.integers(2, 90),
    chunk_rows=st.integers(1, 45),
    bias=st.booleans(),
    weighted=st.booleans(),
    grad=st.sampled_from(["all", "h", "weight", "none"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunks_equal_the_plain_path_at_random(rows, d, V, chunk_rows, bias, weighted, grad, seed):
    """Random sizes, chunkings (one row a chunk to all rows in one), biases, weights (some
    rows off) and which inputs want gradients: the chunked loss and its gradients equal the
    plain cross-entropy's (fp32, 1e-5), the no-grad path included."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(rows, d, generator=g), torch.randn(V, d, generator=g)
    b = torch.randn(V, generator=g) if bias else None
    y = torch.randint(0, V, (rows,), generator=g)
    wt = torch.rand(rows, generator=g) * (torch.rand(rows, generator=g) > 0.2) if weighted else None
    want_grad = {"all": (True, True), "h": (True, False), "weight": (False, True)}.get(grad)
    leaves = {}
    for name, fn in (("plain", head_loss.weighted_nll), ("chunked", head_cross_entropy)):
        hh = h.clone().requires_grad_(bool(want_grad and want_grad[0]))
        ww = w.clone().requires_grad_(bool(want_grad and want_grad[1]))
        bb = None if b is None else b.clone().requires_grad_(bool(want_grad and want_grad[1]))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(head_loss, "PLAIN_UP_TO", 0)
            mp.setattr(head_loss, "CHUNK_ELEMENTS", chunk_rows * V)
            loss = fn(F.linear(hh, ww, bb), y, wt) if name == "plain" else fn(hh, ww, bb, y, wt)
        if want_grad:
            loss.backward()
        leaves[name] = (loss.detach(), [t.grad for t in (hh, ww, bb) if t is not None])
    (a, ga), (c, gc) = leaves["plain"], leaves["chunked"]
    torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)
    for x, z in zip(ga, gc):
        assert (x is None) == (z is None)
        if x is not None:
            torch.testing.assert_close(z, x, atol=1e-5, rtol=1e-5)
