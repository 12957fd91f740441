"""User-facing errors.

Every error a user can cause by bad input is an :class:`AnyorderError`: the CLI prints
its message as one line (no traceback) and exits with code 2. The message names the
problem and the fix.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable
from typing import TextIO

_ESCAPED = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160)) if c != 9} | {
    10: "\\n", 13: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029",
}  # fmt: skip
"""Control characters (C0 but the tab, DEL, C1) and the Unicode line and paragraph
separators, as ``print_line`` writes them: escaped."""


def print_line(text: str, stream: TextIO | None = None) -> None:
    """``text`` and its newline to ``stream`` (stderr) in one write, flushed: the lines of
    processes that share the stream (torchrun's ranks) never run into each other (``print``
    writes the newline apart, and another rank's line came in between). Control characters
    in ``text`` (a newline or a terminal escape in a file name it quotes) are written
    escaped (``\\n``, ``\\x1b``): one line, and nothing for the terminal to act on."""
    out = sys.stderr if stream is None else stream
    out.write(text.translate(_ESCAPED) + "\n")
    out.flush()


def did_you_mean(word: str, options: Iterable[str]) -> str | None:
    """The option closest to ``word`` (a typo's likely fix), or None when none is close
    (difflib's similarity ratio below 0.6)."""
    found = difflib.get_close_matches(word, [str(o) for o in options], n=1, cutoff=0.6)
    return found[0] if found else None


class AnyorderError(Exception):
    """A bad input: printed as one line by the CLI, exit code 2."""

    exit_code = 2


class ConfigError(AnyorderError):
    """Unknown, ill-typed or inconsistent configuration."""


class DataError(AnyorderError):
    """A data source, tokenizer or token shard that cannot be used."""


class CheckpointError(AnyorderError):
    """A missing, corrupt or mismatched checkpoint."""


class WriteError(AnyorderError):
    """A file or folder that cannot be written: a full disk, a file size limit, a read-only
    or unwritable folder, a file where a folder should be, a name too long."""


class SamplingError(AnyorderError):
    """Bad sampling or infilling arguments."""


class TrainingError(AnyorderError):
    """A run that cannot go on (a NaN/Inf loss): exit code 3, after saving the last good state.

    Not a bad input as such, so it has its own exit code; the message names the step and the
    fix all the same.
    """

    exit_code = 3


PREVIEW_CHARS = 60
"""At most this many characters of a user's value are quoted in an error message."""


def preview(value: object, limit: int = PREVIEW_CHARS) -> str:
    """``repr(value)`` cut to a short preview, for quoting a user's value in an error.

    A value from a config can be huge once YAML aliases are expanded (a few hundred bytes of
    nested ``*alias`` lists reach gigabytes), nested thousands of levels deep, or even hold
    itself; :mod:`reprlib` walks only the first few items of the first few levels, so the
    cost and the length stay small whatever the value. Short values read as ``repr`` does.
    """
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 4, 4, 4, 4
    r.maxstring = r.maxother = r.maxlong = limit
    try:
        text = r.repr(value)
    except Exception:  # a repr that fails must not replace the message it is part of
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
