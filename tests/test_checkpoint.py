"""Checkpoints: atomic folders, pruning, checksums, and load_model round trips."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from anyorder import checkpoint as ck
from anyorder.config import load_config
from anyorder.data import ByteTokenizer
from anyorder.errors import CheckpointError
from anyorder.orders import uniform

from conftest import tiny_model


def _config(kind: str, tmp_path):
    return load_config(
        None,
        [
            f"model.kind={kind}",
            "model.vocab_size=257",
            "model.seq_len=16",
            "model.n_layer=2",
            "model.n_head=4",
            "model.d_model=64",
            f"train.out_dir={tmp_path / 'run'}",
        ],
    )


def _model(cfg, seed=0):
    from anyorder.models import build_model

    torch.manual_seed(seed)
    return build_model(cfg.model).eval()


def _save(run, step, cfg, model, **kw):
    return ck.save_checkpoint(run, step, model=model, config=cfg, tokenizer=ByteTokenizer(), **kw)


@pytest.mark.parametrize("kind", ["aogpt", "armd", "mdm", "gpt"])
def test_round_trip_gives_identical_logits(tmp_path, kind):
    cfg = _config(kind, tmp_path)
    model = _model(cfg)
    run = tmp_path / "run"
    path = _save(run, 7, cfg, model)
    assert path == run / "checkpoints" / "step_0000007"
    # atomic write: no temporary folder left beside the checkpoint
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000007"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "model.safetensors",
        "config.yaml",
        "tokenizer/anyorder_tokenizer.json",
    }

    loaded = ck.load_model(run)  # a run folder: its latest checkpoint; no EMA: raw weights
    assert loaded.step == 7 and loaded.path == path and loaded.weights == "raw"
    assert not loaded.model.training
    assert loaded.config.model == cfg.model
    assert loaded.tokenizer.vocab_size == 257
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    order = None if kind == "gpt" else uniform(2, 16, torch.Generator().manual_seed(1)).order
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x, order), model(x, order), rtol=0, atol=0)


def test_tied_head_is_written_once_and_stays_tied(tmp_path):
    from safetensors.torch import load_file

    cfg = _config("aogpt", tmp_path)
    model = _model(cfg)
    assert ck.tied_aliases(model) == {"head.weight": "tok_emb.weight"}
    path = _save(tmp_path / "run", 1, cfg, model)
    stored = load_file(str(path / "model.safetensors"))
    assert "head.weight" not in stored and "tok_emb.weight" in stored
    loaded = ck.load_model(path)  # a checkpoint folder directly
    assert loaded.model.head.weight is loaded.model.tok_emb.weight


def _mapped_file(t: torch.Tensor) -> str:
    """The file /proc/self/maps says holds ``t``'s first byte ("" for anonymous memory)."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) > 5 else ""
    return ""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc maps")
def test_loaded_weights_read_the_file_in_place_and_writes_stay_private(tmp_path):
    """A loaded parameter is the file's (private) mapping, not a copy; writing to it (as
    training does) copies the page and leaves the file, and the next load, unchanged."""
    cfg = _config("gpt", tmp_path)
    model = _model(cfg)
    path = _save(tmp_path / "run", 1, cfg, model)
    file = path / "model.safetensors"
    before = file.read_bytes()
    loaded = ck.load_model(path).model
    matrices = [p for p in loaded.parameters() if p.dim() == 2]
    assert len(matrices) > 2 and all(_mapped_file(p) == str(file.resolve()) for p in matrices)
    assert loaded.head.weight is loaded.tok_emb.weight  # still one Parameter
    with torch.no_grad():
        loaded.tok_emb.weight.add_(1.0)
    assert _mapped_file(loaded.tok_emb.weight) == str(file.resolve())  # same address
    assert file.read_bytes() == before
    again = ck.load_model(path).model
    torch.testing.assert_close(again.tok_emb.weight, model.tok_emb.weight, rtol=0, atol=0)
    torch.testing.assert_close(loaded.tok_emb.weight, model.tok_emb.weight + 1.0)
    # a dtype the model does not hold is copied (cast), not shared
    m16 = _model(cfg).to(torch.bfloat16)
    ck.adopt_state(m16, dict(again.state_dict()))
    assert m16.tok_emb.weight.dtype == torch.bfloat16
    assert _mapped_file(m16.tok_emb.weight) != str(file.resolve())


def test_loading_skips_the_random_initialisation(tmp_path, monkeypatch):
    """Every weight is loaded, so none is drawn first (a 1B model's draw is seconds); the
    init functions work again afterwards, and a fresh model still draws them."""
    from torch.nn import init

    from anyorder.checkpoint.exporting import save_pretrained
    from anyorder.models import build_model

    cfg = _config("aogpt", tmp_path)
    model = _model(cfg)
    run_ckpt = _save(tmp_path / "run", 1, cfg, model)
    export = save_pretrained(model, tmp_path / "exp", ByteTokenizer())
    calls = []

    def spy(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for name in ("normal_", "trunc_normal_", "kaiming_uniform_", "uniform_", "zeros_"):
        monkeypatch.setattr(init, name, spy(name, getattr(init, name)))
    x = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(0))
    order = uniform(1, 16, torch.Generator().manual_seed(1)).order
    for loaded in (ck.load_model(run_ckpt).model, ck.load_exported(export).model):
        with torch.no_grad():
            torch.testing.assert_close(loaded(x, order), model(x, order), rtol=0, atol=0)
    assert calls == []
    build_model(cfg.model)
    assert {"normal_", "zeros_"} <= set(calls)


def test_ema_weights_are_preferred_and_raw_on_request(tmp_path):
    cfg = _config("armd", tmp_path)
    model = _model(cfg, seed=0)
    ema = {k: v + 1.0 for k, v in model.state_dict().items()}
    path = _save(tmp_path / "run", 3, cfg, model, ema=ema)
    got = ck.load_model(path, weights="ema")
    assert got.weights == "ema"
    torch.testing.assert_close(got.model.tok_emb.weight, model.tok_emb.weight + 1.0)
    raw = ck.load_model(path, weights="raw")
    assert raw.weights == "raw"
    torch.testing.assert_close(raw.model.tok_emb.weight, model.tok_emb.weight)


def test_keep_last_prunes_old_checkpoints(tmp_path):
    cfg = _config("gpt", tmp_path)
    model = _model(cfg)
    run = tmp_path / "run"
    for step in (10, 20, 30, 40):
        _save(run, step, cfg, model, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(run)] == ["step_0000030", "step_0000040"]
    assert ck.latest_checkpoint(run) == run / "checkpoints" / "step_0000040"
    # saving the same step again replaces it cleanly
    _save(run, 40, cfg, model, keep_last=2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_0000030",
        "step_0000040",
    ]


def test_failed_write_leaves_nothing(tmp_path):
    class BrokenTokenizer(ByteTokenizer):
        def save(self, folder):
            raise OSError("disk full")

    cfg = _config("gpt", tmp_path)
    run = tmp_path / "run"
    with pytest.raises(CheckpointError, match=r"step_0000005 \(OSError: disk full\); free disk"):
        ck.save_checkpoint(run, 5, model=_model(cfg), config=cfg, tokenizer=BrokenTokenizer())
    assert list((run / "checkpoints").iterdir()) == []
    assert ck.latest_checkpoint(run) is None


def test_stale_temp_folder_is_ignored_and_cleaned(tmp_path):
    cfg = _config("gpt", tmp_path)
    run = tmp_path / "run"
    stale = run / "checkpoints" / ".step_0000009.tmp-abc"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    assert ck.latest_checkpoint(run) is None
    _save(run, 1, cfg, _model(cfg))
    assert not stale.exists()


def test_checksum_mismatch_is_detected(tmp_path):
    cfg = _config("armd", tmp_path)
    path = _save(tmp_path / "run", 2, cfg, _model(cfg))
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its checksum"):
        ck.load_model(path)


def test_truncated_file_is_detected(tmp_path):
    cfg = _config("armd", tmp_path)
    path = _save(tmp_path / "run", 2, cfg, _model(cfg))
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors is truncated.*earlier checkpoint"
    ):
        ck.load_model(path)


def test_a_huge_manifest_is_refused_before_it_is_read(tmp_path):
    """A sparse manifest.json of a terabyte was read whole (a MemoryError traceback)."""
    cfg = _config("armd", tmp_path)
    path = _save(tmp_path / "run", 2, cfg, _model(cfg))
    os.truncate(path / "manifest.json", 1 << 40)
    with pytest.raises(CheckpointError) as e:
        ck.load_model(path)
    assert str(e.value) == (
        f"{path / 'manifest.json'} is 1,099,511,627,776 bytes, more than a manifest holds; "
        f"the checkpoint is damaged: delete {path} and use an earlier checkpoint"
    )


def test_missing_paths(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist; give a run folder"):
        ck.load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        ck.load_model(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="holds weights only"):
        cfg = _config("gpt", tmp_path)
        ck.read_state(_save(tmp_path / "run", 1, cfg, _model(cfg)))


def test_weights_that_do_not_fit_the_config(tmp_path):
    cfg = _config("armd", tmp_path)
    path = _save(tmp_path / "run", 1, cfg, _model(cfg))
    other = tiny_model("armd", vocab_size=257, seq_len=16, d_model=32, n_head=4)
    with pytest.raises(CheckpointError, match="do not fit the model"):
        ck.load_weights(other, path / "model.safetensors")
