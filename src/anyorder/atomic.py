"""Writing files and folders so that a failed or killed writer leaves nothing half-written,
and saying in one line why a write failed.

Every writer of the package goes through here: checkpoints, exports and conversions, the
data cache, a run's metrics, config and summary, eval results.

Design choices:

* A file is written under a temporary name beside its place, fsynced and renamed into
  place (:func:`write_text`); a folder is built the same way (:func:`atomic_folder`). A
  failure removes the temporary and any parent folder made for it, so the target is either
  the old one or the new one, whole.
* Temporary names carry their writer's PID (``.NAME.tmp-PID-...``): a writer killed with
  SIGKILL cannot clean up, so the next writer into the same place removes the temporaries
  of dead PIDs (:func:`remove_stale_temps`), and leaves a live writer's alone.
* A write error is one :class:`~anyorder.errors.WriteError` naming the path and the
  system's cause ("No space left on device", "File too large", "Read-only file system"),
  whichever library raised it: torch and safetensors wrap the ``OSError`` in their own
  exceptions (:func:`os_cause`).
* Paths quoted in messages are cut to a preview (:func:`short_path`): a 5,000-character
  argument must not make a 5,000-character error line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from anyorder.errors import AnyorderError, ConfigError, WriteError

DEFAULT_WHERE = "another folder"
_OS_ERROR = re.compile(r"(?:os error|errno)\s*:?\s*(\d+)", re.I)
_TEMP_PID = re.compile(r"\.tmp-(?:del-|old-)?(\d+)(?:-|$)")


def short_path(path: str | os.PathLike[str], limit: int = 100) -> str:
    """``repr`` of a path, cut to about ``limit`` characters (its start and its end), with
    bytes that are not UTF-8 shown as escapes."""
    text = os.fsdecode(path) if not isinstance(path, str) else path
    if len(text) > limit:
        text = f"{text[: limit - 30]}...({len(text)} characters)...{text[-20:]}"
    return repr(text)


def os_cause(e: BaseException) -> str:
    """The system's words for why ``e`` happened ("No space left on device"), also when
    torch or safetensors wrapped the OSError in their own exception."""
    if isinstance(e, OSError) and e.errno is not None:
        return os.strerror(e.errno)
    m = _OS_ERROR.search(str(e))
    if m:
        return os.strerror(int(m.group(1)))
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def is_write_error(e: BaseException) -> bool:
    """Whether ``e`` is an error of the file system (an OSError, or one wrapped by torch's or
    safetensors' writers) rather than a bug."""
    if isinstance(e, OSError):
        return True
    text = str(e)
    return bool(_OS_ERROR.search(text)) or any(
        s in text for s in ("I/O error", "file write failed", "No space left", "File too large")
    )


_NO_ROOM = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _errno(e: BaseException) -> int | None:
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    m = _OS_ERROR.search(str(e))
    return int(m.group(1)) if m else None


def write_failed(
    path: str | os.PathLike[str], e: BaseException, where: str = DEFAULT_WHERE, then: str = ""
) -> WriteError:
    """The one-line error for a failed write of ``path``: the cause, and a fix that fits it.

    Args:
        path: what could not be written.
        e: the exception.
        where: what the user should pick instead ("another --out folder").
        then: said after the fix ("; step_4 is intact ... then resume").
    """
    code = _errno(e)
    if code in _NO_ROOM:
        fix = f"free disk space (or raise the file size limit) or pick {where}"
    elif code == errno.ENAMETOOLONG:
        fix = f"pick {where} with a shorter name"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        fix = f"a file is in the way: pick {where}"
    else:
        fix = f"pick {where} you can write"
    return WriteError(f"cannot write {short_path(path)} ({os_cause(e)}); {fix}{then}")


@contextlib.contextmanager
def write_errors(
    path: str | os.PathLike[str], where: str = DEFAULT_WHERE, then: str = ""
) -> Iterator[None]:
    """Turn a write error inside the block into :func:`write_failed` naming ``path``."""
    try:
        yield
    except AnyorderError:
        raise
    except Exception as e:
        if not is_write_error(e):
            raise
        raise write_failed(path, e, where, then) from None


def check_utf8_path(path: str | os.PathLike[str], key: str) -> None:
    """Refuse a path whose name is not valid UTF-8: it can be written, but configs,
    manifests and the commands that read a run back (resume, sample, export) keep paths as
    UTF-8 text.

    Raises:
        ConfigError: naming ``key`` and the path (its odd bytes as escapes).
    """
    text = os.fsdecode(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"{key}={short_path(text)} is not valid UTF-8; pick a folder name of UTF-8 text"
        ) from None


def os_error_line(e: OSError) -> str:
    """One line for an OSError no check foresaw: the path(s) it names and the cause."""
    paths = [p for p in (e.filename, e.filename2) if p is not None]
    where = " -> ".join(short_path(p) for p in paths) if paths else "a file"
    return f"cannot use {where} ({os_cause(e)}); check the path and its folders"


# ----------------------------------------------------------------------------- temporaries


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (someone else's process counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def remove_stale_temps(parent: Path, pattern: str) -> list[Path]:
    """Remove the temporaries ``parent/pattern`` of this process or of dead ones; returns
    them. A name with a live PID belongs to a writer still at work (names without a PID come
    from older versions and are removed)."""
    removed = []
    with contextlib.suppress(OSError):
        for p in parent.glob(pattern):
            m = _TEMP_PID.search(p.name)
            pid = int(m.group(1)) if m else None
            if pid is None or pid == os.getpid() or not pid_alive(pid):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()
                removed.append(p)
    return removed


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A new folder ``parent/PREFIX<pid>-<random>`` with the mode a plain ``mkdir`` gives.

    (Not ``tempfile.mkdtemp``: its 0700 would survive the rename into place and hide a
    checkpoint or an export from everyone but its owner.)
    """
    for _ in range(100):
        path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, f"could not create a temporary folder in {parent}")


def apply_umask(folder: Path) -> None:
    """Give the files and folders under ``folder`` the modes the umask gives new ones.

    Some writers make private files (safetensors writes weights 0600); a checkpoint or an
    export is for reading like any file the user makes.
    """
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def fsync_dir(path: Path) -> None:
    """fsync a folder (its entries), where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def missing_folders(path: Path) -> list[Path]:
    """The folders ``mkdir -p path`` would create, outermost first."""
    made = []
    for p in (path, *path.parents):
        try:
            if p.exists() or p.is_symlink():
                break
        except OSError:  # a name too long: mkdir will say so
            break
        made.append(p)
    return made[::-1]


def remove_folders(folders: list[Path]) -> None:
    """Remove the (empty) ``folders``, innermost first; a folder that is not empty stays."""
    for p in reversed(folders):
        with contextlib.suppress(OSError):
            p.rmdir()


# ----------------------------------------------------------------------------- writers


def write_text(path: Path, text: str, where: str = DEFAULT_WHERE, then: str = "") -> None:
    """Write ``text`` to ``path`` through a fsynced temporary beside it and a rename.

    Raises:
        WriteError: naming ``path`` and the cause; neither the temporary nor a folder made
            for it is left, and an earlier ``path`` is untouched.
    """
    path = Path(path)
    made = missing_folders(path.parent)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with write_errors(path, where, then):
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(path.parent, f".{path.name}.tmp-*")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        remove_folders(made)
        raise


@contextlib.contextmanager
def atomic_folder(final: Path, where: str = DEFAULT_WHERE) -> Iterator[Path]:
    """Build a folder under a temporary name beside ``final``; on success rename it into
    place (an existing ``final`` is replaced), on any failure remove it.

    Yields:
        The temporary folder to write into.

    Raises:
        WriteError: a write error inside the block or while moving into place, naming
            ``final`` and the cause; nothing is left behind and an earlier ``final`` is
            intact.
    """
    final = Path(final)
    parent = final.parent
    made = missing_folders(parent)
    tmp = None
    try:
        with write_errors(final, where):
            parent.mkdir(parents=True, exist_ok=True)
            _restore_or_remove_stale(final)
            tmp = make_temp_dir(parent, f".{final.name}.tmp-")
        with write_errors(final, where):
            yield tmp
            apply_umask(tmp)
            fsync_dir(tmp)
            _move_into_place(tmp, final)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_folders(made)
        raise


def _restore_or_remove_stale(final: Path) -> None:
    """Remove dead writers' temporaries of ``final``. A writer killed between moving the
    old folder aside and the new one into place leaves no ``final``: put the old one back."""
    for old in final.parent.glob(f".{final.name}.tmp-old-*"):
        m = _TEMP_PID.search(old.name)
        if m and not pid_alive(int(m.group(1))) and not final.exists():
            with contextlib.suppress(OSError):
                os.replace(old, final)
    remove_stale_temps(final.parent, f".{final.name}.tmp-*")


def _move_into_place(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.tmp-old-{os.getpid()}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
