"""``anyorder serve`` in chat mode, through the HTTP API in-process: the message goes through
the chat template, the answer alone comes back, and bad chat requests are 400s in one line."""

from __future__ import annotations

import json

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.interop.hub import load_any
from anyorder.sample import sample, speculative_sample
from anyorder.serve import Limits
from test_serve import Running, parse_sse

from conftest import tiny_model

SEQ = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An armd of byte vocabulary whose head favours EOS, so answers end early."""
    model = tiny_model("armd", seed=5, vocab_size=257, seq_len=SEQ, head_bias=True, n_layer=1,
                       d_model=32)  # fmt: skip
    with torch.no_grad():
        model.head.bias[ByteTokenizer.eos_id] = 3.0
    return save_pretrained(model, tmp_path_factory.mktemp("chat") / "armd", ByteTokenizer())


@pytest.fixture(scope="module")
def server(folder):
    s = Running(load_any(folder), Limits(max_body_bytes=4096))
    yield s
    s.close()


def _template_ids(message: str) -> list[int]:
    """The byte tokenizer's plain template, written out (docs/data.md)."""
    return list(f"<|user|>\n{message}".encode()) + [256] + list(b"<|assistant|>\n")


@pytest.mark.parametrize(
    "extra, kw",
    [
        ({"mode": "random"}, dict(order="random")),
        ({"mode": "l2r", "speculative": 3}, dict(order="l2r", speculative=3)),
        ({"mode": "lemma1", "steps": 4, "num_samples": 2}, dict(order="random", steps=4)),
        ({"mode": "strided", "streams": 4}, dict(streams=4)),  # 4 heads, then 4 per pass
    ],
)
def test_a_chat_request_returns_the_answers_alone(server, folder, extra, kw) -> None:
    body = {"text": "sort: [MASK c b", "chat": True, "seed": 3, "max_new_tokens": 20, **extra}
    status, text = server.post(body)
    assert status == 200, text
    events = parse_sse(text)
    start, done = events[0][1], events[-1][1]
    ids = _template_ids(body["text"])  # "[MASK" is text in a message, not a hole
    assert start["n"] == len(ids) + 20 and [c[1] for c in start["prompt"]] == ids
    # the same draw, from the sampler called directly on the template's ids
    model = anyorder.load(folder).model
    n, batch = len(ids) + 20, body.get("num_samples", 1)
    prompt = torch.tensor(ids + [0] * 20)
    known = torch.arange(n) < len(ids)
    gen = torch.Generator().manual_seed(3)
    k = kw.pop("speculative", None)
    common = dict(batch=batch, prompt=prompt, known=known, generator=gen, **kw)
    res = speculative_sample(model, n, k, **common) if k else sample(model, n, **common)
    assert done["tokens"] == res.tokens.tolist()
    if "streams" in kw:  # the passes over the answer's 20 slots: 4 heads, then 4 per pass
        assert start["total_steps"] == int(res.step_of.max()) + 1 == 4 + 20 // 4 - 1
    for row, answer in zip(res.tokens.tolist(), done["texts"]):
        tail = row[len(ids) :]
        tail = tail[: tail.index(256)] if 256 in tail else tail
        assert answer == bytes(tail).decode("utf-8", errors="replace")
    ended = [256 in row[len(ids) :] for row in res.tokens.tolist()]
    assert any(ended)  # the cut at EOS was exercised


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text": "x", "chat": 1}, "field 'chat' must be true or false, not 1"),
        ({"text": "x", "chat": "yes"}, "field 'chat' must be true or false, not \"yes\""),
        ({"text": "x", "chat": True, "length": 40}, "length counts the prompt's tokens too; a "
         "chat answer's is max_new_tokens: leave length out"),
        ({"text": "x", "max_new_tokens": 4}, "max_new_tokens is the length of a chat answer; "
         "set chat, or use length"),
        ({"text": "x", "chat": True, "max_new_tokens": 400}, "max_new_tokens=400 must lie in "
         "1..39 (the model's context of 64 tokens less the prompt's 25)"),
        ({"text": "x" * 60, "chat": True}, "the chat prompt is 84 tokens with its template, "
         "leaving no room for an answer in the model's context of 64; shorten the prompt"),
        ({"text": "x", "chat": True, "max_new_tokens": True}, "field 'max_new_tokens' must be "
         "a whole number, not true"),
    ],
)  # fmt: skip
def test_bad_chat_requests_are_400_in_one_line(server, body, message) -> None:
    status, text = server.post(body)
    assert status == 400
    assert json.loads(text) == {"error": message}


def test_the_guard_still_holds_for_chat(server) -> None:
    status, text = server.post(None, raw=b'{"text": "x", "chat": tru')
    assert status == 400 and "JSON" in json.loads(text)["error"]
    status, text = server.post({"text": "y" * 5000, "chat": True})
    assert status == 413, text


def test_the_page_chats(server) -> None:
    """The page's Chat box sends chat: true with the answer length, and shows the answer."""
    from test_serve import CHROMIUM, CHROMIUM_ARGS, _playwright

    sync_playwright = _playwright()
    body = {"text": "add: 2+2", "chat": True, "mode": "random", "seed": 4, "max_new_tokens": 12}
    want = [e for e in parse_sse(server.post(body)[1]) if e[0] == "done"][0][1]["texts"][0]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_selector("body[data-state=ready]", timeout=30_000)
            page.check("#chat")
            assert page.inner_text("#length-label") == "Answer length"
            page.fill("#text", "add: 2+2")
            page.select_option("#mode", "random")
            page.fill("#length", "12")
            page.fill("#seed", "4")
            page.click("#generate")
            page.wait_for_selector("body[data-state=done]", timeout=60_000)
            assert page.is_hidden("#error")
            assert page.input_value("#final-0") == want
        finally:
            browser.close()
