"""The AO-GPT authors' checkpoints: logits against their own code's numbers, every sampler on
the converted models, the padded vocabulary, the hub path offline, and bad files.

``tests/fixtures/aogpt-ref/`` holds two tiny checkpoints written the way scxue/AO-GPT-MDM
writes them and the logits that repository's model code computes from them (its README).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import anyorder
from anyorder.cli import main
from anyorder.config import VARIANTS, load_config
from anyorder.errors import CheckpointError, SamplingError
from anyorder.evaluation.estimators import member_logprobs
from anyorder.interop.hub import load_any
from anyorder.interop.reference import (
    convert_reference,
    model_config_from_reference,
    parameter_order,
    read_reference,
)
from anyorder.sample import lemma1_sample, sequential_sample
from test_evaluate import reference_member_logprobs
from test_sample import slot_oracle

from conftest import GPT2_SKIP, GPT2_TOKENIZER_DIR, REPO, has_gpt2_tokenizer

FIXTURES = REPO / "tests" / "fixtures" / "aogpt-ref"
AO = FIXTURES / "aogpt" / "ckpt_1234.pt"
SIGMA = FIXTURES / "sigmagpt" / "ckpt_1234.pt"
CASES = [
    ("aogpt-ref", "aogpt", "ema"),
    ("aogpt-ref", "aogpt", "raw"),
    ("sigmagpt-ref", "sigmagpt", "raw"),
]


def expected(sub: str) -> dict:
    return torch.load(FIXTURES / sub / "expected.pt", weights_only=True)


@pytest.fixture(scope="module")
def models() -> dict:
    return {
        (fmt, w): convert_reference(FIXTURES / sub / "ckpt_1234.pt", fmt, weights=w).model
        for fmt, sub, w in CASES
    }


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize(("fmt", "sub", "weights"), CASES)
def test_converted_models_give_the_reference_logits(models, fmt, sub, weights) -> None:
    exp = expected(sub)
    model = models[(fmt, weights)]
    tokens, orders = exp["tokens"], exp["orders"]
    assert torch.equal(orders[0], torch.arange(32))  # one left-to-right order among the three
    with torch.no_grad():
        logits = model(tokens, orders)
    # their slot 32 (after the last token) predicts nothing; ours stops at slot 31
    assert_close(logits, exp[f"logits_{weights}"][:, :32], atol=1e-4, rtol=0)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.gather(1, orders).flatten())
    assert_close(loss, exp[f"loss_{weights}"], atol=1e-5, rtol=0)
    for key, value in VARIANTS[fmt].items():
        assert getattr(model.cfg, key) == value, key


def test_ema_and_raw_weights_differ_and_the_ema_list_follows_the_parameters() -> None:
    ref = read_reference(AO)
    order = parameter_order(ref)
    assert len(order) == len(ref.ema) == 37
    assert [tuple(t.shape) for t in ref.ema] == [tuple(ref.state[k].shape) for k in order]
    sigma = read_reference(SIGMA)
    assert sigma.ema is None and "lm_head.weight" not in parameter_order(sigma)
    exp = expected("aogpt")
    assert (exp["logits_ema"] - exp["logits_raw"]).abs().max() > 0.1  # a test that can fail


# ----------------------------------------------------------------------------- the command


def test_cli_convert_writes_a_folder_every_loader_takes(tmp_path, capsys) -> None:
    out = tmp_path / "ao"
    assert main(["convert", str(AO), "--from", "aogpt-ref", "--out", str(out)]) == 0
    assert "aogpt (ema weights)" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["weights"] == "ema" and config["step"] == 1234
    assert config["reference_format"] == "aogpt-ref" and config["head_bias"] is True
    exp = expected("aogpt")
    for model in (anyorder.load(out).model, load_any(out).model):
        with torch.no_grad():
            got = model(exp["tokens"], exp["orders"])
        assert_close(got, exp["logits_ema"][:, :32], atol=1e-4, rtol=0)
    raw = tmp_path / "raw"
    assert (
        main(["convert", str(AO), "--from", "aogpt-ref", "--weights", "raw", "--out", str(raw)])
        == 0
    )
    with torch.no_grad():
        got = anyorder.load(raw).model(exp["tokens"], exp["orders"])
    assert_close(got, exp["logits_raw"][:, :32], atol=1e-4, rtol=0)
    sigma = tmp_path / "sigma"  # a tied head: stored once, re-tied on loading
    assert main(["convert", str(SIGMA), "--from", "sigmagpt-ref", "--out", str(sigma)]) == 0
    assert "\nsigma-GPT (aogpt) (raw weights): " in capsys.readouterr().out
    assert (sigma / "README.md").read_text().split("\n# ")[1].startswith("sigma-GPT model")
    model = anyorder.load(sigma).model
    assert model.head.weight is model.tok_emb.weight
    exp = expected("sigmagpt")
    with torch.no_grad():
        got = model(exp["tokens"], exp["orders"])
    assert_close(got, exp["logits_raw"][:, :32], atol=1e-4, rtol=0)


def _hub_cache(cache: Path, repo: str, files: dict[str, Path]) -> None:
    """Lay ``files`` out in ``cache`` as huggingface_hub stores a downloaded snapshot."""
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    root = cache / f"models--{repo.replace('/', '--')}"
    for name, src in files.items():
        dst = root / "snapshots" / commit / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)


def test_hf_path_goes_through_the_hub_download_offline(tmp_path) -> None:
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    _hub_cache(cache, "Cauthyyy/AO-GPT-MDM", {"124M/run/ckpt_1234.pt": AO})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    env["PYTHONPATH"] = str(REPO / "src")

    def convert(spec: str, out: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "anyorder.cli", "convert", spec, "--from", "aogpt-ref"]
        return subprocess.run(
            [*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=300
        )

    done = convert("hf:Cauthyyy/AO-GPT-MDM/124M/run/ckpt_1234.pt", tmp_path / "ao")
    assert done.returncode == 0, done.stderr
    exp = expected("aogpt")
    with torch.no_grad():
        got = anyorder.load(tmp_path / "ao").model(exp["tokens"], exp["orders"])
    assert_close(got, exp["logits_ema"][:, :32], atol=1e-4, rtol=0)
    missing = convert("hf:Cauthyyy/AO-GPT-MDM/124M/run/ckpt_9.pt", tmp_path / "x")
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "is not in the hub cache and HF_HUB_OFFLINE is set" in missing.stderr
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- bad files


def _damaged(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A bad checkpoint for ``case`` and the --from format to convert it with."""
    path = tmp_path / "ckpt_1.pt"
    good = torch.load(AO, weights_only=True)
    if case == "missing":
        return tmp_path / "absent.pt", "aogpt-ref"
    if case == "folder":
        path.mkdir()
        return path, "aogpt-ref"
    if case == "truncated":
        path.write_bytes(AO.read_bytes()[: AO.stat().st_size // 2])
        return path, "aogpt-ref"
    if case == "text":
        path.write_text("not a checkpoint\n")
        return path, "aogpt-ref"
    if case == "sigma-as-aogpt":
        return SIGMA, "aogpt-ref"
    if case == "named-pipe":  # opening it blocked the command for ever
        os.mkfifo(path)
        return path, "aogpt-ref"
    if case == "compressed-record":  # 10 MB unpacked from 10 kB: a bomb's way
        import zipfile

        with zipfile.ZipFile(AO) as src, zipfile.ZipFile(path, "w") as out:
            for info in src.infolist():
                data = src.read(info.filename)
                if info.filename.endswith("data.pkl"):
                    data += b"\0" * 10_000_000
                    out.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED)
                else:
                    out.writestr(info, data)
        return path, "aogpt-ref"
    bad: object = good
    if case == "not-a-dict":
        bad = good["model"]["_orig_mod.lm_head.bias"]
    elif case == "no-model-args":
        bad = {k: v for k, v in good.items() if k != "model_args"}
    elif case == "pickled-object":
        bad = {**good, "config": Path("x")}  # an arbitrary object: weights_only refuses it
    elif case == "ema-short":
        good["ema_model"]["shadow_params"] = good["ema_model"]["shadow_params"][:-1]
    elif case == "ema-shapes":
        sp = good["ema_model"]["shadow_params"]
        sp[4], sp[5] = sp[5], sp[4]
    elif case == "model-args-layers":
        good["model_args"]["n_layer"] = 3
    elif case == "model-args-width":
        good["model_args"]["n_embd"] = 32
    elif case == "model-args-type":
        good["model_args"]["n_head"] = "2"
    elif case == "model-int-weight":  # cast silently to floats before
        key = "_orig_mod.transformer.h.0.ln_1.weight"
        good["model"][key] = good["model"][key].to(torch.int32)
    elif case == "ema-bool-tensor":
        sp = good["ema_model"]["shadow_params"]
        sp[0] = sp[0] > 0
    elif case == "model-int-key":  # crashed with an AttributeError traceback
        good["model"][5] = torch.zeros(3)
    elif case == "missing-weight":
        del good["model"]["_orig_mod.transformer.h.1.adaLN.1.weight"]
        good["ema_model"]["shadow_params"].pop(-7)
    torch.save(bad, path)
    return path, "aogpt-ref"


ERRORS = [
    ("missing", "reference checkpoint '.*absent.pt' does not exist; give a ckpt_N.pt file"),
    ("folder", "is a folder; give the ckpt_N.pt file inside it"),
    ("truncated", "cannot be read as a torch checkpoint .*damaged, incomplete or not a .pt"),
    ("text", "cannot be read as a torch checkpoint"),
    ("not-a-dict", "holds a Tensor, not an AO-GPT training checkpoint"),
    ("no-model-args", "has no 'model_args': it is not an AO-GPT training checkpoint"),
    ("pickled-object", "holds Python objects besides tensors.*never unpickles code"),
    ("ema-short", "the EMA list holds 36 tensors but the model has 37 parameters"),
    ("ema-shapes", "EMA tensor 4 has shape \\(192, 64\\) but parameter .*ln_1.weight"),
    # model_args are checked against the tensors before anything is built (issue 24)
    ("model-args-layers", "model_args claim n_layer=3, but the weights hold 2 layers"),
    ("model-args-width", "model_args claim n_embd=32, but the weights hold 64 wte columns"),
    ("model-args-type", "model_args\\['n_head'\\] is '2', not a positive integer"),
    ("missing-weight", "the weights lack 'transformer.h.1.adaLN.1.weight'"),
    (
        "model-int-weight",
        "weight 'transformer.h.0.ln_1.weight' holds torch.int32 values, not "
        "floating point; the checkpoint is damaged: download it again",
    ),
    (
        "ema-bool-tensor",
        "EMA tensor 0 holds torch.bool values, not floating point; the EMA is "
        "damaged: use --weights raw or download it again",
    ),
    ("model-int-key", "'model' is not a state dict of tensors; it is damaged"),
    ("named-pipe", "'.*ckpt_1.pt' is a named pipe \\(FIFO\\), not a file; give the ckpt_N.pt file"),
    (
        "compressed-record",
        "cannot be read as a torch checkpoint \\(its record 'ckpt_1234/data"
        ".pkl' is compressed, 10,0[0-9,]+ bytes unpacked, and torch.save compresses none\\); "
        "the file is damaged or not a .pt: download it again",
    ),
    ("sigma-as-aogpt", "is a sigmagpt-ref checkpoint, not aogpt-ref; convert it with --from"),
]


@pytest.mark.parametrize(("case", "message"), ERRORS, ids=[c for c, _ in ERRORS])
def test_bad_checkpoints_give_one_line_exit_2_and_write_nothing(tmp_path, capsys, case, message):
    path, fmt = _damaged(tmp_path, case)
    out = tmp_path / "out" / "model"
    assert main(["convert", str(path), "--from", fmt, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("anyorder convert: error: ") and err.count("\n") == 1, err
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists()


def test_legacy_torch_save_format_reads_too(tmp_path) -> None:
    """Files written by torch.save's pre-zip format cannot be memory-mapped: read whole."""
    legacy = tmp_path / "ckpt_1234.pt"
    torch.save(torch.load(AO, weights_only=True), legacy, _use_new_zipfile_serialization=False)
    exp = expected("aogpt")
    with torch.no_grad():
        got = convert_reference(legacy, "aogpt-ref").model(exp["tokens"], exp["orders"])
    assert_close(got, exp["logits_ema"][:, :32], atol=1e-4, rtol=0)


def test_option_errors(tmp_path, capsys) -> None:
    out = str(tmp_path / "o")
    for argv, message in [
        (["--from", "sigmagpt-ref", "--weights", "ema"], "has no EMA weights (no ema_model)"),
        (["--from", "aogpt-ref", "--to", "armd"], "converts into aogpt; leave out --to"),
        (["--from", "aogpt-ref", "--seq-len", "8"], "--seq-len is for --from gpt2"),
        ([], "--from gpt2 needs --to gpt, aogpt or armd"),
    ]:
        src = str(SIGMA if "sigmagpt-ref" in argv else AO)
        assert main(["convert", src, *argv, "--out", out]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not Path(out).exists()


# ----------------------------------------------------------------------------- padding


def padded_checkpoint(path: Path, rows: int, bias: float = 100.0) -> Path:
    """The AO-GPT fixture with its token table and head padded to ``rows`` rows, the head's
    padding rows biased by ``bias`` (sampled every time, were their logits computed)."""
    ckpt = torch.load(AO, weights_only=True)
    g = torch.Generator().manual_seed(0)

    def pad(t: torch.Tensor, fill: float | None = None) -> torch.Tensor:
        extra = torch.randn((rows - t.shape[0], *t.shape[1:]), generator=g) * 0.02
        return torch.cat([t, extra if fill is None else torch.full_like(extra, fill)])

    state = ckpt["model"]
    shadow = ckpt["ema_model"]["shadow_params"]
    for key, i, fill in (("transformer.wte.weight", 0, None), ("lm_head.weight", -2, None),
                         ("lm_head.bias", -1, bias)):  # fmt: skip
        state["_orig_mod." + key] = pad(state["_orig_mod." + key], fill)
        shadow[i] = pad(shadow[i], fill)
    ckpt["model_args"]["vocab_size"] = rows
    torch.save(ckpt, path)
    return path


def test_padding_ids_are_never_predicted_or_sampled(tmp_path) -> None:
    src = padded_checkpoint(tmp_path / "ckpt_1234.pt", rows=320)
    model = convert_reference(src, "aogpt-ref", tokenizer="bytes").model
    assert (model.cfg.vocab_size, model.cfg.padded_vocab) == (257, 320)
    assert model.tok_emb.weight.shape[0] == model.head.weight.shape[0] == 320
    exp = expected("aogpt")
    with torch.no_grad():
        logits = model(exp["tokens"], exp["orders"])
    assert logits.shape[-1] == 257
    assert_close(logits[..., :97], exp["logits_ema"][:, :32], atol=1e-4, rtol=0)
    g = torch.Generator().manual_seed(0)
    for out in (
        sequential_sample(model, 32, batch=4, generator=g),
        lemma1_sample(model, 32, 6, batch=4, generator=g),
    ):
        assert int(out.tokens.max()) < 257


@pytest.mark.skipif(not has_gpt2_tokenizer(), reason=GPT2_SKIP)
def test_gpt2_sized_table_gets_gpt2s_ids_and_tokenizer(tmp_path) -> None:
    src = padded_checkpoint(tmp_path / "ckpt_1234.pt", rows=50304)
    out = tmp_path / "ao"
    argv = ["convert", str(src), "--from", "aogpt-ref", "--out", str(out)]
    assert main([*argv, "--tokenizer", str(GPT2_TOKENIZER_DIR)]) == 0
    model = anyorder.load(out)
    assert (model.model.cfg.vocab_size, model.model.cfg.padded_vocab) == (50257, 50304)
    assert model.tokenizer.vocab_size == 50257 and model.tokenizer.eos_id == 50256
    text = model.generate(n=8, num_samples=2, seed=0)
    assert len(text) == 2 and all(isinstance(t, str) for t in text)
    # a whole model: infill and score take text through GPT-2's tokenizer
    filled = model.infill("Hello[MASK:3] world", seed=0)
    assert filled.startswith("Hello") and filled.endswith(" world")
    ids = model.tokenizer.encode(" world")
    assert ids == [995] and model.score("Hello world")["tokens"] == 2


def test_vocabulary_from_the_table_and_the_tokenizer() -> None:
    ref = read_reference(AO)
    assert model_config_from_reference(ref).vocab_size == 97  # not GPT-2's: every row
    assert model_config_from_reference(ref, 90).padded_vocab == 97
    ref.model_args["vocab_size"] = 50304  # GPT-2's ids padded to a multiple of 64
    cfg = model_config_from_reference(ref)
    assert (cfg.vocab_size, cfg.padded_vocab, cfg.table_vocab) == (50257, 50304, 50304)
    with pytest.raises(CheckpointError, match="the tokenizer has 50400 ids but the checkpoint"):
        model_config_from_reference(ref, 50400)


# ----------------------------------------------------------------------------- samplers


@pytest.mark.parametrize("key", [("aogpt-ref", "ema"), ("sigmagpt-ref", "raw")])
def test_every_sampler_runs_and_matches_the_forward(models, key) -> None:
    model = models[key]
    g = torch.Generator().manual_seed(1)
    seq = sequential_sample(model, 32, batch=2, generator=g, keep_logits=True)
    with torch.no_grad():
        assert_close(seq.logits, model(seq.tokens, seq.order), atol=1e-5, rtol=0)
    l2r = sequential_sample(model, 16, batch=1, order="l2r", generator=g, keep_logits=True)
    with torch.no_grad():
        assert_close(l2r.logits, model(l2r.tokens, l2r.order), atol=1e-5, rtol=0)
    for shared in (False, True):
        out = lemma1_sample(model, 10, 4, batch=2, shared_counts=shared, generator=g,
                            keep_logits=True)  # fmt: skip
        with torch.no_grad():
            ref = slot_oracle(model, out.tokens, out.order, out.step_of)
        assert_close(out.logits, ref, atol=1e-5, rtol=0)
    x = torch.randint(0, 97, (1, 8), generator=g)
    order = torch.rand(1, 8, generator=g).argsort(-1)
    keys = torch.rand(1, 2, 8, generator=g, dtype=torch.float64)
    slots = torch.arange(8)[None]
    got, _ = member_logprobs(model, x, order, keys)
    with torch.no_grad():
        ref = reference_member_logprobs(model, x, order, keys, slots)
    assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_infill_score_and_serve_on_a_converted_folder(tmp_path) -> None:
    from test_serve import Running

    src = padded_checkpoint(tmp_path / "ckpt_1234.pt", rows=320)
    out = tmp_path / "ao"
    argv = ["convert", str(src), "--from", "aogpt-ref", "--tokenizer", "bytes", "--out", str(out)]
    assert main(argv) == 0
    model = anyorder.load(out)
    filled = model.infill("x = [MASK:6] + y[MASK:3]", seed=0)
    assert filled.startswith("x = ") and len(filled.encode()) >= 10
    plain = model.score("def f(x): return x", order="any", num_orders=2, seed=0)
    ens = model.score("def f(x): return x", order="any", ensemble=4, num_orders=2, seed=0)
    assert plain["nats_per_token"] > 0 and ens["nats_per_token"] > 0
    assert ens["nats_per_token"] != plain["nats_per_token"]
    server = Running(load_any(out))
    try:
        status, body = server.post(
            {"text": "x = [MASK:6]", "mode": "lemma1", "steps": 3, "seed": 0}
        )
    finally:
        server.close()
    assert status == 200 and "event: done" in body, body


# ----------------------------------------------------------------------------- training


def test_variants_train_from_scratch_with_the_reference_init(tmp_path, capsys) -> None:
    cfg = load_config(None, ["model.variant=aogpt-ref", "model.n_layer=2", "model.d_model=64"])
    assert cfg.model.adaln_gate_offset is False and cfg.model.target_dim == 128
    explicit = load_config(None, ["model.variant=aogpt-ref", "model.target_dim=64"])
    assert explicit.model.target_dim == 64  # keys beside the variant win
    model = anyorder.build_model(cfg.model)
    ada = model.blocks[0].ada.linear.weight.detach()
    assert ada.abs().max() <= 3 * 0.02 and 0.015 < float(ada.std()) < 0.025  # truncated N(0, .02)
    assert 0.015 < float(model.tgt_emb.weight.detach().std()) < 0.025
    assert model.pos_emb.weight.shape[0] == cfg.model.seq_len + 1
    for variant in VARIANTS:
        argv = ["train", str(REPO / "configs" / "tiny-aogpt.yaml"), "--dry-run",
                f"model.variant={variant}", "model.n_layer=1", "model.d_model=64",
                "model.seq_len=32", f"train.out_dir={tmp_path / variant}",
                "data.source=builtin:pydoc", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err


def test_sample_and_eval_on_a_folder_without_a_tokenizer(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # eval's data cache goes to the working folder
    out = tmp_path / "ao"
    assert main(["convert", str(AO), "--from", "aogpt-ref", "--out", str(out)]) == 0
    assert "tokenizer none (pass --tokenizer)" in capsys.readouterr().out
    # the CLI and the API refuse alike, and say what to pass
    assert main(["sample", str(out), "--num-samples", "2", "--length", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"anyorder sample: error: {out} holds no tokenizer; pass --tokenizer SPEC (gpt2, "
        "bytes or a tokenizer folder)"
    )
    with pytest.raises(SamplingError, match="holds no tokenizer; pass tokenizer=SPEC to anyorder"):
        anyorder.load(out).generate(n=8)
    assert main(["eval", str(out), "--no-progress"]) == 2
    assert "holds no tokenizer, so eval cannot tokenize text" in capsys.readouterr().err
    # with one, eval scores its data tokenized by the folder's own tokenizer
    src = padded_checkpoint(tmp_path / "ckpt_1234.pt", rows=320)
    byte = tmp_path / "byte"
    argv = ["convert", str(src), "--from", "aogpt-ref", "--tokenizer", "bytes", "--out", str(byte)]
    assert main(argv) == 0
    assert main(["eval", str(byte), "--max-blocks", "2", "--orders", "1", "--no-progress"]) == 0
    assert "any order (K=1 orders)" in capsys.readouterr().out
