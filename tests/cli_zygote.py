"""The real CLI, many times, for the price of one interpreter start-up.

Each ``python -m anyorder.cli ...`` spends about 2.5 s of CPU importing torch before it does
anything; a table of a hundred bad inputs spends most of its time there. A :class:`Zygote`
is one interpreter that has imported the CLI's modules (torch with them, no OpenMP region
run yet, so forking is safe) and forks a child per request. The child is what
``python -m anyorder.cli ARGS`` would be: it changes into the request's folder (``sys.path``
starts with the working folder, as under ``-m``), takes the request's environment,
reads stdin from /dev/null, writes its stdout and stderr into the files named, runs the
``anyorder.cli`` module as ``__main__`` and leaves with its exit status. An exception that
escapes is printed as the interpreter would print it (a ``Traceback``), status 1.

Only what the import already fixed differs from a fresh interpreter: environment variables
read at import time by the modules the zygote imported (torch, numpy, anyorder's own). A
request whose environment must reach such a module runs in a fresh interpreter instead
(``tests/test_errors.py`` does that for the rows that set variables of their own).

Run as a script, it serves one request per line of stdin (JSON: ``cwd``, ``args``, ``env``,
``stdout``, ``stderr``) and answers one line (JSON: ``code``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path


class Zygote:
    """One forking interpreter; :meth:`run` is safe to call from one thread at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lock = threading.Lock()

    def run(self, args: list[str], cwd: Path, env: dict[str, str], out: Path, err: Path) -> int:
        request = {"cwd": str(cwd), "args": args, "env": env, "stdout": str(out)}
        request["stderr"] = str(err)
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the CLI zygote died (see the test's captured stderr)")
        return json.loads(line)["code"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _child(request: dict) -> int:
    """In the forked child: become ``python -m anyorder.cli ARGS``; returns the exit status."""
    import runpy
    import traceback

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, mode in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        handle = os.open(path, mode, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.path[0] = os.getcwd()  # as under -m (this script's folder stood there)
    sys.argv = ["anyorder.cli", *request["args"]]
    try:
        runpy.run_module("anyorder.cli", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _serve() -> None:
    import anyorder.cli.main  # noqa: F401  (the CLI's imports, torch included, once)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(request)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
