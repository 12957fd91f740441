"""Llama, Qwen2, Qwen3 and Mistral checkpoints converted into gpt, aogpt and armd (issue 33).

Tiny random models of each family are built with ``transformers``' own classes (nothing is
downloaded), saved with ``save_pretrained`` and converted; the independent computation is
``transformers``' forward and ``generate`` on the source. Configurations are drawn per
family with a seeded generator: grouped-query ratios, head widths, biases, tied or untied
heads, RoPE scaling (none, linear, llama3), Qwen3's QK-norm weights.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

pytest.importorskip("transformers")
import transformers as tr  # noqa: E402

from anyorder.checkpoint.exported import load_exported  # noqa: E402
from anyorder.cli import main  # noqa: E402
from anyorder.interop.streaming import convert_family  # noqa: E402
from anyorder.sample import sample  # noqa: E402

from conftest import tiny_bpe  # noqa: E402

VOCAB = 320
CLASSES = {
    "llama": (tr.LlamaConfig, tr.LlamaForCausalLM),
    "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM),
    "qwen3": (tr.Qwen3Config, tr.Qwen3ForCausalLM),
    "mistral": (tr.MistralConfig, tr.MistralForCausalLM),
}
TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"


def draw_config(family: str, seed: int) -> dict:
    """A random tiny config of ``family``: the shapes and options that differ in the wild."""
    rng = random.Random(seed)
    n_head = rng.choice([2, 4])
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=rng.choice([40, 64]),
        num_hidden_layers=rng.choice([1, 2]),
        num_attention_heads=n_head,
        num_key_value_heads=rng.choice([d for d in (1, 2, 4) if n_head % d == 0]),
        max_position_embeddings=64,
        rms_norm_eps=rng.choice([1e-6, 1e-5]),
        tie_word_embeddings=rng.random() < 0.5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family != "qwen2" and rng.random() < 0.5 or family == "qwen3":
        kw["head_dim"] = rng.choice([8, 12, 16])  # n_head * head_dim != hidden_size too
    scaling = rng.choice(["default", "linear", "llama3"])
    rope: dict = {"rope_type": scaling, "rope_theta": rng.choice([10000.0, 500000.0])}
    if scaling == "linear":
        rope["factor"] = 4.0
    elif scaling == "llama3":
        rope.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        rope["original_max_position_embeddings"] = 32
    kw["rope_parameters"] = rope
    return kw


def save_source(path, family: str, seed: int, *, dtype=torch.float32, shard: bool = False):
    """Build, perturb (norm weights and biases off their init, queries and keys scaled up)
    and save a random model."""
    config_cls, model_cls = CLASSES[family]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**draw_config(family, seed))).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # sharp attention: positions (RoPE, the BOS's) show in the logits
    hf = hf.to(dtype)
    kw = {"max_shard_size": "20KB"} if shard else {}
    hf.save_pretrained(str(path), **kw)
    return hf


def logits_on_bos(hf, x: torch.Tensor, bos: int = 1) -> torch.Tensor:
    """The source's logits on ``[bos] + x`` that predict ``x`` (B, n, V)."""
    inp = torch.cat([torch.full((x.shape[0], 1), bos), x], dim=1)
    with torch.no_grad():
        return hf(inp).logits[:, :-1].float()


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A tiny BPE as a transformers fast tokenizer with BOS, EOS, pad and a chat template."""
    raw = tiny_bpe(["<pad>", "<s>", "</s>"], ["the quick brown fox jumps over the lazy dog"] * 50)
    tok = tr.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tok.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(str(folder))
    return folder


# ----------------------------------------------------------------------------- exactness

CASES = [(f, s) for f in CLASSES for s in (0, 1, 2)]


@pytest.mark.parametrize("family,seed", CASES)
def test_converted_gpt_and_aogpt_give_the_source_logits_on_bos_x(tmp_path, family, seed):
    """fp32: the converted gpt given x is the source on [bos] + x to 1e-5, and so is the
    converted aogpt on the left-to-right order (adaLN starts at zero)."""
    hf = save_source(tmp_path / "src", family, seed)
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(seed))
    ref = logits_on_bos(hf, x)
    for kind in ("gpt", "aogpt"):
        convert_family(tmp_path / "src", kind, tmp_path / kind, seq_len=24)
        model = load_exported(tmp_path / kind).model
        assert model.cfg.rope_bos_shift
        with torch.no_grad():
            assert_close(model(x), ref, rtol=0, atol=1e-5)


def test_without_the_bos_shift_the_logits_differ(tmp_path):
    """The BOS position matters under RoPE: with BOS and x_0 sharing position 0 (the old
    layout) the converted gpt is not the source."""
    hf = save_source(tmp_path / "src", "llama", 0)
    convert_family(tmp_path / "src", "gpt", tmp_path / "gpt", seq_len=24)
    model = load_exported(tmp_path / "gpt").model
    model.cfg.rope_bos_shift = False
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (model(x) - logits_on_bos(hf, x)).abs().max().item()
    assert gap > 1e-3  # measured 8.5e-3: far above the 1e-5 the converted gpt meets


BF16_REL = 0.1
"""bf16 against bf16 (both compute in bf16, rounding in different places: transformers
casts the RoPE tables to bf16, we rotate in fp32): max |diff| below 0.1 logit std
(measured 0.0034-0.0039 at std 0.11-0.12, 2026-12-02)."""


@pytest.mark.parametrize("family", list(CLASSES))
def test_bf16_source_keeps_its_dtype_and_stays_close(tmp_path, family):
    hf = save_source(tmp_path / "src", family, 3, dtype=torch.bfloat16)
    convert_family(tmp_path / "src", "gpt", tmp_path / "gpt", seq_len=24)
    config = json.loads((tmp_path / "gpt" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    model = load_exported(tmp_path / "gpt").model.to(torch.bfloat16)
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(3))
    ref = logits_on_bos(hf, x)
    with torch.no_grad():
        ours = model(x).float()
    gap = (ours - ref).abs().max().item()
    print(f"{family} bf16 max |diff| {gap:.4f}, logit std {ref.std():.3f}")
    assert gap < BF16_REL * ref.std().item()


@pytest.mark.parametrize("family", list(CLASSES))
def test_kv_cached_greedy_decoding_equals_generate(tmp_path, family):
    hf = save_source(tmp_path / "src", family, 4)
    convert_family(tmp_path / "src", "gpt", tmp_path / "gpt", seq_len=32)
    model = load_exported(tmp_path / "gpt").model
    prompt = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    n = 20
    full = torch.zeros(2, n, dtype=torch.long)
    full[:, :5] = prompt
    known = torch.zeros(2, n, dtype=torch.bool)
    known[:, :5] = True
    ours = sample(model, n, order="l2r", batch=2, prompt=full, known=known, top_k=1).tokens
    inp = torch.cat([torch.ones(2, 1, dtype=torch.long), prompt], dim=1)
    ref = hf.generate(inp, do_sample=False, max_new_tokens=n - 5, min_new_tokens=n - 5)
    assert torch.equal(ours, ref[:, 1:])


def test_sharded_source_converts_to_the_same_weights(tmp_path):
    save_source(tmp_path / "one", "qwen2", 5)
    save_source(tmp_path / "many", "qwen2", 5, shard=True)
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    convert_family(tmp_path / "one", "aogpt", tmp_path / "a", seq_len=16)
    convert_family(tmp_path / "many", "aogpt", tmp_path / "b", seq_len=16)
    a, b = (load_exported(tmp_path / k).model.state_dict() for k in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_armd_content_weights_map_and_its_start_gap_is_measured(tmp_path):
    """armd has no BOS slot: its content stream is the source fed x at positions 0..n-1;
    its query stream starts from a prefix mean, never the previous token alone, so the
    left-to-right loss cannot start equal (docs/checkpoints.md; GPT-2 converts likewise)."""
    hf = save_source(tmp_path / "src", "llama", 6)
    conv = convert_family(tmp_path / "src", "armd", tmp_path / "armd", l2s=1)
    armd = load_exported(tmp_path / "armd").model
    assert armd.cfg.seq_len == 64 and not armd.cfg.rope_bos_shift
    assert conv.info["query_mlp_fit_residual"] < 1.0
    sd = hf.state_dict()
    attn = "model.layers.0.self_attn."
    qkv = torch.cat([sd[attn + f"{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(armd.blocks[0].attn.qkv.weight, qkv)
    x = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = F.cross_entropy(hf(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).item()
        loss = F.cross_entropy(armd(x)[:, 1:].flatten(0, 1), x[:, 1:].flatten()).item()
    print(f"source {ref:.4f}  converted armd {loss:.4f}  gap {loss - ref:.4f} nats/token")
    assert abs(loss - ref) < 1.0  # random weights: both near log(V); the gap is recorded


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_and_special_ids_ship_with_the_folder(tmp_path, tokenizer_files, capsys):
    import shutil

    save_source(tmp_path / "src", "qwen3", 7)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, tmp_path / "src" / f.name)
    argv = ["convert", str(tmp_path / "src"), "--to", "aogpt", "--out", str(tmp_path / "ao")]
    assert main([*argv, "--seq-len", "32"]) == 0
    loaded = load_exported(tmp_path / "ao")
    tok = loaded.tokenizer
    assert tok is not None and tok.eos_id == 2
    assert tok.encode("the lazy dog") == tr.AutoTokenizer.from_pretrained(
        str(tokenizer_files)
    ).encode("the lazy dog", add_special_tokens=False)
    config = json.loads((tmp_path / "ao" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, None)
    saved = json.loads((tmp_path / "ao" / "tokenizer" / "tokenizer_config.json").read_text())
    shipped = (
        saved.get("chat_template")
        or (tmp_path / "ao" / "tokenizer" / "chat_template.jinja").read_text()
    )
    assert shipped == TEMPLATE
    # the transformers path: the folder loads as an AutoModelForCausalLM, same logits
    auto = tr.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ao"))
    ids = torch.tensor([tok.encode("the quick brown fox")])
    with torch.no_grad():
        assert_close(auto(ids).logits, loaded.model(ids), rtol=0, atol=1e-6)
    assert auto.config.eos_token_id == 2 and auto.config.bos_token_id == 1
    capsys.readouterr()
    assert main(["sample", str(tmp_path / "ao"), "--length", "8", "--seed", "0"]) == 0
    assert main(["sample", str(tmp_path / "ao"), "--infill", "the [MASK:3] dog"]) == 0


def test_chat_on_a_converted_folder_is_the_sources_greedy_answer(tmp_path, tokenizer_files):
    """``Model.chat`` on a converted folder renders the prompt with the source's own chat
    template and answers what the source's ``generate`` answers on [bos] + those ids."""
    import shutil

    import anyorder

    hf = save_source(tmp_path / "src", "llama", 3)
    for f in tokenizer_files.iterdir():
        shutil.copy(f, tmp_path / "src" / f.name)
    convert_family(tmp_path / "src", "gpt", tmp_path / "gpt", seq_len=32)
    model = anyorder.load(tmp_path / "gpt")
    answer = model.chat("the quick brown fox", order="l2r", top_k=1, max_new_tokens=8)
    # the independent side: transformers renders the template, then generates greedily
    tok = tr.AutoTokenizer.from_pretrained(str(tokenizer_files))
    messages = [{"role": "user", "content": "the quick brown fox"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    inp = torch.tensor([[1, *ids]])
    out = hf.generate(inp, do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, inp.shape[1] :]
    want = out.tolist()
    if 2 in want:  # the answer ends at the source's EOS
        want = want[: want.index(2)]
    assert len(want) >= 3, want  # an answer to compare, not an immediate EOS
    assert answer == tok.decode(want, skip_special_tokens=False)


# ----------------------------------------------------------------------------- refusals


def _with(tmp_path, **config):
    save_source(tmp_path / "src", "mistral", 8)
    path = tmp_path / "src" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tmp_path / "src"


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"sliding_window": 16},
            "a sliding window of 16 < seq_len 63 + the BOS (pass --seq-len 15 or less)",
        ),
        ({"num_local_experts": 8}, "mixture of experts (num_local_experts)"),
        ({"partial_rotary_factor": 0.5}, "partial rotary (partial_rotary_factor 0.5)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
        ({"model_type": "gemma"}, "Gemma's (1 + w) norms and scaled embeddings"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' (the SwiGLU MLP uses silu)"),
    ],
)
def test_unmappable_features_are_refused_by_name(tmp_path, capsys, config, message):
    src = _with(tmp_path, **config)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", str(src), "--to", "gpt", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_missing_bos_id_is_asked_for(tmp_path, capsys):
    src = _with(tmp_path, bos_token_id=None)
    capsys.readouterr()
    assert main(["convert", str(src), "--to", "gpt", "--out", str(tmp_path / "o")]) == 2
    assert "names no bos_token_id; pass --bos-id" in capsys.readouterr().err
    assert (
        main(["convert", str(src), "--to", "gpt", "--bos-id", "5", "--out", str(tmp_path / "o")])
        == 0
    )


def test_rope_bos_shift_is_refused_where_it_means_nothing():
    from anyorder.config import ModelConfig
    from anyorder.errors import ConfigError

    for kw in (dict(kind="armd", pos_emb="rope"), dict(kind="gpt", pos_emb="learned")):
        with pytest.raises(ConfigError, match="model.rope_bos_shift moves the BOS slot"):
            ModelConfig(rope_bos_shift=True, **kw)


def test_non_finite_weights_leave_nothing_behind(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    src = _with(tmp_path)
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["convert", str(src), "--to", "aogpt", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "source weight 'model.layers.0.mlp.up_proj.weight' holds NaN or infinite values; "
        "nothing was written: convert a checkpoint with finite weights"
    )
    assert len(err.splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_bos_id_outside_the_vocabulary_is_refused(tmp_path, capsys):
    src = _with(tmp_path)
    capsys.readouterr()
    argv = [
        "convert",
        str(src),
        "--to",
        "gpt",
        "--bos-id",
        str(VOCAB),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 2
    assert f"BOS id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})" in capsys.readouterr().err


def test_a_window_holding_the_bos_and_every_token_converts_exactly(tmp_path, capsys):
    """Mistral v0.1's window: the last of seq_len tokens must still see the BOS, so a window
    of 17 converts at seq_len 16 (and equals the source there) and refuses seq_len 17."""
    src = _with(tmp_path, sliding_window=17)
    hf = tr.AutoModelForCausalLM.from_pretrained(str(src)).eval()
    capsys.readouterr()
    argv = ["convert", str(src), "--to", "gpt", "--out"]
    assert main([*argv, str(tmp_path / "no"), "--seq-len", "17"]) == 2
    assert "a sliding window of 17 < seq_len 17 + the BOS" in capsys.readouterr().err
    assert main([*argv, str(tmp_path / "gpt"), "--seq-len", "16"]) == 0
    model = load_exported(tmp_path / "gpt").model
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert_close(model(x), logits_on_bos(hf, x), rtol=0, atol=1e-5)
