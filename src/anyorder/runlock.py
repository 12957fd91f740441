"""One writer per run folder: an exclusive ``fcntl`` lock held for a training run's life.

Two ``anyorder train`` processes writing into one ``train.out_dir`` would interleave their
``metrics.jsonl`` rows, prune each other's checkpoints and leave a ``config.yaml`` of one
run beside the weights of the other. The second one is therefore refused with one line
naming the first one's PID.

Design choices:

* ``RUN/.lock`` is locked with ``flock(LOCK_EX | LOCK_NB)``: the kernel drops the lock when
  its holder dies, however it dies (SIGKILL, power loss), so a stale file never blocks a
  resume. The holder writes its PID into the file for the message.
* The file is removed when the run ends. Removing a lock file races with a process that
  opened it just before: that process may lock the removed file. So after locking, the
  path must still name the locked file (same inode); otherwise the lock is taken again.
* Under torchrun only rank 0 takes the lock (the other ranks write nothing into the run
  folder); the trainer broadcasts whether it got it, so every rank stops together.
* A run folder the lock had to create is removed again when the run fails before writing
  anything (bad data, a config mismatch), so a refused run leaves no folder behind.
* ``fcntl`` is POSIX; where it is missing (Windows) the lock is a no-op.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from anyorder.atomic import write_failed
from anyorder.errors import ConfigError

LOCK_FILE = ".lock"
"""The lock file inside a run folder."""
RUN_MARKER = ".anyorder-run"
"""Written first into a run folder that training creates: the folder is a run's, and a later
training may write into it."""
_RUN_SIGNS = (RUN_MARKER, ".anyorder-demo")
"""Files that make a folder a run's (the demo marks its folder before it trains into it)."""


def check_run_folder(path: str | Path, key: str = "train.out_dir") -> None:
    """A run folder must be new, empty, or one anyorder made: a training writes config.yaml,
    metrics.jsonl and summary.json into it, replacing files of those names.

    An empty value (an unset shell variable: ``train.out_dir=$OUT``) and the current folder
    are refused outright. A run from before the marker existed is recognised by its
    checkpoints (``checkpoints/step_*``); a lock file left by a killed run counts as nothing.

    Raises:
        ConfigError: naming ``key``, what the folder holds and the fix.
    """
    if not str(path).strip():
        raise ConfigError(
            f"{key} is empty (an unset shell variable?); name the run folder, e.g. {key}=runs/NAME"
        )
    p = Path(path).expanduser()
    try:
        here = p.resolve() == Path.cwd().resolve()
    except OSError:  # the current folder was removed: nothing of the user's to protect here
        here = False
    if here:
        raise ConfigError(
            f"{_named(key, path)} is the current folder; a run needs a folder of its own "
            f"(new, empty, or an earlier run's), e.g. {key}=runs/NAME"
        )
    if not p.is_dir():
        return  # new (or a file, which check_writable_dir names)
    try:
        names = sorted(e.name for e in os.scandir(p) if e.name != LOCK_FILE)
    except OSError:
        return  # unreadable: the lock or the first write names it
    if not names or any(n in names for n in _RUN_SIGNS) or any(p.glob("checkpoints/step_*")):
        return
    shown = ", ".join(n[:40] for n in names[:4]) + (", ..." if len(names) > 4 else "")
    raise ConfigError(
        f"{_named(key, path)} holds files that are not a run's ({shown}); a run folder must be "
        f"new, empty or one anyorder made: pick another {key}"
    )


def _nearest_existing(path: Path) -> Path:
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            return p
    return Path("/")


def check_writable_dir(path: str | Path, key: str) -> None:
    """A folder that can be created (or exists) at ``path``: not a file, not under a file,
    and its nearest existing parent is a writable folder.

    Raises:
        ConfigError: naming ``key`` (e.g. ``train.out_dir``) and what is wrong.
    """
    p = Path(path).expanduser()
    name = _named(key, path)
    base = _nearest_existing(p)
    if base == p and p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"{name} is not writable; pick a folder you can write")
        return
    if base == p:
        raise ConfigError(f"{name} is a file, not a folder; pick a folder path")
    if not base.is_dir():
        raise ConfigError(f"{name} lies under {str(base)!r}, which is a file; pick a folder path")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{name} cannot be created ({str(base)!r} is not writable); pick a folder you can write"
        )


def _named(key: str, path: str | Path) -> str:
    """``train.out_dir='x'`` for a config key, ``--out 'x'`` for an option."""
    return f"{key} {str(path)!r}" if key.startswith("-") else f"{key}={str(path)!r}"


def make_dirs(path: Path, key: str) -> list[Path]:
    """``mkdir -p path``; returns the folders it created (deepest last).

    Raises:
        ConfigError: the folder cannot be created (``/proc``, a read-only disk...).
    """
    made = [p for p in (path, *path.parents) if not p.exists()][::-1]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        for p in reversed(made):
            with contextlib.suppress(OSError):
                p.rmdir()
        raise ConfigError(
            f"{_named(key, path)} cannot be created ({e.strerror}); pick a folder you can write"
        ) from None
    return made


class RunLock:
    """The exclusive lock on a run folder (see the module notes).

    Args:
        run_dir: the run folder (created if needed).
        key: the config key that named it, for messages.
    """

    def __init__(self, run_dir: str | Path, key: str = "train.out_dir") -> None:
        self.run_dir = Path(run_dir).expanduser()
        self.key = key
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None
        self.made: list[Path] = []

    def holder(self) -> int | None:
        """The PID written by the process that holds (or last held) the lock, if any."""
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def acquire(self) -> RunLock:
        """Take the lock, or raise.

        Raises:
            ConfigError: another process holds it (its PID in the message), or the folder
                cannot be created.
            WriteError: the lock file cannot be written (a full disk); it is removed again.
        """
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            fcntl = None
        self.made = make_dirs(self.run_dir, self.key)
        if fcntl is None:
            return self
        for _ in range(100):  # another process removing the file at the same moment: retry
            try:
                # O_NOFOLLOW: a lock file planted as a symlink must not truncate its target
                flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                self._forget_folders()
                raise ConfigError(
                    f"cannot create the lock file {self.path} ({e.strerror}); pick a folder "
                    "you can write"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                self._forget_folders()
                pid = self.holder()
                who = f"PID {pid}" if pid else "another process"
                raise ConfigError(
                    f"{self.key}={str(self.run_dir)!r} is in use by another training ({who}); "
                    "wait for it to finish, stop it, or pick another train.out_dir"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except OSError:
                same = False
            if same:
                break
            os.close(fd)  # we locked a file that was removed meanwhile: take the new one
        else:
            raise ConfigError(f"cannot lock {self.path}; try again")
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as e:  # a full disk: os.write's error names no file, so name it here
            with contextlib.suppress(OSError):
                self.path.unlink()  # while still locked (see the module notes)
            os.close(fd)
            self._forget_folders()
            raise write_failed(self.path, e, f"another {self.key}") from None
        self.fd = fd
        return self

    def _forget_folders(self) -> None:
        for p in reversed(self.made):
            with contextlib.suppress(OSError):
                p.rmdir()  # only empty folders: never anything a run wrote
        self.made = []

    def release(self, *, remove_made: bool = False) -> None:
        """Drop the lock and remove the lock file; with ``remove_made``, also the folders
        :meth:`acquire` created, when they are empty again."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()  # first, while still locked (see the module notes)
            os.close(self.fd)
            self.fd = None
        if remove_made:
            self._forget_folders()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
