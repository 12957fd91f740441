"""Conversational data (issue 34, item 1): rendering, one block per example, the prompt's
length beside each block, the split, and bad records refused in one line, nothing written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from anyorder.config import DataConfig
from anyorder.data import ByteTokenizer, cache_key, load_tokenizer, prepare
from anyorder.data.chat import encode_example, render_messages, render_prompt
from anyorder.errors import ConfigError, DataError

from conftest import chatml_tokenizer

EOS = 256
PAIRS = [(f"add {i} and {i + 1}", str(2 * i + 1)) for i in range(12)]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def b(text: str) -> list[int]:
    return list(text.encode())


def write_records(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def pair_records(pairs=PAIRS) -> list[dict]:
    return [{"prompt": p, "response": r} for p, r in pairs]


def cfg(tmp_path: Path, source: Path | str, **kw) -> DataConfig:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return DataConfig(source=str(source), **kw)


@pytest.fixture(scope="module")
def chatml_folder(tmp_path_factory) -> Path:
    """A tiny transformers tokenizer with a ChatML chat template, saved to a folder."""
    tok = chatml_tokenizer()
    tok.chat_template = CHATML
    folder = tmp_path_factory.mktemp("chatml")
    tok.save_pretrained(str(folder))
    return folder


# ----------------------------------------------------------------------------- rendering


def test_plain_template_for_the_byte_tokenizer():
    tok = ByteTokenizer()
    ex = encode_example({"prompt": "2+2?", "response": "4"}, tok, 64, EOS)
    assert ex.prompt_ids == b("<|user|>\n2+2?") + [EOS] + b("<|assistant|>\n")
    assert ex.response_ids == b("4") + [EOS]
    assert render_prompt("2+2?", tok) == ex.prompt_ids
    block = ex.block(64, EOS)
    assert block == ex.prompt_ids + b("4") + [EOS] * (64 - len(ex.prompt_ids) - 1)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    ex = encode_example({"messages": messages}, tok, 128, EOS)
    turns = b("<|system|>\nbe brief") + [EOS] + b("<|user|>\nhi") + [EOS]
    turns += b("<|assistant|>\nhello") + [EOS] + b("<|user|>\nbye") + [EOS]
    assert ex.prompt_ids == turns + b("<|assistant|>\n")
    assert ex.response_ids == b("ciao") + [EOS]
    assert render_prompt(messages[:-1], tok) == ex.prompt_ids
    assert render_messages(messages, tok, add_generation_prompt=False) == turns + b(
        "<|assistant|>\nciao"
    ) + [EOS]


def test_a_tokenizers_chat_template_renders_prompt_and_answer(chatml_folder):
    tok = load_tokenizer(str(chatml_folder))
    raw = tok.tok
    ex = encode_example({"prompt": "hello", "response": "world"}, tok, 64, tok.eos_id)

    def ids(text: str) -> list[int]:
        return raw.encode(text, add_special_tokens=False)

    assert ex.prompt_ids == ids("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    # the template ends the turn with <|im_end|> and a newline; EOS comes after it
    assert ex.response_ids == ids("world<|im_end|>\n") + [
        raw.convert_tokens_to_ids("<|endoftext|>")
    ]
    assert raw.convert_ids_to_tokens(ex.prompt_ids[:1]) == ["<|im_start|>"]
    assert render_prompt("hello", tok) == ex.prompt_ids


def test_the_cache_keeps_the_chat_template(tmp_path, chatml_folder):
    src = write_records(tmp_path / "chat.jsonl", pair_records())
    d = prepare(cfg(tmp_path, src, tokenizer=str(chatml_folder)), 48, progress=False)
    ref = load_tokenizer(str(chatml_folder))
    assert render_prompt("add 1 and 2", d.tokenizer) == render_prompt("add 1 and 2", ref)


# ----------------------------------------------------------------------------- packing


def test_one_block_per_example_with_its_prompt_length(tmp_path):
    records = pair_records() + [
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "a long answer " * 4},
            ]
        }
    ]
    src = write_records(tmp_path / "chat.jsonl", records)
    seq_len = 40
    d = prepare(cfg(tmp_path, src, val_fraction=0.25), seq_len, progress=False)
    assert d.is_chat and d.manifest["kind"] == "chat"
    expected = {}
    for p, r in PAIRS:  # independent: the plain template by hand, EOS to the end
        prompt = b(f"<|user|>\n{p}") + [EOS] + b("<|assistant|>\n")
        answer = b(r) + [EOS]
        expected[tuple(prompt + answer + [EOS] * (seq_len - len(prompt) - len(answer)))] = (
            len(prompt),
            len(answer),
        )
    prompt = b("<|user|>\nhi") + [EOS] + b("<|assistant|>\n")
    cut = prompt + b("a long answer " * 4)[: seq_len - len(prompt)]  # no EOS: cut
    expected[tuple(cut)] = (len(prompt), seq_len - len(prompt))
    got = {}
    for split in ("train", "val"):
        for block, pair in zip(d.split(split), d.lengths[split]):
            got[tuple(int(t) for t in block)] = tuple(int(v) for v in pair)
        idx = np.arange(d.num_blocks(split))
        assert d.prompt_lengths(split, idx).tolist() == d.lengths[split][:, 0].tolist()
    assert got == expected
    answers = [r for _, r in PAIRS] + ["a long answer " * 4]
    total = sum(d.manifest["splits"][s]["answer_bytes"] for s in ("train", "val"))
    assert total == sum(len(a.encode()) for a in answers)
    assert d.num_blocks("val") >= 1 and d.num_blocks("train") >= 1
    assert (
        d.manifest["splits"]["train"]["cut_answers"] + d.manifest["splits"]["val"]["cut_answers"]
        == 1
    )
    for split in ("train", "val"):  # the lengths are checksummed like the blocks
        info = d.manifest["splits"][split]
        positions = int((seq_len - d.lengths[split][:, 0]).sum())
        assert info["answer_positions"] == positions
        assert d.answer_bytes_per_token(split) == info["answer_bytes"] / positions
        # whole blocks, as text data: the bytes their tokens stand for (ASCII: one a byte id)
        assert info["tokens"] == d.num_blocks(split) * seq_len
        assert info["bytes"] == int((d.split(split) < 256).sum())
        assert d.bytes_per_token(split) == info["bytes"] / info["tokens"]
        digest = hashlib.sha256((d.path / info["lengths_file"]).read_bytes()).hexdigest()
        assert info["lengths_sha256"] == digest
    again = prepare(cfg(tmp_path, src, val_fraction=0.25), seq_len, progress=False)
    assert again.reused and again.is_chat


def test_split_by_record_hash_and_the_fallback(tmp_path):
    src = write_records(tmp_path / "chat.jsonl", pair_records())
    d = prepare(cfg(tmp_path, src, val_fraction=0.3), 48, progress=False)

    def held(p, r):
        key = json.dumps([p, r], sort_keys=True).encode()
        return int(hashlib.sha1(key).hexdigest()[:8], 16) / 2**32 < 0.3

    want_val = [p for p, r in PAIRS if held(p, r)]
    assert want_val, "the hash must hold some out at this share"
    val_prompts = [  # between "<|user|>\n" and EOS + "<|assistant|>\n"
        ByteTokenizer().decode(row[9 : int(n) - 15]) for row, (n, _) in zip(d.val, d.lengths["val"])
    ]
    assert val_prompts == want_val
    # a share too small to hold one out: the last train example moves to validation
    d = prepare(cfg(tmp_path, src, val_fraction=1e-9), 48, progress=False)
    assert d.num_blocks("val") == 1 and d.num_blocks("train") == len(PAIRS) - 1
    p, r = PAIRS[-1]
    assert ByteTokenizer().decode(d.val[0]) == f"<|user|>\n{p}<|assistant|>\n{r}"


def test_format_auto_detects_chat_and_keys_differ(tmp_path):
    src = write_records(tmp_path / "chat.jsonl", pair_records())
    text = write_records(tmp_path / "text.jsonl", [{"text": p} for p, _ in PAIRS])
    assert cache_key(cfg(tmp_path, src), 32) == cache_key(cfg(tmp_path, src, format="chat"), 32)
    assert cache_key(cfg(tmp_path, src), 32) != cache_key(cfg(tmp_path, src, format="text"), 32)
    assert cache_key(cfg(tmp_path, text), 32) == cache_key(cfg(tmp_path, text, format="text"), 32)
    assert not prepare(cfg(tmp_path, text, val_fraction=0.3), 8, progress=False).is_chat
    with pytest.raises(ConfigError, match=r"^data.format='dialog': use auto, text or chat$"):
        cache_key(cfg(tmp_path, src, format="dialog"), 32)


BAD = [
    ({"prompt": "q"}, "has no prompt and response fields nor messages (it has: prompt); give "
     "each record prompt and response, or messages"),
    ({"prompt": "q", "response": " "}, "has an empty answer; give it one or remove the record"),
    ({"prompt": "q" * 40, "response": "a"}, ": the prompt is 64 tokens, which leaves no room for "
     "an answer in model.seq_len=48; shorten the prompt or raise model.seq_len"),
    ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]},
     ": message 0 has role 'bot'; use system, user or assistant"),
    ({"messages": [{"role": "user", "content": "x"}]}, ": the last message is the user's; end "
     "with the assistant's answer, the part trained on"),
    ({"prompt": 3, "response": "a"}, ": field 'prompt' holds int, not text"),
]  # fmt: skip


@pytest.mark.parametrize("record, message", BAD)
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, record, message):
    path = tmp_path / "chat.jsonl"
    write_records(path, [*pair_records()[:3], record, *pair_records()[3:]])
    with pytest.raises(DataError) as e:
        prepare(cfg(tmp_path, path, format="chat"), 48, progress=False)
    sep = "" if message.startswith(":") else " "
    assert str(e.value) == f"{path}:4{sep}{message}"
    assert not (tmp_path / "cache").exists()  # nothing half-written


def test_too_few_examples_and_plain_text_sources(tmp_path):
    one = write_records(tmp_path / "one.jsonl", pair_records()[:1])
    with pytest.raises(DataError, match="holds 1 example"):
        prepare(cfg(tmp_path, one), 48, progress=False)
    with pytest.raises(DataError, match=r"builtin:pydoc is plain text"):
        prepare(cfg(tmp_path, "builtin:pydoc", format="chat"), 48, progress=False)
    with pytest.raises(ConfigError, match=r"^data.tokenizer=bpe:300 trains on plain text"):
        prepare(cfg(tmp_path, one, tokenizer="bpe:300"), 48, progress=False)
    assert not (tmp_path / "cache").exists()


def test_hf_local_folder_reads_the_same_examples(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "recs"
    write_records(folder / "a.jsonl", pair_records())
    local = prepare(cfg(tmp_path, folder / "a.jsonl", val_fraction=0.3), 48, progress=False)
    hub = prepare(
        cfg(tmp_path, f"hf:{folder}", format="chat", val_fraction=0.3), 48, progress=False
    )
    np.testing.assert_array_equal(hub.train, local.train)
    np.testing.assert_array_equal(hub.lengths["val"], local.lengths["val"])


UNREADABLE = [
    ("[" * 100_000 + "]" * 100_000, "nests too deep for a JSON reader; fix or remove the line"),
    ("9" * 10_000, "holds a number of more than 4300 digits, which Python's JSON reader refuses; "
     "fix or remove the line"),
]  # fmt: skip


@pytest.mark.parametrize("at", [1, 3])  # line 1: data.format=auto reads it to decide
@pytest.mark.parametrize("field", ["prompt", "text"])  # chat data and text data alike
@pytest.mark.parametrize("value, message", UNREADABLE, ids=["deep", "digits"])
def test_a_line_json_cannot_read_is_one_line_through_the_cli(
    tmp_path, capsys, at, field, value, message
):
    """A record nested 100,000 deep or holding a 10,000-digit number: ``anyorder train``
    names the file and line, exit 2 (a RecursionError or ValueError traceback before)."""
    from anyorder.cli import main

    from conftest import REPO

    good = [json.dumps(r) for r in pair_records()[:4]]
    if field == "text":
        good = [json.dumps({"text": p}) for p, _ in PAIRS[:4]]
    bad = f'{{"{field}": "q", "response": "a", "n": {value}}}'
    lines = [*good[: at - 1], bad, *good[at - 1 :]]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    argv = ["train", str(REPO / "configs/tiny-aogpt.yaml"), f"data.source={path}",
            f"data.cache_dir={tmp_path}/cache", f"train.out_dir={tmp_path}/run",
            "train.device=cpu"]  # fmt: skip
    if field == "prompt" and at > 1:
        argv.append("order.condition=prompt")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"anyorder train: error: {path}:{at} {message}"
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()
