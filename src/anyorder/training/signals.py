"""SIGINT and SIGTERM: save and stop after the current step, on every rank at once.

Design choices:

* The handlers only record the signal (printing from a handler can re-enter a write); the
  loop checks between steps, and the ranks agree (an all-reduce of the flag), so every rank
  saves the same step.
* A second signal stops at once (KeyboardInterrupt).
* Handlers are installed only in the main thread, and the previous ones are restored.
"""

from __future__ import annotations

import signal
from typing import Any

import torch
import torch.distributed as dist

from anyorder.training.distributed import DistEnv


class StopSignals:
    """SIGINT and SIGTERM ask the loop to save and stop after the current step.

    The handlers only record the signal (printing from a handler can re-enter a write);
    the loop checks between steps. A second signal stops at once (KeyboardInterrupt).
    Handlers are installed only in the main thread, and the previous ones are restored.
    """

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.received: list[int] = []
        self.name: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received.append(signum)

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def agreed(self, env: DistEnv) -> bool:
        """Whether any rank got a signal (every rank must call, every step)."""
        flag = self.received[0] if self.received else 0
        if env.distributed:
            t = torch.tensor([flag], dtype=torch.long, device=env.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        if flag:
            self.name = signal.Signals(flag).name
        return bool(flag)
