"""The recipes for fine-tuning a converted model (configs/*-from-*.yaml, issue 33 item 5):
their model sections are the sources' published shapes, their settings a GPU run's, and
each trains a step (a dry run) from a folder of its shape, shrunk, as ``anyorder convert``
writes one, without downloading anything."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from anyorder import build_model
from anyorder.config import load_config
from anyorder.memory import param_estimate
from anyorder.training.setup import check_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = {
    # name: (source vocabulary rows, the source's published parameter count)
    "armd-from-qwen3-0.6b": (151936, 596_049_920),
    "aogpt-from-qwen3-0.6b": (151936, 596_049_920),
    "gpt-from-llama-3.2-1b": (128256, 1_235_814_400),
}


def test_every_from_recipe_is_listed() -> None:
    assert sorted(p.stem for p in CONFIGS.glob("*-from-*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_the_sources_shape_with_gpu_settings(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.yaml")
    check_config(cfg)
    m, t, o = cfg.model, cfg.train, cfg.order
    assert m.kind == name.split("-")[0]
    rows, published = RECIPES[name]
    # the trunk's count is the source's; our own parts come on top: gpt/aogpt's BOS
    # vector, aogpt's target table and adaLN, armd's query MLP
    gpt = dataclasses.replace(m, kind="gpt", vocab_size=rows)
    assert param_estimate(gpt) == published + m.d_model
    assert (t.dtype, t.activation_checkpointing) == ("bf16", True)
    assert t.init_from and Path(cfg.data.tokenizer) == Path(t.init_from) / "tokenizer"
    assert t.batch_size % t.grad_accum == 0 and t.warmup_steps > 0 and t.lr <= 1e-4
    if m.kind == "gpt":
        assert o.kind == "l2r"
    else:  # starts at pure left to right, where the converted model is (closest to) exact
        assert o.kind == "progressive" and o.i_ar not in (0, "0%")
    # what the header promises: the convert command writes the folder init_from reads
    text = (CONFIGS / f"{name}.yaml").read_text()
    assert f"--to {m.kind} --seq-len {m.seq_len} --out {t.init_from}\n" in text


def test_qwen3_recipes_hold_qwen3_and_llama_holds_llama() -> None:
    """The fields from the sources' config.json, spelled out once more here."""
    q = load_config(CONFIGS / "armd-from-qwen3-0.6b.yaml").model
    assert (q.n_layer, q.d_model, q.n_head, q.n_kv_head, q.head_dim) == (28, 1024, 16, 8, 128)
    assert (q.intermediate_size, q.rope_base, q.qk_norm, q.tie_embeddings) == (
        3072, 1e6, True, True,
    )  # fmt: skip
    a = load_config(CONFIGS / "aogpt-from-qwen3-0.6b.yaml").model
    trunk = {f.name for f in dataclasses.fields(q)} - {"kind", "target_dim", "l2s"}
    assert {k: getattr(a, k) for k in trunk} == {k: getattr(q, k) for k in trunk}
    ll = load_config(CONFIGS / "gpt-from-llama-3.2-1b.yaml").model
    assert (ll.n_layer, ll.d_model, ll.n_head, ll.n_kv_head, ll.d_head) == (16, 2048, 32, 8, 64)
    assert (ll.intermediate_size, ll.rope_base, ll.norm_eps) == (8192, 500000.0, 1e-5)
    assert ll.rope_scale == ("llama3", 32.0, 1.0, 4.0, 8192)


SHRINK = {
    "model.n_layer": 2,
    "model.d_model": 64,
    "model.n_head": 4,
    "model.n_kv_head": 2,
    "model.intermediate_size": 96,
    "model.seq_len": 32,
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_trains_a_step_from_a_converted_folder(tmp_path, capsys, name: str) -> None:
    """The recipe, shrunk, against a folder holding weights of that shape (what `anyorder
    convert` writes): init_from accepts the model section, one step runs."""
    from anyorder.checkpoint.exporting import save_pretrained
    from anyorder.training.loop import train
    from test_train import _corpus

    folder = tmp_path / "converted"
    shrink = {**SHRINK, "model.head_dim": 16 if "qwen3" in name else None}
    over = [f"{k}={v}" for k, v in shrink.items() if v is not None]
    over += [
        f"train.init_from={folder}",
        f"data.source={_corpus(tmp_path)}",
        "data.tokenizer=bytes",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"train.out_dir={tmp_path / 'run'}",
        "train.device=cpu",
        "train.dtype=fp32",  # bf16 on a CPU without bf16 units is 7-13x slower
    ]
    cfg = load_config(CONFIGS / f"{name}.yaml", over)
    if "llama" in name:  # the head width of the shrunk model, as its converter would write
        assert cfg.model.d_head == 16
    converted = build_model(dataclasses.replace(cfg.model, vocab_size=257))
    save_pretrained(converted, folder, weights="converted")
    s = train(cfg, dry_run=True, progress=False)
    assert s["dry_run"] and math.isfinite(s["loss"]) and s["vocab_size"] == 257
    assert "(blocks recomputed in backward)" in capsys.readouterr().out


def test_weights_with_more_ids_than_the_tokenizer_keep_their_table(tmp_path, capsys) -> None:
    """A converted Qwen reads 151,936 ids while its tokenizer makes 151,669: here weights of
    300 ids and the byte tokenizer's 257. The run keeps the weights' table (the spare ids
    never occur in the data); a tokenizer with more ids than the weights is still refused."""
    from anyorder.checkpoint.exporting import save_pretrained
    from anyorder.errors import ConfigError
    from anyorder.training.loop import train
    from test_train import _corpus, _overrides

    folder = tmp_path / "converted"
    over = _overrides(tmp_path / "run", tmp_path / "cache", "armd", **{
        "data.source": _corpus(tmp_path), "data.tokenizer": "bytes",
        "train.init_from": folder,
    })  # fmt: skip
    cfg = load_config(None, over)
    save_pretrained(build_model(dataclasses.replace(cfg.model, vocab_size=300)), folder)
    s = train(cfg, dry_run=True, progress=False)
    assert s["vocab_size"] == 300 and math.isfinite(s["loss"])
    assert "model.vocab_size 300 kept from train.init_from (the tokenizer has 257 ids" in (
        capsys.readouterr().out
    )
    save_pretrained(build_model(dataclasses.replace(cfg.model, vocab_size=200)), folder)
    with pytest.raises(ConfigError, match=r"^model.vocab_size=200 is smaller than the tokeni"):
        train(cfg, dry_run=True, progress=False)
