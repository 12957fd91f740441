"""Exported models: round trips, the folder's contents, the hub path offline, the errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from anyorder import checkpoint as ckpt_mod
from anyorder.checkpoint.exported import is_exported
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.config import MODEL_KINDS, RunConfig, to_dict
from anyorder.data import ByteTokenizer
from anyorder.errors import CheckpointError
from anyorder.interop.hub import from_pretrained, load_any, push_to_hub
from anyorder.orders import uniform

from conftest import tiny_model


def logits_of(model, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=g)
    order = None if kind == "gpt" else uniform(2, 12, g).order
    with torch.no_grad():
        return model(x, order)


@pytest.mark.parametrize("kind", [*MODEL_KINDS, "aogpt-rope-target"])
def test_round_trip_gives_identical_logits(tmp_path, kind: str) -> None:
    extra = {"pos_emb": "rope", "rope_query": "target"} if kind == "aogpt-rope-target" else {}
    kind = kind.split("-")[0]
    model = tiny_model(kind, seed=3, vocab_size=257, **extra)
    folder = save_pretrained(model, tmp_path / "m", ByteTokenizer(), weights="raw", step=7)
    loaded = from_pretrained(folder)
    assert loaded.model.kind == kind and loaded.step == 7 and loaded.weights == "raw"
    assert loaded.tokenizer.encode("hé") == ByteTokenizer().encode("hé")
    assert to_dict(loaded.model.cfg) == to_dict(model.cfg)
    assert_close(logits_of(loaded.model, kind), logits_of(model, kind), rtol=0, atol=0)
    if model.cfg.tie_embeddings and kind != "mdm":  # the tie survives the file
        assert loaded.model.head.weight is loaded.model.tok_emb.weight


def test_folder_is_uploadable_as_is(tmp_path) -> None:
    from safetensors import safe_open

    model = tiny_model("armd", vocab_size=257)
    run = RunConfig(model=model.cfg)
    run.train.steps = 5
    folder = save_pretrained(model, tmp_path / "m", ByteTokenizer(), run_config=run)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer",
        "tokenizer.json",  # transformers' byte tokenizer (AutoTokenizer, pipeline)
        "tokenizer_config.json",
        "training_config.yaml",
    ]
    assert (folder / "tokenizer" / "anyorder_tokenizer.json").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "anyorder" and config["anyorder_kind"] == "armd"
    assert config["anyorder_version"] == "0.1.0" and config["anyorder_format"] == 1
    assert {k: config[k] for k in to_dict(model.cfg)} == to_dict(model.cfg)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["format"] == "pt"
    assert "tok_emb.weight" in keys and "head.weight" not in keys  # tied: written once
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: anyorder\n") and "anyorder.load(" in card
    assert from_pretrained(folder).config.train.steps == 5
    # nothing but the folder itself: no temporary leftovers beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_an_exports_training_config_does_not_choose_where_eval_writes(tmp_path) -> None:
    """training_config.yaml comes with a downloaded folder: its data.cache_dir (a folder of
    the machine that trained) made `anyorder eval` write the data cache there, wherever it
    pointed. The cache goes to this machine's cache home; the rest of the run is kept."""
    model = tiny_model("gpt", vocab_size=257)
    run = RunConfig(model=model.cfg)
    run.data.cache_dir = str(tmp_path / "their-cache")
    run.data.source = "builtin:stdlib"
    folder = save_pretrained(model, tmp_path / "m", ByteTokenizer(), run_config=run)
    assert "their-cache" in (folder / "training_config.yaml").read_text()
    config = from_pretrained(folder).config
    assert config.data.cache_dir == "auto" and config.data.source == "builtin:stdlib"


def test_an_exports_data_is_tokenized_by_the_tokenizer_it_holds(tmp_path) -> None:
    """training_config.yaml names the tokenizer of the run that trained (``bpe:300``, trained
    again on whatever the data is now, or a path of that machine); an export that holds its
    tokenizer has ``anyorder eval``'s data tokenized by it, as the model reads."""
    from anyorder.data import load_tokenizer

    model = tiny_model("gpt", vocab_size=257)
    run = RunConfig(model=model.cfg)
    run.data.tokenizer = "bpe:300"
    folder = save_pretrained(model, tmp_path / "m", ByteTokenizer(), run_config=run)
    assert "bpe:300" in (folder / "training_config.yaml").read_text()
    config = from_pretrained(folder).config
    assert Path(config.data.tokenizer) == (folder / "tokenizer").resolve()
    assert load_tokenizer(config.data.tokenizer).encode("ab") == [97, 98]


def test_export_replaces_an_earlier_export_but_nothing_else(tmp_path) -> None:
    a, b = tiny_model("gpt", seed=1), tiny_model("gpt", seed=2)
    folder = save_pretrained(a, tmp_path / "m")
    save_pretrained(b, folder)
    assert_close(logits_of(from_pretrained(folder).model, "gpt"), logits_of(b, "gpt"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not an exported anyorder model"):
        save_pretrained(a, other)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_push_to_hub_refuses_an_incomplete_folder(tmp_path) -> None:
    # Offline, the upload itself is not exercised: only the check before any network use.
    folder = save_pretrained(tiny_model("gpt"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="is not a complete exported model"):
        push_to_hub(folder, "someone/tiny")


def test_wrong_kind_and_missing_files(tmp_path) -> None:
    folder = save_pretrained(tiny_model("armd"), tmp_path / "m")
    with pytest.raises(CheckpointError, match="holds a armd model, not aogpt; load it as armd"):
        from_pretrained(folder, kind="aogpt")
    assert from_pretrained(folder, kind="armd").model.kind == "armd"
    with pytest.raises(CheckpointError, match="model path '.*nowhere' does not exist"):
        from_pretrained(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="has no config.json: it is not an exported"):
        from_pretrained(empty)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing; the export is"):
        from_pretrained(folder)


def test_an_export_whose_two_kinds_differ_is_refused(tmp_path) -> None:
    # aogpt and armd share every weight name and shape, so an edited kind loaded without a word
    import anyorder

    model = tiny_model("armd", vocab_size=257)
    folder = save_pretrained(model, tmp_path / "m", ByteTokenizer())
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["anyorder_kind"] == cfg["kind"] == "armd"
    cfg["kind"] = "aogpt"
    cfg_path.write_text(json.dumps(cfg))
    message = (
        f'{cfg_path} has anyorder_kind "armd" but kind "aogpt"; they must agree: export again '
        "(or set both to the kind the weights were trained as)"
    )
    for load in (anyorder.load, from_pretrained, load_any, ckpt_mod.load_model):
        with pytest.raises(CheckpointError) as e:
            load(folder)
        assert str(e.value) == message
    cfg["kind"] = "armd"
    cfg_path.write_text(json.dumps(cfg))
    assert anyorder.load(folder).kind == "armd"


def test_corrupt_weights_are_named(tmp_path) -> None:
    folder = save_pretrained(tiny_model("aogpt"), tmp_path / "m")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit inside a tensor: only the checksum sees it
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupt \\(its SHA-256 differs"):
        from_pretrained(folder)
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    config = json.loads((folder / "config.json").read_text())
    # the checksum recorded for the garbage (an attacker's edit): the header check fails
    config["weights_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    (folder / "config.json").write_text(json.dumps(config))
    # its header is read before the model is built (tests/test_errors.py, issue 17)
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt \\(its safetensors h"):
        from_pretrained(folder)


@pytest.mark.parametrize("dim", ["1e400", "1.5", '"12"', "-1", "true"])
def test_a_safetensors_header_shape_that_is_not_a_size_is_refused(tmp_path, dim) -> None:
    """1e400 (JSON for infinity) crashed with an OverflowError traceback; 1.5, "12" and true
    were read as sizes."""
    import struct

    folder = save_pretrained(tiny_model("gpt"), tmp_path / "m")
    weights = folder / "model.safetensors"
    raw = weights.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["norm_f.weight"]["shape"] = ["@"]
    text = json.dumps(header).replace('"@"', dim).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(CheckpointError) as e:
        from_pretrained(folder)
    assert str(e.value) == (
        f"{weights} is corrupt (its safetensors header: tensor 'norm_f.weight' has shape "
        f"[{json.loads(dim)!r}], not a list of sizes); export or download it again"
    )


def test_a_huge_config_json_is_refused_before_it_is_read(tmp_path) -> None:
    """A sparse config.json of a terabyte (nothing on disk) was read whole: a MemoryError
    traceback, or as many gigabytes of memory as the machine would give."""
    import os

    folder = save_pretrained(tiny_model("gpt"), tmp_path / "m")
    os.truncate(folder / "config.json", 1 << 40)
    assert not is_exported(folder)
    with pytest.raises(CheckpointError) as e:
        from_pretrained(folder)
    assert str(e.value) == (
        f"{folder / 'config.json'} is unreadable (ValueError: 1,099,511,627,776 bytes, more "
        "than an export's config.json holds); export again"
    )


def test_a_head_the_config_ties_but_the_file_holds_apart_is_refused(tmp_path) -> None:
    """config.json ties the head to the embedding, the file holds a head.weight of its own
    (a hand-made or converted file): the head was ignored silently, the model another one."""
    from safetensors.torch import load_file, save_file

    folder = save_pretrained(tiny_model("gpt"), tmp_path / "m")
    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    save_file({**state, "head.weight": state["tok_emb.weight"] + 1}, str(weights))
    config = json.loads((folder / "config.json").read_text())
    config["weights_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        from_pretrained(folder)
    assert str(e.value) == (
        f"{weights} does not fit the model config.json describes (not equal to the weight "
        "the config ties them to: head.weight)"
    )
    save_file({**state, "head.weight": state["tok_emb.weight"].clone()}, str(weights))
    config["weights_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    (folder / "config.json").write_text(json.dumps(config))
    loaded = from_pretrained(folder)  # an equal copy is the tie written twice: fine
    assert loaded.model.head.weight is loaded.model.tok_emb.weight


def test_weights_of_another_shape_are_refused(tmp_path) -> None:
    folder = save_pretrained(tiny_model("gpt", d_model=64), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["d_model"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not fit the model config.json describes"):
        from_pretrained(folder)


def test_integer_weights_are_refused_not_cast(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_pretrained(tiny_model("gpt"), tmp_path / "m")
    weights = folder / "model.safetensors"
    state = {k: v.to(torch.int32) for k, v in load_file(str(weights)).items()}
    save_file(state, str(weights), metadata={"format": "pt", "tied": "{}"})
    config = json.loads((folder / "config.json").read_text())
    config["weights_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not fit .*not floating point: "):
        from_pretrained(folder)


def test_weights_that_are_not_finite_are_not_written(tmp_path) -> None:
    model = tiny_model("aogpt")
    with torch.no_grad():
        model.tok_emb.weight[3, 1] = float("inf")
    with pytest.raises(
        CheckpointError, match=r"tok_emb.weight holds 0 NaN and 1 Inf of \d+ values"
    ):
        save_pretrained(model, tmp_path / "m")
    assert not (tmp_path / "m").exists() and list(tmp_path.iterdir()) == []


def test_an_export_without_a_checksum_is_refused(tmp_path) -> None:
    folder = save_pretrained(tiny_model("gpt"), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config["weights_sha256"]  # the weights could then be swapped unnoticed
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="records no weights_sha256"):
        from_pretrained(folder)


def test_other_folders_get_a_hint(tmp_path) -> None:
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="describes a 'gpt2' model.*anyorder convert"):
        from_pretrained(gpt2)
    run = tmp_path / "run"
    model = tiny_model("gpt", vocab_size=257)
    ckpt_mod.save_checkpoint(
        run, 3, model=model, config=RunConfig(model=model.cfg), tokenizer=ByteTokenizer()
    )
    with pytest.raises(CheckpointError, match="is a training checkpoint or run, not an export"):
        from_pretrained(run)


def _snapshot(cache, repo_id: str, folder) -> None:
    """Lay ``folder`` out in ``cache`` as huggingface_hub stores a downloaded snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / commit)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def test_hub_id_offline_from_a_cache_laid_out_like_the_hub(tmp_path) -> None:
    pytest.importorskip("huggingface_hub")
    model = tiny_model("armd", seed=5, vocab_size=257)
    folder = save_pretrained(model, tmp_path / "export", ByteTokenizer())
    cache = tmp_path / "hub"
    _snapshot(cache, "someone/tiny-armd", folder)
    loaded = from_pretrained("someone/tiny-armd", cache_dir=cache, local_files_only=True)
    assert_close(logits_of(loaded.model, "armd"), logits_of(model, "armd"), rtol=0, atol=0)
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == 257
    # a snapshot folder given as a path loads the same way
    snap = next((cache / "models--someone--tiny-armd" / "snapshots").iterdir())
    assert from_pretrained(snap).model.kind == "armd"
    with pytest.raises(CheckpointError, match="'someone/absent' is neither a local folder nor"):
        from_pretrained("someone/absent", cache_dir=cache, local_files_only=True)


def _checkpoint(tmp_path):
    """A training checkpoint whose EMA and raw weights differ."""
    raw = tiny_model("aogpt", seed=1, vocab_size=257)
    ema = tiny_model("aogpt", seed=2, vocab_size=257)
    cfg = RunConfig(model=raw.cfg)
    path = ckpt_mod.save_checkpoint(
        tmp_path / "run",
        10,
        model=raw,
        config=cfg,
        tokenizer=ByteTokenizer(),
        ema=ema.state_dict(),
    )
    return path, raw, ema


def test_export_takes_ema_weights_by_default(tmp_path) -> None:
    from anyorder.checkpoint.exporting import export

    path, raw, ema = _checkpoint(tmp_path)
    out = export(tmp_path / "run", tmp_path / "ema")
    loaded = from_pretrained(out)
    assert loaded.weights == "ema" and loaded.step == 10
    assert_close(logits_of(loaded.model, "aogpt"), logits_of(ema, "aogpt"), rtol=0, atol=0)
    out = export(path, tmp_path / "raw", weights="raw")
    assert_close(logits_of(from_pretrained(out).model, "aogpt"), logits_of(raw, "aogpt"))
    assert json.loads((out / "config.json").read_text())["weights"] == "raw"


def test_load_any_dispatches_on_what_it_is_given(tmp_path) -> None:
    path, _, ema = _checkpoint(tmp_path)
    out = save_pretrained(ema, tmp_path / "export", ByteTokenizer())
    for spec in (tmp_path / "run", path, out):
        loaded = load_any(spec, kind="aogpt")
        assert_close(logits_of(loaded.model, "aogpt"), logits_of(ema, "aogpt"), rtol=0, atol=0)
    assert is_exported(out) and not is_exported(path)
    with pytest.raises(CheckpointError, match="holds a aogpt model, not armd"):
        load_any(tmp_path / "run", kind="armd")


def test_checkpoint_load_model_reads_exports_too(tmp_path) -> None:
    model = tiny_model("mdm", vocab_size=257)
    out = save_pretrained(model, tmp_path / "export", ByteTokenizer())
    loaded = ckpt_mod.load_model(out)
    assert loaded.model.kind == "mdm" and loaded.path == out


def test_export_and_checkpoint_modes_follow_the_umask(tmp_path) -> None:
    import os

    def modes(root):
        return {
            p.relative_to(root).as_posix(): os.stat(p).st_mode & 0o777
            for p in [root, *root.rglob("*")]
        }

    model = tiny_model("gpt", vocab_size=257)
    old = os.umask(0o027)
    try:
        folder = save_pretrained(model, tmp_path / "m", ByteTokenizer())
        run = RunConfig(model=model.cfg)
        ckpt = ckpt_mod.save_checkpoint(
            tmp_path / "run", 3, model=model, config=run, tokenizer=ByteTokenizer()
        )
    finally:
        os.umask(old)
    for root in (folder, ckpt):
        got = modes(root)
        assert got["."] == 0o750 and got["tokenizer"] == 0o750, got
        files = {k: v for k, v in got.items() if (root / k).is_file()}
        assert set(files.values()) == {0o640}, files  # safetensors alone would write 0600
