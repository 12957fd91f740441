"""What a run writes beside its checkpoints: ``metrics.jsonl`` (and TensorBoard), the config,
the summary.

Design choices:

* Rank 0 writes; every row carries the run's seed.
* A row is appended with one ``write``; a process killed mid-row leaves a partial last line,
  which the resumed run drops with the rows after its checkpoint (the file is then replaced
  atomically), so a resumed curve is the uninterrupted one.
* Whole files (config.yaml, summary.json) are written to a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from anyorder.atomic import write_failed, write_text
from anyorder.config import RunConfig, to_dict
from anyorder.errors import WriteError
from anyorder.training.distributed import DistEnv, raise_rank0_error


class MetricsLog:
    """``RUN/metrics.jsonl`` (and TensorBoard when installed), written by rank 0 only.

    Every row carries the run's seed. A row is appended with one ``write``; a process killed
    mid-row leaves a partial last line, which the resumed run drops with the rows after its
    checkpoint (the file is then replaced atomically).
    """

    def __init__(
        self,
        run_dir: Path | None,
        active: bool,
        resume_step: int | None,
        seed: int = 0,
        defer: bool = False,
    ) -> None:
        self.path = run_dir / "metrics.jsonl" if (run_dir and active) else None
        self.seed = seed
        self.tb = None
        self.defer = defer  # under torchrun: keep a write error for agree(), every rank's
        self.error: WriteError | None = None
        if self.path is None:
            return
        if resume_step is not None and self.path.exists():
            # Rows after the checkpoint belong to a run that was cut short: drop them.
            keep = [
                line
                for line in self.path.read_text(errors="replace").splitlines()
                if _step_of_row(line) is not None and _step_of_row(line) <= resume_step
            ]
            write_atomic(self.path, "".join(k + "\n" for k in keep), self._resumable())
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        except ImportError:  # tensorboard is optional
            self.tb = None

    def write(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        row = {"step": row.get("step"), "seed": self.seed, **row}
        line = (json.dumps(row) + "\n").encode()
        try:
            _append(self.path, line)
        except OSError as e:
            error = write_failed(self.path, e, "another train.out_dir", self._resumable())
            if not self.defer:
                raise error from None
            self.error, self.path = error, None  # raised by agree(), on every rank at once
            return
        if self.tb is not None:
            for k, v in row.items():
                if k not in ("step", "seed") and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def agree(self, env: DistEnv) -> None:
        """After a row (every rank calls this where a row is due): rank 0's write error,
        raised on every rank (:func:`~anyorder.training.distributed.raise_rank0_error`)."""
        raise_rank0_error(self.error, env)

    def _resumable(self) -> str:
        from anyorder.checkpoint import latest_checkpoint

        last = latest_checkpoint(self.path.parent) if self.path is not None else None
        if last is None:
            return "; no checkpoint was saved yet"
        return f"; {last} is intact: the same command resumes from it"

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _append(path: Path, data: bytes) -> None:
    """Append ``data`` with unbuffered writes; on a write error (a full disk mid-row) cut the
    partial row off again before raising (a resume drops a partial last row anyway)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _step_of_row(line: str) -> int | None:
    """The step of a metrics row, or None for a blank or partial (killed mid-write) line, or
    a damaged one (its step not a whole number, or JSON nested past the reader's depth)."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        return None
    step = row.get("step", 0) if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``RUN/metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if _step_of_row(line) is not None]


def config_yaml(cfg: RunConfig) -> str:
    """The config as the run folder's ``config.yaml`` holds it."""
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def write_atomic(path: Path, text: str, then: str = "") -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place.

    Raises:
        WriteError: naming ``path`` and the cause (``then`` is said after the fix).
    """
    write_text(path, text, "another train.out_dir", then)
