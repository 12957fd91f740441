"""The naive sampler (the oracle): prompts kept, seeds reproducible, supports respected."""

from __future__ import annotations

import pytest
import torch

from anyorder.errors import SamplingError
from anyorder.sample import filter_logits, naive_sample, prompt_order, sample_logits

from conftest import tiny_model


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd", "mdm"])
def test_naive_sample_keeps_the_prompt_and_is_seeded(kind: str) -> None:
    model = tiny_model(kind)
    n = 10
    known = torch.zeros(2, n, dtype=torch.bool)
    if kind == "gpt":
        known[:, :3] = True  # a left-to-right model takes a prefix
    else:
        known[:, [0, 4, 9]] = True  # scattered known positions
    prompt = torch.randint(0, 11, (2, n), generator=torch.Generator().manual_seed(0))
    a = naive_sample(
        model, n, prompt=prompt, known=known, generator=torch.Generator().manual_seed(5)
    )
    b = naive_sample(
        model, n, prompt=prompt, known=known, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.order, b.order)
    assert torch.equal(a.tokens[known], prompt[known])
    assert a.forward_passes == n - 3
    assert bool(known.gather(1, a.order[:, :3]).all())
    assert bool((a.step_of[known] == -1).all()) and bool((a.step_of[~known] >= 0).all())


def test_prompt_order_puts_known_first() -> None:
    known = torch.tensor([[False, True, False, True, False]])
    o = prompt_order(known, torch.Generator().manual_seed(0))
    assert o[0, :2].tolist() == [1, 3]
    assert sorted(o[0, 2:].tolist()) == [0, 2, 4]


def test_top_k_and_top_p_supports() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)[0, 2:]).all()
    # probabilities ~ [0.64, 0.24, 0.09, 0.03, 0.01]: top-p 0.8 keeps the first two
    kept = ~torch.isinf(filter_logits(logits, top_p=0.8))
    assert kept[0].tolist() == [True, True, False, False, False]
    g = torch.Generator().manual_seed(0)
    draws = sample_logits(logits.expand(2000, 5), g, top_p=0.8)
    assert set(draws.tolist()) == {0, 1}


def test_sampling_controls_are_checked() -> None:
    model = tiny_model("armd")
    with pytest.raises(SamplingError, match="temperature=0 must be > 0"):
        naive_sample(model, 4, temperature=0)
    with pytest.raises(SamplingError, match=r"top-p=1.5 must lie in \(0, 1\]"):
        naive_sample(model, 4, top_p=1.5)
    with pytest.raises(SamplingError, match="longer than the model's context"):
        naive_sample(model, 40)


def test_prompt_order_keeps_known_positions_left_to_right() -> None:
    known = torch.zeros(3, 12, dtype=torch.bool)
    known[:, [2, 5, 7, 11]] = True
    o = prompt_order(known, torch.Generator().manual_seed(1))
    assert o[:, :4].tolist() == [[2, 5, 7, 11]] * 3
    assert len({tuple(r) for r in o[:, 4:].tolist()}) == 3  # the rest is random per row
