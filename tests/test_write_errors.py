"""Issue 24: a user's own files survive write errors and killed writers, through the real CLI.

The single bad inputs are rows of docs/errors.md (tests/test_errors.py). Here are the cases
that need a process limit or a killed process:

* a file size limit (``RLIMIT_FSIZE``, which fails writes with EFBIG the way a full disk
  fails them with ENOSPC, and works as root, unlike a read-only folder) during ``export``,
  ``convert``, ``eval --out`` and the metrics writes of a training between checkpoints:
  one line naming the path and the cause, exit 2, no temporary left, the earlier export or
  checkpoint byte-identical and loadable, and the same command finishing once there is room;
* a writer killed with SIGKILL while it holds a temporary folder (export, convert, data):
  the next run of the same command removes it, and leaves a live writer's alone.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import anyorder
from anyorder import checkpoint as ck

from conftest import REPO

CONFIG = """\
model: {kind: armd, n_layer: 2, n_head: 2, d_model: 32, seq_len: 32}
data: {source: "builtin:pydoc", max_documents: 40, cache_dir: cache}
train: {out_dir: run, steps: 2, batch_size: 8, lr: 0.01, warmup_steps: 1, eval_every: 0,
        eval_batches: 1, ckpt_every: 2, keep_last: 2, log_every: 1, device: cpu, seed: 3}
"""
REF = REPO / "tests" / "fixtures" / "aogpt-ref" / "aogpt" / "ckpt_1234.pt"


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _limit(nbytes: int):
    def apply() -> None:  # in the child: a write past `nbytes` fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def cli(cwd: Path, *args: str, limit: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "anyorder.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=None if limit is None else _limit(limit),
    )


def one_line(out: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert out.returncode == 2, out.stderr
    return lines[0]


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A trained tiny run (a checkpoint at step 2) and an export of it."""
    root = tmp_path_factory.mktemp("user_files")
    (root / "cfg.yaml").write_text(CONFIG)
    out = cli(root, "train", "cfg.yaml", "--no-progress")
    assert out.returncode == 0, out.stderr
    out = cli(root, "export", "run", "--out", "exp")
    assert out.returncode == 0, out.stderr
    return root


@pytest.fixture
def w(trained, tmp_path) -> Path:
    dest = tmp_path / "w"
    shutil.copytree(trained, dest, symlinks=True)
    return dest


# ----------------------------------------------------------------------------- a full disk


def test_export_over_an_earlier_one_on_a_full_disk_keeps_it(w) -> None:
    before = _files(w / "exp")
    out = cli(w, "export", "run", "--out", "exp", limit=50_000)  # weights are ~136 KB
    assert one_line(out) == (
        "anyorder export: error: cannot write 'exp' (File too large); free disk space (or "
        "raise the file size limit) or pick another --out folder"
    )
    assert _files(w / "exp") == before  # byte-identical, and loadable
    assert ck.load_model(w / "exp").step == 2
    assert _temps(w) == []
    out = cli(w, "export", "run", "--out", "exp")  # room again: it replaces the export
    assert out.returncode == 0, out.stderr


def test_convert_on_a_full_disk_leaves_nothing(w) -> None:
    shutil.copy(REF, w / "ckpt_1234.pt")
    args = ["convert", "ckpt_1234.pt", "--from", "aogpt-ref", "--out", "new/ao"]
    out = cli(w, *args, limit=50_000)
    assert one_line(out).startswith(
        "anyorder convert: error: cannot write 'new/ao' (File too large)"
    )
    assert not (w / "new").exists()  # not even the parent folder made for it
    out = cli(w, *args)
    assert out.returncode == 0, out.stderr
    assert ck.load_model(w / "new" / "ao").model.kind == "aogpt"


def test_eval_out_on_a_full_disk_leaves_no_folder(w) -> None:
    out = cli(w, "eval", "run", "--no-progress", "--out", "res/deep", limit=300)
    # the evaluation's estimate comes first (printed even without a bar: issue 25), then the
    # one error line
    estimate, *rest = out.stderr.splitlines()
    assert "likelihoods of 76 blocks: about" in estimate
    out.stderr = "\n".join(rest) + "\n"
    assert one_line(out) == (
        "anyorder eval: error: cannot write 'res/deep/likelihood.json' (File too large); free "
        "disk space (or raise the file size limit) or pick another --out folder"
    )
    assert not (w / "res").exists()


def test_a_disk_that_fills_between_checkpoints_stops_the_run_and_keeps_the_last(w) -> None:
    """metrics.jsonl, padded to just under the limit with rows of steps the checkpoint
    covers (a resume keeps them), fails at its next row; checkpoints are smaller and fit."""
    ckpt = ck.latest_checkpoint(w / "run")
    saved = _files(ckpt)
    metrics = w / "run" / "metrics.jsonl"
    text = metrics.read_text()
    limit = 400_000
    pad = json.dumps({"step": 1, "pad": "x" * (limit - len(text) - 60)}) + "\n"
    metrics.write_text(pad + text)
    rows_before = metrics.read_bytes()
    args = ["train", "cfg.yaml", "--no-progress", "train.steps=6"]
    out = cli(w, *args, limit=limit)
    assert one_line(out) == (
        "anyorder train: error: cannot write 'run/metrics.jsonl' (File too large); free disk "
        "space (or raise the file size limit) or pick another train.out_dir; "
        f"{ckpt.relative_to(w)} is intact: the same command resumes from it"
    )
    assert metrics.read_bytes() == rows_before  # no half-written row
    assert ck.list_checkpoints(w / "run") == [ckpt]
    assert _files(ckpt) == saved
    ck.verify(ckpt)
    again = cli(w, *args)
    assert again.returncode == 0, again.stderr
    assert ck.latest_checkpoint(w / "run").name == "step_0000006"


FULL_DISK = """\
import errno, os
_write, _full = os.write, os.environ["ANYORDER_TEST_FULL"]
def write(fd, data):  # what a full disk answers to a write into the folder
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""
    if target.startswith(_full):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _write(fd, data)
os.write = write
"""


def full_disk_cli(
    cwd: Path, full: Path, *args: str, launch: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """The CLI with every ``os.write`` into ``full`` failing with ENOSPC (a sitecustomize on
    PYTHONPATH: RLIMIT_FSIZE gives EFBIG, and a small file system needs root to mount);
    ``launch``: a launcher's module and options (torchrun) before ``-m anyorder.cli``."""
    site = cwd.parent / "full_disk_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(FULL_DISK)
    env = {**_env(), "ANYORDER_TEST_FULL": str(full), "TMPDIR": str(cwd.parent)}
    env["ANYORDER_DIST_TIMEOUT_S"] = "120"  # a rank left waiting fails, not hangs
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *launch, "-m", "anyorder.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_under_torchrun_rank0s_metrics_write_error_stops_every_rank(w) -> None:
    # only rank 0 writes metrics.jsonl; before, rank 1 went on to the next collective and
    # waited there for a rank 0 that had left (until gloo's timeout)
    launch = ("-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}")
    out = full_disk_cli(w, w / "fresh" / "metrics.jsonl", "train", "cfg.yaml", "--no-progress",
                        "train.out_dir=fresh", "train.ckpt_every=0", launch=launch)  # fmt: skip
    line = (
        "anyorder train: error: cannot write 'fresh/metrics.jsonl' (No space left on device); "
        "free disk space (or raise the file size limit) or pick another train.out_dir; no "
        "checkpoint was saved yet"
    )
    errors = [x for x in out.stderr.splitlines() if x.startswith("anyorder train: error:")]
    assert errors == [line, line], out.stderr[-3000:]  # both ranks, the same line
    # torchrun prints a traceback of its own (ChildFailedError); none of its frames may lie
    # in the package (a clone's folder may well be named "anyorder": match the package's path)
    package = str(Path(anyorder.__file__).resolve().parent) + os.sep
    frames = [x for x in out.stderr.splitlines() if x.lstrip().startswith('File "')]
    assert not [x for x in frames if package in x], out.stderr[-3000:]
    assert out.returncode != 0
    assert not (w / "fresh" / ".lock").exists()
    assert (w / "fresh" / "metrics.jsonl").read_bytes() == b""  # no partial row


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_training_into_a_full_disk_names_the_lock_file_and_removes_it(w) -> None:
    # a new run folder: made for the lock, removed with it
    out = full_disk_cli(w, w / "fresh", "train", "cfg.yaml", "--no-progress",
                        "train.out_dir=fresh")  # fmt: skip
    assert one_line(out) == (
        "anyorder train: error: cannot write 'fresh/.lock' (No space left on device); free "
        "disk space (or raise the file size limit) or pick another train.out_dir"
    )
    assert not (w / "fresh").exists()
    # an existing run: its files as they were, and no lock left to block the next run
    before = _files(w / "run")
    out = full_disk_cli(w, w / "run", "train", "cfg.yaml", "--no-progress", "train.steps=4")
    assert one_line(out) == (
        "anyorder train: error: cannot write 'run/.lock' (No space left on device); free "
        "disk space (or raise the file size limit) or pick another train.out_dir"
    )
    assert not (w / "run" / ".lock").exists()
    assert _files(w / "run") == before


# ----------------------------------------------------------------------------- killed writers


def _killed_writer(parent: Path, prefix: str) -> Path:
    """A real writer that makes its temporary folder (named with its PID, as every writer
    of the package does) and is killed with SIGKILL holding it."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from anyorder.atomic import make_temp_dir\n"
        "tmp = make_temp_dir(Path(sys.argv[1]), sys.argv[2])\n"
        "(tmp / 'model.safetensors').write_bytes(b'x' * 4096)\n"
        "print(tmp, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(parent), prefix],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    tmp = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL and tmp.is_dir()
    return tmp


def _live_writer_temp(parent: Path, prefix: str) -> Path:
    """A temporary folder of a writer still at work (this test's own parent process)."""
    tmp = parent / f"{prefix}{os.getppid()}-feedbeef"
    tmp.mkdir()
    return tmp


def test_a_killed_exports_temporary_folder_is_removed_by_the_next_export(w) -> None:
    dead = _killed_writer(w, ".exp.tmp-")
    live = _live_writer_temp(w, ".exp.tmp-")
    out = cli(w, "export", "run", "--out", "exp")
    assert out.returncode == 0, out.stderr
    assert not dead.exists()
    assert live.is_dir()  # another writer's, still running: left alone


def test_a_killed_conversions_temporary_folder_is_removed_by_the_next_one(w) -> None:
    shutil.copy(REF, w / "ckpt_1234.pt")
    dead = _killed_writer(w, ".ao.tmp-")
    out = cli(w, "convert", "ckpt_1234.pt", "--from", "aogpt-ref", "--out", "ao")
    assert out.returncode == 0, out.stderr
    assert _temps(w) == [] and not dead.exists()


def test_a_killed_data_builds_temporary_folder_is_removed_by_the_next_build(w) -> None:
    dead = _killed_writer(w / "cache", ".0123456789abcdef.tmp-")
    # another corpus (max_documents) is another cache key: a build runs
    out = cli(w, "data", "cfg.yaml", "data.max_documents=30")
    assert out.returncode == 0, out.stderr
    assert not dead.exists()
    assert _temps(w / "cache") == []


def test_an_export_killed_between_its_two_renames_is_put_back(w) -> None:
    """Killed after moving the old export aside and before moving the new one in: the next
    export into the same folder puts the old one back first (here that export then fails on
    a full disk, and the old export is what remains, byte-identical)."""
    before = _files(w / "exp")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_capture())
    pid = int(gone.stdout)  # a PID that has ended
    os.replace(w / "exp", w / f".exp.tmp-old-{pid}")
    out = cli(w, "export", "run", "--out", "exp", limit=50_000)
    assert "cannot write 'exp' (File too large)" in one_line(out)
    assert _files(w / "exp") == before
    assert _temps(w) == []


def _capture() -> dict:
    return {"env": _env(), "capture_output": True, "text": True, "timeout": 60}
