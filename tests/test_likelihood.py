"""Eq. 5 by enumeration, and the decoder's order-dependent conditionals (Eq. 6)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from anyorder import orders
from anyorder.evaluation.estimators import (
    any_order_nll,
    bits_per_byte,
    exact_any_order_nll,
    exact_mdm_elbo,
    left_to_right_nll,
    mdm_elbo,
    sequence_nll,
)

from conftest import tiny_model


@pytest.mark.parametrize("n", [4, 5])
def test_eq5_mdm_elbo_equals_average_over_all_orders(n: int, gen: torch.Generator) -> None:
    """For an encoder, the mask-based ELBO computed exactly equals the any-order NLL
    averaged over all n! orders."""
    model = tiny_model("mdm", vocab_size=5, seq_len=n)
    tokens = torch.randint(0, 5, (3, n), generator=gen)
    assert_close(
        exact_mdm_elbo(model, tokens), exact_any_order_nll(model, tokens), atol=1e-4, rtol=1e-6
    )


def test_mc_elbo_agrees_with_exact(gen: torch.Generator) -> None:
    model = tiny_model("mdm", vocab_size=5, seq_len=5)
    tokens = torch.randint(0, 5, (4, 5), generator=gen)
    exact = float(exact_mdm_elbo(model, tokens).mean()) / 5
    est = mdm_elbo(model, tokens, 400, gen)
    lo, hi = est.ci95()
    assert lo - 2 * est.stderr <= exact <= hi + 2 * est.stderr


def test_aogpt_conditionals_depend_on_the_context_order(gen: torch.Generator) -> None:
    """The reviewer's point (Eq. 6): the same context set in two orders gives two different
    conditionals for the same target under a decoder — and the same under the encoder."""
    n = 5
    tokens = torch.randint(0, 5, (1, n), generator=gen)
    a = torch.tensor([[0, 1, 2, 3, 4]])
    b = torch.tensor([[2, 0, 1, 3, 4]])  # same context {0,1,2} for target 3 (slot 3)
    for kind, differs in (("aogpt", True), ("mdm", False)):
        model = tiny_model(kind, vocab_size=5, seq_len=n)
        pa = model(tokens, a)[0, 3].log_softmax(-1)
        pb = model(tokens, b)[0, 3].log_softmax(-1)
        if differs:
            assert (pa - pb).abs().max() > 1e-4
        else:
            assert_close(pa, pb, atol=1e-5, rtol=1e-5)


def test_aogpt_average_over_orders_differs_from_single_orders(gen: torch.Generator) -> None:
    n = 4
    model = tiny_model("aogpt", vocab_size=5, seq_len=n)
    tokens = torch.randint(0, 5, (2, n), generator=gen)
    avg = exact_any_order_nll(model, tokens)
    l2r = sequence_nll(model, tokens, orders.l2r(2, n).order)
    assert not torch.allclose(avg.float(), l2r, atol=1e-4)


def test_monte_carlo_any_order_covers_the_exact_average(gen: torch.Generator) -> None:
    n = 5
    model = tiny_model("armd", vocab_size=5, seq_len=n)
    tokens = torch.randint(0, 5, (4, n), generator=gen)
    exact = float(exact_any_order_nll(model, tokens).mean()) / n
    est = any_order_nll(model, tokens, 200, gen)
    assert est.samples == 200 and est.stderr > 0
    assert abs(est.mean - exact) < 4 * est.stderr


def test_left_to_right_nll_is_the_sum_of_slot_nll(gen: torch.Generator) -> None:
    model = tiny_model("gpt")
    tokens = torch.randint(0, 11, (2, 8), generator=gen)
    logp = model(tokens).log_softmax(-1)
    expected = -logp.gather(2, tokens[..., None])[..., 0].sum(1)
    assert_close(left_to_right_nll(model, tokens), expected)


def test_bits_per_byte() -> None:
    assert bits_per_byte(math.log(2), 1.0) == pytest.approx(1.0)
    assert bits_per_byte(2 * math.log(2), 4.0) == pytest.approx(0.5)


def _per_slot_nll(model, tokens: torch.Tensor, order: torch.Tensor, blocks) -> torch.Tensor:
    """The old path, written out: one encoder pass per slot on a copy with that slot's block
    and later ones masked, cross-entropy at the slot's target position."""
    B, T = order.shape
    n = tokens.shape[1]
    block = torch.arange(T).expand(B, T) if blocks is None else blocks
    out = torch.zeros(B, T)
    for b in range(B):
        rank = torch.full((n,), 1 << 30)  # positions outside the order: always masked
        rank[order[b]] = block[b]
        for t in range(T):
            copy = torch.where(rank < block[b, t], tokens[b], model.mask_id)
            logits = model.denoise(copy[None])[0, order[b, t]].float()
            out[b, t] = torch.nn.functional.cross_entropy(logits, tokens[b, order[b, t]])
    return out


def test_mdm_one_encoder_pass_per_masked_set_equals_one_per_slot(gen) -> None:
    """The fast path groups the slots that share a masked set (a block) into one pass; its
    NLLs equal the per-slot computation's, for single-slot blocks, strided blocks and a
    prefix of an order, across chunk boundaries (max_tokens)."""
    model = tiny_model("mdm", vocab_size=7, seq_len=12)
    tokens = torch.randint(0, 7, (3, 12), generator=gen)
    calls = []
    model.denoise_features = (lambda f: lambda x: calls.append(len(x)) or f(x))(
        model.denoise_features
    )
    uniform = orders.uniform(3, 12, gen).order
    strided = orders.strided(3, 12, 4)  # 4 heads one at a time, then 2 blocks of 4
    cases = [(uniform, None), (strided.order, strided.model_blocks), (uniform[:, :5], None)]
    for order, blocks in cases:
        for max_tokens in (12 * 2, 8192):  # 2 copies per call, or all at once
            calls.clear()
            fast = model.token_nll(tokens, order, blocks, max_tokens=max_tokens)
            sets = 3 * (order.shape[1] if blocks is None else int(blocks.max()) + 1)
            assert sum(calls) == sets  # one copy per (row, block)
            assert_close(fast, _per_slot_nll(model, tokens, order, blocks), atol=1e-5, rtol=1e-5)


def _mdlm_token_nll(model, tokens: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """-log p(x0_i | x_t) at every position (B, n), x_t = tokens with ``masked`` replaced."""
    logits = model.denoise(torch.where(masked, model.mask_id, tokens)).float()
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")


def test_mdm_loss_is_mdlms_continuous_time_elbo_on_the_same_mask_draw(gen) -> None:
    """MDLM's estimator, (1/t) * sum over masked tokens of -log p(x0 | x_t) per sequence,
    divided by n, at the mask draw the training loss made (its m masked slots of the
    order; t = m/n, where the two forms coincide) equals our training loss exactly."""
    model = tiny_model("mdm", vocab_size=7, seq_len=10)
    tokens = torch.randint(0, 7, (6, 10), generator=gen)
    order = orders.uniform(6, 10, gen).order
    ours = model.loss(tokens, order, generator=torch.Generator().manual_seed(3))
    m = torch.randint(1, 11, (6,), generator=torch.Generator().manual_seed(3))  # the same draw
    slot = torch.empty_like(order).scatter_(1, order, torch.arange(10).expand(6, 10))
    masked = slot >= 10 - m[:, None]
    t = m.double() / 10
    nll = _mdlm_token_nll(model, tokens, masked).double()
    mdlm = ((nll * masked).sum(dim=1) / t / 10).mean()
    assert_close(ours.double(), mdlm, atol=1e-6, rtol=1e-6)


def test_mdm_loss_expectation_is_mdlms_integral_over_t(gen) -> None:
    """In expectation: MDLM's continuous-time ELBO, the integral over t of (1/t) E[sum of
    the masked NLL] with every token masked independently with probability t (by 64-point
    Gauss-Legendre quadrature in t, exact for these polynomials, over all 2^n mask sets),
    equals n times the expectation of our estimator (m ~ U{1..n}, a uniform set of m)."""
    import itertools

    import numpy as np

    n = 5
    model = tiny_model("mdm", vocab_size=4, seq_len=n)
    tokens = torch.randint(0, 4, (2, n), generator=gen)
    nodes, weights = np.polynomial.legendre.leggauss(64)
    ts, ws = (nodes + 1) / 2, weights / 2  # on [0, 1]
    mdlm = torch.zeros(2, dtype=torch.float64)
    ours = torch.zeros(2, dtype=torch.float64)
    for bits in itertools.product([False, True], repeat=n):
        m = sum(bits)
        if m == 0:
            continue
        masked = torch.tensor(bits).expand(2, n)
        total = (_mdlm_token_nll(model, tokens, masked).double() * masked).sum(dim=1)
        mdlm += float(np.sum(ws / ts * ts**m * (1 - ts) ** (n - m))) * total
        ours += total / m / n / math.comb(n, m)  # P(m) P(set | m) (1/m) sum
    assert_close(mdlm, n * ours, atol=1e-9, rtol=1e-9)
