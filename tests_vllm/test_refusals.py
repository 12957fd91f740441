"""What cannot be served exactly is refused: a bad request gets vLLM's validation error (400
over HTTP) naming the field, and the engine goes on serving; a model vLLM's cache cannot hold
is refused at start, in one line."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

from anyorder.vllm import ORDER_KEY, SEED_KEY

from conftest import SEQ_LEN, anyorder_greedy, save_pretrained, start, tiny

WHERE = "(vllm_xargs over HTTP, SamplingParams.extra_args in Python)"
BAD = [
    # (prompt length, max_tokens, extra_args, other params, the message's start)
    (2, 3, {ORDER_KEY: [0, 1, 2, 2, 4]}, {},
     "anyorder_order is not a permutation of 0..4: position 2 appears twice"),
    (2, 3, {ORDER_KEY: [0, 1, 2, 3, 9]}, {},
     "anyorder_order is not a permutation of 0..4: position 9 is out of range"),
    (2, 3, {ORDER_KEY: [0, 1, 2]}, {},
     "anyorder_order has 3 positions, but the prompt's 2 tokens and max_tokens 3 make 5"),
    (2, 3, {ORDER_KEY: [0, 1, "2", 3, 4]}, {},
     f"anyorder_order {WHERE} must be a list of whole numbers"),
    (2, 3, {ORDER_KEY: [1, 0, 2, 3, 4], SEED_KEY: 3}, {},
     "give anyorder_order or anyorder_seed, not both"),
    (2, 3, {SEED_KEY: -1}, {}, f"anyorder_seed {WHERE} must be a whole number"),
    (2, 3, {ORDER_KEY: [1, 0, 2, 3, 4]}, {"ignore_eos": False},
     "a request with anyorder_order must set ignore_eos: true"),
    (2, 3, {ORDER_KEY: [4, 3, 2, 1, 0]}, {"stop_token_ids": [7]},
     "a request with anyorder_order cannot take stop strings"),
    (2, SEQ_LEN, {SEED_KEY: 1}, {},
     f"the prompt's 2 tokens and max_tokens {SEQ_LEN} make {SEQ_LEN + 2} positions"),
]  # fmt: skip


@pytest.mark.parametrize("prompt_len, max_tokens, extra, other, message", BAD)
def test_a_bad_request_is_refused_naming_the_field(
    aogpt_engine, prompt_len, max_tokens, extra, other, message
):
    llm, model = aogpt_engine
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, detokenize=False, extra_args=extra,
        **{"ignore_eos": True, **other},
    )  # fmt: skip
    prompt = TokensPrompt(prompt_token_ids=list(range(5, 5 + prompt_len)))
    with pytest.raises(VLLMValidationError) as e:
        llm.generate([prompt], params)
    assert str(e.value).startswith(message), str(e.value)
    # and the engine serves the next request as before
    good = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    want, _ = anyorder_greedy(model, prompt["prompt_token_ids"], list(range(prompt_len + 4)))
    assert list(good[0].outputs[0].token_ids) == want


def test_a_prompt_longer_than_the_model_is_vllms_usual_refusal(aogpt_engine):
    llm, _ = aogpt_engine
    with pytest.raises(VLLMValidationError, match="longer than the maximum model length"):
        llm.generate([TokensPrompt(prompt_token_ids=[3] * (SEQ_LEN + 1))], SamplingParams())


def test_a_gpt_export_refuses_any_order(gpt_engine):
    llm, _ = gpt_engine
    params = SamplingParams(max_tokens=2, ignore_eos=True, extra_args={SEED_KEY: 1})
    with pytest.raises(VLLMValidationError, match="this export is a gpt model, which reads left"):
        llm.generate([TokensPrompt(prompt_token_ids=[1])], params)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("armd", "armd cannot be served by vLLM: its query stream reads the content stream's"),
        ("mdm", "mdm cannot be served by vLLM: the engine's KV cache is causal and mdm is not"),
    ],
)
def test_a_model_the_engine_cannot_hold_is_refused_at_start(tmp_path, kind, message):
    save_pretrained(tiny(kind), tmp_path)
    with pytest.raises(Exception, match=message):
        start(tmp_path)


def test_a_context_past_the_model_is_refused_at_start(exports, monkeypatch):
    # vLLM refuses it unless told to allow it; then anyorder does
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.raises(Exception, match="max_model_len 64 is over what the model holds"):
        start(exports["gpt"][0], max_model_len=64)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tensor_parallel_size": 2}, "anyorder models run whole on one device per engine"),
        ({"enable_prompt_embeds": True}, "anyorder models take token prompts, not embeddings"),
    ],
)
def test_what_the_model_cannot_honour_is_refused_at_start(exports, options, message):
    with pytest.raises(Exception, match=message):
        start(exports["gpt"][0], **options)
