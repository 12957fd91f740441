"""Through a real vLLM engine, an anyorder export decodes exactly as anyorder does: left to
right and in any order chosen per request, alone and batched with other orders."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from anyorder.vllm import ORDER_KEY, SEED_KEY, place, seeded_order

from conftest import anyorder_greedy, engine_logprobs, forward_logprobs

TOL = 1e-4  # nats, fp32


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True,
        extra_args=extra or None,
    )  # fmt: skip


def check(model, prompt, order, completion) -> None:
    want, want_lp = anyorder_greedy(model, prompt, order)
    assert list(completion.token_ids) == want
    got_lp = engine_logprobs(completion)
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < TOL


@pytest.mark.parametrize("kind", ["gpt", "aogpt"])
def test_left_to_right_greedy_is_anyorders(kind, gpt_engine, aogpt_engine):
    llm, model = {"gpt": gpt_engine, "aogpt": aogpt_engine}[kind]
    prompts = [[72, 101, 108], [1], [200, 3, 9, 44, 7, 100, 2]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(12))
    for prompt, out in zip(prompts, outs):
        check(model, prompt, list(range(len(prompt) + 12)), out.outputs[0])


def test_the_cli_s_greedy_text_is_the_engine_s(exports, gpt_engine):
    """``anyorder sample --order l2r --top-k 1`` of the export, and vLLM given the same text."""
    import contextlib
    import io
    import json

    from anyorder.cli import main

    folder = exports["gpt"][0]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["sample", str(folder), "--prompt", "Hel", "--order", "l2r", "--top-k", "1",
                     "--length", "15", "--json", "--no-stop-at-eos"])  # fmt: skip
    assert code in (0, None)
    cli = json.loads(out.getvalue())["samples"][0]["tokens"]
    llm, _ = gpt_engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = llm.generate(["Hel"], params)[0]
    assert list(got.prompt_token_ids)[1:] == cli[:3]  # the BOS slot in front
    assert list(got.outputs[0].token_ids) == cli[3:]


ORDERS = [
    # (prompt, order): infilling puts the prompt's tokens anywhere
    ([72, 101, 108], [5, 0, 9, 1, 2, 3, 4, 6, 7, 8, 10, 11, 12]),
    ([7, 8], [12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]),
    ([], [3, 1, 4, 0, 2]),
    ([9, 9, 9, 9], [0, 9, 1, 8, 2, 7, 3, 6, 4, 5]),
    ([50], list(range(8))),
]


def test_any_order_per_request_batched_and_alone(aogpt_engine):
    """Requests with different orders, in one batch and each alone: anyorder's tokens and
    log-probabilities for that order, every time."""
    llm, model = aogpt_engine
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in ORDERS]
    params = [greedy(len(o) - len(p), **{ORDER_KEY: o}) for p, o in ORDERS]
    batched = llm.generate(prompts, params)
    for (prompt, order), out in zip(ORDERS, batched):
        check(model, prompt, order, out.outputs[0])
    for i in range(len(ORDERS)):
        alone = llm.generate([prompts[i]], params[i])[0].outputs[0]
        assert alone.token_ids == batched[i].outputs[0].token_ids


def test_a_seed_names_anyorders_random_order(aogpt_engine):
    llm, model = aogpt_engine
    prompt = [65, 66, 67]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)] * 3,
        [greedy(10, **{SEED_KEY: s}) for s in (0, 1, 0)],
    )
    for seed, out in zip((0, 1, 0), outs):
        order = seeded_order(3, 13, seed)
        assert order[:3] == [0, 1, 2] and sorted(order) == list(range(13))
        check(model, prompt, order, out.outputs[0])
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert seeded_order(3, 13, 0) != seeded_order(3, 13, 1)


def test_place_puts_the_tokens_at_their_positions(aogpt_engine):
    llm, model = aogpt_engine
    prompt, order = ORDERS[0]
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy(10, **{ORDER_KEY: order}))
    placed = place(prompt, out[0].outputs[0].token_ids, order)
    want, _ = anyorder_greedy(model, prompt, order)
    assert [placed[p] for p in order[3:]] == want
    assert [placed[p] for p in order[:3]] == prompt
    assert place(prompt, [1], order)[order[4]] is None  # not generated yet


@pytest.mark.parametrize("extra", [{}, {ORDER_KEY: [4, 0, 2, 1, 3, 5, 6, 7, 8, 9]}, {SEED_KEY: 5}])
def test_seeded_sampling_is_reproducible_and_drawn_from_the_model(aogpt_engine, extra):
    """A request seed gives the same tokens again; each drawn token's reported
    log-probability is the model's conditional for that order (uncached forward)."""
    llm, model = aogpt_engine
    prompt = [1, 2]
    params = SamplingParams(
        max_tokens=8, temperature=1.0, seed=1234, logprobs=0, detokenize=False,
        ignore_eos=True, extra_args=extra or None,
    )  # fmt: skip
    first, again = (llm.generate([TokensPrompt(prompt_token_ids=prompt)], params)[0] for _ in "ab")
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    order = list(range(10))
    if extra:
        order = extra.get(ORDER_KEY) or seeded_order(2, 10, extra[SEED_KEY])
    tokens = [0] * 10
    for token, position in zip(prompt + list(first.outputs[0].token_ids), order):
        tokens[position] = token
    import torch

    want = forward_logprobs(model, torch.tensor(tokens), order, 2)
    got = engine_logprobs(first.outputs[0])
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL


@st.composite
def requests(draw):
    """A batch of 1-6 requests: prompts of 0-6 tokens, 1-12 generated, each left to right, an
    explicit order (prompt positions anywhere) or a seed."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        k, m = draw(st.integers(0, 6)), draw(st.integers(1, 12))
        prompt = draw(st.lists(st.integers(0, 255), min_size=k, max_size=k))
        how = draw(st.sampled_from(["l2r", "order", "seed"]))
        if how == "l2r":
            out.append((prompt, list(range(k + m)), {}))
        elif how == "order":
            order = draw(st.permutations(range(k + m)))
            out.append((prompt, list(order), {ORDER_KEY: list(order)}))
        else:
            seed = draw(st.integers(0, 2**31))
            out.append((prompt, seeded_order(k, k + m, seed), {SEED_KEY: seed}))
    return out


@settings(max_examples=int(os.environ.get("ANYORDER_VLLM_EXAMPLES", "12")), deadline=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(batch=requests())
def test_random_batches_equal_anyorders_sampler(aogpt_engine, batch):
    """Property: any batch of requests (sizes, prompts, orders, seeds drawn at random) gets,
    request by request, anyorder's greedy tokens and the uncached forward's log-probabilities."""
    llm, model = aogpt_engine
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _, _ in batch]
    params = [greedy(len(o) - len(p), **fields) for p, o, fields in batch]
    for (prompt, order, _), out in zip(batch, llm.generate(prompts, params, use_tqdm=False)):
        check(model, prompt, order, out.outputs[0])
