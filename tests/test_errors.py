"""Every row of docs/errors.md: the real CLI, one line on stderr, exit code 2, no files.

Each row runs ``python -m anyorder.cli`` in a folder of its own (a copy of a prepared
world: a trained tiny ARMD run, its data cache, a tokenizer of another vocabulary, bad
corpora and configs) with relative paths, so the messages are stable and the documented
message can be matched whole: ``<...>`` in the table stands for any text. The rows run
four at a time (each is mostly interpreter start-up); every test then checks its own row:

* stderr is exactly one line, the documented message, and holds no ``Traceback``;
* the exit code is the documented one (2);
* the row's folder holds exactly the files it held before (names, sizes and times).

The set of rows here and the set of rows in docs/errors.md must be the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO

ERRORS_MD = REPO / "docs" / "errors.md"
CONFIG = """\
model: {kind: armd, n_layer: 2, n_head: 2, d_model: 32, seq_len: 32}
data: {source: "builtin:pydoc", max_documents: 40, cache_dir: cache}
train: {out_dir: run, steps: 2, batch_size: 8, lr: 0.01, warmup_steps: 1, eval_every: 0,
        eval_batches: 1, ckpt_every: 0, log_every: 1, device: cpu}
"""
CKPT = "run/checkpoints/step_0000002"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _truncate(folder: Path) -> None:
    path = folder / CKPT / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_byte(folder: Path) -> None:
    path = folder / CKPT / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor: same size, other bytes
    path.write_bytes(bytes(data))


def _data_folder(folder: Path) -> Path:
    (cache,) = (folder / "cache").iterdir()
    return cache


def _edit_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _flip_shard_byte(folder: Path) -> None:
    path = _data_folder(folder) / "val.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01  # another byte-level token id: same size, other checksum
    path.write_bytes(bytes(data))


def _token_beyond_vocab(folder: Path) -> None:
    """A token id the vocabulary lacks, with the manifest's checksum made to match."""
    import hashlib

    cache = _data_folder(folder)
    data = bytearray((cache / "val.bin").read_bytes())
    data[10:12] = (300).to_bytes(2, "little")  # uint16 shards
    (cache / "val.bin").write_bytes(bytes(data))

    def fix(m):
        m["splits"]["val"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
        return m

    _edit_json(cache / "manifest.json", fix)


def _shard_dtype(folder: Path) -> None:
    _edit_json(_data_folder(folder) / "manifest.json", lambda m: {**m, "dtype": "uint32"})


def _manifest(folder: Path) -> Path:
    return folder / CKPT / "manifest.json"


def _manifest_list(folder: Path) -> None:
    _manifest(folder).write_text("[]")


def _manifest_no_bytes(folder: Path) -> None:
    def drop(m):
        del m["files"]["model.safetensors"]["bytes"]
        return m

    _edit_json(_manifest(folder), drop)


def _manifest_bad_step(folder: Path) -> None:
    _edit_json(_manifest(folder), lambda m: {**m, "step": "two"})


def _unlisted_ema(folder: Path) -> None:
    """EMA weights whose manifest entry was removed (here: a file no entry vouches for)."""
    shutil.copy(folder / CKPT / "model.safetensors", folder / CKPT / "ema.safetensors")


def _no_manifests(folder: Path) -> None:
    for p in (folder / "run" / "checkpoints").glob("step_*/manifest.json"):
        p.unlink()


def _huge_export_config(folder: Path) -> None:
    _edit_json(folder / "exp" / "config.json", lambda c: {**c, "n_layer": 4096, "d_model": 4096})


_HELD: list = []  # run-folder locks held by this process for the rows' lifetime


def _hold_run_lock(folder: Path) -> None:
    from anyorder.runlock import RunLock

    _HELD.append(RunLock(folder / "run").acquire())


REF = REPO / "tests" / "fixtures" / "aogpt-ref"  # checkpoints in the AO-GPT authors' format


def _ref_truncated(folder: Path) -> None:
    data = (REF / "aogpt" / "ckpt_1234.pt").read_bytes()
    (folder / "ckpt_1234.pt").write_bytes(data[: len(data) // 2])


def _ref_ema_short(folder: Path) -> None:
    import torch

    ckpt = torch.load(REF / "aogpt" / "ckpt_1234.pt", weights_only=True)
    ckpt["ema_model"]["shadow_params"].pop()
    torch.save(ckpt, folder / "ckpt_1234.pt")


def _ref_sigma(folder: Path) -> None:
    shutil.copy(REF / "sigmagpt" / "ckpt_1234.pt", folder / "ckpt_1234.pt")


TRAIN = ["train", "cfg.yaml", "--no-progress"]
CONVERT_REF = ["convert", "ckpt_1234.pt", "--from", "aogpt-ref", "--out", "ao"]
NEW = "train.out_dir=new"  # a run folder that must not appear
FRESH = [NEW, "data.cache_dir=newcache"]  # and a data cache that must not appear either
# id: (command line, extra environment, setup of the row's folder)
ROWS: dict[str, tuple[list[str], dict[str, str], object]] = {
    "config-unknown-key": ([*TRAIN, "model.n_layr=2"], {}, None),
    "config-ill-typed": ([*TRAIN, "train.steps=many"], {}, None),
    "config-file-unknown-key": (["train", "typo.yaml"], {}, None),
    "config-missing-file": (["train", "nope.yaml"], {}, None),
    "config-bad-yaml": (["train", "broken.yaml"], {}, None),
    "config-not-key-value": ([*TRAIN, "train.steps"], {}, None),
    "cli-bad-option": (["sample", "run", "--top-p", "abc"], {}, None),
    "config-bad-value": ([*TRAIN, "train.lr=0", NEW], {}, None),
    "data-missing": ([*TRAIN, "data.source=missing.txt", *FRESH], {}, None),
    "data-empty-file": ([*TRAIN, "data.source=corpus/empty.txt", *FRESH], {}, None),
    "data-empty-folder": ([*TRAIN, "data.source=emptydir", *FRESH], {}, None),
    "data-unreadable": ([*TRAIN, "data.source=corpus/bad.parquet", *FRESH], {}, None),
    "data-too-small": ([*TRAIN, "data.source=corpus/tiny.txt", *FRESH], {}, None),
    "tokenizer-vocab-resume": ([*TRAIN, "data.tokenizer=tok300"], {}, None),
    "tokenizer-vocab-init-from": (
        [*TRAIN, "train.init_from=run", "data.tokenizer=tok300", NEW],
        {},
        None,
    ),
    "tokenizer-vocab-export": (["sample", "exp"], {}, None),
    "checkpoint-missing": (["sample", "nowhere"], {}, None),
    "checkpoint-none": (["sample", "emptydir"], {}, None),
    "checkpoint-truncated": (["sample", "run"], {}, _truncate),
    "checkpoint-corrupted": (["sample", "run"], {}, _flip_byte),
    "checkpoint-kind-resume": ([*TRAIN, "model.kind=aogpt"], {}, None),
    "checkpoint-kind-init-from": (
        [*TRAIN, "train.init_from=run", "model.kind=gpt", NEW],
        {},
        None,
    ),
    "convert-ref-truncated": (CONVERT_REF, {}, _ref_truncated),
    "convert-ref-ema-mismatch": (CONVERT_REF, {}, _ref_ema_short),
    "convert-ref-other-format": (CONVERT_REF, {}, _ref_sigma),
    "prompt-too-long": (["sample", "run", "--prompt", "x" * 40], {}, None),
    "infill-hole-out-of-range": (["sample", "run", "--infill", "ab[MASK:40]"], {}, None),
    "infill-template-too-long": (["sample", "run", "--infill", "y" * 30 + "[MASK:4]"], {}, None),
    "infill-overlapping-holes": (["sample", "run", "--infill", "a[MASK:3[MASK:2]]b"], {}, None),
    "infill-bad-hole": (["sample", "run", "--infill", "a[MASK:0]b"], {}, None),
    "infill-no-hole": (["sample", "run", "--infill", "abc"], {}, None),
    "streams-do-not-divide": (["sample", "run", "--streams", "5"], {}, None),
    "top-p-out-of-range": (["sample", "run", "--top-p", "1.5"], {}, None),
    "temperature-not-positive": (["sample", "run", "--temperature", "0"], {}, None),
    "gpu-train": ([*TRAIN, "train.device=cuda", NEW], {}, None),
    "gpu-sample": (["sample", "run", "--device", "cuda"], {}, None),
    "gpu-eval": (["eval", "run", "--device", "cuda"], {}, None),
    "torchrun-rendezvous": (
        [*TRAIN, NEW],
        {
            "WORLD_SIZE": "2",
            "RANK": "1",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "CLOSED_PORT",
            "ANYORDER_DIST_TIMEOUT_S": "2",
        },
        None,
    ),
    # issue 17: one writer per run folder, bounds, verified data, manifests, tracebacks
    "run-folder-busy": ([*TRAIN], {}, _hold_run_lock),
    "sample-steps-too-many": (["sample", "run", "--steps", "100000000"], {}, None),
    "data-shard-corrupted": (["eval", "run"], {}, _flip_shard_byte),
    "data-token-out-of-range": (["eval", "run"], {}, _token_beyond_vocab),
    "data-manifest-damaged": (["eval", "run"], {}, _shard_dtype),
    "data-val-fraction-zero": ([*TRAIN, "data.val_fraction=0", *FRESH], {}, None),
    "checkpoint-manifest-damaged": (["sample", "run"], {}, _manifest_list),
    "checkpoint-manifest-no-bytes": (["sample", "run"], {}, _manifest_no_bytes),
    "checkpoint-manifest-bad-step": (["sample", "run"], {}, _manifest_bad_step),
    "checkpoint-ema-unlisted": (["sample", "run"], {}, _unlisted_ema),
    "checkpoint-manifests-missing": ([*TRAIN], {}, _no_manifests),
    "infill-hole-huge": (["sample", "run", "--infill", "a[MASK:" + "9" * 5000 + "]"], {}, None),
    "seed-out-of-range": (["sample", "run", "--seed", str(2**70)], {}, None),
    "num-samples-out-of-range": (["sample", "run", "--num-samples", "100000000"], {}, None),
    "length-zero": (["sample", "run", "--length", "0"], {}, None),
    # issue 26: speculative sampling
    "speculative-with-steps": (["sample", "run", "--speculative", "4", "--steps", "8"], {}, None),
    "speculative-zero": (["sample", "run", "--speculative", "0"], {}, None),
    "eval-targets-zero": (["eval", "run", "--ensemble", "2", "--targets", "0"], {}, None),
    "eval-out-is-file": (["eval", "run", "--out", "cfg.yaml"], {}, None),
    "out-dir-is-file": ([*TRAIN, "train.out_dir=cfg.yaml"], {}, None),
    "out-dir-unwritable": ([*TRAIN, "train.out_dir=/proc/anyorder-run"], {}, None),
    "cache-dir-under-file": (
        [*TRAIN, NEW, "data.cache_dir=cfg.yaml/cache"],
        {},
        None,
    ),
    "serve-port-out-of-range": (["serve", "run", "--port", "99999"], {}, None),
    "config-empty-file": (["train", "empty.yaml"], {}, None),
    "tokenizer-hub-unreachable": (
        [*TRAIN, "data.tokenizer=nope", *FRESH],
        {"HF_ENDPOINT": "http://127.0.0.1:CLOSED_PORT"},
        None,
    ),
    "export-config-does-not-fit": (["sample", "exp"], {}, _huge_export_config),
}


# ----------------------------------------------------------------------------- the table


def documented_rows() -> dict[str, tuple[str, int]]:
    """``{id: (message pattern, exit code)}`` from the table in docs/errors.md."""
    rows: dict[str, tuple[str, int]] = {}
    for line in ERRORS_MD.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 5 or not re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            continue
        ident, code, message = cells[0].strip("`"), cells[3], cells[4]
        m = re.fullmatch(r"`(.*)`", message)
        assert m, f"docs/errors.md row {ident}: the message cell must be one `code span`"
        rows[ident] = (m.group(1).replace("\\|", "|"), int(code))
    return rows


def message_regex(documented: str) -> re.Pattern[str]:
    """The documented message as a regex: ``<...>`` placeholders match any text."""
    parts = re.split(r"<[^<>]*>", documented)
    return re.compile(".+?".join(re.escape(p) for p in parts))


def test_every_documented_row_has_a_test_and_back() -> None:
    assert set(documented_rows()) == set(ROWS)


# ----------------------------------------------------------------------------- the world


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: relative path -> (size, mtime in ns) for files,
    (0, 0) for folders (a temporary folder made and removed again changes a folder's mtime,
    not what it holds)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[str((Path(dirpath) / name).relative_to(root)) + "/"] = (0, 0)
        for name in filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The folder every row starts from (copied per row)."""
    from anyorder.config import load_config
    from anyorder.data import BPETokenizer
    from anyorder.training.loop import train

    root = tmp_path_factory.mktemp("errors_world")
    (root / "cfg.yaml").write_text(CONFIG)
    (root / "typo.yaml").write_text("train: {stpes: 3}\n")
    (root / "broken.yaml").write_text("model: {kind: [armd\n")
    (root / "empty.yaml").write_text("# nothing set\n")
    (root / "corpus").mkdir()
    (root / "corpus" / "empty.txt").write_text("")
    (root / "corpus" / "tiny.txt").write_text("hello\n")
    (root / "corpus" / "bad.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    (root / "emptydir").mkdir()
    from pydoc_data.topics import topics

    cwd = os.getcwd()
    os.chdir(root)  # the run's config keeps the relative paths the rows use
    try:
        train(load_config("cfg.yaml"), progress=False)
    finally:
        os.chdir(cwd)
    BPETokenizer.train(list(topics.values())[:40], 300).save(root / "tok300")
    # an export whose tokenizer folder was swapped for one of another vocabulary
    from anyorder.checkpoint.exporting import export

    export(root / "run", root / "exp")
    shutil.rmtree(root / "exp" / "tokenizer")
    shutil.copytree(root / "tok300", root / "exp" / "tokenizer")
    assert (root / CKPT / "manifest.json").is_file()
    return root


def _run_row(ident: str, world: Path, base: Path) -> dict:
    args, extra, setup = ROWS[ident]
    folder = base / ident
    shutil.copytree(world, folder, symlinks=True)
    if setup is not None:
        setup(folder)
    # CUDA_VISIBLE_DEVICES="" makes any machine one without a GPU (the gpu-* rows)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({k: v.replace("CLOSED_PORT", str(_closed_port())) for k, v in extra.items()})
    before = _tree(folder)
    out = subprocess.run(
        [sys.executable, "-m", "anyorder.cli", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {
        "code": out.returncode,
        "stderr": out.stderr,
        "stdout": out.stdout,
        "before": before,
        "after": _tree(folder),
    }


@pytest.fixture(scope="module")
def outcomes(world, tmp_path_factory) -> dict[str, dict]:
    """Every row, run four at a time."""
    base = tmp_path_factory.mktemp("errors_rows")
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {i: pool.submit(_run_row, i, world, base) for i in ROWS}
        results = {i: f.result() for i, f in futures.items()}
    report = base / "outcomes.json"
    clean = sum(r["code"] == 2 and len(r["stderr"].splitlines()) == 1 for r in results.values())
    report.write_text(json.dumps({"rows": len(results), "clean": clean}) + "\n")
    print(f"\nbad inputs tried: {len(results)}, clean one-line errors (exit 2): {clean}")
    return results


@pytest.mark.parametrize("ident", sorted(ROWS))
def test_documented_error(ident: str, outcomes) -> None:
    pattern, code = documented_rows()[ident]
    r = outcomes[ident]
    lines = r["stderr"].splitlines()
    assert "Traceback" not in r["stderr"], r["stderr"]
    assert len(lines) == 1, r["stderr"]
    assert message_regex(pattern).fullmatch(lines[0]), f"{lines[0]!r} !~ {pattern!r}"
    assert r["code"] == code == 2, r["stderr"]
    changed = sorted(set(r["after"].items()) ^ set(r["before"].items()))
    assert not changed, f"files were left behind or changed: {changed}"
