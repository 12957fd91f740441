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
  a connection still sending holds none. Waiting connections are capped per client
  address (:attr:`Limits.max_waiting_per_client`) and in all (:attr:`Limits.max_waiting`).
  Room is made at the expense of whoever holds the most: a newcomer beyond its address's
  share drops that address's longest-waiting connection, and when all places are taken the
  longest-waiting connection of the address with the most goes. So a client that floods
  the server with silent connections only ever drops its own, and a prompt client on
  another address loses nothing.
* A connection is dropped as slow, or refused as late, only once what it sent is read:
  whatever the kernel holds for it is read first, and if that makes the request whole it
  is answered (a request sent whole in one write is never refused as late, however many
  connections arrive with it). The reader takes at most :data:`TAKEN_PER_ROUND` queued
  newcomers between two reads of those it holds, so a flood cannot stretch its rounds.
* Accepted sockets wait for the reader in a queue of at most :data:`MAX_QUEUED`, of which
  one address may hold :data:`MAX_QUEUED_PER_CLIENT`; beyond either, a newcomer is closed
  at once (a flood fills its own share, not the queue).
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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from anyorder.serve.generation import Limits

LINGER_S = 1.0
"""How long an answered connection is drained before it is closed."""
MAX_QUEUED = 256
"""Accepted connections the reader has not yet taken; more are closed at once."""
MAX_QUEUED_PER_CLIENT = MAX_QUEUED // 2
TAKEN_PER_ROUND = 32
"""Queued connections the reader takes between two reads of those it holds: under a flood
its rounds stay short, so a request that has arrived is read long before its deadline."""
"""Of those, how many one client address may hold; more of its own are closed at once."""
_HEAD_END = re.compile(rb"\r?\n\r?\n")


def peer_of(addr: Any) -> str:
    """The client's address without its port: what per-client limits count by."""
    return str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)


@dataclass
class _Conn:
    sock: socket.socket
    addr: Any
    deadline: float
    since: float = field(default_factory=time.monotonic)
    """When the reader took it (a dropped request is told how long it waited)."""
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
        name = name.lower()  # "Content-Length : 5" is no header to http.server either
        if name == b"content-length":
            lengths.append(value.strip(b" \t\r"))  # as guard.content_length reads it
        elif name == b"transfer-encoding":
            chunked = True
    if chunked or len(lengths) != 1 or not re.fullmatch(rb"[0-9]+", lengths[0]):
        return head_len
    digits = lengths[0].lstrip(b"0") or b"0"  # zeros in front count for nothing, as in
    if len(digits) > 10:  # guard.content_length; a longer length: the handler's 413
        return head_len
    return head_len + int(digits)


class Intake:
    """The reader thread: takes accepted sockets (:meth:`add`), hands whole requests to
    ``dispatch(sock, addr, data)`` (False: no worker free, the client gets 503), answers
    and drains everything else itself."""

    def __init__(
        self, limits: Limits, dispatch: Callable[[socket.socket, Any, bytes], bool]
    ) -> None:
        self.limits, self.dispatch = limits, dispatch
        self._new: queue.Queue[tuple[socket.socket, Any, bool]] = queue.Queue()
        self._queued: dict[str, int] = {}  # per client address, guarded by _queued_lock
        self._queued_lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}
        self._backlog = False  # newcomers left in the queue for the next round
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="serve-intake", daemon=True)
        self._thread.start()

    # -- called from other threads: never blocks
    def add(self, sock: socket.socket, addr: Any, *, linger: bool = False) -> None:
        """Take an accepted connection (``linger``: one already answered, to drain)."""
        peer = peer_of(addr)
        with self._queued_lock:
            full = self._new.qsize() >= MAX_QUEUED
            if not (self._stop or full or self._queued.get(peer, 0) >= MAX_QUEUED_PER_CLIENT):
                self._queued[peer] = self._queued.get(peer, 0) + 1
                self._new.put((sock, addr, linger))
                full = None
        if full is not None:  # refused: closed at once
            with contextlib.suppress(OSError):
                sock.close()
            return
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
        wait = 0.0 if self._backlog else min(max(soonest - now, 0.0), 1.0)
        ready = self._sel.select(wait)
        for key, _ in ready:  # what has arrived first, then the newcomers
            if (c := self._conns.get(key.fileobj)) is not None:  # not dropped meanwhile
                self._read(c)
        if self._backlog or any(key.fileobj is self._wake_r for key, _ in ready):
            self._take_new()
        self._expire()

    def _take_new(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        self._backlog = True
        for _ in range(TAKEN_PER_ROUND):
            try:
                sock, addr, linger = self._new.get_nowait()
            except queue.Empty:
                self._backlog = False
                return
            with self._queued_lock:
                peer = peer_of(addr)
                if self._queued.get(peer, 0) <= 1:
                    self._queued.pop(peer, None)
                else:
                    self._queued[peer] -= 1
            now = time.monotonic()
            c = _Conn(sock, addr, now + (LINGER_S if linger else self.limits.request_timeout_s))
            c.closing = linger
            self._make_room(peer, closing=linger)
            try:
                sock.setblocking(False)
                self._sel.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):  # closed already: nothing to read or answer
                self._drop(c)
                continue
            self._conns[sock] = c

    def _make_room(self, peer: str, *, closing: bool) -> None:
        """Room for one more connection of ``peer`` among those of its kind (waiting, or
        answered and ``closing``): at most ``max_waiting_per_client`` of one address and
        ``max_waiting`` in all. The one that goes is the longest waiting of ``peer`` when it
        is over its share, else of the address holding the most. A waiting one is read
        first: a request found whole is answered, not dropped; a partial one gets 408."""
        cap, share = self.limits.max_waiting, self.limits.max_waiting_per_client
        while True:
            kind = [c for c in self._conns.values() if c.closing == closing]
            counts = Counter(peer_of(c.addr) for c in kind)
            if counts[peer] >= share:
                why = f"{share} connections from this address were waiting, the most one may have"
                pool = [c for c in kind if peer_of(c.addr) == peer]
            elif len(kind) >= cap:
                # the most; of equals, the newcomer's, else the one that has waited longest
                top = max(counts, key=lambda p: (counts[p], p == peer))
                why = f"{cap} connections were waiting, the most this server keeps, and this "
                why += "address had the most of them"
                pool = [c for c in kind if peer_of(c.addr) == top]
            else:
                return
            oldest = min(pool, key=lambda c: c.deadline)
            if closing:
                self._drop(oldest)
                continue
            self._read(oldest)  # what has arrived: whole, it is answered rather than dropped
            if self._conns.get(oldest.sock) is oldest and not oldest.closing:
                self._refuse(oldest, 408, "Request Timeout", self._dropped_message(oldest, why))

    def _dropped_message(self, c: _Conn, why: str) -> str:
        waited = time.monotonic() - c.since
        return (
            f"the request was not whole after {waited:.1f} s and is dropped ({why}); "
            "send the headers and body at once"
        )

    def _late_message(self) -> str:
        return (
            f"the request was not sent whole within {self.limits.request_timeout_s:g} s "
            "and is dropped (it took too long); send the headers and body at once"
        )

    def _read(self, c: _Conn) -> None:
        """Read what the kernel holds for ``c``: one read for an answered connection; for a
        waiting one, until nothing is left or the request is whole or refused (bounded: the
        header and body limits end it)."""
        while True:
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
            self._take(c, data)
            if self._conns.get(c.sock) is not c or c.closing:  # whole, refused or gone
                return

    def _take(self, c: _Conn, data: bytes) -> None:
        """The bytes ``data`` of a waiting connection (``b""``: the client closed)."""
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
        self._make_room(peer_of(c.addr), closing=True)

    def _expire(self) -> None:
        now = time.monotonic()
        for c in [c for c in self._conns.values() if c.deadline <= now]:
            if c.closing:
                self._drop(c)
                continue
            self._read(c)  # what has arrived: whole, it is answered rather than refused
            if self._conns.get(c.sock) is c and not c.closing:
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


def internal_error(e: Exception) -> str:
    """Print the traceback of an exception that is a bug (not the user's) to stderr; the
    message the client gets."""
    traceback.print_exc(file=sys.stderr)
    return f"internal error: {type(e).__name__}: {e}"
