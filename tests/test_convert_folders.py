"""Hostile model folders given to ``anyorder convert`` (issue 40, items 7 and 8).

A model folder is untrusted input: its index may name files outside it, any of its files may
be a named pipe, a link to ``/dev/zero``, JSON nested 100,000 deep, or a safetensors file
whose header lies. Each case runs the real CLI (``python -m anyorder.cli convert``) in a
subprocess with a timeout (a hang fails the test instead of the suite) and a 4 GiB address
space limit (a read of ``/dev/zero`` fails instead of filling the machine), and checks one
line on stderr, exit code 2, no output folder and the source folder untouched. What is
legitimate keeps working: the hub cache's snapshot of links into ``../../blobs``, a copy of
a tensor in two shards and tensors the export does not take (a one-line warning each).

The sources are tiny random Llamas saved by ``transformers``' own ``save_pretrained``.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

TIMEOUT_S = int(os.environ.get("ANYORDER_TEST_HANG_S", "300"))  # a hang: a run takes seconds
# address space of a conversion (a link to /dev/zero read whole grows past it): a CUDA build
# of torch maps its libraries into more than 4 GiB, so 8 GiB, as test_chat_sandbox's cap
MEMORY_BYTES = 8 << 30
CONVERT = ["convert", "victim", "--to", "aogpt", "--out", "out"]
INDEX = "model.safetensors.index.json"
SHARDS = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def convert(cwd: Path, args: list[str] = CONVERT, env: dict | None = None):
    """``python -m anyorder.cli ARGS`` in ``cwd``; a run past :data:`TIMEOUT_S` fails."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "anyorder.cli", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            preexec_fn=_limit_memory,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"anyorder {' '.join(args)} hung (killed after {TIMEOUT_S} s)")


def listing(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder`` (links not followed) with its kind, size and time."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def refused(cwd: Path, message: str, args: list[str] = CONVERT) -> None:
    """The conversion ends in ``message`` alone on stderr, exit 2, nothing written."""
    before = listing(cwd)
    r = convert(cwd, args)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [f"anyorder convert: error: {message}"], r.stderr
    assert r.returncode == 2
    assert not (cwd / "out").exists()
    assert listing(cwd) == before


def save_llama(path: Path, seed: int, *, layers: int = 2, shard: bool = False) -> None:
    import transformers as tr

    cfg = tr.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = tr.LlamaForCausalLM(cfg)
    model.save_pretrained(str(path), **({"max_shard_size": "8KB"} if shard else {}))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """``single``: one file; ``sharded``: four shards and an index; ``other``: another
    model of the same shapes; ``deeper``: three layers."""
    root = tmp_path_factory.mktemp("saved")
    save_llama(root / "single", 0)
    save_llama(root / "sharded", 0, shard=True)
    save_llama(root / "other", 1)
    save_llama(root / "deeper", 0, layers=3)
    assert sorted(p.name for p in (root / "sharded").glob("*.safetensors")) == SHARDS
    return root


def world(tmp_path: Path, saved: Path, name: str) -> Path:
    """A folder to run in, holding ``victim``: a copy of the saved source ``name``."""
    shutil.copytree(saved / name, tmp_path / "victim")
    return tmp_path


def edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"] = {k: edit(k, v) for k, v in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))


def exported(cwd: Path) -> dict[str, torch.Tensor]:
    return load_file(str(cwd / "out" / "model.safetensors"))


# ----------------------------------------------------------------------------- item 7


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_index_naming_a_file_outside_the_folder_is_refused(tmp_path, saved, how):
    """A weight_map entry ``../other/model.safetensors`` (or its absolute path) was followed:
    the export held the other model's weights."""
    cwd = world(tmp_path, saved, "sharded")
    shutil.copytree(saved / "other", cwd / "other")
    target = "../other/model.safetensors"
    if how == "absolute":
        target = str((cwd / "other" / "model.safetensors").resolve())
    victim = cwd / "victim"
    for name in SHARDS:
        (victim / name).unlink()
    edit_index(victim, lambda k, v: target)
    refused(
        cwd,
        f"victim/{INDEX} names the weight file {target!r}, which is not inside 'victim'; an "
        "index names the files beside it: download the checkpoint again",
    )


def test_gpt2_index_naming_a_file_outside_the_folder_is_refused(tmp_path):
    """The GPT-2 reader followed the same names; the CLI checks the folder before it picks
    a reader."""
    import transformers as tr

    cfg = tr.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    tr.GPT2LMHeadModel(cfg).save_pretrained(str(tmp_path / "other"))
    (tmp_path / "victim").mkdir()
    shutil.copy(tmp_path / "other" / "config.json", tmp_path / "victim")
    index = {"weight_map": {"transformer.wte.weight": "../other/model.safetensors"}}
    (tmp_path / "victim" / INDEX).write_text(json.dumps(index))
    refused(
        tmp_path,
        f"victim/{INDEX} names the weight file '../other/model.safetensors', which is not "
        "inside 'victim'; an index names the files beside it: download the checkpoint again",
        ["convert", "victim", "--to", "gpt", "--bos-id", "1", "--out", "out"],
    )
    # and in Python, where no CLI checks the folder first; a weight file linking out too
    from anyorder.errors import CheckpointError
    from anyorder.interop.convert import convert_gpt2

    with pytest.raises(CheckpointError, match=r"names the weight file '\.\./other/model"):
        convert_gpt2(tmp_path / "victim", "gpt", bos_id=1)
    (tmp_path / "victim" / INDEX).unlink()
    (tmp_path / "victim" / "model.safetensors").symlink_to(tmp_path / "other" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors links to .*, outside"):
        convert_gpt2(tmp_path / "victim", "gpt", bos_id=1)


def test_index_naming_a_file_through_dot_dot_inside_is_refused(tmp_path, saved):
    """``sub/../x`` is read as written: an index names the files beside it, without ``..``."""
    cwd = world(tmp_path, saved, "sharded")
    victim = cwd / "victim"
    (victim / "sub").mkdir()
    edit_index(victim, lambda k, v: f"sub/../{v}" if v == SHARDS[0] else v)
    refused(
        cwd,
        f"victim/{INDEX} names the weight file 'sub/../{SHARDS[0]}', which is not inside "
        "'victim'; an index names the files beside it: download the checkpoint again",
    )


def test_hub_cache_snapshot_of_links_into_blobs_converts(tmp_path, saved):
    """The hub's cache layout: every file of ``snapshots/<rev>`` is a link to
    ``../../blobs/<hash>``, outside the snapshot folder. Its names are plain names inside the
    folder, so it converts, by hub id offline and by path, to the weights of the plain
    folder."""
    hub = tmp_path / "hub"
    repo = hub / "models--owner--llama"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for i, src in enumerate(sorted((saved / "sharded").iterdir())):
        shutil.copy(src, repo / "blobs" / f"blob{i}")
        (snap / src.name).symlink_to(f"../../blobs/blob{i}")
    shutil.copytree(saved / "sharded", tmp_path / "plain")
    r = convert(tmp_path, ["convert", "plain", "--to", "aogpt", "--out", "want"])
    assert r.returncode == 0, r.stderr
    want = load_file(str(tmp_path / "want" / "model.safetensors"))
    for args, env in [
        (
            ["convert", "owner/llama"],
            {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"},
        ),
        (["convert", str(snap.relative_to(tmp_path))], {}),
    ]:
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        r = convert(tmp_path, [*args, "--to", "aogpt", "--out", "out"], env)
        assert r.returncode == 0, r.stderr
        assert r.stderr == ""
        got = exported(tmp_path)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("how", ["shard", "single", "blobs-not-a-snapshot"])
def test_a_weight_file_linking_outside_the_folder_is_refused(tmp_path, saved, how):
    """A folder's plain name that is a link to another model's weights (a cloned repo or an
    unpacked archive can hold one) was followed like a hub snapshot's: the export held the
    other model's tensors. Only links into the folder, or a snapshot's into its cache's
    blobs/, are read; a link inside the folder still converts."""
    cwd = world(tmp_path, saved, "single" if how == "single" else "sharded")
    shutil.copytree(saved / "other", cwd / "other")
    victim = cwd / "victim"
    name = "model.safetensors" if how == "single" else SHARDS[0]
    target = cwd / "other" / "model.safetensors"
    if how == "blobs-not-a-snapshot":  # a blobs/ folder beside it, but no snapshots/ layout
        (cwd / "blobs").mkdir()
        target = shutil.copy(target, cwd / "blobs" / "blob0")
    (victim / name).unlink()
    (victim / name).symlink_to(target)
    refused(
        cwd,
        f"victim/{name} links to {str(Path(target).resolve())!r}, outside 'victim'; a model "
        "folder's weights lie inside it (or in the hub cache's blobs/ for a snapshot): copy "
        "the file into the folder",
    )


def test_a_weight_file_linking_inside_the_folder_converts(tmp_path, saved):
    """A link that stays inside the folder is the folder's own file: the same export as the
    plain folder's."""
    plain = world(tmp_path / "plain", saved, "single")
    assert convert(plain).returncode == 0
    cwd = world(tmp_path / "linked", saved, "single")
    victim = cwd / "victim"
    (victim / "weights").mkdir()
    (victim / "model.safetensors").rename(victim / "weights" / "real.safetensors")
    (victim / "model.safetensors").symlink_to("weights/real.safetensors")
    r = convert(cwd)
    assert r.returncode == 0, r.stderr
    got, want = exported(cwd), exported(plain)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ----------------------------------------------------------------------------- item 8


def test_config_json_named_pipe_is_refused(tmp_path, saved):
    """``convert`` blocked forever reading it (the CLI reads ``model_type`` first)."""
    cwd = world(tmp_path, saved, "single")
    (cwd / "victim" / "config.json").unlink()
    os.mkfifo(cwd / "victim" / "config.json")
    refused(
        cwd,
        "victim/config.json is a named pipe (FIFO), not a file; replace it with the file itself",
    )


def test_config_json_link_to_dev_zero_is_refused(tmp_path, saved):
    """It was read until the memory ran out (60-100 MB/s)."""
    cwd = world(tmp_path, saved, "single")
    (cwd / "victim" / "config.json").unlink()
    (cwd / "victim" / "config.json").symlink_to("/dev/zero")
    refused(cwd, "victim/config.json is a device, not a file; replace it with the file itself")


def test_weight_map_naming_a_named_pipe_is_refused(tmp_path, saved):
    cwd = world(tmp_path, saved, "sharded")
    shard = cwd / "victim" / SHARDS[1]
    shard.unlink()
    os.mkfifo(shard)
    refused(
        cwd,
        f"victim/{SHARDS[1]} is a named pipe (FIFO), not a file; replace it with the file itself",
    )


def test_tokenizer_json_named_pipe_is_refused(tmp_path, saved):
    """The folder's tokenizer is loaded with it: ``tokenizers`` blocked reading the pipe."""
    cwd = world(tmp_path, saved, "single")
    os.mkfifo(cwd / "victim" / "tokenizer.json")
    refused(
        cwd,
        "victim/tokenizer.json is a named pipe (FIFO), not a file; replace it with the file itself",
    )


@pytest.mark.parametrize("nest", ["[", '{"a":'])
def test_config_json_nested_too_deeply_is_refused(tmp_path, saved, nest):
    """A RecursionError's traceback before."""
    cwd = world(tmp_path, saved, "single")
    (cwd / "victim" / "config.json").write_text(nest * 100_000)
    refused(
        cwd, "victim/config.json is unreadable (nested too deeply); download the checkpoint again"
    )


def _rewrite_header(path: Path, edit) -> None:
    """``path`` with its safetensors header edited (and its data kept)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = edit(json.loads(raw[8 : 8 + n]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _past_the_end(header: dict) -> dict:
    a, b = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [a + 10**9, b + 10**9]
    return header


def _f64(header: dict) -> dict:
    header["model.norm.weight"]["dtype"] = "F64"
    header["model.norm.weight"]["shape"] = [8]  # the same 64 bytes
    return header


def _made_up_dtype(header: dict) -> dict:
    header["model.norm.weight"]["dtype"] = "Q3"
    return header


HEADER_LIES = {
    "offsets-past-the-end": (
        _past_the_end,
        "victim/model.safetensors: tensor 'model.norm.weight' claims bytes <n>..<n> for shape "
        "[16] F32, and the file holds <n> bytes of data; download the checkpoint again",
    ),
    "made-up-dtype": (
        _made_up_dtype,
        "victim/model.safetensors: tensor 'model.norm.weight' has a damaged header entry "
        '({"dtype": "Q3", "shape": [16], "data_offsets": [<n>, <n>]}); download the '
        "checkpoint again",
    ),
    "dtype-convert-does-not-read": (
        _f64,
        "weight 'model.norm.weight' is stored as F64; convert reads F32, BF16 and F16 "
        "weights: save the checkpoint in one of those",
    ),
}


@pytest.mark.parametrize("case", sorted(HEADER_LIES))
def test_safetensors_header_that_lies_is_refused(tmp_path, saved, case):
    import re

    edit, message = HEADER_LIES[case]
    cwd = world(tmp_path, saved, "single")
    _rewrite_header(cwd / "victim" / "model.safetensors", edit)
    before = listing(cwd)
    r = convert(cwd)
    assert "Traceback" not in r.stderr, r.stderr
    pattern = re.escape(f"anyorder convert: error: {message}").replace("<n>", r"\d+")
    assert len(r.stderr.splitlines()) == 1 and re.fullmatch(pattern, r.stderr.strip()), r.stderr
    assert r.returncode == 2
    assert not (cwd / "out").exists() and listing(cwd) == before


@pytest.mark.parametrize("length", [2**63, 2**40, 0])
def test_safetensors_header_length_that_lies_is_refused(tmp_path, saved, length):
    """A header length past the file (or 2**63) is refused before anything is allocated."""
    cwd = world(tmp_path, saved, "single")
    path = cwd / "victim" / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", length) + raw[8:])
    refused(
        cwd,
        f"victim/model.safetensors is not a safetensors file (a header of {length} bytes "
        f"claimed in a file of {len(raw)}); download the checkpoint again",
    )


# ----------------------------------------------------------------------------- warnings


def test_tensor_in_two_shards_reads_the_index_s_copy_and_says_so(tmp_path, saved):
    """A later shard's copy silently replaced the one the index names."""
    cwd = world(tmp_path, saved, "sharded")
    victim = cwd / "victim"
    index = json.loads((victim / INDEX).read_text())["weight_map"]
    home = index["model.norm.weight"]
    later = SHARDS[SHARDS.index(home) + 1]
    norm = load_file(str(victim / home))["model.norm.weight"]
    tensors = load_file(str(victim / later))
    save_file({**tensors, "model.norm.weight": norm + 5}, str(victim / later), {"format": "pt"})
    r = convert(cwd)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        f"warning: 'victim' holds tensor 'model.norm.weight' in two files, {home} and {later}; "
        f"converting the copy in {home} (the file the index names)"
    ]
    assert torch.equal(exported(cwd)["norm_f.weight"], norm)


def test_tensors_the_export_does_not_take_are_named(tmp_path, saved):
    """A third layer (config.json says two) and a key no family has were dropped silently."""
    cwd = world(tmp_path, saved, "deeper")
    victim = cwd / "victim"
    config = json.loads((victim / "config.json").read_text())
    (victim / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    tensors = load_file(str(victim / "model.safetensors"))
    tensors["vision_tower.proj"] = torch.zeros(3)
    save_file(tensors, str(victim / "model.safetensors"), {"format": "pt"})
    r = convert(cwd)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        "warning: 10 tensors of 'victim' are not converted "
        "('model.layers.2.input_layernorm.weight', 'model.layers.2.mlp.down_proj.weight', "
        "'model.layers.2.mlp.gate_proj.weight', ...): layers beyond the 2 its config.json "
        "has, or names the Llama map does not know"
    ]
    assert not any(k.startswith("blocks.2.") for k in exported(cwd))
