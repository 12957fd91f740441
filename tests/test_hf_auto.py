"""Exported folders through ``transformers``' real entry points (AutoConfig, AutoModel,
AutoModelForCausalLM, ``generate``, ``pipeline``, ``save_pretrained``), without remote code:
anyorder's logits, loss and samplers, and one-line refusals of what they cannot honour."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.errors import CheckpointError, ConfigError, SamplingError
from anyorder.hf.model import AnyorderModel
from anyorder.sample import decode_text, sample

from conftest import tiny_model

transformers = pytest.importorskip("transformers")

KINDS = ["gpt", "aogpt", "armd", "mdm"]
V, N = 257, 16


def export(tmp_path: Path, kind: str, name: str | None = None, **kw) -> Path:
    model = tiny_model(kind, seed=5, vocab_size=V, seq_len=N)
    return save_pretrained(model, tmp_path / (name or kind), ByteTokenizer(), **kw)


def ids(b: int = 2, t: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V - 1, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {kind: export(root, kind) for kind in KINDS}


# -- loading without remote code --------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_auto_classes_load_an_export_without_remote_code(folders, kind: str) -> None:
    folder = folders[kind]
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and not list(folder.glob("*.py"))  # no code shipped
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    assert hf_config.model_type == "anyorder" and hf_config.to_model_config().kind == kind
    ours = anyorder.load(folder).model
    x = ids()
    for auto in (transformers.AutoModel, transformers.AutoModelForCausalLM):
        hf = auto.from_pretrained(folder)
        assert isinstance(hf, transformers.PreTrainedModel) and not hf.training
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)
            if kind != "gpt":
                g = torch.Generator().manual_seed(1)
                order = torch.stack([torch.randperm(N, generator=g) for _ in range(2)])
                torch.testing.assert_close(
                    hf(input_ids=x, order=order).logits, ours(x, order), atol=1e-5, rtol=0
                )


def test_every_model_field_survives_transformers_config(tmp_path) -> None:
    """A model field whose name transformers' config also uses (rope_scaling is a property of
    PretrainedConfig in transformers 5: it crashed AutoConfig on every export) must reach the
    model unchanged: a trunk with every option of issue 33 away from its default."""
    torch.manual_seed(3)
    cfg = anyorder.preset(
        "tiny", kind="aogpt", vocab_size=V, seq_len=N, n_layer=2, n_head=4, n_kv_head=2,
        d_model=64, head_dim=8, intermediate_size=40, qkv_bias=True, pos_emb="rope",
        rope_base=5000.0, rope_scaling_type="llama3", rope_factor=4.0,
        rope_low_freq_factor=1.5, rope_high_freq_factor=3.0, rope_original_max_pos=8,
        norm_eps=1e-6, tie_embeddings=False,
    )  # fmt: skip
    model = anyorder.build_model(cfg).eval()
    folder = save_pretrained(model, tmp_path / "modern", ByteTokenizer())
    assert transformers.AutoConfig.from_pretrained(folder).to_model_config() == cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-5, rtol=0)


def test_an_older_export_with_code_runs_none_of_it(tmp_path) -> None:
    """Exports written before carried auto_map and modeling_anyorder.py: the registered
    classes win, even with trust_remote_code=True, so the folder's file is never run."""
    folder = export(tmp_path, "aogpt")
    marker = tmp_path / "ran"
    (folder / "modeling_anyorder.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from anyorder.hf.config import AnyorderConfig\n"
        "from anyorder.hf.model import AnyorderModel\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "modeling_anyorder.AnyorderConfig",
        "AutoModel": "modeling_anyorder.AnyorderModel",
    }
    (folder / "config.json").write_text(json.dumps(config))
    for trust in (None, True):
        hf = transformers.AutoModel.from_pretrained(folder, trust_remote_code=trust)
        assert type(hf) is AnyorderModel and type(hf.config).__module__ == "anyorder.hf.config"
    assert not marker.exists()


def test_import_anyorder_then_transformers_registers_for_pipeline(tmp_path) -> None:
    """A fresh process: ``import anyorder`` (which imports no transformers), then
    transformers' Auto classes and pipeline find the classes with no trust_remote_code."""
    from anyorder.data.tokenizers import BPETokenizer

    texts = ["the cat sat on the mat and the dog sat on the log"] * 20
    tok = BPETokenizer.train(texts, 300)
    model = tiny_model("gpt", seed=3, vocab_size=tok.vocab_size, seq_len=N)
    folder = save_pretrained(model, tmp_path / "m", tok)
    code = f"""
import sys, anyorder, torch
assert "transformers" not in sys.modules
folder = {str(folder)!r}
from transformers import AutoConfig, AutoTokenizer
assert "transformers.modeling_utils" not in sys.modules  # a tokenizer user pays nothing
assert type(AutoConfig.from_pretrained(folder)).__name__ == "AnyorderConfig"
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, pipeline
hf = AutoModelForCausalLM.from_pretrained(folder)
x = torch.tensor([[5, 6, 7]])
greedy = hf.generate(x, max_new_tokens=4)
tok = PreTrainedTokenizerFast(tokenizer_file=folder + "/tokenizer/tokenizer.json",
                              eos_token="<|endoftext|>")
pipe = pipeline("text-generation", model=folder, tokenizer=tok)
prompt = tok.decode([5, 6, 7])
text = pipe(prompt, max_new_tokens=4, do_sample=False, return_full_text=False)[0]["generated_text"]
drawn = pipe(prompt, max_new_tokens=4, seed=3)[0]["generated_text"]  # its default: sampling
assert drawn.startswith(prompt), drawn
import json
cont = tok.decode(greedy[0, 3:], skip_special_tokens=True)
print(json.dumps([type(hf).__name__, text, cont]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(Path(anyorder.__file__).parents[1]), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    name, text, greedy_text = json.loads(out.stdout.strip().splitlines()[-1])
    assert name == "AnyorderModel"
    assert text == greedy_text and text  # the pipeline's greedy default is generate's greedy


# -- device_map, dtype ------------------------------------------------------------------


def test_device_map_and_dtype_are_honoured_or_refused(folders) -> None:
    folder, x = folders["armd"], ids()
    ours = anyorder.load(folder).model
    for device_map in ("auto", "cpu", {"": "cpu"}, {"model": "cpu", "model.head": "cpu"}):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map=device_map)
        assert hf.device == torch.device("cpu")
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match=r"^device_map puts parts of the model on cpu, meta; "):
        transformers.AutoModel.from_pretrained(folder, device_map={"a": "cpu", "b": "meta"})
    with pytest.raises(ConfigError, match=r"^device_map='balanced' splits the model over devi"):
        transformers.AutoModel.from_pretrained(folder, device_map="balanced")
    with pytest.raises(ConfigError, match=r"^device_map='nowhere' is not a device; use 'auto'"):
        transformers.AutoModel.from_pretrained(folder, device_map="nowhere")
    bf16 = ours.to(torch.bfloat16)
    for key in ("dtype", "torch_dtype"):
        for value in (torch.bfloat16, "bfloat16"):
            hf = transformers.AutoModel.from_pretrained(folder, **{key: value})
            assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
            with torch.no_grad():
                assert torch.equal(hf(x).logits, bf16(x))
    with pytest.raises(ConfigError, match=r'^dtype="int8" is not a dtype of anyorder weights '):
        transformers.AutoModel.from_pretrained(folder, dtype="int8")
    with pytest.raises(ConfigError, match=r"^dtype='int8' is not one an anyorder model runs in"):
        AnyorderModel.from_pretrained(folder, dtype="int8")
    with pytest.raises(ConfigError, match=r"^revision='v2' picks a hub revision, but '.*' is a l"):
        transformers.AutoModel.from_pretrained(folder, revision="v2")


def test_dtype_auto_is_the_stored_dtype(tmp_path) -> None:
    folder = export(tmp_path, "aogpt", dtype="bfloat16")
    hf = transformers.AutoModel.from_pretrained(folder, dtype="auto")
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    default = transformers.AutoModel.from_pretrained(folder)  # as anyorder.load: float32
    assert {p.dtype for p in default.parameters()} == {torch.float32}


def test_a_bad_stored_dtype_is_one_line_in_both_loaders(tmp_path) -> None:
    folder = export(tmp_path, "aogpt")
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in (("torch_dtype", "evil"), ("dtype", "nn"), ("torch_dtype", [1])):
        path.write_text(json.dumps({**config, key: value}))
        shown = re.escape(json.dumps(value))
        with pytest.raises(CheckpointError, match=rf"config.json has {key}={shown}, not a dtype "):
            anyorder.load(folder)
        with pytest.raises(ConfigError, match=rf"^{key}={shown} is not a dtype of anyorder weig"):
            transformers.AutoModelForCausalLM.from_pretrained(folder)


# -- attention_mask and labels ------------------------------------------------------------


def test_attention_mask_of_ones_is_accepted_and_padding_refused(folders) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["gpt"])
    x = ids()
    with torch.no_grad():
        plain = hf(x).logits
        torch.testing.assert_close(hf(x, attention_mask=torch.ones_like(x)).logits, plain)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding
    with pytest.raises(ConfigError, match=r"^attention_mask has zeros \(padding\): an anyorder"):
        hf(x, attention_mask=mask)
    with pytest.raises(ConfigError, match=r"^attention_mask has zeros \(padding\)"):
        hf.generate(x[:, :4], attention_mask=mask[:, :4], max_new_tokens=2)
    with pytest.raises(ConfigError, match=r"^AnyorderModel.forward does not take position_ids"):
        hf(x, position_ids=torch.arange(N)[None])


def _l2r_nll_by_hand(model, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean of -log p(label_t | x_<t) over labelled t, one forward per t: a decoder reads
    the prefix x[:, :t+1]; the encoder its denoiser with positions >= t masked."""
    total, count = torch.zeros(()), 0
    for t in range(x.shape[1]):
        if model.kind == "mdm":
            masked = x.clone()
            masked[:, t:] = model.mask_id
            logits = model.denoise(masked)[:, t]
        else:
            logits = model(x[:, : t + 1])[:, t]
        logp = torch.log_softmax(logits.double(), -1)
        for b in range(x.shape[0]):
            if labels[b, t] != -100:
                total, count = total - logp[b, labels[b, t]], count + 1
    return total / count


@pytest.mark.parametrize("kind", KINDS)
def test_labels_give_the_left_to_right_nll(folders, kind: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[kind])
    ours = anyorder.load(folders[kind]).model
    x = ids(2, 8)
    labels = x.clone()
    labels[0, :3] = -100  # an unscored prompt
    with torch.no_grad():
        loss = hf(input_ids=x, labels=labels).loss
        by_hand = _l2r_nll_by_hand(ours, x, labels)
    torch.testing.assert_close(loss.double(), by_hand, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match=r"^labels have shape \(2, 7\), input_ids \(2, 8\);"):
        hf(input_ids=x, labels=labels[:, :7])
    with pytest.raises(ConfigError, match=r"^labels hold ids outside 0..256 \(-100 marks an un"):
        hf(input_ids=x, labels=torch.full_like(x, V))
    with pytest.raises(
        ConfigError, match=r"^input_ids must be \(batch, length\), not of shape \(8,\)$"
    ):
        hf(input_ids=x[0])
    with pytest.raises(ConfigError, match=r"^input_ids hold ids outside 0..256 "):
        hf(input_ids=torch.full_like(x, -5))
    with pytest.raises(ConfigError, match=r"^AnyorderModel.forward does not take output_attent"):
        hf(input_ids=x, output_attentions=True)
    loss, logits = hf(input_ids=x, labels=labels, return_dict=False)
    assert torch.equal(loss, hf(input_ids=x, labels=labels).loss)


# -- generate ---------------------------------------------------------------------------


def _greedy_by_hand(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """Left-to-right argmax decoding from plain forwards of the whole sequence (later
    positions hold a placeholder; the decoders do not read them, the encoder masks them)."""
    n = prompt.shape[1] + new
    x = torch.zeros(prompt.shape[0], n, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt
    for t in range(prompt.shape[1], n):
        if model.kind == "mdm":
            masked = x.clone()
            masked[:, t:] = model.mask_id
            logits = model.denoise(masked)[:, t]
        else:
            logits = model(x)[:, t]
        x[:, t] = logits.argmax(-1)
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_is_the_argmax_decode(folders, kind: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[kind])
    prompt = ids(2, 5, seed=3)
    with torch.no_grad():
        expected = _greedy_by_hand(anyorder.load(folders[kind]).model, prompt, 7)
        got = hf.generate(prompt, max_new_tokens=7, order="l2r", eos_token_id=None)
        # greedy (transformers' default) goes left to right unless told: deterministic
        default = hf.generate(prompt, max_new_tokens=7, eos_token_id=None)
    assert torch.equal(got, expected) and torch.equal(default, expected)


CASES = [
    ("gpt", dict(temperature=0.8, top_k=20)),
    ("aogpt", dict(top_p=0.9)),
    ("aogpt", dict(order="l2r", temperature=1.3)),
    ("armd", dict(steps=4)),
    ("armd", dict(speculative=3, top_k=50)),
    ("mdm", dict(steps=5, temperature=0.9)),
]


@pytest.mark.parametrize("kind, settings", CASES)
def test_sampling_generate_is_anyorders_sampler(folders, kind: str, settings: dict) -> None:
    """Same tokens as anyorder's API (text, through the byte tokenizer) and samplers
    (tokens) with the same settings and seed."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[kind])
    api = anyorder.load(folders[kind])
    text = "Hi!"
    prompt = torch.tensor([ByteTokenizer().encode(text)])
    got = hf.generate(
        prompt, max_new_tokens=9, do_sample=True, num_return_sequences=3, seed=11, **settings
    )
    assert got.shape == (3, 12) and torch.equal(got[:, :3], prompt.expand(3, 3))
    hf_settings = {"top_k": 50, **settings}  # transformers' default top_k when sampling
    texts = api.generate(n=12, num_samples=3, prompt=text, seed=11, **hf_settings)
    tok = ByteTokenizer()
    assert [decode_text(tok, row, tok.eos_id) for row in got] == texts
    if "speculative" in settings:
        return
    known = torch.zeros(12, dtype=torch.bool)
    known[:3] = True
    full = torch.zeros(12, dtype=torch.long)
    full[:3] = prompt[0]
    order = hf_settings.pop("order", "l2r" if kind == "gpt" else "random")
    result = sample(
        api.model, 12, order=order, batch=3, prompt=full, known=known,
        generator=torch.Generator().manual_seed(11), **hf_settings,
    )  # fmt: skip
    no_eos = hf.generate(
        prompt, max_new_tokens=9, do_sample=True, num_return_sequences=3, seed=11,
        eos_token_id=None, **settings,
    )  # fmt: skip
    assert torch.equal(no_eos, result.tokens)


def test_generate_seed_defaults_to_torchs_global_generator(folders) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["aogpt"])
    prompt = ids(1, 4)
    torch.manual_seed(7)
    a = hf.generate(prompt, max_new_tokens=8, do_sample=True)
    torch.manual_seed(7)
    assert torch.equal(hf.generate(prompt, max_new_tokens=8, do_sample=True), a)


def test_generate_pads_after_eos_and_streams(folders) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["aogpt"])
    prompt = ids(1, 3)
    free = hf.generate(prompt, max_new_tokens=10, eos_token_id=None, do_sample=True, seed=2)
    eos = int(free[0, 5])  # the 3rd new token, made "EOS": everything after it is padding
    got = hf.generate(
        prompt, max_new_tokens=10, eos_token_id=eos, pad_token_id=V - 1, do_sample=True, seed=2
    )
    first = 3 + int((free[0, 3:] == eos).nonzero()[0])
    assert torch.equal(got[0, : first + 1], free[0, : first + 1])
    assert bool((got[0, first + 1 :] == V - 1).all())

    class Recorder:
        def __init__(self) -> None:
            self.parts, self.ended = [], False

        def put(self, value: torch.Tensor) -> None:
            self.parts.append(value.clone())

        def end(self) -> None:
            self.ended = True

    streamer = Recorder()
    out = hf.generate(prompt, max_new_tokens=10, eos_token_id=None, streamer=streamer, seed=1)
    assert streamer.ended and torch.equal(torch.cat(streamer.parts, 1), out)
    with pytest.raises(SamplingError, match=r"^a streamer takes one sequence, this call makes 2;"):
        hf.generate(prompt, max_new_tokens=3, do_sample=True, num_return_sequences=2,
                    streamer=Recorder())  # fmt: skip


ATTACKS = [
    (dict(max_new_tokens=10**9), SamplingError, r"^max_new_tokens=1000000000 after a 4-token p"),
    (
        dict(max_new_tokens=13),
        SamplingError,
        r"makes 17 tokens, more than the model's context \(16\); use max_new_tokens <= 12$",
    ),
    (dict(max_new_tokens=-3), SamplingError, r"^generate\(\): `max_new_tokens` must be greater"),
    (dict(max_new_tokens=0), SamplingError, r"^generate\(\): `max_new_tokens` must be greater"),
    (
        dict(max_new_tokens=None, max_length=3),
        SamplingError,
        r"^max_length=3 leaves no new token after the 4-token",
    ),
    (dict(num_beams=2), SamplingError, r"^num_beams=2: anyorder samples, it has no beam search"),
    (
        dict(do_sample=True, num_return_sequences=10**6),
        SamplingError,
        r"^1 prompt\(s\) x num_return_sequences=1000000 make",
    ),
    (dict(num_return_sequences=2), SamplingError, r"^generate\(\): Greedy methods \(do_sample"),
    (dict(repetition_penalty=1.3), SamplingError, r"^generate\(\) does not apply repetition_pe"),
    (dict(output_scores=True), SamplingError, r"^generate\(\) does not apply output_scores"),
    (dict(stop_strings=["x"]), SamplingError, r"^generate\(\) does not apply stop_strings"),
    (dict(do_sample=True, temperature=0.0), SamplingError, r"^temperature=0.0 must be > 0"),
    (dict(do_sample=True, top_p=1.5), SamplingError, r"^top-p=1.5 must lie in"),
    (dict(steps=99), SamplingError, r"^steps=99 must lie in 1..n=14"),
    (dict(order="sideways"), SamplingError, r"^order='sideways': use one of random, l2r, str"),
    (dict(seed=-1), SamplingError, r"^seed=-1 must be a whole number in 0.."),
    (dict(past_key_values=()), SamplingError, r"^generate\(\) does not take past_key_values$"),
    (dict(max_new_tokens=2.5), SamplingError, r"^max_new_tokens=2.5 must be a whole number >= 1$"),
    (dict(do_sample=True, top_k=-1), SamplingError, r"^top-k=-1 must be at least 1"),
    (dict(num_return_sequences=0), SamplingError, r"^num_return_sequences=0 must be a whole"),
    (dict(min_new_tokens=3), SamplingError, r"^generate\(\) does not apply min_new_tokens"),
    (dict(assistant_model=torch.nn.Linear(1, 1)), SamplingError, r"^generate\(\) does not tak"),
    (dict(speculative=2, steps=3), SamplingError, r"^--speculative drafts and verifies along"),
    (dict(eos_token_id=[1, 2]), SamplingError, r"^eos_token_id=\[1, 2\]: anyorder stops at one"),
]


@pytest.mark.parametrize("kwargs, error, message", ATTACKS)
def test_generate_refuses_in_one_line(folders, kwargs: dict, error, message: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["aogpt"])
    kwargs = {"max_new_tokens": 10, **kwargs}
    with pytest.raises(error, match=message) as info:
        hf.generate(ids(1, 4), **kwargs)
    assert "\n" not in str(info.value)


def test_generate_refuses_stopping_criteria_and_bad_ids(folders) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["gpt"])
    criteria = transformers.StoppingCriteriaList([transformers.MaxLengthCriteria(6)])
    with pytest.raises(SamplingError, match=r"^generate\(stopping_criteria=...\) is not applied"):
        hf.generate(ids(1, 4), max_new_tokens=4, stopping_criteria=criteria)
    with pytest.raises(SamplingError, match=r"^input_ids must be \(batch, length\), not of shap"):
        hf.generate(torch.tensor([1, 2]), max_new_tokens=4)
    with pytest.raises(SamplingError, match=r"^input_ids must be integer token ids, not torch.fl"):
        hf.generate(torch.tensor([[1.0, 2.0]]), max_new_tokens=4)
    with pytest.raises(SamplingError, match=r"^input_ids hold ids outside 0..256$"):
        hf.generate(torch.tensor([[1, 300]]), max_new_tokens=4)
    out = hf.generate(ids(1, 4), max_new_tokens=3, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 7)


# -- save_pretrained --------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trips_through_both_loaders(folders, tmp_path, kind: str) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[kind])
    hf.save_pretrained(tmp_path / "again")
    x = ids()
    with torch.no_grad():
        expected = anyorder.load(folders[kind]).model(x)
        again = anyorder.load(tmp_path / "again")
        assert again.tokenizer is not None and again.kind == kind
        torch.testing.assert_close(again.model(x), expected, atol=0, rtol=0)
        reloaded = transformers.AutoModel.from_pretrained(tmp_path / "again")
        torch.testing.assert_close(reloaded(x).logits, expected, atol=0, rtol=0)
    with pytest.raises(ConfigError, match=r"^save_pretrained\(push_to_hub=True\) is not supp"):
        hf.save_pretrained(tmp_path / "hub", push_to_hub=True)


# -- what transformers' loaders pass (issue 40) ------------------------------------------


def test_every_option_the_loaders_pass_at_its_default_is_accepted(folders) -> None:
    """transformers' Auto classes pass subfolder="", cache_dir, force_download,
    local_files_only, proxies, revision... on every call (5.x: and pipeline dtype="auto"):
    at their defaults they change nothing and must not be refused."""
    folder, x = folders["aogpt"], ids()
    ours = anyorder.load(folder).model
    defaults = dict(
        subfolder="", revision=None, cache_dir=None, force_download=False,
        local_files_only=False, proxies=None, token=None, trust_remote_code=False,
        code_revision=None, low_cpu_mem_usage=None, use_safetensors=None,
        attn_implementation=None, output_loading_info=False, device_map=None,
        adapter_kwargs={},
    )  # fmt: skip
    for load in (AnyorderModel.from_pretrained, transformers.AutoModelForCausalLM.from_pretrained):
        hf = load(folder, **defaults)
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)
    # options that do nothing for a local folder, whatever their value (as in transformers),
    # and the attention kernel (anyorder's attention is its own: the same function)
    hf = transformers.AutoModel.from_pretrained(
        folder, attn_implementation="eager", cache_dir=str(folder.parent / "cache"),
        local_files_only=True, token=True, trust_remote_code=True,
    )  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)
    # revision="main" is transformers' default (a local folder has no other); both names of
    # the dtype may be given when they agree
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, revision="main", dtype=torch.float16, torch_dtype="float16"
    )
    assert hf.dtype == torch.float16
    # pipeline passes dtype="auto": the stored dtype (float32 here)
    pipe = transformers.pipeline("text-generation", model=str(folder))
    assert type(pipe.model) is AnyorderModel and pipe.model.dtype == torch.float32


def test_subfolder_is_read(tmp_path) -> None:
    folder = export(tmp_path / "repo", "armd", name="inner")
    ours = anyorder.load(folder).model
    x = ids()
    for sub in ("inner", "inner/"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "repo", subfolder=sub)
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)
    with pytest.raises(CheckpointError, match=r"^'.*repo' has no subfolder 'nope'; check subf"):
        AnyorderModel.from_pretrained(tmp_path / "repo", subfolder="nope")


def _snapshots(cache: Path, repo_id: str, revisions: dict[str, Path]) -> None:
    """Lay the folders out in ``cache`` as huggingface_hub stores downloaded snapshots, one
    commit per revision name (a branch or tag: refs/<name>)."""
    import shutil

    root = cache / f"models--{repo_id.replace('/', '--')}"
    for i, (name, folder) in enumerate(revisions.items()):
        commit = f"{i:040x}"
        shutil.copytree(folder, root / "snapshots" / commit)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / name).write_text(commit)


def test_a_hub_id_is_read_at_its_revision_from_cache_dir(tmp_path, monkeypatch) -> None:
    """A hub id goes through anyorder's hub download with the revision transformers
    resolved, cache_dir and local_files_only (here: a cache laid out like the hub's, read
    offline); what that download cannot honour is one line naming it."""
    hub = pytest.importorskip("huggingface_hub")
    # offline, read at import by the hub client (else transformers' look-up of a PEFT adapter
    # retries the network for ~25 s, local_files_only or not)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    main_ = export(tmp_path, "aogpt", name="main")
    v2 = save_pretrained(
        tiny_model("aogpt", seed=9, vocab_size=V, seq_len=N), tmp_path / "v2", ByteTokenizer()
    )
    cache = tmp_path / "hub"
    _snapshots(cache, "someone/tiny", {"main": main_, "v2": v2})
    x = ids()
    for revision, folder in ((None, main_), ("v2", v2)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            "someone/tiny", cache_dir=cache, local_files_only=True, revision=revision
        )
        with torch.no_grad():
            expected = anyorder.load(folder).model(x)
            torch.testing.assert_close(hf(x).logits, expected, atol=1e-5, rtol=0)
    nested = tmp_path / "nested"
    export(nested, "aogpt", name="sub")
    _snapshots(cache, "someone/nested", {"main": nested})
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        "someone/nested", subfolder="sub", cache_dir=cache, local_files_only=True
    )
    with torch.no_grad():
        expected = anyorder.load(nested / "sub").model(x)
        torch.testing.assert_close(hf(x).logits, expected, atol=1e-5, rtol=0)
    fixes = {
        "token": ("hf_x", r"log in \(huggingface-cli login\) or set HF_TOKEN$"),
        "proxies": ({"https": "p:1"}, r"set HTTPS_PROXY in the environment$"),
        "force_download": (True, r"delete the model's folder from the hub cache$"),
    }
    for key, (value, fix) in fixes.items():
        with pytest.raises(
            ConfigError, match=rf"^from_pretrained\({key}=...\) is not passed to .*{fix}"
        ):
            AnyorderModel.from_pretrained("someone/tiny", cache_dir=cache, **{key: value})
    with pytest.raises(CheckpointError, match=r"^model 'someone/absent' is neither a local fold"):
        AnyorderModel.from_pretrained("someone/absent", cache_dir=cache, local_files_only=True)
    # a refused option is said before anything is looked for or downloaded
    with pytest.raises(ConfigError, match=r"^AnyorderModel.from_pretrained does not take foo "):
        AnyorderModel.from_pretrained("someone/absent", foo=1)
    with pytest.raises(ConfigError, match=r"^dtype='int8' is not one an anyorder model runs in"):
        AnyorderModel.from_pretrained("someone/absent", dtype="int8")


def test_options_that_change_meaning_are_refused_in_one_line(folders, tmp_path) -> None:
    folder = folders["gpt"]
    refused = [
        (dict(revision="v2"), r"^revision='v2' picks a hub revision, but '.*' is a local folder;"),
        (dict(output_loading_info=True), r"^AnyorderModel.from_pretrained does not take outp"),
        (dict(quantization_config={"load_in_8bit": True}), r"does not take quantization_c"),
        (dict(variant="fp16"), r"^AnyorderModel.from_pretrained does not take variant "),
        # a model field given to from_pretrained lands in the config: the weights decide
        (dict(n_layer=5), r"^the config sets n_layer=5, but the weights in '.*' have n_layer=2;"),
        (dict(dropout=0.3), r"^the config sets dropout=0.3, but the weights in '.*' have dropout"),
        (
            dict(dtype=torch.float16, torch_dtype="bfloat16"),
            r"^dtype='torch.float16' and torch_dtype='bfloat16' differ; give one \(dtype\)$",
        ),
    ]
    for kwargs, message in refused:
        with pytest.raises(ConfigError, match=message) as info:
            transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        assert "\n" not in str(info.value)
    other = export(tmp_path, "gpt", name="wide")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "n_head": 2}))
    for config in (str(other), transformers.AutoConfig.from_pretrained(other)):
        with pytest.raises(ConfigError, match=r"^the config sets n_head=2, but the weights in "):
            AnyorderModel.from_pretrained(folder, config=config)
    with pytest.raises(ConfigError, match=r"^config is a GPT2Config, not an AnyorderConfig; "):
        AnyorderModel.from_pretrained(folder, config=transformers.GPT2Config())
    same = AnyorderModel.from_pretrained(folder, config=str(folder))  # its own: accepted
    assert same.config.to_model_config() == anyorder.load(folder).model.cfg


def test_a_training_run_loads_with_its_models_config(tmp_path) -> None:
    """A run folder's config.json is the run's (nested sections): the config comes from the
    weights' model (it read as the defaults: an aogpt config on a gpt model)."""
    from anyorder import checkpoint as ckpt_mod
    from anyorder.config import RunConfig

    model = tiny_model("gpt", seed=2, vocab_size=V, seq_len=N)
    run = RunConfig(model=model.cfg)
    ckpt_mod.save_checkpoint(
        tmp_path / "run", 3, model=model, config=run, tokenizer=ByteTokenizer()
    )
    hf = AnyorderModel.from_pretrained(tmp_path / "run")
    assert hf.config.to_model_config() == model.cfg
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("device_map", ["meta", {"": "meta"}, torch.device("meta")])
def test_device_map_meta_is_refused_at_load(folders, device_map) -> None:
    """device_map="meta" was accepted and generate then raised a bare RuntimeError."""
    with pytest.raises(ConfigError, match=r"^device_map='meta' makes a model without weights, "):
        transformers.AutoModelForCausalLM.from_pretrained(folders["gpt"], device_map=device_map)


def test_a_device_that_is_not_here_is_refused_at_load(folders) -> None:
    if torch.cuda.is_available():
        bad = f"cuda:{torch.cuda.device_count()}"
        message = rf"^device_map='{bad}': this machine has \d+ CUDA device\(s\), cuda:0..cuda:"
    else:
        bad, message = "cuda:1", r"^device_map='cuda:1': no CUDA device here; use 'cpu' or 'auto'$"
    index = int(bad.split(":")[1])
    for device_map in (bad, index, {"": index}, {"model": bad, "model.head": index}):
        with pytest.raises(ConfigError, match=message):
            transformers.AutoModelForCausalLM.from_pretrained(folders["gpt"], device_map=device_map)


# -- the byte tokenizer through AutoTokenizer and pipeline (issue 40) --------------------


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory) -> Path:
    """What ``anyorder export RUN --out FOLDER`` writes for a run trained on bytes."""
    from anyorder import checkpoint as ckpt_mod
    from anyorder.cli import main
    from anyorder.config import RunConfig

    root = tmp_path_factory.mktemp("byte-run")
    model = tiny_model("aogpt", seed=4, vocab_size=V, seq_len=N)
    ckpt_mod.save_checkpoint(
        root / "run", 3, model=model, config=RunConfig(model=model.cfg), tokenizer=ByteTokenizer()
    )
    assert main(["export", str(root / "run"), "--out", str(root / "out")]) == 0
    return root / "out"


@pytest.fixture(scope="module")
def auto_tokenizer(byte_export):
    return transformers.AutoTokenizer.from_pretrained(str(byte_export))


def test_auto_tokenizer_of_a_byte_export_has_the_byte_ids(byte_export, auto_tokenizer) -> None:
    assert "also as `tokenizer.json` (`AutoTokenizer`" in (byte_export / "README.md").read_text()
    tok, ours = auto_tokenizer, ByteTokenizer()
    assert len(tok) == ours.vocab_size and tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == ours.eos_id and tok.convert_tokens_to_ids("<|endoftext|>") == 256
    assert tok.bos_token_id is None and tok.model_max_length == N
    every_byte = [b for b in range(256)]
    assert tok.decode(every_byte) == ours.decode(every_byte)
    for b in range(256):  # one id per byte, each on its own
        assert tok.decode([b]) == ours.decode([b])
    text = "".join(chr(c) for c in range(1, 0x800)) + " \t\n\r  .,;'\"é漢字🙂\U0010fffd \u00a0x"
    assert tok(text)["input_ids"] == ours.encode(text)
    assert tok.decode(ours.encode(text)) == text
    assert tok.decode([104, 105, 256, 33]) == "hi<|endoftext|>!"
    assert tok.decode([104, 105, 256, 33], skip_special_tokens=True) == ours.decode(
        [104, 105, 256, 33]
    )


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(
        max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    @given(text=st.text(max_size=80), raw=st.lists(st.integers(0, 256), max_size=60))
    def test_auto_tokenizer_agrees_with_the_byte_tokenizer_on_any_text(
        auto_tokenizer, text: str, raw: list[int]
    ) -> None:
        tok, ours = auto_tokenizer, ByteTokenizer()
        text = text.replace("<|endoftext|>", "")  # transformers reads it as EOS (as GPT-2)
        ids_ = tok(text)["input_ids"]
        assert ids_ == ours.encode(text) and tok.decode(ids_) == text
        assert tok.decode(raw, skip_special_tokens=True) == ours.decode(raw)


def test_pipeline_on_a_byte_export_needs_no_tokenizer(byte_export) -> None:
    pipe = transformers.pipeline("text-generation", model=str(byte_export))
    hf = transformers.AutoModelForCausalLM.from_pretrained(byte_export)
    prompt = "Hi!"
    out = pipe(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)
    greedy = hf.generate(torch.tensor([ByteTokenizer().encode(prompt)]), max_new_tokens=6)
    tok = ByteTokenizer()
    assert out[0]["generated_text"] == decode_text(tok, greedy[0, 3:], tok.eos_id)
    drawn = pipe(prompt, max_new_tokens=6, seed=3, num_return_sequences=2)
    expected = hf.generate(
        torch.tensor([tok.encode(prompt)]), max_new_tokens=6, do_sample=True, seed=3,
        num_return_sequences=2,
    )  # fmt: skip
    assert [d["generated_text"] for d in drawn] == [
        prompt + decode_text(tok, row[3:], tok.eos_id) for row in expected
    ]
