"""Every ``anyorder convert`` of a transformers checkpoint is exact or refused in one line
(issue 40).

The independent computation is ``transformers`` itself, loading the same folder: its
logits (RoPE read from ``rope_scaling``, ``rope_parameters`` or both; Qwen's sliding
layers) and what its ``generate`` stops on (``generation_config.json``'s
``eos_token_id``). Tiny random models, nothing downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")
import transformers as tr  # noqa: E402

from anyorder.checkpoint.exported import load_exported  # noqa: E402
from anyorder.cli import main  # noqa: E402

from conftest import tiny_bpe  # noqa: E402

VOCAB = 320
TRANSFORMERS_4 = int(tr.__version__.split(".")[0]) < 5
"""transformers 4 (pyproject's floor) knows no ``rope_parameters``: a config spelled so is
a transformers-5 config, converted as transformers 5 reads it."""
CLASSES = {
    "llama": (tr.LlamaConfig, tr.LlamaForCausalLM),
    "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM),
    "qwen3": (tr.Qwen3Config, tr.Qwen3ForCausalLM),
    "mistral": (tr.MistralConfig, tr.MistralForCausalLM),
}


def save_source(path, family: str = "llama", seed: int = 0, **config) -> None:
    """A random tiny model of ``family``, sharpened (queries and keys scaled up, so that
    positions show in the logits), saved with ``save_pretrained``."""
    config_cls, model_cls = CLASSES[family]
    kw = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**{**kw, **config})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    hf.save_pretrained(str(path))


def edit_config(folder, drop=(), **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key in drop:
        config.pop(key, None)
    path.write_text(json.dumps({**config, **changes}))


def source_logits(folder, x: torch.Tensor, bos: int = 1) -> torch.Tensor:
    """transformers' own model from the folder, on ``[bos] + x`` (B, n, V)."""
    hf = tr.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    inp = torch.cat([torch.full((x.shape[0], 1), bos), x], dim=1)
    with torch.no_grad():
        return hf(inp).logits[:, :-1]


def convert(folder, out, *extra: str) -> tuple[int, str]:
    """``anyorder convert`` through the CLI: (exit code, stderr)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["convert", str(folder), "--out", str(out), *extra])
    return code, err.getvalue().strip()


def assert_equal_to_source(folder, tmp_path, x: torch.Tensor, seq_len: int = 24) -> None:
    """The converted gpt, and aogpt on the left-to-right order, give the source's logits."""
    ref = source_logits(folder, x)
    for kind in ("gpt", "aogpt"):
        code, err = convert(folder, tmp_path / kind, "--to", kind, "--seq-len", str(seq_len))
        assert code == 0, err
        model = load_exported(tmp_path / kind).model
        with torch.no_grad():
            assert_close(model(x), ref, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- RoPE

SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },  # fmt: skip
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
}


def spell(scaling: dict, spelling: str) -> tuple[dict, list[str]]:
    """config.json's RoPE keys: transformers 4's (``rope_scaling`` with ``type``, the base
    at the top level), transformers 5's (``rope_parameters``), or a transformers-5 save
    with the older key added (both)."""
    if spelling == "rope_scaling":
        old = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
        return {"rope_scaling": old, "rope_theta": 500000.0}, ["rope_parameters"]
    if spelling == "rope_parameters":
        return {"rope_parameters": {**scaling, "rope_theta": 500000.0}}, []
    default = {"rope_type": "default", "rope_theta": 500000.0}
    return {"rope_parameters": default, "rope_scaling": dict(scaling)}, []


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters", "both"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_rope_as_transformers_reads_it_or_refused(tmp_path, scaling, spelling):
    """Each RoPE, spelled each way: the export equals LlamaForCausalLM from the same
    folder, or (yarn, which the trunk does not compute) is refused in one line."""
    if TRANSFORMERS_4 and spelling == "rope_parameters":
        pytest.skip("transformers 4 reads no rope_parameters")
    save_source(tmp_path / "src")
    keys, drop = spell(SCALINGS[scaling], spelling)
    edit_config(tmp_path / "src", drop=drop, **keys)
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    if scaling == "yarn":
        code, err = convert(tmp_path / "src", tmp_path / "out", "--to", "gpt")
        assert code == 2 and len(err.splitlines()) == 1
        assert err.endswith(
            "rope scaling 'yarn' is not implemented by anyorder's trunk; it converts "
            "default, linear, llama3"
        )
        assert not (tmp_path / "out").exists()
        return
    assert_equal_to_source(tmp_path / "src", tmp_path, x)


def test_the_rope_spellings_disagree_where_it_shows(tmp_path):
    """The check above can fail: the scaled source is not the unscaled one."""
    save_source(tmp_path / "a")
    save_source(tmp_path / "b")
    keys, _ = spell(SCALINGS["linear"], "both")
    edit_config(tmp_path / "a", **keys)
    edit_config(tmp_path / "b", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    gap = (source_logits(tmp_path / "a", x) - source_logits(tmp_path / "b", x)).abs().max()
    assert gap > 1e-2


def test_llama3_without_its_original_context_uses_max_position_embeddings(tmp_path):
    """transformers fills in original_max_position_embeddings from
    max_position_embeddings; so does the conversion."""
    if TRANSFORMERS_4:
        pytest.skip("transformers 4 reads no rope_parameters")
    save_source(tmp_path / "src")
    llama3 = {k: v for k, v in SCALINGS["llama3"].items() if "original" not in k}
    edit_config(tmp_path / "src", rope_parameters={**llama3, "rope_theta": 10000.0})
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    assert_equal_to_source(tmp_path / "src", tmp_path, x)


# ----------------------------------------------------------------------------- windows


@pytest.mark.parametrize(
    "window",
    [
        {"max_window_layers": 2},  # no layer from 2 on: none slides
        {"max_window_layers": 0, "layer_types": ["full_attention"] * 2},
        {"use_sliding_window": False, "max_window_layers": 0},
    ],
)
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_with_no_sliding_layer_converts_exactly(tmp_path, family, window):
    config = {"use_sliding_window": True, "sliding_window": 4, **window}
    save_source(tmp_path / "src", family, 3, **config)
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    assert_equal_to_source(tmp_path / "src", tmp_path, x)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_with_a_sliding_layer_is_refused(tmp_path, family):
    config = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    save_source(tmp_path / "src", family, 3, **config)  # layer 1 slides
    code, err = convert(tmp_path / "src", tmp_path / "out", "--to", "gpt", "--seq-len", "24")
    assert code == 2 and len(err.splitlines()) == 1
    assert "uses a sliding window of 4 < seq_len 24 + the BOS (pass --seq-len 3 or less)" in err
    assert not (tmp_path / "out").exists()
    x = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(3))
    assert_equal_to_source(tmp_path / "src", tmp_path, x, seq_len=3)  # within the window


def test_a_llama_config_s_sliding_window_means_nothing(tmp_path):
    """transformers' Llama attends to the whole prefix whatever sliding_window says."""
    save_source(tmp_path / "src")
    edit_config(tmp_path / "src", sliding_window=4)
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(4))
    assert_equal_to_source(tmp_path / "src", tmp_path, x)


# ----------------------------------------------------------------------------- seq_len


@pytest.mark.parametrize("kind,seq_len", [("gpt", 2**40), ("aogpt", 10**7), ("armd", 131073)])
def test_a_context_past_the_bound_is_refused(tmp_path, kind, seq_len):
    save_source(tmp_path / "src")
    edit_config(tmp_path / "src", max_position_embeddings=2**41)
    argv = ["--to", kind, "--seq-len", str(seq_len)]
    code, err = convert(tmp_path / "src", tmp_path / "out", *argv)
    assert code == 2
    assert err == (
        f"anyorder convert: error: seq_len={seq_len} must lie in 1..131072 (anyorder convert "
        "writes at most 131072 positions)"
    )
    assert not (tmp_path / "out").exists()


def test_the_longest_context_converts_and_samples(tmp_path):
    from anyorder.sample import sample

    save_source(tmp_path / "src")
    edit_config(tmp_path / "src", max_position_embeddings=2**41)
    code, err = convert(tmp_path / "src", tmp_path / "ao", "--to", "aogpt", "--seq-len", "131072")
    assert code == 0, err
    model = load_exported(tmp_path / "ao").model
    assert model.cfg.seq_len == 131072
    gen = torch.Generator().manual_seed(0)
    out = sample(model, 8, order="random", batch=1, generator=gen).tokens
    assert out.shape == (1, 8)


# ----------------------------------------------------------------------------- one line


def _config_only(tmp_path, **changes):
    save_source(tmp_path / "src")
    edit_config(tmp_path / "src", **changes)
    return tmp_path / "src"


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            {"model_type": "gpt2"},
            "config.json says model_type gpt2 but has no 'n_embd', GPT-2's width; give a GPT-2 "
            "checkpoint, or correct model_type (llama, qwen2, qwen3 or mistral: their configs "
            "name hidden_size)",
        ),
        (
            {"model_type": ["llama"]},
            "'SRC': config.json has model_type ['llama']; anyorder convert reads model_type "
            "gpt2, llama, mistral, qwen2, qwen3 (a string, as save_pretrained writes it): fix "
            "config.json",
        ),
        (
            {"rope_scaling": "yarn"},
            "config.json's rope_scaling is 'yarn'; it must be an object such as "
            '{"rope_type": "linear", "factor": 2.0}, or null: fix config.json',
        ),
        (
            {"rope_scaling": [2.0]},
            "config.json's rope_scaling is [2.0]; it must be an object such as "
            '{"rope_type": "linear", "factor": 2.0}, or null: fix config.json',
        ),
        (
            {"rope_parameters": "linear"},
            "config.json's rope_parameters is 'linear'; it must be an object such as "
            '{"rope_type": "linear", "factor": 2.0}, or null: fix config.json',
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": [2]}},
            "config.json's rope_parameters factor is [2]; it must be a positive number: fix "
            "config.json",
        ),
        (
            {"hidden_size": 32.0},
            "config.json's hidden_size is 32.0; it must be a positive whole number (an integer, "
            "as transformers writes it): fix config.json",
        ),
        (
            {"hidden_size": 32.5},
            "config.json's hidden_size is 32.5; it must be a positive whole number (an integer, "
            "as transformers writes it): fix config.json",
        ),
        (
            {"eos_token_id": [2, 999]},
            "config.json's eos_token_id holds 999, not an id of the vocabulary (0..319); fix "
            "config.json",
        ),
        (
            {"max_position_embeddings": 1},
            "config.json's max_position_embeddings is 1; it must be a whole number >= 2 (an "
            "integer, as transformers writes it): fix config.json",
        ),
        (
            {"model_type": None},
            "'SRC': config.json names no model_type; anyorder convert reads gpt2, llama, qwen2, "
            'qwen3 or mistral checkpoints by it: add the model\'s "model_type" to config.json '
            "(save_pretrained writes it)",
        ),
    ],
)
def test_a_bad_config_is_one_line_naming_it(tmp_path, tokenizer_files, changes, message):
    """With the source's tokenizer beside it (transformers' tokenizer loader reads
    config.json too, and once took the blame for a float hidden_size)."""
    import shutil

    src = _config_only(tmp_path, **changes)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, src / f.name)
    code, err = convert(src, tmp_path / "out", "--to", "gpt")
    assert code == 2, err
    assert err == "anyorder convert: error: " + message.replace("SRC", str(src))
    assert not (tmp_path / "out").exists()


def test_help_names_every_source(capsys):
    for argv in (["--help"], ["convert", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "GPT-2, Llama, Qwen2, Qwen3 or Mistral weights -> gpt, aogpt or armd" in text
        assert "GPT-2 weights ->" not in text


# ----------------------------------------------------------------------------- EOS

SPECIALS = {
    # family: (special tokens, tokenizer bos, tokenizer eos, config bos, generate's eos list)
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", 0, [2, 0]),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", 0, [2, 0]),
    "llama": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        0,
        [1, 2],
    ),
    "mistral": (["<unk>", "<s>", "</s>"], "<s>", "</s>", 1, [2]),
}
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("tok"), ["<pad>", "<s>", "</s>"], "<s>", "</s>")


def _tokenizer(folder, specials, bos, eos):
    """A tiny byte-level BPE with ``specials`` as ids 0.. and a chat template."""
    raw = tiny_bpe(specials, ["the quick brown fox jumps over the lazy dog"] * 50)
    tok = tr.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos)
    tok.chat_template = CHAT
    tok.save_pretrained(str(folder))
    return folder


def chat_source(tmp_path, family: str):
    """A source whose greedy chat answer ends at its end-of-turn token after a few tokens:
    that token's head row is the third answer token's, a hair longer."""
    import shutil

    specials, bos, eos, bos_id, stops = SPECIALS[family]
    src = tmp_path / "src"
    save_source(src, family, 5, bos_token_id=bos_id, eos_token_id=stops)
    for f in _tokenizer(tmp_path / "tok", specials, bos, eos).iterdir():
        shutil.copy(f, src / f.name)
    generation = {"bos_token_id": bos_id, "eos_token_id": stops}
    (src / "generation_config.json").write_text(json.dumps(generation))
    tok = tr.AutoTokenizer.from_pretrained(str(src))
    messages = [{"role": "user", "content": "the quick brown fox"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    inp = torch.tensor([[bos_id, *ids]])
    hf = tr.AutoModelForCausalLM.from_pretrained(str(src)).eval()
    free = hf.generate(inp, do_sample=False, max_new_tokens=8, eos_token_id=None)
    answer = free[0, inp.shape[1] :].tolist()
    third = next(t for t in answer[2:] if t not in answer[:2] and t >= len(specials))
    stop = tok.eos_token_id
    with torch.no_grad():
        hf.lm_head.weight[stop] = 1.001 * hf.lm_head.weight[third]
    hf.save_pretrained(str(src))
    (src / "generation_config.json").write_text(json.dumps(generation))
    return src, tok, inp, stop


@pytest.mark.parametrize("family", list(SPECIALS))
def test_the_export_stops_where_the_source_s_generate_stops(tmp_path, family):
    """The export's EOS is the one the source's generate stops a chat at (Qwen: <|im_end|>,
    not the <|endoftext|> it starts from), and Model.chat ends its answer there, as
    transformers' generate on [bos] + the rendered prompt does."""
    import anyorder

    src, tok, inp, stop = chat_source(tmp_path, family)
    hf = tr.AutoModelForCausalLM.from_pretrained(str(src)).eval()
    stops = hf.generation_config.eos_token_id
    assert stop in (stops if isinstance(stops, list) else [stops])
    out = hf.generate(inp, do_sample=False, max_new_tokens=8)[0, inp.shape[1] :].tolist()
    assert stop in out and 2 <= out.index(stop) < 7, out  # generate stopped inside the answer
    code, err = convert(src, tmp_path / "gpt", "--to", "gpt", "--seq-len", "63")
    assert code == 0, err
    config = json.loads((tmp_path / "gpt" / "config.json").read_text())
    assert config["eos_token_id"] == stop
    model = anyorder.load(tmp_path / "gpt")
    assert model.tokenizer.eos_id == stop
    answer = model.chat("the quick brown fox", order="l2r", top_k=1, max_new_tokens=8)
    assert answer == tok.decode(out[: out.index(stop)], skip_special_tokens=False)
