"""The compiled training step: ``torch.compile(fullgraph=True)`` of the loss module (what
``train.compile`` compiles in one process) takes every model kind's loss and its backward as
one graph, and gives the eager loss and gradients (fp32, within 1e-5).

The reference is the eager call of the same module; what the compiled side adds (dynamo's
trace, AOT autograd's backward, inductor's kernels) is what is under test. ``aot_eager``
checks the graph and the traced backward on every variant; inductor's CPU kernels run on
one per kind (the slow mark runs them on more).
"""

from __future__ import annotations

import pytest
import torch

from anyorder.config import LoraConfig
from anyorder.layers import head_loss
from anyorder.models.lora import add_adapters
from anyorder.orders import prompt_first, strided
from anyorder.training.setup import LossModule

from conftest import tiny_model

N, B = 16, 3
KINDS = ("gpt", "aogpt", "armd", "mdm")
VARIANTS = ("plain", "prompt", "blocks", "checkpointed", "lora", "dropout", "chunked")
CASES = [  # gpt and aogpt predict one token per slot: no blocks; the encoder has no chunks
    (k, v)
    for k in KINDS
    for v in VARIANTS
    if not (v == "blocks" and k in ("gpt", "aogpt")) and not (v == "chunked" and k == "mdm")
]


def _inputs(kind: str, variant: str, seed: int = 0):
    """tokens, order, blocks, prompt lengths of one micro-batch, as the step passes them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (B, N), generator=g)
    plen = torch.tensor([3, 0, 7]) if variant == "prompt" else None
    if kind == "gpt":
        return tokens, None, None, plen
    if variant == "blocks":
        o = strided(B, N, 4)
        return tokens, o.order, o.model_blocks, plen
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B)])
    if plen is not None:
        order = prompt_first(order, plen)
    return tokens, order, None, plen


def _model(kind: str, variant: str):
    extra = {"dropout": 0.1} if variant == "dropout" else {}
    model = tiny_model(kind, seq_len=N, **extra).train()
    model.checkpoint_blocks = variant == "checkpointed"
    if variant == "lora":
        add_adapters(model, LoraConfig(r=4, targets=("qkv", "mlp")))
    return model


def _step(module, model, inputs, seed: int):
    """One micro-step as ``training/step.py`` takes it: the draws eagerly, the loss through
    the module, backward; the loss and every gradient."""
    tokens, order, blocks, plen = inputs
    draws = model.loss_draws(tokens, torch.Generator().manual_seed(seed), plen)
    torch.manual_seed(seed)  # dropout's masks: the same stream on both sides
    loss = module(tokens, order, blocks, None, plen, draws)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _check(kind: str, variant: str, backend: str, monkeypatch) -> None:
    if variant in ("chunked", "prompt"):  # the head's loss in chunks of 5 rows, not plain
        monkeypatch.setattr(head_loss, "PLAIN_UP_TO", 0)
        monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", 5 * 11)
    model = _model(kind, variant)
    module = LossModule(model)
    inputs = _inputs(kind, variant)
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    torch._dynamo.reset()
    for seed in (1, 2):  # a second call runs the cached graph (no recompile, same answers)
        if variant == "dropout":  # random masks: compare the graph with itself by seed
            a, ga = _step(compiled, model, inputs, seed)
            b, gb = _step(compiled, model, inputs, seed)
            model.eval()
            c, gc = _step(module, model, inputs, seed)  # eval: no dropout, the eager loss
            d, gd = _step(compiled, model, inputs, seed)
            model.train()
            torch.testing.assert_close(d, c, atol=1e-5, rtol=0)
        else:
            a, ga = _step(module, model, inputs, seed)
            b, gb = _step(compiled, model, inputs, seed)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        assert ga.keys() == gb.keys() and ga
        for name in ga:
            torch.testing.assert_close(gb[name], ga[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("kind", "variant"), CASES)
def test_loss_and_backward_compile_as_one_graph(kind: str, variant: str, monkeypatch) -> None:
    """No graph break (fullgraph raises on one): dynamo and AOT autograd's backward."""
    _check(kind, variant, "aot_eager", monkeypatch)


INDUCTOR_DEFAULT = [("gpt", "prompt"), ("aogpt", "chunked"), ("armd", "plain"), ("mdm", "plain")]


@pytest.mark.parametrize(
    ("kind", "variant"),
    INDUCTOR_DEFAULT
    + [
        pytest.param(k, v, marks=pytest.mark.slow)
        for k in KINDS
        for v in ("plain", "prompt", "blocks", "lora", "chunked")
        if (k, v) in CASES and (k, v) not in INDUCTOR_DEFAULT
    ],
)
def test_inductor_step_equals_eager(kind: str, variant: str, monkeypatch) -> None:
    """Inductor's CPU kernels, as ``train.compile=true`` runs them."""
    _check(kind, variant, "inductor", monkeypatch)


def test_draws_ahead_equal_the_generator_inside() -> None:
    """The encoder's mask levels drawn ahead (``loss_draws``) give the loss that drawing them
    inside ``loss`` from the same generator state gives, and consume the generator alike."""
    model = tiny_model("mdm", seq_len=N).train()
    tokens, order, _, plen = _inputs("mdm", "prompt")
    for p in (None, plen):
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        inside = model.loss(tokens, order, generator=g1, prompt_len=p)
        ahead = model.loss(tokens, order, prompt_len=p, **model.loss_draws(tokens, g2, p))
        assert torch.equal(inside, ahead)
        assert torch.equal(g1.get_state(), g2.get_state())
    assert tiny_model("aogpt").loss_draws(tokens, g1, None) == {}
