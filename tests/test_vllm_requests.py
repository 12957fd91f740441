"""The rules of a vLLM request's order fields (anyorder.vllm.requests), which need no vLLM:
the engine runs them at admission and in the worker (tests_vllm/ runs them through it)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anyorder.sampling.draws import prompt_order
from anyorder.vllm.requests import (
    ORDER_KEY,
    SEED_KEY,
    RequestError,
    cache_salt,
    place,
    resolve_order,
    seeded_order,
)


def resolve(extra, k=2, m=3, seq_len=16, kind="aogpt", **kw):
    return resolve_order(extra, prompt_len=k, max_tokens=m, seq_len=seq_len, kind=kind, **kw)


def test_no_field_is_left_to_right():
    assert resolve(None) is None
    assert resolve({"other": 1}) is None
    assert resolve({ORDER_KEY: [0, 1, 2, 3, 4]}) is None  # an explicit left-to-right order


@given(st.integers(0, 8), st.integers(1, 8), st.data())
@settings(max_examples=200, deadline=None)
def test_every_permutation_of_the_sequence_is_served_as_given(k, m, data):
    order = data.draw(st.permutations(range(k + m)))
    got = resolve({ORDER_KEY: list(order)}, k=k, m=m)
    assert got == (None if list(order) == list(range(k + m)) else list(order))


@given(st.integers(0, 8), st.integers(1, 8), st.lists(st.integers(-3, 20), max_size=20))
@settings(max_examples=300, deadline=None)
def test_anything_but_a_permutation_is_refused_naming_the_field(k, m, order):
    if sorted(order) == list(range(k + m)):
        return
    with pytest.raises(RequestError) as e:
        resolve({ORDER_KEY: order}, k=k, m=m)
    assert e.value.parameter == ORDER_KEY and str(e.value).startswith(ORDER_KEY)


@pytest.mark.parametrize(
    "extra, kw, parameter, message",
    [
        ({ORDER_KEY: [0, 1, 2, 2, 4]}, {}, ORDER_KEY,
         "anyorder_order is not a permutation of 0..4: position 2 appears twice"),
        ({ORDER_KEY: [0, 1, 2, 3, 5]}, {}, ORDER_KEY,
         "anyorder_order is not a permutation of 0..4: position 5 is out of range"),
        ({ORDER_KEY: [1, 0]}, {}, ORDER_KEY,
         "anyorder_order has 2 positions, but the prompt's 2 tokens and max_tokens 3 make 5: "
         "give a permutation of 0..4 (the prompt's positions first), or change max_tokens"),
        ({ORDER_KEY: [0, 1, True, 3, 4]}, {}, ORDER_KEY,
         "anyorder_order (vllm_xargs over HTTP, SamplingParams.extra_args in Python) must be a "
         "list of whole numbers (positions), not [0, 1, true, 3, 4]"),
        ({ORDER_KEY: "0 1 2"}, {}, ORDER_KEY, "anyorder_order (vllm_xargs over HTTP"),
        ({SEED_KEY: 1.5}, {}, SEED_KEY,
         "anyorder_seed (vllm_xargs over HTTP, SamplingParams.extra_args in Python) must be a "
         "whole number in [0, 2**63), not 1.5"),
        ({SEED_KEY: 2, ORDER_KEY: [0]}, {}, ORDER_KEY,
         "give anyorder_order or anyorder_seed, not both"),
        ({SEED_KEY: 2}, {"kind": "gpt"}, SEED_KEY,
         "this export is a gpt model, which reads left to right only: drop anyorder_seed, or "
         "serve an aogpt export for any order"),
        ({SEED_KEY: 2}, {"m": 15}, "max_tokens",
         "the prompt's 2 tokens and max_tokens 15 make 17 positions, but the model has 16: "
         "lower max_tokens to 14 or less"),
        ({ORDER_KEY: [4, 3, 2, 1, 0]}, {"ignore_eos": False}, "ignore_eos",
         "a request with anyorder_order must set ignore_eos: true"),
        ({ORDER_KEY: [4, 3, 2, 1, 0]}, {"stops": True}, "stop",
         "a request with anyorder_order cannot take stop strings or stop_token_ids"),
    ],
)  # fmt: skip
def test_each_refusal_names_its_field_and_the_fix(extra, kw, parameter, message):
    with pytest.raises(RequestError) as e:
        resolve(extra, **kw)
    assert e.value.parameter == parameter
    assert str(e.value).startswith(message)


def test_a_left_to_right_request_may_stop_at_eos():
    assert resolve({ORDER_KEY: list(range(5))}, ignore_eos=False, stops=True) is None


@given(st.integers(0, 10), st.integers(1, 10), st.integers(0, 2**63 - 1))
@settings(max_examples=100, deadline=None)
def test_a_seed_names_the_prompt_first_then_a_draw_of_anyorders_samplers(k, m, seed):
    order = seeded_order(k, k + m, seed)
    assert order[:k] == list(range(k)) and sorted(order) == list(range(k + m))
    assert order == seeded_order(k, k + m, seed)  # the same every time, every process
    known = (torch.arange(k + m) < k)[None]
    want = prompt_order(known, torch.Generator().manual_seed(seed), "random")[0].tolist()
    assert order == want


def test_seeds_differ():
    assert len({tuple(seeded_order(2, 12, s)) for s in range(20)}) == 20


def test_place_and_salt():
    order = [3, 0, 4, 1, 2]
    assert place([7, 8], [9, 10, 11], order) == [8, 10, 11, 7, 9]
    assert place([7, 8], [9], order) == [8, None, None, 7, 9]
    assert place([7], [8, 9], None) == [7, 8, 9]
    assert cache_salt(order) == cache_salt(list(order))
    assert cache_salt(order) != cache_salt([3, 0, 4, 2, 1])
