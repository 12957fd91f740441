"""The HTTP side of ``anyorder serve``: a standard-library threaded server, the page's
static files, ``GET /api/info`` and ``POST /api/generate`` as server-sent events.

Design choices:

* Standard library only (:mod:`http.server`'s handler): no new dependency, and page loads
  are answered while a generation runs.
* A request reaches a thread only when it is whole: :mod:`anyorder.serve.intake` reads
  every connection until then in one thread, with one deadline per request, so slow or
  silent clients hold no thread and the accepting thread never waits on a client. The
  handler parses the request from memory and writes its answer before one deadline.
* The response headers are sent at the sampler's first pass, so an
  :class:`~anyorder.errors.AnyorderError` raised before it becomes a 400 with its one-line
  message; errors after it arrive as an ``error`` event. Unexpected exceptions become a 500
  or an ``error`` event; the server keeps going.
* Bounded (:class:`~anyorder.serve.generation.Limits`): request time (408), header size
  (431), body size (413), one generation at a time (429 with ``Retry-After`` while busy),
  requests answered at once (503), the time an answer may take to be read. One request per
  connection (HTTP/1.0 style: a pipelined second request is not read). A client that goes
  away stops its generation at the next pass (the write fails) and is logged in one line.
* Raw requests are checked (Host, Origin, Content-Type, -Encoding and -Length, UTF-8, JSON
  depth) by the pure functions of :mod:`anyorder.serve.guard` before the model sees them.
* Binds ``127.0.0.1`` by default (IPv6 ``::1`` works too): the page is for this machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import socketserver
import sys
import threading
import time
import traceback
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyorder.serve.guard as serve_guard
from anyorder.data.chat_template import render_deadline
from anyorder.errors import AnyorderError, CheckpointError, SamplingError
from anyorder.serve.generation import (
    MODES,
    MODES_OF_KIND,
    SPECULATIVE_KINDS,
    GenRequest,
    LimitError,
    Limits,
    Plan,
    parse_request,
    plan_request,
    run_generation,
)
from anyorder.serve.guard import cut
from anyorder.serve.intake import DeadlineWriter, Intake, internal_error, log_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from anyorder.checkpoint import Loaded

DEFAULT_CHECKPOINT = "runs/demo"
"""What ``anyorder serve`` loads without an argument: the main job's model."""
STATIC = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}


class App:
    """A loaded model, its limits and the lock that keeps generations bounded."""

    def __init__(
        self,
        loaded: Loaded,
        limits: Limits = Limits(),  # noqa: B008 (frozen: immutable)
        *,
        autocast: bool = False,
    ):
        if loaded.tokenizer is None:
            raise CheckpointError(
                f"{loaded.path} holds no tokenizer; export the model with its tokenizer to serve it"
            )
        self.loaded, self.limits, self.autocast = loaded, limits, autocast
        self.slots = threading.BoundedSemaphore(limits.max_concurrent)

    def info(self) -> dict[str, Any]:
        """What the page shows and offers: the model, its modes, the limits."""
        m = self.loaded.model
        return {
            "kind": m.kind,
            "seq_len": m.cfg.seq_len,
            "vocab_size": m.cfg.vocab_size,
            "params": m.num_params(),
            "tokenizer": getattr(self.loaded.tokenizer, "name", None),
            "step": self.loaded.step,
            "path": str(self.loaded.path),
            "modes": list(MODES_OF_KIND.get(m.kind, MODES)),
            "speculative": m.kind in SPECULATIVE_KINDS,
            "limits": asdict(self.limits),
        }


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "anyorder-serve"
    default_request_version = "HTTP/1.0"  # answers to malformed lines get a status line too

    def setup(self) -> None:
        # The intake read the whole request already: parsing it never waits on the client.
        # The answer has one deadline however slowly the client reads it.
        sock, data = self.request
        self.connection = sock
        self.rfile = io.BytesIO(data)
        self.wfile = DeadlineWriter(sock, time.monotonic() + self.server.app.limits.send_timeout_s)

    def send_response(self, code: int, message: str | None = None) -> None:
        super().send_response(code, message)
        self.send_header("Connection", "close")  # one request per connection: say so

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()  # one request per connection

    def parse_request(self) -> bool:
        # http.server's checks of the request line; the headers are read and checked by
        # guard.parse_headers (http.client refused exactly 100 header lines)
        lines = serve_guard.header_lines(self.rfile)
        body, self.rfile = self.rfile, io.BytesIO(b"\r\n")
        try:
            if not super().parse_request():
                return False
        finally:
            self.rfile = body
        try:
            self.headers = serve_guard.parse_headers(lines, self.MessageClass)
        except serve_guard.Refusal as e:
            self._error(e.status, str(e))
            return False
        return True

    def finish(self) -> None:
        pass  # the server half-closes and drains the socket

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        if self.server.verbose:
            super().log_message(format, *args)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002
        # http.server's own "Request timed out" (an answer nobody read): one line, always
        log_line(self.client_address, format % args)

    def _json(self, status: int, data: dict[str, Any], headers: dict | None = None) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str, headers: dict | None = None) -> None:
        if status >= 400 and status not in (404, 405, 429):
            self.close_connection = True
        self._json(status, {"error": message}, headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, too many headers, a request
        line too long) as JSON, like every other answer."""
        self.close_connection = True
        short = cut(message or self.responses.get(code, ("error",))[0])  # it quotes the line
        with contextlib.suppress(OSError):
            self._error(code, f"{short}; send one well-formed HTTP request")

    def _refused(self) -> bool:
        """Host and Origin checks (:mod:`anyorder.serve.guard`); True when refused."""
        twice = serve_guard.repeated(self.headers)
        if twice is not None:
            n = len(self.headers.get_all(twice))
            self._error(400, f"the request has {n} {twice} headers; send one")
            return True
        host = self.headers.get("Host")
        if not serve_guard.host_allowed(host, self.server.bound_host):
            url = serve_guard.page_url(self.server.bound_host, self.server.server_address[1])
            shown = serve_guard.preview(host)
            self._error(403, f"Host {shown} is not this server's address; open the page at {url}")
            return True
        origin = self.headers.get("Origin")
        if not serve_guard.origin_allowed(origin, host):
            shown = serve_guard.preview(origin)
            self._error(403, f"cross-origin request from {shown} refused; use the page itself")
            return True
        return False

    def _routes(self, path: str) -> str | None:
        """The method a path takes (None: no such path)."""
        if path == "/api/generate":
            return "POST"
        if path in ("/", "/index.html", "/api/info") or path.removeprefix("/static/") in STATIC:
            return "GET"
        return None

    def __getattr__(self, name: str) -> Any:
        # Every other method (PUT, DELETE, OPTIONS, HEAD, made-up ones) gets JSON 404/405
        # instead of http.server's HTML 501.
        if name.startswith("do_"):
            return self._other_method
        raise AttributeError(name)

    def _other_method(self) -> None:
        if self._refused():
            return
        path = self.path.split("?", 1)[0]
        allow = self._routes(path)
        if allow is None:
            return self._error(404, f"no page at {cut(path)}; the page is /")
        self._error(
            405,
            f"{cut(self.command)} is not served at {path}; use {allow}",
            {"Allow": allow},
        )

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self._refused():
            return
        path = self.path.split("?", 1)[0]
        if path == "/api/info":
            return self._json(200, self.server.app.info())
        if path == "/api/generate":
            return self._error(405, "use POST with a JSON body", {"Allow": "POST"})
        name = "index.html" if path in ("/", "/index.html") else None
        if path.startswith("/static/"):
            name = path[len("/static/") :]
        if name not in STATIC:  # a fixed list: no path from the client reaches the disk
            return self._error(404, f"no page at {cut(path)}; the page is /")
        body = (resources.files("anyorder") / "web" / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", f"{STATIC[name]}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.write(body)

    def _read_request(self, app: App) -> GenRequest | None:
        """The checked body of a generation request, or None after sending the refusal."""
        if (refusal := serve_guard.body_refusal(self.headers)) is not None:
            self._error(refusal.status, str(refusal))  # not JSON, or compressed
            return None
        value = self.headers.get("Content-Length")
        length = serve_guard.content_length(value)
        if length is None or self.headers.get("Transfer-Encoding"):
            self._error(411, "send the JSON body with a Content-Length of ASCII digits (not "
                        "chunked)")  # fmt: skip
            return None
        if length > app.limits.max_body_bytes:
            shown = cut(value.strip(" \t").lstrip("0"))
            limit = app.limits.max_body_bytes
            self._error(413, f"the request is {shown} bytes; this server takes at most {limit}")
            return None
        raw = self.rfile.read(length)  # whole: the intake waited for it
        if serve_guard.json_too_deep(raw):
            self._error(400, f"the body nests deeper than {serve_guard.MAX_JSON_DEPTH} levels; "
                        "send one flat JSON object")  # fmt: skip
            return None
        try:
            text = serve_guard.body_text(raw, self.headers.get("Content-Type"))  # UTF-8 or 400
            return parse_request(serve_guard.strict_json(text), app.limits)
        except (ValueError, RecursionError) as e:  # not JSON, a 5000-digit number
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            self._error(400, f"the body is not JSON ({reason}); send a JSON object")
        except AnyorderError as e:
            self._error(400, str(e))
        return None

    def do_POST(self) -> None:  # noqa: N802
        started = time.perf_counter()
        if self._refused():
            return
        if self.path.split("?", 1)[0] != "/api/generate":
            return self._error(404, f"nothing to POST at {cut(self.path)}; use /api/generate")
        app = self.server.app
        if (req := self._read_request(app)) is None:
            return
        try:  # checked before taking a slot: a refusal never holds one; a chat template
            with render_deadline(started, app.limits.time_limit_s):  # renders in time
                plan = plan_request(app.loaded, req)
        except Exception as e:  # the render may have taken the time limit: the answer has
            self.wfile.deadline = time.monotonic() + app.limits.send_timeout_s  # its own time
            if isinstance(e, AnyorderError):
                return self._error(400, str(e))
            return self._error(500, internal_error(e))  # a bug, not the user's: keep serving
        if not app.slots.acquire(blocking=False):
            busy = f"busy: this server runs {app.limits.max_concurrent} generation(s) at a time; "
            return self._error(429, busy + "try again when it finishes", {"Retry-After": "1"})
        held = [True]
        # the stream may take the time limit, and its last events as long as any answer
        self.wfile.deadline = time.monotonic() + app.limits.time_limit_s + app.limits.send_timeout_s

        def free() -> None:  # once, before the last event goes out (see run_generation)
            if held:
                held.clear()
                app.slots.release()

        try:
            self._stream(app, req, started, plan, free)
        finally:
            free()

    def _stream(
        self, app: App, req: GenRequest, t0: float, plan: Plan, free: Callable[[], None]
    ) -> None:
        started = False

        def emit(event: str, data: dict[str, Any]) -> None:
            nonlocal started
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Accel-Buffering", "no")
                self.end_headers()
                started = True
            self.wfile.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        try:
            done = run_generation(
                app.loaded, req, emit, app.limits, autocast=app.autocast, started=t0,
                plan=plan, on_finished=free,
            )  # fmt: skip
            self.log_message("generated %d tokens, %.0f tokens/s", done["generated"],
                             done["tokens_per_s"])  # fmt: skip
        except TimeoutError:  # a stream nobody reads: stopped at its deadline
            self.close_connection = True
            log_line(self.client_address, "did not read its stream in time; generation stopped")
        except OSError as e:  # the page went away (Stop): generation stopped
            self.close_connection = True
            log_line(self.client_address, f"left during its stream ({type(e).__name__}); "
                     "generation stopped")  # fmt: skip
        except AnyorderError as e:
            if not started:  # the slot is free before the answer goes: a client that asks
                free()  # again at once must not find the server busy with its own request
                return self._error(503 if isinstance(e, LimitError) else 400, str(e))
            free()
            with contextlib.suppress(OSError):
                emit("error", {"message": str(e)})
        except Exception as e:  # a bug, not the user's: report it, keep serving
            message = internal_error(e)
            free()
            if started:
                with contextlib.suppress(OSError):
                    emit("error", {"message": message})
            else:
                self._error(500, message)


class _Server(HTTPServer):
    """Accepts connections and hands them to an :class:`~anyorder.serve.intake.Intake`,
    which reads each request whole; each whole request then gets a thread of its own, at
    most ``limits.max_connections`` at once (the intake answers 503 beyond)."""

    app: App
    verbose: bool = False
    bound_host: str = "127.0.0.1"
    request_queue_size = 128  # socketserver's 5 makes a burst of clients wait 1 s (SYN retry)

    def __init__(self, address: tuple[str, int], app: App, family: socket.AddressFamily) -> None:
        self.address_family = family
        self.app = app
        self._busy = 0
        self._busy_lock = threading.Lock()
        super().__init__(address, _Handler)
        self.intake = Intake(app.limits, self._dispatch)

    def server_bind(self) -> None:
        # HTTPServer's own looks the address up in DNS (getfqdn): slow, and not needed here
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request: Any, client_address: Any) -> None:
        self.intake.add(request, client_address)  # never waits: see intake.Intake.add

    def _dispatch(self, sock: socket.socket, addr: Any, data: bytes) -> bool:
        with self._busy_lock:
            if self._busy >= self.app.limits.max_connections:
                return False
            self._busy += 1
        try:
            threading.Thread(target=self._work, args=(sock, addr, data), daemon=True).start()
        except RuntimeError:  # no thread to be had: as busy
            with self._busy_lock:
                self._busy -= 1
            return False
        return True

    def _work(self, sock: socket.socket, addr: Any, data: bytes) -> None:
        try:
            sock.setblocking(True)
            self.RequestHandlerClass((sock, data), addr, self)
        except TimeoutError:
            log_line(addr, "did not read its answer in time; closed")
        except OSError as e:  # BrokenPipe, ConnectionReset: the client left early
            log_line(addr, f"left before its answer was sent ({type(e).__name__})")
        except Exception:  # a bug, not the client's: the traceback, and keep serving
            traceback.print_exc(file=sys.stderr)
        finally:
            with self._busy_lock:
                self._busy -= 1
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
            self.intake.add(sock, addr, linger=True)

    def server_close(self) -> None:
        super().server_close()
        if hasattr(self, "intake"):  # socketserver closes a server it could not bind too
            self.intake.close()


def make_server(
    app: App, host: str = "127.0.0.1", port: int = 8000, *, verbose: bool = False
) -> HTTPServer:
    """An HTTP server for ``app`` bound to ``host:port`` (port 0: any free port; an IPv6
    address such as ``::1`` or ``[::1]`` listens on IPv6).

    Call ``serve_forever()`` on it (in a thread for tests); ``server_address`` has the port.
    """
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        server = _Server((bare, port), app, family)
    except OSError as e:
        raise SamplingError(
            f"cannot listen on {cut(host)}:{port} ({e.strerror or e}); pick another --host or "
            "--port"
        ) from None
    except OverflowError:
        raise SamplingError(f"--port {port} must lie in 0..65535 (0: any free port)") from None
    server.verbose, server.bound_host = verbose, bare
    return server


def serve(
    checkpoint: str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: Limits = Limits(),  # noqa: B008 (frozen: immutable)
    device: str = "auto",
    dtype: str = "auto",
    weights: str = "ema",
    verbose: bool = False,
    huge_pages: bool = True,
) -> None:
    """Load a model and serve the page until interrupted (``anyorder serve``).

    Args:
        checkpoint: export folder, hub id, run folder or checkpoint (default:
            :data:`DEFAULT_CHECKPOINT`, the main job's model).
        host, port: where to listen (``127.0.0.1``: this machine only).
        limits: per-request bounds.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``auto`` (bf16 autocast on CUDA), ``fp32`` or ``bf16``.
        weights: ``ema`` or ``raw`` (training checkpoints).
        verbose: log every request.
        huge_pages: weights in 2 MB pages on a CPU (:mod:`anyorder.hugepages`).

    Raises:
        CheckpointError: no model there (the default folder: run ``make demo`` first).
    """
    from anyorder.interop.hub import load_any
    from anyorder.training.distributed import resolve_device

    if checkpoint is None:
        checkpoint = DEFAULT_CHECKPOINT
        if not Path(checkpoint).exists():
            raise CheckpointError(
                f"no model at {checkpoint}: run `make demo` first or pass a checkpoint"
            )
    dev = resolve_device(device, what="--device")
    loaded = load_any(checkpoint, weights=weights, device=dev, huge_pages=huge_pages)
    app = App(loaded, limits, autocast=dtype == "bf16" or (dtype == "auto" and dev.type == "cuda"))
    server = make_server(app, host, port, verbose=verbose)
    h, p = server.server_address[:2]
    h = f"[{h}]" if ":" in h else h
    m = loaded.model
    print(
        f"serving {m.kind} ({m.num_params() / 1e6:.2f}M parameters, context {m.cfg.seq_len}) "
        f"from {loaded.path} at http://{h}:{p}/  (Ctrl-C stops)",
        flush=True,
    )
    if host not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        print(f"note: listening on {host}: other machines can reach this page", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
