"""order.condition=prompt (issue 34, item 2): orders with the prompt first, each model's loss
on the answer only against an independent computation, the conditional Eq. 5 by enumeration,
validation of the answers, and a run end to end."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from anyorder import orders as orders_mod
from anyorder.config import OrderConfig
from anyorder.errors import ConfigError
from anyorder.evaluation.answers import answer_any_order_nll, answer_nll
from anyorder.orders import OrderSampler, displace, displace_answer, prompt_first

from conftest import tiny_model

V, N = 11, 6


def perturbed(kind: str, seed: int = 0, **kw):
    """A tiny fp32 model with every weight moved off its initialisation (adaLN included)."""
    model = tiny_model(kind, seed, vocab_size=V, seq_len=N, d_model=32, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def batch(seed: int = 0, plen=(2, 3, 1)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (len(plen), N), generator=g)
    return x, torch.tensor(plen)


# ----------------------------------------------------------------------------- orders


def test_prompt_first_keeps_the_answer_in_the_drawn_order():
    g = torch.Generator().manual_seed(0)
    drawn = orders_mod.uniform(3, N, g).order
    plen = torch.tensor([0, 2, 5])
    got = prompt_first(drawn, plen)
    for row, p in enumerate(plen.tolist()):
        answer = [int(q) for q in drawn[row] if q >= p]  # independent: filter the drawn order
        assert got[row].tolist() == list(range(p)) + answer


def test_the_answer_is_uniform_over_its_orders():
    sampler = OrderSampler(OrderConfig(kind="uniform", condition="prompt"))
    g = torch.Generator().manual_seed(0)
    plen = torch.full((6000,), 3)
    o = sampler(6000, N, 0, g, prompt_len=plen).order
    assert (o[:, :3] == torch.arange(3)).all()
    counts = Counter(tuple(r) for r in o[:, 3:].tolist())
    assert len(counts) == 6  # 3! orders of the answer, each about 1000 times
    assert max(abs(c - 1000) for c in counts.values()) < 4 * math.sqrt(1000 * 5 / 6)


def test_progressive_over_the_answer():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    # no prompt: the same order from the same draws as the plain schedule
    assert torch.equal(
        displace_answer(torch.zeros(5, dtype=torch.long), N, 2, g1), displace(5, N, 2, g2)
    )
    g = torch.Generator().manual_seed(0)
    plen = torch.tensor([0, 2, 4, 5] * 50)
    o = displace_answer(plen, N, 1, g)
    for row, p in zip(o.tolist(), plen.tolist()):
        assert row[:p] == list(range(p)) and sorted(row[p:]) == list(range(p, N))
        answer = row[p:]  # one token moved: the rest keep their order
        assert any(answer[:i] + answer[i + 1 :] == sorted(answer[:i] + answer[i + 1 :])
                   for i in range(len(answer)))  # fmt: skip
    assert (o[plen == 2] != torch.arange(N)).any(dim=1).any()  # some are displaced
    sampler = OrderSampler(
        OrderConfig(kind="progressive", i_ar=5, i_perm=9, rho=3, condition="prompt")
    )
    assert torch.equal(sampler(4, N, 2, g, prompt_len=plen[:4]).order, torch.arange(N).expand(4, N))


def test_mix_and_the_orders_that_cannot_take_a_prompt():
    sampler = OrderSampler(OrderConfig(kind="mix", p_l2r=0.5, condition="prompt"))
    g = torch.Generator().manual_seed(0)
    o = sampler(400, N, 0, g, prompt_len=torch.full((400,), 2)).order
    l2r = (o == torch.arange(N)).all(dim=1).float().mean()
    assert 0.5 + 0.5 / 24 - 0.1 < l2r < 0.5 + 0.5 / 24 + 0.1  # l2r, or uniform that is l2r
    assert (o[:, :2] == torch.arange(2)).all()
    with pytest.raises(ConfigError, match=r"^order.condition=prompt takes token-level orders"):
        OrderSampler(OrderConfig(kind="sbp", condition="prompt"))
    with pytest.raises(ConfigError, match=r"^order.condition='answer' is unknown"):
        OrderSampler(OrderConfig(condition="answer"))


# ----------------------------------------------------------------------------- losses


def sequential_answer_nll(model, x, plen, order) -> torch.Tensor:
    """Independent: each answer slot scored by a forward over the order's prefix up to it
    (the decoders see nothing later), summed over the answer: (B,)."""
    out = torch.zeros(len(x), dtype=torch.float64)
    for b in range(len(x)):
        o = order[b : b + 1]
        for t in range(int(plen[b]), N):
            if model.kind == "gpt":
                logits = model(x[b : b + 1, : t + 1])[0, t]
            else:
                logits = model(x[b : b + 1], o[:, : t + 1])[0, t]
            out[b] -= F.log_softmax(logits.double(), -1)[x[b, o[0, t]]]
    return out


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd"])
def test_decoder_loss_is_the_answers_nll_in_the_same_order(kind):
    model = perturbed(kind)
    x, plen = batch()
    if kind == "gpt":
        order = torch.arange(N).expand(len(x), N)
        loss = model.loss(x, None, prompt_len=plen)
    else:
        g = torch.Generator().manual_seed(5)
        order = OrderSampler(OrderConfig(kind="uniform", condition="prompt"))(
            len(x), N, 0, g, prompt_len=plen
        ).order
        loss = model.loss(x, order, prompt_len=plen)
    want = sequential_answer_nll(model, x, plen, order)
    answer_tokens = int((N - plen).sum())
    torch.testing.assert_close(loss.double(), want.sum() / answer_tokens, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        answer_nll(model, x, plen, None if kind == "gpt" else order).double(),
        want,
        rtol=1e-5,
        atol=1e-5,
    )
    # the prompt's tokens carry no loss: change the first prompt token's target ... no: its
    # prediction is not scored, so moving the logits there does not move the loss
    full = model.loss(x, None if kind == "gpt" else order)
    assert not torch.isclose(full, loss)


def test_mdm_loss_masks_only_the_answer():
    model = perturbed("mdm")
    x, plen = batch()
    g = torch.Generator().manual_seed(5)
    order = orders_mod.uniform(len(x), N, g).order
    loss = model.loss(x, order, generator=torch.Generator().manual_seed(9), prompt_len=plen)
    # independent: the draw m ~ U{1..r}, the answer's last m in the order masked
    u = torch.rand(len(x), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    r = N - plen
    m = (u * r).floor().long() + 1
    total = torch.zeros((), dtype=torch.float64)
    for b in range(len(x)):
        answer_order = [int(q) for q in order[b] if q >= plen[b]]
        masked = answer_order[len(answer_order) - int(m[b]) :]
        x_t = x[b].clone()
        x_t[masked] = model.mask_id
        logp = F.log_softmax(model.denoise(x_t[None])[0].double(), -1)
        nll = -sum(logp[i, x[b, i]] for i in masked)
        total += nll / m[b] * r[b]  # the row's estimate of its answer's NLL
    torch.testing.assert_close(loss.double(), total / r.sum(), rtol=1e-5, atol=1e-6)


def exact_conditional_elbo(model, x, p: int) -> float:
    """Independent: the ELBO of the answer with the prompt unmasked, every mask set of the
    answer enumerated: sum_m (1/m) mean_{|M|=m} sum_{i in M} -log p(x_i | x without M)."""
    sets = [s for m in range(1, N - p + 1) for s in itertools.combinations(range(p, N), m)]
    x_t = x.repeat(len(sets), 1)
    for row, masked in enumerate(sets):
        x_t[row, list(masked)] = model.mask_id
    logp = F.log_softmax(model.denoise(x_t).double(), -1)  # (S, N, V): one batched call
    nll = -logp.gather(2, x.expand(len(sets), N)[..., None])[..., 0]
    total = 0.0
    for row, masked in enumerate(sets):
        m = len(masked)
        total += float(nll[row, list(masked)].sum()) / m / math.comb(N - p, m)
    return total


@torch.no_grad()
def test_enumeration_identity_any_order_equals_the_conditional_elbo():
    model = perturbed("mdm")
    x, _ = batch(plen=(3,))
    p = 3
    plen = torch.tensor([p])
    perms = list(itertools.permutations(range(p, N)))
    # the any-order NLL of the answer, averaged over all its orders, the prompt first
    orders = torch.tensor([list(range(p)) + list(q) for q in perms])
    xs = x.expand(len(perms), N)
    ao = answer_nll(model, xs, plen.expand(len(perms)), orders).double().mean()
    elbo = exact_conditional_elbo(model, x[0], p)
    assert ao.item() == pytest.approx(elbo, rel=1e-5)
    # the training estimator, every order and mask count enumerated: its mean is ELBO / r
    r = N - p
    est = torch.stack([
        model.elbo_estimate(xs, orders, prompt_len=plen.expand(len(perms)),
                            mask_count=torch.full((len(perms),), m)).double()
        for m in range(1, r + 1)
    ])  # fmt: skip
    assert est.mean().item() * r == pytest.approx(elbo, rel=1e-5)
    # a decoder's conditionals depend on the context's order: not an identity there
    dec = perturbed("aogpt")
    assert answer_nll(dec, xs, plen.expand(len(perms)), orders).double().mean().item() != (
        pytest.approx(exact_conditional_elbo(model, x[0], p), rel=1e-3)
    )


# ----------------------------------------------------------------------------- validation


def test_any_order_estimate_is_per_answer_token():
    model = perturbed("aogpt")
    x, plen = batch()
    est = answer_any_order_nll(model, x, plen, 1, torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    o = prompt_first(orders_mod.uniform(len(x), N, g).order, plen)
    want = sequential_answer_nll(model, x, plen, o).sum() / int((N - plen).sum())
    assert est.mean == pytest.approx(float(want.detach()), rel=1e-5)


def write_chat(path, count: int = 40) -> None:
    rows = [{"prompt": f"{i}+{i}", "response": str(2 * i)} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "mdm"])
def test_train_on_a_chat_jsonl_with_the_prompt_first(tmp_path, kind, capsys):
    from anyorder.cli import main

    write_chat(tmp_path / "chat.jsonl")
    (tmp_path / "sft.yaml").write_text(
        f"model: {{kind: {kind}, n_layer: 1, n_head: 2, d_model: 32, seq_len: 40}}\n"
        f"data: {{source: {tmp_path}/chat.jsonl, cache_dir: {tmp_path}/cache, val_fraction: 0.2}}\n"
        "order: {condition: prompt}\n"
        f"train: {{out_dir: {tmp_path}/run, steps: 2, batch_size: 4, eval_every: 0, "
        "eval_batches: 1, ckpt_every: 0, log_every: 1, device: cpu, dtype: fp32, "
        "warmup_steps: 1}\n"
    )
    assert main(["train", str(tmp_path / "sft.yaml")]) == 0
    printed = capsys.readouterr().out
    assert "validation of the answers: left to right" in printed
    if kind != "gpt":
        assert "uniform over the answer, the prompt first" in printed
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val/l2r_bpt" in r][-1]
    assert math.isfinite(val["val/l2r_bpt"])
    assert val["val/l2r_bpt"] == pytest.approx(val["val/l2r_nll"] / math.log(2))
    assert ("val/ao_bpt" in val) == (kind != "gpt")


def test_a_prompt_condition_on_text_data_is_refused(tmp_path, capsys):
    from anyorder.cli import main

    rc = main(["train", "configs/tiny-aogpt.yaml", "order.condition=prompt",
               f"train.out_dir={tmp_path}/run", "train.device=cpu"])  # fmt: skip
    assert rc == 2
    assert capsys.readouterr().err.splitlines() == [
        "anyorder train: error: order.condition=prompt needs prompt/response data, and "
        "data.source 'builtin:pydoc' is read as text; give .jsonl records with prompt and "
        "response or messages (data.format=chat), or set order.condition=none"
    ]
    assert not (tmp_path / "run").exists()
