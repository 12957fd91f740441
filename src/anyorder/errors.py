"""User-facing errors.

Every error a user can cause by bad input is an :class:`AnyorderError`: the CLI prints
its message as one line (no traceback) and exits with code 2. The message names the
problem and the fix.
"""

from __future__ import annotations


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
