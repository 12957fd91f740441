"""Issue 24: a user's own files and folders, through the real CLI.

A training writes config.yaml, metrics.jsonl and summary.json into its run folder, so a
run folder must be new, empty, or one anyorder made (it holds ``.anyorder-run``, or, for
runs from before that file, checkpoints). The single bad inputs are rows of docs/errors.md
(tests/test_errors.py); here are the cases that need the exact bytes of the user's files,
or more than one command:

1. ``train.out_dir=`` (an unset shell variable) and ``train.out_dir=.`` run in a folder
   that holds the user's config.yaml (with comments), summary.json and metrics.jsonl: one
   line, exit 2, and every byte of the folder as it was;
2. a run folder anyorder made still resumes, and so does one from before the marker;
3. errors quote values as a short preview, whatever the value expands to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli

CONFIG = """\
# my notes: these comments must survive
model: {kind: armd, n_layer: 2, n_head: 2, d_model: 32, seq_len: 32}
data: {source: "builtin:pydoc", max_documents: 40, cache_dir: cache}
train: {steps: 2, batch_size: 8, lr: 0.01, warmup_steps: 1, eval_every: 0,
        eval_batches: 1, ckpt_every: 0, log_every: 1, device: cpu, seed: 3}
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, env=_env())


def one_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert out.returncode == 2, out.stderr
    return lines[0]


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` with its bytes (None for folders)."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = None
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


@pytest.mark.parametrize("value", ["", ".", "./", "CWD"])
def test_the_current_folder_is_never_a_run_folder(tmp_path, value) -> None:
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "summary.json").write_text('{"mine": true}\n')
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    before = _snapshot(tmp_path)
    value = str(tmp_path) if value == "CWD" else value
    out = cli(tmp_path, "train", "config.yaml", "--no-progress", f"train.out_dir={value}")
    line = one_line(out)
    if value:
        assert line == (
            f"anyorder train: error: train.out_dir={value!r} is the current folder; a run "
            "needs a folder of its own (new, empty, or an earlier run's), e.g. "
            "train.out_dir=runs/NAME"
        )
    else:
        assert "train.out_dir is empty (an unset shell variable?)" in line
    assert out.stdout == ""
    assert _snapshot(tmp_path) == before  # not a byte changed, nothing added (no cache)


def test_a_run_folder_anyorder_made_resumes_and_so_does_an_older_one(tmp_path) -> None:
    (tmp_path / "config.yaml").write_text(CONFIG)
    out = cli(tmp_path, "train", "config.yaml", "--no-progress", "train.out_dir=run")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / ".anyorder-run").is_file()
    out = cli(tmp_path, "train", "config.yaml", "--no-progress", "train.out_dir=run",
              "train.steps=3")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "resuming from run/checkpoints/step_0000002 at step 2" in out.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_0000003").is_dir()
    # a run written before the marker existed is known by its checkpoints
    (tmp_path / "run" / ".anyorder-run").unlink()
    out = cli(tmp_path, "train", "config.yaml", "--no-progress", "train.out_dir=run",
              "train.steps=4")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "resuming from run/checkpoints/step_0000003 at step 3" in out.stdout
    # an empty folder the user made is a fine run folder
    (tmp_path / "empty").mkdir()
    out = cli(tmp_path, "train", "config.yaml", "--no-progress", "train.out_dir=empty")
    assert out.returncode == 0, out.stderr


def test_a_folder_of_the_users_files_is_refused_and_left_alone(tmp_path) -> None:
    (tmp_path / "config.yaml").write_text(CONFIG)
    work = tmp_path / "work"
    work.mkdir()
    for i in range(6):
        (work / f"notes{i}.txt").write_text(f"note {i}\n")
    before = _snapshot(tmp_path)
    line = one_line(cli(tmp_path, "train", "config.yaml", "train.out_dir=work"))
    assert line == (
        "anyorder train: error: train.out_dir='work' holds files that are not a run's "
        "(notes0.txt, notes1.txt, notes2.txt, notes3.txt, ...); a run folder must be new, "
        "empty or one anyorder made: pick another train.out_dir"
    )
    assert _snapshot(tmp_path) == before


def test_an_error_quotes_a_short_preview_of_a_huge_value(tmp_path) -> None:
    """A value of 10**4 distinct items (under the alias budget) is still quoted short."""
    big = "[" + ", ".join(f"v{i}" for i in range(9000)) + "]"
    (tmp_path / "config.yaml").write_text(f"train: {{steps: {big}}}\n")
    line = one_line(cli(tmp_path, "train", "config.yaml"))
    assert line == (
        "anyorder train: error: config key 'train.steps' expects int, got ['v0', 'v1', "
        "'v2', 'v3', ...] (list); fix the value in the file or on the command line"
    )


# ----------------------------------------------------------------------------- the data cache


def test_training_writes_no_data_cache_into_the_working_folder(tmp_path) -> None:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    (work / "config.yaml").write_text(CONFIG.replace(", cache_dir: cache", ""))
    env = {**_env(), "ANYORDER_CACHE": str(home)}
    out = subprocess.run(
        [sys.executable, "-m", "anyorder.cli", "train", "config.yaml", "--no-progress",
         f"train.out_dir={tmp_path / 'run'}"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in work.iterdir()) == ["config.yaml"]
    (key,) = (home / "data").iterdir()
    assert (key / "manifest.json").is_file()
    assert f"data: preparing builtin:pydoc into {key} (data.cache_dir)" in out.stdout
    assert f"({key})" in out.stdout  # and where it reads from


def test_a_file_name_with_a_newline_or_an_escape_stays_on_one_line(tmp_path) -> None:
    """A data file named with a newline split the error over two lines, and a terminal
    escape in a name reached the terminal; both are written escaped."""
    (tmp_path / "config.yaml").write_text(CONFIG)
    (tmp_path / "corpus").mkdir()
    name = "a\nb\x1b[2J\u2028\x85.txt"
    (tmp_path / "corpus" / name).write_bytes("caf\xe9 au lait".encode("latin-1"))
    out = cli(tmp_path, "train", "config.yaml", "--no-progress", "data.source=corpus")
    assert one_line(out) == (
        "anyorder train: error: corpus/a\\nb\\x1b[2J\\u2028\\x85.txt is not UTF-8 text (byte "
        "0xe9 at offset 3); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove it "
        "from data.source"
    )


# ----------------------------------------------------------------------------- closed pipes


@pytest.mark.parametrize(
    "args",
    [["info", "--config-keys"], ["sample", "RUN", "--num-samples", "2", "--length", "8"]],
)
def test_a_closed_pipe_ends_quietly(tmp_path, args) -> None:
    if "RUN" in args:
        (tmp_path / "config.yaml").write_text(CONFIG)
        trained = cli(tmp_path, "train", "config.yaml", "--no-progress", "train.out_dir=run")
        assert trained.returncode == 0, trained.stderr
        args = [a.replace("RUN", "run") for a in args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "anyorder.cli", *args],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc.stdout.close()  # the reader is gone before the first write (as `| head` soon is)
    _, err = proc.communicate(timeout=600)
    assert err.decode() == ""  # no traceback, no "Exception ignored"
    assert proc.returncode == 141  # 128 + SIGPIPE, as a Unix tool


# ----------------------------------------------------------------------------- memory


def test_an_ensemble_beyond_the_memory_is_refused_with_both_figures(tmp_path, monkeypatch, capsys):
    """The ensemble's draws against the machine's memory (here said to be 1 MB, so that a
    tiny model shows the check)."""
    from anyorder import memory
    from anyorder.cli import main

    (tmp_path / "config.yaml").write_text(CONFIG)
    assert (
        cli(tmp_path, "train", "config.yaml", "--no-progress", "train.out_dir=run").returncode == 0
    )
    monkeypatch.setattr(memory, "machine_memory", lambda device="cpu": 10**6)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    assert main(["eval", "run", "--ensemble", "1000", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "anyorder eval: error: --ensemble 1000 needs at least 4.1 MB for the orders of 8 "
        "block(s) of 32 tokens at once, more than this machine's 1.0 MB; use e.g. --ensemble 8 "
        "(or lower --batch-size)"
    ]
    assert _snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- a long .txt


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_a_long_text_file_read_in_pieces_makes_the_same_shards(tmp_path, monkeypatch, tokenizer):
    """The same corpus prepared whole and in pieces of about 2,000 characters: the same
    shards, byte for byte, and the same statistics."""
    from pydoc_data.topics import topics

    from anyorder.config import load_config
    from anyorder.data import prepare, sources

    text = " ".join(topics.values())[:120_000]  # one document, many cut points
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "book.txt").write_text(text)
    (corpus / "small.txt").write_text("a short second document\n")
    made = {}
    for name, limit in (("whole", 10**9), ("pieces", 2_000)):
        monkeypatch.setattr(sources, "LONG_TEXT_BYTES", limit)
        values = {"source": corpus, "tokenizer": tokenizer, "cache_dir": tmp_path / name}
        cfg = load_config(None, [f"data.{k}={v}" for k, v in values.items()])
        made[name] = prepare(cfg.data, 64, progress=False).path
    for shard in ("train.bin", "val.bin"):
        assert (made["whole"] / shard).read_bytes() == (made["pieces"] / shard).read_bytes()
    whole, pieces = ((made[k] / "manifest.json").read_text() for k in ("whole", "pieces"))
    assert whole == pieces
    assert not list(made["pieces"].glob(".long-document*"))  # the spill file is gone


def test_pieces_are_cut_only_between_words(tmp_path) -> None:
    from anyorder.data.sources import LongText

    text = "ab  cd ef\n gh " + "x" * 20 + " ij kl"  # 20 < 4 pieces: the word stays whole
    (tmp_path / "t.txt").write_text(text)
    pieces = list(LongText(tmp_path / "t.txt", piece_chars=8).pieces())
    assert "".join(pieces) == text and len(pieces) > 2
    for a, b in zip(pieces, pieces[1:]):
        assert not a[-1].isspace() and b[0] == " " and not b[1].isspace()
