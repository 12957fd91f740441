"""GPT-2 -> gpt / aogpt / armd: logits parity, ARMD's starting gap, errors, the CLI, init_from."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from anyorder.errors import CheckpointError, ConfigError
from anyorder.interop.convert import convert, convert_gpt2, read_gpt2
from anyorder.interop.hub import from_pretrained

from conftest import GPT2_SKIP, GPT2_TOKENIZER_DIR, has_gpt2_tokenizer

transformers = pytest.importorskip("transformers")

EOS = 50256


def gpt2_folder(path, seed: int = 0, **overrides):
    """A tiny random transformers GPT-2 saved with save_pretrained; returns (folder, model)."""
    torch.manual_seed(seed)
    cfg = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=64)
    cfg.update(overrides)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()
    hf.save_pretrained(str(path))
    return path, hf


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    return gpt2_folder(tmp_path_factory.mktemp("gpt2") / "src")


def gpt2_logits(hf, x: torch.Tensor, bos: int = EOS) -> torch.Tensor:
    """GPT-2 on ``[bos] + x``: slot t predicts x_t, as our models' slot t does."""
    with torch.no_grad():
        inp = torch.cat([torch.full((x.shape[0], 1), bos), x], dim=1)
        return hf(inp).logits[:, : x.shape[1]]


@pytest.mark.parametrize("kind", ["gpt", "aogpt"])
def test_converted_decoder_reproduces_gpt2_logits(tiny_gpt2, kind: str) -> None:
    folder, hf = tiny_gpt2
    conv = convert_gpt2(folder, kind)
    assert conv.model.cfg.seq_len == 63  # one position goes to the BOS
    x = torch.randint(0, 50257, (2, 63), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = conv.model(x)
    assert_close(ours, gpt2_logits(hf, x), rtol=0, atol=1e-5)


def test_aogpt_is_exactly_gpt2_until_trained(tiny_gpt2) -> None:
    """Zero adaLN: left to right it is GPT-2; on other orders it is GPT-2 told no target."""
    folder, hf = tiny_gpt2
    model = convert_gpt2(folder, "aogpt").model
    assert all(not b.ada.linear.weight.any() for b in model.blocks)
    x = torch.randint(0, 50257, (1, 20), generator=torch.Generator().manual_seed(1))
    order = torch.randperm(20, generator=torch.Generator().manual_seed(2))[None]
    with torch.no_grad():
        permuted = model(x, order)
    # blind to the target: slot t's logits do not depend on which position it predicts
    other = order.clone()
    other[0, [5, 6]] = other[0, [6, 5]]
    with torch.no_grad():
        assert_close(model(x, other)[:, :6], permuted[:, :6], rtol=0, atol=1e-5)


def test_untied_head_and_prefixless_names(tmp_path) -> None:
    """A GPT-2 with its own lm_head, saved as a bare GPT2Model-style state dict."""
    from safetensors.torch import save_file

    folder, hf = gpt2_folder(tmp_path / "src", seed=3, tie_word_embeddings=False, vocab_size=300)
    with torch.no_grad():
        hf.lm_head.weight.normal_(0, 0.02)
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    conv = convert_gpt2(folder, "gpt", bos_id=299)
    assert not conv.model.cfg.tie_embeddings
    x = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(conv.model(x), gpt2_logits(hf, x, bos=299), rtol=0, atol=1e-5)


def train_gpt2(steps: int = 120):
    """A tiny GPT-2 trained briefly on bytes of Python's docs, the way GPT-2 was trained
    (windows of text, no end-of-text prefix): something to lose. Initialised here, not by
    transformers, so that it does not change with the transformers version."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))[:400_000].encode()
    data = torch.tensor(list(text), dtype=torch.long)
    train, val = data[:-20_000], data[-20_000:]
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=257, n_positions=64,
        bos_token_id=256, eos_token_id=256, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "ln_" in name:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(train) - 64, (16,), generator=g)
        x = torch.stack([train[i : i + 64] for i in idx])
        loss = F.cross_entropy(hf(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return hf.eval(), torch.stack([val[i : i + 64] for i in range(0, len(val) - 64, 64)][:32])


@pytest.fixture(scope="module")
def trained_gpt2(tmp_path_factory):
    hf, val = train_gpt2()
    folder = tmp_path_factory.mktemp("trained") / "gpt2"
    hf.save_pretrained(str(folder))
    return folder, hf, val


def test_armd_two_stream_maps_gpt2_exactly_given_the_previous_token(tiny_gpt2) -> None:
    """With every layer two-stream and the query stream started from the previous slot's
    content embedding (which ARMD's prefix mean cannot give), the converted ARMD at slot t
    computes exactly GPT-2's prediction at the previous token (GPT-2 fed x itself: no
    shift, x_0 at position 0). So the weight mapping and the two-stream semantics are
    right, and the starting gap is ARMD's query initialisation alone."""
    folder, hf = tiny_gpt2
    armd = convert_gpt2(folder, "armd", l2s=2).model
    assert armd.cfg.seq_len == 64  # no BOS slot: the whole table
    x = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(4))

    def previous_content(target, prefix):  # g0_t = h0_(t-1); slot 0 is not compared
        h = armd.embed_content(x, target)
        return torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)

    armd.embed_query = previous_content
    with torch.no_grad():
        ours = armd(x)[:, 1:]
        ref = hf(x).logits[:, :-1]
    assert_close(ours, ref, rtol=0, atol=1e-5)


def test_armd_starts_within_the_stated_gap_of_gpt2(trained_gpt2) -> None:
    """Stated tolerance: on this tiny trained GPT-2 (2 layers, bytes, 120 steps) the converted
    armd's left-to-right loss starts above GPT-2's by less than 1.0 nats/token (measured
    0.32), and far below a fresh model's. Both are scored on the same targets x_1..x_(n-1)
    (GPT-2 fed x has no prediction for x_0). It cannot start equal: its query stream never
    holds the previous token (see the test above). The better the GPT-2, the more it leans
    on that token and the larger the gap (docs/checkpoints.md); the progressive schedule's
    left-to-right phase closes it."""
    folder, hf, val = trained_gpt2
    with torch.no_grad():
        ref = F.cross_entropy(hf(val).logits[:, :-1].flatten(0, 1), val[:, 1:].flatten()).item()
        armd = convert_gpt2(folder, "armd").model
        loss = F.cross_entropy(armd(val)[:, 1:].flatten(0, 1), val[:, 1:].flatten()).item()
    unigram = torch.bincount(val.flatten(), minlength=257).float() / val.numel()
    assert ref < -(unigram[val].log().mean().item())  # GPT-2 learned more than unigrams
    print(f"gpt2 {ref:.4f}  converted armd {loss:.4f}  gap {loss - ref:.4f} nats/token")
    assert 0 < loss - ref < 1.0
    assert loss < math.log(257) - 1.5  # a fresh model starts at about log(257) = 5.55


# ----------------------------------------------------------------------------- errors


def test_sources_we_cannot_convert_are_named(tmp_path, tiny_gpt2) -> None:
    folder, _ = tiny_gpt2
    with pytest.raises(ConfigError, match="cannot convert GPT-2 into 'mdm'"):
        convert_gpt2(folder, "mdm")
    with pytest.raises(ConfigError, match="seq_len=64 must lie in 1..63"):
        convert_gpt2(folder, "gpt", seq_len=64)
    with pytest.raises(CheckpointError, match="model path '.*absent' does not exist"):
        read_gpt2(tmp_path / "absent")
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(
        CheckpointError, match="holds a 'llama' model; convert_gpt2 reads GPT-2 checkpoints"
    ):
        read_gpt2(other)
    bare = tmp_path / "bare"
    bare.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="holds no weights"):
        read_gpt2(bare)
    (bare / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    (bare / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="activation 'relu' is not supported"):
        convert_gpt2(bare, "gpt")


@pytest.mark.parametrize("value", ["x", 1.5, True, math.inf])
def test_a_gpt2_bos_token_id_that_is_not_a_token_id_is_refused(tmp_path, tiny_gpt2, value):
    """A string crashed with a ValueError traceback, 1e400 (JSON for infinity) with an
    OverflowError; 1.5 and true were read as ids 1."""
    folder, _ = tiny_gpt2
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    cfg = json.loads((src / "config.json").read_text())
    text = json.dumps({**cfg, "bos_token_id": "@"}).replace('"@"', json.dumps(value))
    (src / "config.json").write_text(text.replace("Infinity", "1e400"))
    with pytest.raises(ConfigError) as e:
        convert_gpt2(src, "gpt")
    assert str(e.value) == (
        f"the GPT-2 config's bos_token_id is {value!r}, not a token id; pass --bos-id with "
        "the token the model starts from"
    )


def test_a_gpt2_bos_token_id_of_zero_is_kept(tmp_path, tiny_gpt2) -> None:
    """0 is a token id (it used to fall back to 50256, as a missing id does)."""
    folder, _ = tiny_gpt2
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "bos_token_id": 0}))
    assert convert_gpt2(src, "gpt").info["bos_id"] == 0
    (src / "config.json").write_text(json.dumps({**cfg, "bos_token_id": None}))
    assert convert_gpt2(src, "gpt").info["bos_id"] == EOS


def _bin_folder(path, hf, edit=None):
    """A GPT-2 folder whose weights are a torch.save'd pytorch_model.bin, ``edit``ed."""
    path.mkdir()
    hf.config.save_pretrained(str(path))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    torch.save(edit(state) if edit else state, path / "pytorch_model.bin")
    return path


def _with(**items):
    return lambda state: {**state, **items}


def _int_ln(state):
    key = "transformer.h.0.ln_1.weight"
    return {**state, key: (state[key] * 10).to(torch.int32)}


@pytest.mark.parametrize(
    "edit, message",
    [
        # cast silently into float weights of nonsense
        (_int_ln, "weight 'transformer.h.0.ln_1.weight' is stored as torch.int32; convert "
         "reads float32, bfloat16 and float16 weights: save the checkpoint in one of those"),
        # AttributeError tracebacks
        (lambda s: {**s, 5: torch.zeros(3)},
         "{bin} holds the key 5, not a tensor name; download the checkpoint again"),
        (_with(extra=5), "{bin} holds 'extra': int, not a tensor; download the checkpoint again"),
        (lambda s: [1, 2],
         "{bin} holds list, not a state dict of tensors; download the checkpoint again"),
    ],
)  # fmt: skip
def test_pytorch_model_bin_of_anything_but_float_tensors_is_refused(
    tmp_path, tiny_gpt2, edit, message
):
    folder, hf = tiny_gpt2
    src = _bin_folder(tmp_path / "bin", hf, edit)
    with pytest.raises(CheckpointError) as e:
        convert_gpt2(src, "gpt")
    assert str(e.value) == message.format(bin=src / "pytorch_model.bin")


def test_a_pytorch_model_bin_with_a_compressed_record_is_refused(tmp_path, tiny_gpt2) -> None:
    """torch.load unpacks a record whole: a file of a megabyte could unpack gigabytes."""
    import zipfile

    folder, hf = tiny_gpt2
    src = _bin_folder(tmp_path / "bin", hf)
    path = src / "pytorch_model.bin"
    packed = tmp_path / "packed.bin"
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(packed, "w") as out:
        for info in zin.infolist():
            out.writestr(info.filename, zin.read(info.filename), zipfile.ZIP_DEFLATED)
    packed.replace(path)
    with pytest.raises(CheckpointError) as e:
        convert_gpt2(src, "gpt")
    assert str(e.value).startswith(f"{path} cannot be read as a torch checkpoint (its record ")
    assert str(e.value).endswith(
        "and torch.save compresses none); the file is damaged or not a .pt: download the "
        "checkpoint again"
    )


def test_pytorch_model_bin_converts(tmp_path, tiny_gpt2) -> None:
    folder, hf = tiny_gpt2
    conv = convert_gpt2(_bin_folder(tmp_path / "bin", hf), "gpt")
    x = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(conv.model(x), gpt2_logits(hf, x)[:, :20], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- tokenizer, CLI


@pytest.mark.skipif(not has_gpt2_tokenizer(), reason=GPT2_SKIP)
def test_converted_folder_carries_the_gpt2_tokenizer(tmp_path, tiny_gpt2) -> None:
    folder, _ = tiny_gpt2
    conv = convert(folder, "aogpt", tmp_path / "out", tokenizer=str(GPT2_TOKENIZER_DIR))
    loaded = from_pretrained(conv.folder)
    assert loaded.tokenizer.encode("Hello world") == [15496, 995]
    assert loaded.tokenizer.eos_id == EOS and loaded.weights == "converted"


def test_cli_convert_and_its_errors(tmp_path, tiny_gpt2, capsys) -> None:
    from anyorder.cli import main

    folder, hf = tiny_gpt2
    out = tmp_path / "gpt"
    assert main(["convert", str(folder), "--to", "gpt", "--out", str(out), "--seq-len", "32"]) == 0
    assert "gpt: " in capsys.readouterr().out
    loaded = from_pretrained(out)
    x = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_close(loaded.model(x), gpt2_logits(hf, x), rtol=0, atol=1e-5)
    config = json.loads((out / "config.json").read_text())
    assert config["weights"] == "converted" and config["bos_id"] == EOS
    assert main(["convert", str(tmp_path / "nope"), "--to", "gpt", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("anyorder convert: error: model path") and "\n" not in err


def test_cli_needs_no_transformers_to_convert(tmp_path, tiny_gpt2) -> None:
    """Conversion reads the files itself: transformers is never imported."""
    folder, _ = tiny_gpt2
    code = (
        "import sys; from anyorder.interop.convert import convert_gpt2; "
        f"convert_gpt2({str(folder)!r}, 'armd'); "
        "assert 'transformers' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


# ----------------------------------------------------------------------------- fine-tuning


@pytest.fixture
def byte_armd(tmp_path, trained_gpt2):
    """The trained byte-level GPT-2 converted to armd (seq_len 32), and a small corpus."""
    folder, _, _ = trained_gpt2
    conv = convert(folder, "armd", tmp_path / "armd", seq_len=32, tokenizer="bytes")
    text = tmp_path / "corpus"
    text.mkdir()
    from pydoc_data.topics import topics

    for i, key in enumerate(sorted(topics)[:40]):
        (text / f"{i}.txt").write_text(topics[key])
    return conv, text


def _run_config(tmp_path, conv, text, **train):
    from anyorder.config import load_config

    overrides = [
        f"data.source={text}",
        "data.tokenizer=bytes",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.val_fraction=0.1",
        "order.kind=progressive",
        "order.i_ar=1",
        "order.i_perm=3",
        "order.rho=4",
        f"train.init_from={conv.folder}",
        f"train.out_dir={tmp_path / 'run'}",
        "train.batch_size=4",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.log_every=1",
        "train.warmup_steps=0",
    ] + [f"train.{k}={v}" for k, v in train.items()]
    return load_config(None, overrides)


def test_training_starts_from_init_from(tmp_path, byte_armd) -> None:
    """With a negligible learning rate the run's checkpoint holds the converted weights; the
    model section comes from init_from (the config names none)."""
    from anyorder.checkpoint import load_model
    from anyorder.training.loop import train

    conv, text = byte_armd
    cfg = _run_config(tmp_path, conv, text, steps=2, lr=1e-12, ema=0.0)
    assert cfg.model.kind == "aogpt"  # the default, replaced by init_from's
    train(cfg, progress=False)
    loaded = load_model(tmp_path / "run", weights="raw")
    assert loaded.config.model == conv.model.cfg
    for k, v in conv.model.state_dict().items():
        assert_close(loaded.model.state_dict()[k], v, rtol=0, atol=1e-8, msg=k)


def test_any_order_fine_tuning_then_export(tmp_path, byte_armd) -> None:
    from anyorder.checkpoint.exporting import export
    from anyorder.training.loop import train
    from anyorder.training.metrics import read_metrics

    conv, text = byte_armd
    summary = train(_run_config(tmp_path, conv, text, steps=4, lr=1e-3, ema=0.9), progress=False)
    assert summary["step"] == 4
    losses = [row["loss"] for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert len(losses) == 4 and all(math.isfinite(v) and v < math.log(257) for v in losses)
    out = export(tmp_path / "run", tmp_path / "export")
    loaded = from_pretrained(out, kind="armd")
    assert loaded.step == 4 and loaded.weights == "ema"
    assert loaded.config.train.init_from == str(conv.folder)


def test_init_from_refuses_a_contradicting_model_section(tmp_path, byte_armd) -> None:
    from anyorder.training.loop import train

    conv, text = byte_armd
    cfg = _run_config(tmp_path, conv, text, steps=1)
    cfg.model.n_layer = 3
    with pytest.raises(CheckpointError, match="model.n_layer=3 contradicts train.init_from="):
        train(cfg, progress=False)
    cfg = _run_config(tmp_path, conv, text, steps=1)
    cfg.data.tokenizer = "bpe:300"
    with pytest.raises(ConfigError, match="smaller than the tokenizer.s 300 ids"):
        train(cfg, progress=False)
