"""A shared prompt is prefilled for its keys and values only: the output head runs on the
decoded slots alone (at a 128k vocabulary the head over the prompt cost more than the
prompt's layers; benchmarks/vs_transformers_generate.py), and the tokens are unchanged."""

from __future__ import annotations

import pytest
import torch

from anyorder.sample import sample

from conftest import tiny_model

N, K, B = 12, 5, 3


def _request():
    prompt = torch.zeros(B, N, dtype=torch.long)
    prompt[:, :K] = torch.tensor([3, 1, 4, 1, 5])  # the same in every row: prefilled once
    known = torch.zeros(B, N, dtype=torch.bool)
    known[:, :K] = True
    return prompt, known


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd"])
def test_the_head_runs_on_the_decoded_slots_only(kind):
    model = tiny_model(kind)
    rows = []
    hook = model.head.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[:-1].numel()))
    prompt, known = _request()
    order = "l2r" if kind == "gpt" else "random"
    g = torch.Generator().manual_seed(0)
    out = sample(model, N, order=order, batch=B, prompt=prompt, known=known, top_k=1, generator=g)
    hook.remove()
    assert out.forward_passes == 1 + N - K  # the prefill, then one token a pass
    assert sum(rows) == B * (N - K)  # no logits for the prompt's slots


def test_greedy_tokens_after_a_prefill_equal_full_forwards():
    """The oracle: the gpt's full forward, re-run on the growing text, argmax each time."""
    model = tiny_model("gpt")
    prompt, known = _request()
    out = sample(model, N, order="l2r", batch=B, prompt=prompt, known=known, top_k=1).tokens
    x = prompt.clone()
    with torch.no_grad():
        for t in range(K, N):
            x[:, t] = model(x)[:, t].argmax(-1)
    assert torch.equal(out, x)


def test_top_k_1_is_the_argmax_and_draws_nothing():
    """Greedy decoding at a 128k vocabulary spent ~11% of its time drawing from a point mass
    (float64 softmax, exponentials over every logit); top_k=1 is now the argmax."""
    from anyorder.sampling.draws import sample_logits

    logits = torch.randn(3, 2, 1000, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    got = sample_logits(logits, g, temperature=0.7, top_k=1, top_p=0.9)
    assert torch.equal(got, logits.argmax(-1))
    assert torch.equal(g.get_state(), state)
