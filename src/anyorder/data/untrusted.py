"""Refusing code from downloaded folders: a tokenizer or model folder is untrusted input.

``transformers`` imports Python from a folder when its ``tokenizer_config.json`` or
``config.json`` has an ``auto_map`` (with ``trust_remote_code`` unset it asks on stdin first,
"Do you wish to run the custom code? [y/N]", in the middle of a command). anyorder never runs
a model folder's code, nor asks.

Design choices:

* Every ``from_pretrained`` anyorder calls passes ``trust_remote_code=False``; this module
  refuses, in one line naming the file and the key, what would need code, before
  ``transformers`` reads the folder: an ``auto_map``, or a ``tokenizer_class`` that is not a
  tokenizer class ``transformers`` itself ships. A refusal beats the silent fallback to a
  generic class that ``trust_remote_code=False`` gives, which may tokenize differently.
* A file among those that cannot be read as JSON is refused too (fail closed): the check must
  not skip what ``transformers`` might still read.
* Every file read from such a folder is a regular file of bounded size, opened once: a named
  pipe would block the read forever and a link to ``/dev/zero`` would fill the memory.
  :func:`open_regular` asks ``stat`` first (a device is never opened), opens without blocking
  and checks the open file again; :func:`refuse_special_files` does the ``stat`` part for the
  files ``transformers`` reads itself.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from anyorder.data.files import kind_of
from anyorder.data.sources import _first_line
from anyorder.errors import AnyorderError, DataError

MAX_FOLDER_FILE_BYTES = 256 << 20
"""At most this many bytes in a tokenizer or config file of a model folder (the largest
tokenizer.json of a released model is a few tens of MB)."""

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "config.json",
    "anyorder_tokenizer.json",
)
"""The files of a folder that loading its tokenizer may read."""


def _not_regular(path: Path, mode: int) -> str:
    return f"{path} is {kind_of(mode)}, not a file; replace it with the file itself"


def open_regular(path: Path, error: type[AnyorderError] = DataError) -> BinaryIO | None:
    """``path`` opened for reading, or None when nothing is there (a dangling link included).

    Anything but a regular file is refused without reading it: ``stat`` is asked first (a
    device is never opened), the open does not block (a named pipe put there since), and the
    open file is asked again, so what is read is what was checked.

    Raises:
        error: one line naming the path and what it is.
    """
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise error(_not_regular(path, mode))
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise error(
            f"{path} cannot be opened ({_first_line(e)}); check the file and its permissions"
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(_not_regular(path, mode))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_regular(
    path: Path, limit: int = MAX_FOLDER_FILE_BYTES, error: type[AnyorderError] = DataError
) -> bytes | None:
    """The bytes of the regular file ``path`` (:func:`open_regular`), at most ``limit`` of
    them; None when there is no such file.

    Raises:
        error: not a regular file, or larger than ``limit``.
    """
    f = open_regular(path, error)
    if f is None:
        return None
    with f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(
            f"{path} is larger than {limit} bytes, more than such a file holds; "
            "replace it with the right file"
        )
    return data


def parse_json(data: bytes, path: Path, fix: str, error: type[AnyorderError] = DataError) -> Any:
    """``data`` (the bytes of ``path``) as JSON; one line (``fix`` its remedy) when it is not.

    Raises:
        error: not UTF-8, not JSON, or nested too deeply for the parser.
    """
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else _first_line(e)[:120]
        raise error(f"{path} is unreadable ({why}); {fix}") from None


def plain_name(name: str) -> bool:
    """Whether ``name`` (a file name a folder's index gives) stays inside the folder as
    written: relative, without ``..``, without NUL."""
    return (
        bool(name)
        and "\0" not in name
        and not name.startswith("/")
        and ".." not in (name.split("/"))
    )


def refuse_links_out(folder: Path, path: Path, fix: str, error: type[AnyorderError]) -> None:
    """Refuse a file of ``folder`` that leads outside it through links.

    The hub's cache keeps a snapshot (``models--ORG--NAME/snapshots/REV/``) as links to
    ``../../blobs/HASH``: those lead into the blobs of the snapshot's own repository, and are
    read. Any other link out of the folder (to another model's weights, a user's files) would
    put what the folder does not hold into an export that may be published.

    Raises:
        error: naming the file, where it leads and ``fix``.
    """
    try:
        real, root = path.resolve(), folder.resolve()
    except (OSError, RuntimeError) as e:  # a loop of links
        raise error(f"{path} cannot be followed ({_first_line(e)}); {fix}") from None
    if real.is_relative_to(root):
        return
    snapshot = folder.absolute()
    if (
        snapshot.parent.name == "snapshots"
        and real.parent == (snapshot.parent.parent / "blobs").resolve()
    ):
        return
    raise error(
        f"{path} links to {str(real)[:200]!r}, outside {str(folder)!r}; a model folder's "
        "weights lie inside it (or in the hub cache's blobs/ for a snapshot): copy the file "
        "into the folder"
    )


def refuse_special_files(
    folder: str | Path,
    names: tuple[str, ...] = TOKENIZER_FILES,
    error: type[AnyorderError] = DataError,
    limit: int = MAX_FOLDER_FILE_BYTES,
) -> None:
    """Refuse a folder where one of ``names`` is there but is no regular file of at most
    ``limit`` bytes: another library reads it, and would block on a named pipe or fill the
    memory from ``/dev/zero``. Only ``stat`` is asked.

    Raises:
        error: one line naming the file and what it is.
    """
    for name in names:
        path = Path(folder) / name
        try:
            st = path.stat()
        except OSError:
            continue  # not there (or not reachable): the reader says so if it needs it
        if not stat.S_ISREG(st.st_mode):
            raise error(_not_regular(path, st.st_mode))
        if st.st_size > limit:
            raise error(
                f"{path} is {st.st_size} bytes, more than the {limit} such a file holds; "
                "replace it with the right file"
            )


_CODE_FILES = ("tokenizer_config.json", "config.json")
"""The files whose keys make ``transformers`` import Python from the folder."""


def _shipped_tokenizer_class(name: Any) -> bool:
    """Whether ``name`` is a tokenizer class that ``transformers`` itself ships."""
    if not isinstance(name, str):
        return False
    try:
        import transformers
    except ImportError:  # nothing can load it then; the loader says so
        return True
    try:
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        cls = tokenizer_class_from_name(name)
    except Exception:
        cls = getattr(transformers, name, None) if name.isidentifier() else None
    base = getattr(transformers, "PreTrainedTokenizerBase", None)
    return (
        isinstance(cls, type)
        and (base is None or issubclass(cls, base))
        and cls.__module__.startswith("transformers.")
    )


def refuse_custom_code(folder: str | Path) -> None:
    """Refuse a folder whose ``tokenizer_config.json`` or ``config.json`` asks ``transformers``
    to run Python code of its own: an ``auto_map``, or a ``tokenizer_class`` that is not one of
    transformers' classes. A model folder from the hub is untrusted input; anyorder never runs
    code from it. A file that cannot be read as JSON is refused too (fail closed).

    The files a tokenizer load may read must be regular files of bounded size
    (:func:`refuse_special_files`).

    Raises:
        DataError: one line naming the file and the key.
    """
    refuse_special_files(folder)
    for name in _CODE_FILES:
        path = Path(folder) / name
        raw = read_regular(path)
        if raw is None:
            continue
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise DataError(
                f"{path} is not readable JSON ({_first_line(e)[:120]}); fix or remove it"
            ) from None
        if not isinstance(data, dict):
            continue
        if "auto_map" in data:
            entry = json.dumps(data["auto_map"])[:120]
            raise DataError(
                f"{path} has an auto_map ({entry}), which asks to run "
                "the folder's own Python code, and anyorder never runs a model folder's code; "
                "use one that needs none (without auto_map)"
            )
        cls = data.get("tokenizer_class")
        if cls is not None and not _shipped_tokenizer_class(cls):
            raise DataError(
                f"{path} names tokenizer_class {str(cls)[:80]!r}, which "
                "is not a class transformers ships, and anyorder never runs a model folder's "
                "code: set it to one of transformers' tokenizers (e.g. PreTrainedTokenizerFast)"
            )


def hub_code_refusal(spec: str) -> DataError:
    """The error for a hub id whose tokenizer asks for code of its own."""
    return DataError(
        f"tokenizer {spec!r} asks to run Python code from the hub (an auto_map), and anyorder "
        "never runs a model's code; pick a tokenizer transformers ships"
    )


def asks_for_code(e: BaseException) -> bool:
    """Whether ``transformers`` refused to load something because it needs remote code."""
    return isinstance(e, ValueError) and "trust_remote_code" in str(e)


def refuse_loaded_auto_map(tok: Any, spec: str) -> None:
    """A hub tokenizer was loaded with remote code refused; refuse it too if it asked for some
    (transformers then falls back to one of its classes, which may not tokenize the same)."""
    if (getattr(tok, "init_kwargs", None) or {}).get("auto_map"):
        raise hub_code_refusal(spec)
