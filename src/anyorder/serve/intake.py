"""Connections of ``anyorder serve`` outside the handler: one thread reads every request
until it is whole; answers are written before one deadline.

Design choices:

* The accepting thread only hands a new socket over (a queue and a wake-up byte), so no
  client can stall it: nothing it does waits on a client.
* One reader thread (a :mod:`selectors` loop) reads every connection that has not yet sent
  a whole request, without blocking. A request has one deadline for its headers and body
  together (:attr:`Limits.request_timeout_s`), however slowly its bytes drip in; past it
  the client gets 408 and is closed.
* Only a whole request takes a worker thread (:attr:`Limits.max_connections`, 503 beyond);
  a connection still sending holds none. Waiting connections are capped as well
  (:attr:`Limits.max_waiting`): when they are all taken, the one that has waited longest
  is dropped (408) for the newcomer, so slow clients hold nothing a prompt client needs.
* The reader frames a request by its Content-Length only; what is wrong with it (a
  duplicate or malformed length, chunked encoding, a body over the limit) is left to the
  handler, which answers it whole, as it does every other refusal.
* Answers sent from here (408, 431, 400, 503) are a few hundred bytes, sent without
  blocking; the connection is then half-closed and drained for at most
  :data:`LINGER_S` in the same loop, so that closing it does not reset the connection
  before the client has read its answer.
* An answer's writes share one deadline (:class:`DeadlineWriter`): a client that reads
  slowly or not at all is cut off instead of holding its thread.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import selectors
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from anyorder.serve.generation import Limits

LINGER_S = 1.0
"""How long an answered connection is drained before it is closed."""
MAX_QUEUED = 256
"""Accepted connections the reader has not yet taken; more are closed at once."""
_HEAD_END = re.compile(rb"\r?\n\r?\n")


@dataclass
class _Conn:
    sock: socket.socket
    addr: Any
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    need: int | None = None
    """Bytes of the whole request, once its headers are in."""
    closing: bool = False
    """Answered: read and dropped until the client closes or the deadline."""


def answer(status: int, reason: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.0 answer with a JSON ``{"error": message}`` body that closes."""
    body = json.dumps({"error": message}).encode()
    return (
        f"HTTP/1.0 {status} {reason}\r\nServer: anyorder-serve\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\nCache-Control: no-store\r\n{extra}"
        "Connection: close\r\n\r\n"
    ).encode() + body


def request_size(head: bytes, head_len: int) -> int:
    """Bytes of the whole request whose header block is ``head`` (``head_len`` bytes with
    its blank line): the headers alone when the body cannot be framed by one plain
    Content-Length (the handler refuses those with the reason)."""
    lengths, chunked = [], False
    for line in head.split(b"\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            lengths.append(value.strip())
        elif name == b"transfer-encoding":
            chunked = True
    if chunked or len(lengths) != 1 or not re.fullmatch(rb"[0-9]{1,10}", lengths[0]):
        return head_len
    return head_len + int(lengths[0])


class Intake:
    """The reader thread: takes accepted sockets (:meth:`add`), hands whole requests to
    ``dispatch(sock, addr, data)`` (False: no worker free, the client gets 503), answers
    and drains everything else itself."""

    def __init__(
        self, limits: Limits, dispatch: Callable[[socket.socket, Any, bytes], bool]
    ) -> None:
        self.limits, self.dispatch = limits, dispatch
        self._new: queue.Queue[tuple[socket.socket, Any, bool]] = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="serve-intake", daemon=True)
        self._thread.start()

    # -- called from other threads: never blocks
    def add(self, sock: socket.socket, addr: Any, *, linger: bool = False) -> None:
        """Take an accepted connection (``linger``: one already answered, to drain)."""
        if self._stop or self._new.qsize() >= MAX_QUEUED:
            with contextlib.suppress(OSError):
                sock.close()
            return
        self._new.put((sock, addr, linger))
        with contextlib.suppress(OSError):  # a full wake-up pipe already wakes the loop
            self._wake_w.send(b"x")

    def close(self) -> None:
        """Stop the thread and close every connection it holds."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)

    # -- the reader thread
    def _run(self) -> None:
        try:
            while not self._stop:
                try:
                    self._round()
                except Exception:  # a bug here must not stop every client being read
                    traceback.print_exc(file=sys.stderr)
        finally:
            for c in list(self._conns.values()):
                self._drop(c)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _round(self) -> None:
        now = time.monotonic()
        soonest = min((c.deadline for c in self._conns.values()), default=now + 1)
        for key, _ in self._sel.select(min(max(soonest - now, 0.0), 1.0)):
            if key.fileobj is self._wake_r:
                self._take_new()
            elif (c := self._conns.get(key.fileobj)) is not None:  # not dropped meanwhile
                self._read(c)
        self._expire()

    def _take_new(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                sock, addr, linger = self._new.get_nowait()
            except queue.Empty:
                return
            now = time.monotonic()
            c = _Conn(sock, addr, now + (LINGER_S if linger else self.limits.request_timeout_s))
            c.closing = linger
            self._make_room(closing=linger)
            try:
                sock.setblocking(False)
                self._sel.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):  # closed already: nothing to read or answer
                self._drop(c)
                continue
            self._conns[sock] = c

    def _make_room(self, *, closing: bool) -> None:
        """Keep at most ``max_waiting`` connections of each kind: the one waiting longest
        goes (a waiting request gets 408 first)."""
        mine = [c for c in self._conns.values() if c.closing == closing]
        while mine and len(mine) >= self.limits.max_waiting:
            oldest = min(mine, key=lambda c: c.deadline)
            mine.remove(oldest)
            if closing:
                self._drop(oldest)
            else:
                self._refuse(oldest, 408, "Request Timeout", self._late_message(dropped=True))

    def _late_message(self, *, dropped: bool = False) -> str:
        why = "other clients were waiting" if dropped else "it took too long"
        return (
            f"the request was not sent whole within {self.limits.request_timeout_s:g} s "
            f"and is dropped ({why}); send the headers and body at once"
        )

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if c.closing:
            if not data:
                self._drop(c)
            return
        if not data:  # the client stopped sending before its request was whole
            if c.buf.strip():
                self._refuse(c, 400, "Bad Request", "the request ended before it was whole; "
                             "send the whole request before closing")  # fmt: skip
            else:
                self._drop(c)
            return
        c.buf += data
        if c.need is None and c.buf[:1] in (b"\r", b"\n"):  # empty lines before a request
            del c.buf[: len(c.buf) - len(c.buf.lstrip(b"\r\n"))]  # are skipped (RFC 9112)
        if c.need is None:  # look for the blank line in the new bytes only: linear
            m = _HEAD_END.search(c.buf, max(0, len(c.buf) - len(data) - 3))
            if (m is None and len(c.buf) > self.limits.max_header_bytes) or (
                m is not None and m.start() > self.limits.max_header_bytes
            ):
                n = self.limits.max_header_bytes
                message = f"the request's headers are over {n} bytes; send shorter ones"
                return self._refuse(c, 431, "Request Header Fields Too Large", message)
            if m is None:
                return
            c.need = request_size(bytes(c.buf[: m.start()]), m.end())
            if c.need - m.end() > self.limits.max_body_bytes:
                c.need = m.end()  # the handler answers 413 without waiting for the body
        if len(c.buf) >= c.need:
            self._sel.unregister(c.sock)
            del self._conns[c.sock]
            if not self.dispatch(c.sock, c.addr, bytes(c.buf[: c.need])):
                self._conns[c.sock] = c
                self._sel.register(c.sock, selectors.EVENT_READ)
                n = self.limits.max_connections
                self._refuse(c, 503, "Service Unavailable",
                             f"busy: this server answers {n} request(s) at once; retry",
                             "Retry-After: 1\r\n")  # fmt: skip

    def _refuse(self, c: _Conn, status: int, reason: str, message: str, extra: str = "") -> None:
        """Send a short answer without blocking, half-close, and drain until the client
        closes or :data:`LINGER_S` has passed."""
        try:
            c.sock.send(answer(status, reason, message, extra))
            c.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return self._drop(c)
        c.closing, c.deadline, c.buf = True, time.monotonic() + LINGER_S, bytearray()
        self._make_room(closing=True)

    def _expire(self) -> None:
        now = time.monotonic()
        for c in [c for c in self._conns.values() if c.deadline <= now]:
            if c.closing:
                self._drop(c)
            else:
                self._refuse(c, 408, "Request Timeout", self._late_message())

    def _drop(self, c: _Conn) -> None:
        if self._conns.pop(c.sock, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.close()


class DeadlineWriter:
    """A socket's writes, all before one deadline: a client that reads slowly, or not at
    all, is cut off (``TimeoutError``) instead of holding its thread."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the client did not read the answer in time")
            self.sock.settimeout(left)
            view = view[self.sock.send(view) :]
        return len(data)

    def flush(self) -> None:
        pass


def log_line(client: Any, what: str) -> None:
    """One line on stderr about one client (no traceback: the client's doing, not a bug)."""
    host, port = client[:2] if isinstance(client, tuple) else (client, "")
    print(f"anyorder serve: {host}:{port}: {what}", file=sys.stderr, flush=True)
