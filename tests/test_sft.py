"""order.condition=prompt (issue 34, item 2): orders with the prompt first, each model's loss
on the answer only against an independent computation, the conditional Eq. 5 by enumeration,
validation of the answers, and a run end to end."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from anyorder import orders as orders_mod
from anyorder.config import OrderConfig
from anyorder.errors import ConfigError
from anyorder.evaluation.answers import answer_any_order_nll, answer_nll
from anyorder.orders import OrderSampler, displace, displace_answer, prompt_first

from conftest import gloo_worker, tiny_model

V, N = 11, 6
TESTS = Path(__file__).parent


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


@torch.no_grad()
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
    assert est.mean == pytest.approx(float(want), rel=1e-5)


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


def test_resume_is_bit_exact_with_the_prompt_first(tmp_path):
    from anyorder import checkpoint as ck
    from anyorder.config import load_config
    from anyorder.training.loop import train
    from anyorder.training.metrics import read_metrics

    write_chat(tmp_path / "chat.jsonl")

    def cfg(run):
        return load_config(None, [
            "model.kind=armd", "model.n_layer=1", "model.n_head=2", "model.d_model=32",
            "model.seq_len=40", f"data.source={tmp_path}/chat.jsonl",
            f"data.cache_dir={tmp_path}/cache", "data.val_fraction=0.2", "order.condition=prompt",
            "order.kind=progressive", "order.i_ar=1", "order.i_perm=3", "order.rho=4",
            f"train.out_dir={run}", "train.steps=4", "train.batch_size=4", "train.eval_every=0",
            "train.eval_batches=1", "train.ckpt_every=0", "train.device=cpu", "train.dtype=fp32",
            "train.log_every=1",
            "train.warmup_steps=1",
        ])  # fmt: skip

    train(cfg(tmp_path / "straight"), resume=False, progress=False)
    train(cfg(tmp_path / "split"), resume=False, progress=False, stop_at=2)
    torch.manual_seed(987)  # the resumed run restores every RNG it uses
    train(cfg(tmp_path / "split"), resume=True, progress=False)
    a = ck.load_model(tmp_path / "straight").model.state_dict()
    b = ck.load_model(tmp_path / "split").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [[r["loss"] for r in read_metrics(tmp_path / run) if "loss" in r]
              for run in ("straight", "split")]  # fmt: skip
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_validation_reports_the_answers_given_their_prompts(tmp_path):
    from anyorder.config import DataConfig, load_config
    from anyorder.data import prepare
    from anyorder.training.validation import format_val, validate

    write_chat(tmp_path / "chat.jsonl")
    data = prepare(
        DataConfig(source=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "c"),
                   val_fraction=0.3),
        32,
        progress=False,
    )  # fmt: skip
    cfg = load_config(None, ["model.kind=aogpt", "order.condition=prompt"])
    model = tiny_model("aogpt", 0, vocab_size=257, seq_len=32, d_model=32)
    val = validate(model, data, cfg, torch.device("cpu"), batches=1, batch_size=3)
    x = data.batch("val", [0, 1, 2])
    plen = data.prompt_lengths("val", [0, 1, 2])
    # independent: each answer position scored from its prefix, left to right
    total = 0.0
    for b in range(3):
        with torch.no_grad():
            logp = F.log_softmax(model(x[b : b + 1])[0].double(), -1)
        total -= sum(float(logp[t, x[b, t]]) for t in range(int(plen[b]), 32))
    answer_tokens = int((32 - plen).sum())
    assert val["val/answer_tokens"] == answer_tokens
    assert val["val/l2r_nll"] == pytest.approx(total / answer_tokens, rel=1e-5)
    assert val["val/l2r_bpt"] == pytest.approx(total / answer_tokens / math.log(2), rel=1e-5)
    assert val["val/ao_bpt_se"] >= 0 and math.isfinite(val["val/ao_bpt"])
    assert format_val(val).startswith("validation of the answers: left to right ")


# ----------------------------------------------------------------------------- accumulation


def write_uneven_chat(path, count: int = 48) -> None:
    """Prompts and answers of many lengths: the micro-batches' answer-token counts differ."""
    rows = [{"prompt": "q" * (1 + 7 * i % 13), "response": "a" * (1 + 5 * i % 17)}
            for i in range(count)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def sft_overrides(tmp_path, kind: str, **extra) -> list[str]:
    values = {
        "model.kind": kind, "model.n_layer": 1, "model.n_head": 2, "model.d_model": 32,
        "model.seq_len": 64, "data.source": f"{tmp_path}/chat.jsonl",
        "data.cache_dir": f"{tmp_path}/cache", "data.val_fraction": 0.2,
        "order.condition": "prompt", "train.out_dir": f"{tmp_path}/run", "train.steps": 4,
        "train.batch_size": 8, "train.eval_every": 0, "train.eval_batches": 1,
        "train.ckpt_every": 0, "train.log_every": 1, "train.device": "cpu",
        "train.dtype": "fp32", "train.warmup_steps": 1, "train.grad_clip": 0, **extra,
    }  # fmt: skip
    return [f"{k}={v}" for k, v in values.items()]


def first_step(cfg):
    """The loss and the gradients (by name) of a run's first optimizer step, through the
    training API: the run's parts, one ``train_step``; the gradients as the optimizer is
    about to read them (a step pre-hook)."""
    from anyorder.training.distributed import setup_distributed
    from anyorder.training.setup import build_parts, prepare_data, resolve_vocab
    from anyorder.training.step import train_step

    env = setup_distributed("cpu")
    data = prepare_data(cfg, env, dry_run=False, progress=False, tmp=None)
    parts = build_parts(resolve_vocab(cfg, data.tokenizer.vocab_size), env, data, None)
    grads = {}

    def keep(opt, args, kwargs):
        for name, p in parts.model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach()  # FSDP2's is a shard: the whole tensor, from every rank
                grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()

    parts.opt.register_step_pre_hook(keep)
    loss = train_step(parts, 0)
    return loss, grads


@pytest.mark.parametrize("kind", ["aogpt", "gpt", "mdm"])
def test_the_sft_loss_does_not_depend_on_the_accumulation(tmp_path, kind):
    """Issue 40, item 6: under order.condition=prompt the step's loss and gradients are the
    mean over the batch's answer tokens, at grad_accum 1, 2 and 4 alike (micro-batches with
    unequal answer-token counts)."""
    from anyorder.config import load_config
    from anyorder.data import prepare

    write_uneven_chat(tmp_path / "chat.jsonl")
    results = {a: first_step(load_config(None, sft_overrides(
        tmp_path, kind, **{"train.grad_accum": a}))) for a in (1, 2, 4)}  # fmt: skip
    cfg = load_config(None, sft_overrides(tmp_path, kind))
    data = prepare(cfg.data, 64, progress=False)
    from anyorder.data import BlockSampler

    idx = BlockSampler(data.num_blocks("train"), 8, cfg.train.seed, 0, 1).next_indices()
    plen = data.prompt_lengths("train", idx)
    counts = [int((64 - plen[a : a + 2]).sum()) for a in range(0, 8, 2)]
    assert len(set(counts)) > 1, counts  # the micro-batches of 2 differ in answer tokens
    loss1, grads1 = results[1]
    for a in (2, 4):
        loss, grads = results[a]
        assert loss == pytest.approx(loss1, rel=0, abs=1e-6), (a, loss, loss1)
        assert grads.keys() == grads1.keys()
        for name in grads1:
            torch.testing.assert_close(grads[name], grads1[name], rtol=1e-5, atol=1e-7)


SFT_WORKER = gloo_worker(  # a gloo rank's first step, its loss and gradients saved
    "job",
    "from anyorder.config import load_config\nfrom test_sft import first_step\n",
    """\
    loss, grads = first_step(load_config(None, job["overrides"]))
    torch.save({"loss": loss, "grads": grads}, job["out"] + f".{rank}")
    """,
)


@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_two_ranks_take_the_mean_over_the_batchs_answer_tokens(tmp_path, fsdp):
    """Issue 40, item 6 under DDP (and FSDP2): two gloo ranks at grad_accum 2 (ranks and
    micro-batches with unequal answer-token counts) give the loss and gradients of one
    process on the whole batch."""
    from anyorder.config import load_config

    from conftest import run_two_ranks

    write_uneven_chat(tmp_path / "chat.jsonl")
    loss1, grads1 = first_step(load_config(None, sft_overrides(tmp_path, "aogpt")))
    script = tmp_path / "worker.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + SFT_WORKER)
    over = sft_overrides(tmp_path, "aogpt", **{"train.grad_accum": 2, "train.fsdp": fsdp})
    out = tmp_path / "step"
    run_two_ranks(script, json.dumps({"overrides": over, "out": str(out)}), tmp_path / "store")
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}")
        assert got["loss"] == pytest.approx(loss1, rel=0, abs=1e-6), (rank, got["loss"], loss1)
        assert got["grads"].keys() == grads1.keys()
        for name in grads1:
            torch.testing.assert_close(got["grads"][name], grads1[name], rtol=1e-5, atol=1e-7)


def test_the_training_log_shows_the_answers_loss_in_bits_per_token(tmp_path, capsys):
    """Issue 40: under order.condition=prompt the answers' slots run on with EOS padding,
    which has no bytes, so the log's "bits/byte" of the loss grew with the padding (229
    bits/byte for a converted model); the log now says bits per answer token, the loss over
    ln 2, as validation's line does."""
    from anyorder.cli import main

    write_uneven_chat(tmp_path / "chat.jsonl")
    (tmp_path / "sft.yaml").write_text("{}\n")
    over = sft_overrides(tmp_path, "aogpt", **{"train.steps": 2})
    assert main(["train", str(tmp_path / "sft.yaml"), *over]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "| loss" in line]
    assert lines
    for line in lines:
        nats, bits = (float(w) for w in re.findall(r"loss ([0-9.]+) nats/token = ([0-9.]+) "
                                                    r"bits/token,", line)[0])  # fmt: skip
        assert bits == pytest.approx(nats / math.log(2), abs=2e-3), line
        assert "bits/byte" not in line
