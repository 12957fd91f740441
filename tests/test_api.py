"""The Python API: anyorder.load(...).generate / infill / score, and its match with the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.errors import CheckpointError, ConfigError, SamplingError
from anyorder.evaluation.estimators import left_to_right_nll

from conftest import tiny_model

TEXT = "def f(x):\n    return x + 1\n\nprint(f(41))\n"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One export per model kind: byte vocabulary, context 32."""
    root = tmp_path_factory.mktemp("exports")
    return {
        kind: save_pretrained(
            tiny_model(kind, seed=7, vocab_size=257, seq_len=32), root / kind, ByteTokenizer()
        )
        for kind in ("gpt", "aogpt", "armd", "mdm")
    }


def cli_sample(capsys, *args: str) -> dict:
    from anyorder.cli import main

    assert main(["sample", *args, "--json", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "kind, options",
    [
        ("gpt", {}),
        ("aogpt", {"order": "random"}),
        ("armd", {"steps": 4}),
        ("armd", {"streams": 2}),
        ("mdm", {"steps": 5}),
    ],
)
def test_generate_is_the_cli_sample(exports, capsys, kind: str, options: dict) -> None:
    model = anyorder.load(exports[kind])
    kw = dict(n=16, num_samples=2, seed=3, temperature=0.9, top_k=50, **options)
    texts = model.generate(**kw)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    assert model.generate(**kw) == texts  # seeded
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    out = cli_sample(
        capsys, str(exports[kind]), "--length=16", "--num-samples=2", "--seed=3",
        "--temperature=0.9", "--top-k=50", *flags,
    )  # fmt: skip
    assert [s["text"] for s in out["samples"]] == texts


def test_prompt_and_infill_keep_the_known_text(exports, capsys) -> None:
    model = anyorder.load(exports["armd"])
    for text in model.generate(n=24, num_samples=3, prompt="def ", seed=1, stop_at_eos=False):
        assert text.startswith("def ")
    template = "x = [MASK:6] + y[MASK:3]"
    filled = model.infill(template, seed=2)
    assert filled.startswith("x = ") and " + y" in filled
    out = cli_sample(capsys, str(exports["armd"]), "--infill", template, "--seed=2")
    assert out["samples"][0]["text"] == filled
    with pytest.raises(SamplingError, match="no hole"):
        model.infill("no holes here")


def test_generate_errors_are_sampling_errors(exports) -> None:
    gpt = anyorder.load(exports["gpt"])
    with pytest.raises(SamplingError, match="gpt generates left to right"):
        gpt.generate(n=8, order="random")
    with pytest.raises(SamplingError, match="order='strided' needs streams"):
        anyorder.load(exports["armd"]).generate(n=8, order="strided")
    with pytest.raises(SamplingError, match="length n=33 must lie in 1..32"):
        gpt.generate(n=33)
    with pytest.raises(SamplingError, match="temperature=0"):
        gpt.generate(n=8, temperature=0)


@pytest.mark.parametrize(
    "controls, message",
    [
        # an int too large for a float: OverflowError inside the sampler before
        ({"temperature": 10**400}, "temperature=1" + "0" * 27 + "..." + "0" * 29 + " must be a "
         "finite number > 0, e.g. 1.0"),  # cut as reprlib cuts: 28 + "..." + 29
        ({"temperature": True}, "temperature=True must be a number > 0, e.g. 1.0 (0.01 for "
         "near-greedy)"),
        # a TypeError from torch.topk before
        ({"top_k": 2.5}, "top-k=2.5 must be a whole number, at least 1; leave it out to keep "
         "every token"),
        ({"top_k": True}, "top-k=True must be a whole number, at least 1; leave it out to keep "
         "every token"),
        # counted as top_p=1 (no cut) before
        ({"top_p": True}, "top-p=True must lie in (0, 1]; use e.g. 0.9, or 1 for no cut"),
        ({"steps": 2.5}, "steps=2.5 must be a whole number, at least 1"),
    ],
)  # fmt: skip
def test_generate_checks_the_type_of_its_controls(exports, controls, message) -> None:
    model = anyorder.load(exports["aogpt"])
    with pytest.raises(SamplingError) as e:
        model.generate(n=8, **controls)
    assert str(e.value) == message
    with pytest.raises(SamplingError) as e:
        model.infill("ab[MASK:3]", **controls)
    assert str(e.value) == message


TEXT_ONLY = "must be a str"
MESSAGES = "must be a str or a list of {'role': ..., 'content': ...} messages"


@pytest.mark.parametrize(
    "call, message",
    [
        # AttributeError: 'int' object has no attribute 'encode', from the tokenizer, before
        (lambda m: m.generate(n=8, prompt=123), f"prompt {TEXT_ONLY}, not int (123); pass the "
         "text as a str"),
        (lambda m: m.generate(n=8, prompt=[1, 2]), f"prompt {TEXT_ONLY}, not list ([1, 2]); "
         "pass the text as a str"),
        (lambda m: m.generate(n=8, prompt=0), f"prompt {TEXT_ONLY}, not int (0); pass the text "
         "as a str"),  # no prompt at all before: 0 is falsy
        (lambda m: m.generate(n=8, prompt=b"ab"), f"prompt {TEXT_ONLY}, not bytes (b'ab'); "
         "decode it first, e.g. .decode('utf-8')"),
        # TypeError: cannot use a string pattern on a bytes-like object, before
        (lambda m: m.infill(b"a[MASK:2]"), f"template {TEXT_ONLY}, not bytes (b'a[MASK:2]'); "
         "decode it first, e.g. .decode('utf-8')"),
        (lambda m: m.infill(None), f"template {TEXT_ONLY}, not NoneType (None); pass the text "
         "as a str"),
        # TypeError: 'int' object is not iterable, before; bytes read as a list of messages
        (lambda m: m.chat(123), f"prompt_or_messages {MESSAGES}, not int (123); pass the text "
         "as a str"),
        (lambda m: m.chat(b"hi"), f"prompt_or_messages {MESSAGES}, not bytes (b'hi'); decode "
         "it first, e.g. .decode('utf-8')"),
        (lambda m: m.chat({"role": "user", "content": "hi"}), f"prompt_or_messages {MESSAGES}, "
         "not dict ({'content': 'hi', 'role': 'user'}); pass one message as a list of one"),
    ],
)  # fmt: skip
def test_text_arguments_are_checked_at_the_api(exports, call, message) -> None:
    """A prompt that is not text is one clear SamplingError naming the argument, the type
    given and what is expected, not a TypeError or AttributeError from the tokenizer."""
    with pytest.raises(SamplingError) as e:
        call(anyorder.load(exports["armd"]))
    assert str(e.value) == message


def test_score_checks_its_text(exports) -> None:
    model = anyorder.load(exports["aogpt"])
    with pytest.raises(ConfigError) as e:
        model.score(123)
    assert str(e.value) == "text must be a str, not int (123); pass the text as a str"
    with pytest.raises(ConfigError) as e:
        model.score("ab", context=b"x" * 100)
    assert str(e.value) == (
        "context must be a str, not bytes (b'" + "x" * 26 + "..." + "x" * 28 + "'); decode it "
        "first, e.g. .decode('utf-8')"  # a short preview, as reprlib cuts it
    )
    assert model.chat([{"role": "user", "content": "hi"}], max_new_tokens=2) == model.chat(
        "hi", max_new_tokens=2
    )  # a list of messages and a text both still go


def test_score_left_to_right_is_the_exact_nll(exports) -> None:
    model = anyorder.load(exports["aogpt"])
    ids = ByteTokenizer().encode(TEXT)
    assert len(ids) > 32  # two windows: 32 tokens, then the rest
    res = model.score(TEXT)
    windows = [torch.tensor([ids[:32]]), torch.tensor([ids[32:]])]
    total = sum(float(left_to_right_nll(model.model, w)[0]) for w in windows)
    assert res["nats_per_token"] == pytest.approx(total / len(ids), rel=1e-6)
    assert res["stderr"] == 0.0 and res["tokens"] == len(ids) and res["bytes"] == len(TEXT)
    assert res["ppl"] == pytest.approx(math.exp(res["nats_per_token"]))
    assert res["bits_per_byte"] == pytest.approx(total / math.log(2) / len(TEXT))


def test_score_any_order_and_ensembles(exports) -> None:
    model = anyorder.load(exports["armd"])
    a = model.score(TEXT, order="any", num_orders=4, seed=0)
    assert a == model.score(TEXT, order="any", num_orders=4, seed=0)  # seeded
    assert math.isfinite(a["stderr"]) and a["stderr"] > 0 and a["num_orders"] == 4
    e = model.score(TEXT, order="any", num_orders=4, ensemble=3, seed=0)
    assert e["ensemble"] == 3 and e["nats_per_token"] != a["nats_per_token"]
    assert math.isfinite(e["nats_per_token"]) and e["nats_per_token"] < math.log(257) + 1
    mdm = anyorder.load(exports["mdm"]).score(TEXT, order="any", num_orders=2)
    assert math.isfinite(mdm["nats_per_token"])
    with pytest.raises(ConfigError, match="gpt is a left-to-right model"):
        anyorder.load(exports["gpt"]).score(TEXT, order="any")
    with pytest.raises(ConfigError, match="use it with order='any'"):
        model.score(TEXT, ensemble=2)
    with pytest.raises(ConfigError, match="encodes to no tokens"):
        model.score("")


def test_load_errors_and_tokenizer_override(tmp_path, exports) -> None:
    with pytest.raises(CheckpointError, match="model path '.*missing' does not exist"):
        anyorder.load(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="holds a mdm model, not armd"):
        anyorder.load(exports["mdm"], kind="armd")
    bare = save_pretrained(tiny_model("aogpt", vocab_size=257, seq_len=32), tmp_path / "bare")
    with pytest.raises(
        SamplingError, match="holds no tokenizer; pass tokenizer=SPEC to anyorder.load"
    ):
        anyorder.load(bare).generate(n=4)
    model = anyorder.load(bare, tokenizer="bytes")
    assert len(model.generate(n=4, num_samples=2)) == 2
    assert "kind='aogpt'" in repr(model)


def test_import_stays_light() -> None:
    code = (
        "import sys, anyorder; "
        "assert callable(anyorder.load); "
        "assert not {'anyorder.api', 'anyorder.interop.hub', 'transformers'} & set(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _newline_eos_run(run, kind: str):
    """A run whose tokenizer ends documents with the newline, an ordinary token, so that a
    text prompt can hold EOS; its head favours EOS, so samples end by a generated one too."""
    from anyorder.checkpoint import save_checkpoint
    from anyorder.config import RunConfig
    from anyorder.data.tokenizers import BPETokenizer

    raw = BPETokenizer.train(["ab cd\nef gh\n" * 20], 300).tok
    tok = BPETokenizer(raw, name="newline-eos", spec="newline-eos", eos_id=raw.token_to_id("Ċ"))
    model = tiny_model(kind, vocab_size=tok.vocab_size, seq_len=32, head_bias=True)
    with torch.no_grad():
        model.head.bias[tok.eos_id] = 4.0
    save_checkpoint(run, 1, model=model, config=RunConfig(model=model.cfg), tokenizer=tok)
    return tok


def test_a_prompt_holding_eos_is_kept_by_the_cli_and_the_api(tmp_path, capsys) -> None:
    """Issue 32 (4): stopping at EOS (the default) cut the text and overwrote the tokens from
    the prompt's own EOS on. Only a generated EOS ends a sample."""
    from anyorder.cli import main

    tok = _newline_eos_run(tmp_path / "gpt", "gpt")
    _newline_eos_run(tmp_path / "aogpt", "aogpt")
    eos, n, text = tok.eos_id, 20, "ab\ncd"
    ids = tok.encode(text)
    k = len(ids)
    assert eos in ids[:-1]  # the prompt holds EOS, with text after it
    argv = ["--prompt", text, "--length", str(n), "--seed", "1"]
    # gpt, left to right: decoding stops at the first generated EOS
    (s,) = cli_sample(capsys, str(tmp_path / "gpt"), *argv)["samples"]
    tokens, steps = s["tokens"], s["step_of"]
    assert tokens[:k] == ids and steps[:k] == [-1] * k
    end = tokens.index(eos, k)  # the first generated EOS (the head's bias makes one)
    assert tokens[end:] == [eos] * (n - end)
    assert steps[k:] == list(range(end + 1 - k)) + [-2] * (n - 1 - end)
    assert s["text"] == tok.decode(tokens[:end]) and s["text"].startswith("abcd")
    assert main(["sample", str(tmp_path / "gpt"), *argv, "--device", "cpu"]) == 0
    assert capsys.readouterr().out == s["text"] + "\n"  # streamed: the same text
    assert anyorder.load(tmp_path / "gpt").generate(n=n, prompt=text, seed=1) == [s["text"]]
    # aogpt, any order: no early stop, the text is cut at the first generated EOS
    (s,) = cli_sample(capsys, str(tmp_path / "aogpt"), *argv)["samples"]
    tokens = s["tokens"]
    assert tokens[:k] == ids and eos in tokens[k:]
    assert s["text"] == tok.decode(tokens[: tokens.index(eos, k)])
    assert s["text"].startswith("abcd")
    model = anyorder.load(tmp_path / "aogpt")
    assert model.generate(n=n, prompt=text, seed=1) == [s["text"]]
    for kw in (dict(speculative=3), dict(order="confidence"), dict(steps=5)):  # cut alike
        (t,) = model.generate(n=n, prompt=text, seed=2, **kw)
        assert t.startswith("abcd"), kw
