"""The harness's ``--apply_chat_template`` on an anyorder model: the prompt reaches the model
as the chat template's ids, written out here, and the numbers are those of a plain forward
over them."""

from __future__ import annotations

import pytest

from anyorder.data import ByteTokenizer

pytest.importorskip("lm_eval", reason="the harness is the eval extra: pip install anyorder[eval]")

from test_harness import _by_hand, _encoded, _pairs, harness  # noqa: E402


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A gpt of byte vocabulary, context 64 (as test_harness.py's)."""
    from anyorder.checkpoint.exporting import save_pretrained

    from conftest import tiny_model

    model = tiny_model("gpt", seed=3, vocab_size=257, seq_len=64)
    return {"gpt": save_pretrained(model, tmp_path_factory.mktemp("h") / "gpt", ByteTokenizer())}


def _plain(messages, generation: bool = True) -> list[int]:
    """The byte tokenizer's documented template, written out: <|ROLE|>, newline, content,
    EOS per turn; then <|assistant|> and a newline."""
    eos = ByteTokenizer.eos_id
    ids: list[int] = []
    for m in messages:
        ids += list(f"<|{m['role']}|>\n{m['content']}".encode()) + [eos]
    return ids + (list(b"<|assistant|>\n") if generation else [])


def test_the_rendered_string_gives_back_the_template_ids(exports) -> None:
    from anyorder.harness import AnyorderLM

    lm = AnyorderLM(str(exports["gpt"]), device="cpu")
    chat = [{"role": "system", "content": "brief"}, {"role": "user", "content": "sort: b a"}]
    text = lm.apply_chat_template(chat)
    assert lm.tok_encode(text) == _plain(chat)
    assert "<|user|>\nsort: b a" in text  # the readable text is there for the logs
    # glued to a continuation, and twice (few-shot turns rendered apart): ids, then text
    assert lm.tok_encode(text + " a b") == _plain(chat) + list(b" a b")
    assert lm.tok_encode("x" + text + text) == [120, *_plain(chat), *_plain(chat)]
    done = lm.apply_chat_template(chat[1:], add_generation_prompt=False)
    assert lm.tok_encode(done) == _plain(chat[1:], generation=False)
    assert lm.tok_encode("plain text") == list(b"plain text")
    assert lm.chat_template() == "<|{role}|>\\n{content}<EOS>"


@pytest.mark.slow  # the harness's task index: ~30 s; the test above is the fast variant
def test_apply_chat_template_through_the_harness(tmp_path, monkeypatch, exports) -> None:
    from anyorder.harness import AnyorderLM

    got = harness(
        tmp_path, monkeypatch, exports["gpt"], "anyorder_mc", "--apply_chat_template",
        "--limit", "2",
    )  # fmt: skip
    lm = AnyorderLM(str(exports["gpt"]), device="cpu")
    for sample in got["anyorder_mc"]:
        question = sample["doc"]["question"]
        for ctx, cont, ll, _ in _pairs(sample):
            ctx_ids, cont_ids = _encoded(lm, ctx, cont)
            assert ctx_ids == _plain([{"role": "user", "content": question}])
            assert cont_ids == list(cont.encode())
            assert ll == pytest.approx(_by_hand(lm.model, ctx_ids, cont_ids), rel=1e-5)


def test_anyorder_eval_passes_the_flag_on(monkeypatch, capsys, exports) -> None:
    import anyorder.harness
    from anyorder.cli import main as cli
    from anyorder.errors import ConfigError

    seen = []

    def spy(*args, **kw):  # the harness itself is run above (slow) and in test_harness.py
        seen.append(kw["apply_chat_template"])
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(anyorder.harness, "run_harness", spy)
    args = ["eval", str(exports["gpt"]), "--suite", "lm-eval", "--tasks", "anyorder_mc"]
    for flag in ([], ["--apply-chat-template"]):
        assert cli([*args, *flag]) == 2
        assert capsys.readouterr().err == "anyorder eval: error: stopped by the test\n"
    assert seen == [False, True]
