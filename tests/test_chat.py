"""Chat: Model.chat and ``anyorder sample --chat`` answer after the chat template's prompt,
by any sampler, and stop at EOS; the answer is what a direct sampler call decodes there."""

from __future__ import annotations

import json

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.errors import SamplingError
from anyorder.sample import sample, speculative_sample

from conftest import tiny_model

SEQ = 64
PROMPT = "sort: d b a"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One export per decoder kind: byte vocabulary, context 48, a head that favours EOS
    (so that answers end before the context does, but not at once)."""
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for kind in ("gpt", "aogpt", "armd"):
        model = tiny_model(
            kind, seed=3, vocab_size=257, seq_len=SEQ, head_bias=True, n_layer=1, d_model=32
        )
        with torch.no_grad():
            model.head.bias[ByteTokenizer.eos_id] = 3.0
        out[kind] = save_pretrained(model, root / kind, ByteTokenizer())
    return out


def _plain_prompt(messages) -> list[int]:
    """The byte tokenizer's documented template (docs: <|ROLE|>, newline, content, EOS;
    then <|assistant|> and a newline), written out here."""
    tok = ByteTokenizer()
    ids: list[int] = []
    for m in messages:
        ids += list(f"<|{m['role']}|>\n{m['content']}".encode()) + [tok.eos_id]
    return ids + list(b"<|assistant|>\n")


def _direct(model, ids: list[int], new: int, seed: int, **kw) -> str:
    """The answer from the sampler called on the prompt ids directly: the tokens after the
    prompt, cut at the first EOS."""
    n = len(ids) + new
    prompt = torch.zeros(n, dtype=torch.long)
    prompt[: len(ids)] = torch.tensor(ids)
    known = torch.arange(n) < len(ids)
    gen = torch.Generator().manual_seed(seed)
    k = kw.pop("speculative", None)
    if k is not None:
        res = speculative_sample(model, n, k, prompt=prompt, known=known, generator=gen, **kw)
    else:
        res = sample(model, n, prompt=prompt, known=known, generator=gen, **kw)
    answer = res.tokens[0, len(ids) :].tolist()
    cut = answer.index(256) if 256 in answer else len(answer)
    return bytes(answer[:cut]).decode("utf-8", errors="replace"), cut < len(answer)


@pytest.mark.parametrize(
    "kind, chat_kw, sample_kw",
    [
        ("gpt", {}, dict(order="l2r")),
        ("aogpt", {}, dict(order="random")),
        ("aogpt", dict(order="l2r"), dict(order="l2r")),
        ("armd", dict(steps=4), dict(order="random", steps=4)),
        ("aogpt", dict(speculative=4), dict(order="random", speculative=4)),
        ("armd", dict(streams=2), dict(streams=2)),  # the answer's room rounded down to 2s
    ],
)
def test_chat_is_the_sampler_after_the_rendered_prompt(exports, kind, chat_kw, sample_kw):
    model = anyorder.load(exports[kind])
    ids = _plain_prompt([{"role": "user", "content": PROMPT}])
    new = SEQ - len(ids)
    new -= new % sample_kw.get("streams", 1)
    ended = []
    for seed in range(2):
        want, end = _direct(model.model, ids, new, seed, **sample_kw)
        assert model.chat(PROMPT, seed=seed, **chat_kw) == want
        ended.append(end)
    assert any(ended), "no answer ended at an EOS: the check of the cut did not run"


def test_messages_max_new_tokens_and_the_answer_alone(exports):
    model = anyorder.load(exports["aogpt"])
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add: 2+2"},
    ]
    ids = _plain_prompt(messages)
    want, _ = _direct(model.model, ids, 5, 7, order="random")
    got = model.chat(messages, seed=7, max_new_tokens=5)
    assert got == want and len(got) <= 5
    assert "<|" not in got
    armd = anyorder.load(exports["armd"])
    with pytest.raises(SamplingError, match=r"^max_new_tokens=5 is not a multiple of the 2 "):
        armd.chat("x", streams=2, max_new_tokens=5)
    ids = _plain_prompt([{"role": "user", "content": "x"}])
    want, _ = _direct(armd.model, ids, 6, 7, streams=3)
    assert armd.chat("x", streams=3, max_new_tokens=6, seed=7) == want
    with pytest.raises(SamplingError, match=r"^max_new_tokens=99 must lie in 1\.\.\d+ \(the"):
        model.chat("x", max_new_tokens=99)
    with pytest.raises(SamplingError, match=r"^the chat prompt is \d+ tokens with its template, "):
        model.chat("x" * SEQ)
    with pytest.raises(SamplingError, match=r"^order='any': use one of"):
        model.chat("x", order="any")


def test_cli_chat_prints_the_answer_alone(exports, capsys):
    from anyorder.cli import main

    for kind, flags, kw in [
        ("gpt", [], {}),  # streamed, left to right
        ("aogpt", ["--steps", "4"], dict(steps=4)),
        ("armd", ["--speculative", "3"], dict(speculative=3)),
    ]:
        path = str(exports[kind])
        want = anyorder.load(path).chat(PROMPT, seed=2, **kw)
        assert (
            main(["sample", path, "--chat", PROMPT, "--seed", "2", "--device", "cpu", *flags]) == 0
        )
        assert capsys.readouterr().out == want + "\n", kind
    path = str(exports["aogpt"])
    argv = ["sample", path, "--chat", PROMPT, "--device", "cpu", "--max-new-tokens", "6"]
    assert main([*argv, "--json"]) == 0
    (s,) = json.loads(capsys.readouterr().out)["samples"]
    assert s["text"] == anyorder.load(path).chat(PROMPT, max_new_tokens=6)
    assert len(s["tokens"]) == len(_plain_prompt([{"role": "user", "content": PROMPT}])) + 6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--chat", "x", "--length", "40"], "--chat takes the answer's length from "
         "--max-new-tokens; leave out --length"),
        (["--max-new-tokens", "4"], "--max-new-tokens sets the length of a --chat answer; use "
         "--length"),
        (["--chat", "x", "--max-new-tokens", "0"], "--max-new-tokens=0 must lie in 1..39 (the "
         "model's context of 64 tokens less the prompt's 25)"),
        (["--chat", "x", "--max-new-tokens", "7", "--streams", "3"], "--max-new-tokens=7 is "
         "not a multiple of the 3 streams (strided decoding cuts the answer into equal "
         "streams); use 6 or leave --max-new-tokens out"),
    ],
)  # fmt: skip
def test_cli_chat_errors(exports, capsys, argv, message):
    from anyorder.cli import main

    kind = "armd" if "--streams" in argv else "aogpt"  # strided decoding is armd's
    assert main(["sample", str(exports[kind]), "--device", "cpu", *argv]) == 2
    assert capsys.readouterr().err == f"anyorder sample: error: {message}\n"


def test_a_chat_with_a_model_trained_on_plain_text_warns(tmp_path) -> None:
    """The README's first chat used a model pre-trained on Python's docs and printed noise
    without a word: where the run's own config says it never saw prompts and answers
    (trained here from scratch on plain text), the API warns and the CLI says so on stderr;
    an SFT run, a fine-tuned one and a converted one (step 0) get no warning."""
    import subprocess
    import sys
    import warnings

    from anyorder.config import RunConfig

    model = tiny_model("armd", seed=3, vocab_size=257, seq_len=SEQ, n_layer=1, d_model=32)
    plain = RunConfig(model=model.cfg)
    plain.data.source = "builtin:pydoc"
    sft = RunConfig(model=model.cfg)
    sft.data.source, sft.order.condition = "task/train.jsonl", "prompt"
    tuned = RunConfig(model=model.cfg)
    tuned.train.init_from = "runs/base"
    folders = {
        name: save_pretrained(model, tmp_path / name, ByteTokenizer(), run_config=cfg, step=step)
        for name, cfg, step in [("plain", plain, 100), ("sft", sft, 100), ("tuned", tuned, 100),
                                ("converted", None, None)]
    }  # fmt: skip
    want = (
        f"{folders['plain']} was trained on plain text (data.source=builtin:pydoc, "
        "order.condition=none), not on prompts and answers: its chat 'answer' continues the "
        "rendered prompt; fine-tune it on prompt/response data with order.condition=prompt "
        "(docs/data.md)"
    )
    for name, folder in folders.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            anyorder.load(folder).chat(PROMPT, max_new_tokens=4)
        got = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert got == ([want] if name == "plain" else []), name
        assert all(w.filename == __file__ for w in caught), name  # points at the caller
    cmd = [sys.executable, "-m", "anyorder.cli", "sample", str(folders["plain"]), "--chat",
           PROMPT, "--max-new-tokens", "4"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"anyorder sample: warning: {want}" in out.stderr.splitlines()
    cmd[4] = str(folders["sft"])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "warning" not in out.stderr, out.stderr
