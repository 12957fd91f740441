"""The HTTP side of ``anyorder serve``: a standard-library threaded server, the page's
static files, ``GET /api/info`` and ``POST /api/generate`` as server-sent events.

Design choices:

* Standard library only (:class:`http.server.ThreadingHTTPServer`): no new dependency, and
  page loads are answered while a generation runs.
* The response headers are sent at the sampler's first pass, so an
  :class:`~anyorder.errors.AnyorderError` raised before it becomes a 400 with its one-line
  message; errors after it arrive as an ``error`` event. Unexpected exceptions become a 500
  or an ``error`` event; the server keeps going.
* Bounded: body size (413), one generation at a time (429 with ``Retry-After`` while
  busy), connections open at once (503), a read timeout per connection. A client that goes
  away stops its generation at the next pass (the write fails).
* Raw requests are checked (Host, Origin, Content-Type, Content-Length, JSON depth) by the
  pure functions of :mod:`anyorder.serve.guard` before any of them reaches the model.
* Binds ``127.0.0.1`` by default: the page is meant for the machine it runs on.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
import traceback
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyorder.serve.guard as serve_guard
from anyorder.errors import AnyorderError, CheckpointError, SamplingError
from anyorder.serve.generation import (
    MODES,
    MODES_OF_KIND,
    GenRequest,
    LimitError,
    Limits,
    Plan,
    parse_request,
    plan_request,
    run_generation,
)

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
            "limits": asdict(self.limits),
        }


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "anyorder-serve"
    default_request_version = "HTTP/1.0"  # answers to malformed lines get a status line too

    def setup(self) -> None:
        # A per-connection socket timeout: a client that stops sending (a partial request)
        # or stops reading is dropped after it instead of holding a thread forever.
        self.timeout = self.server.app.limits.read_timeout_s
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        if self.server.verbose:
            super().log_message(format, *args)

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
        short = message or self.responses.get(code, ("error",))[0]
        with contextlib.suppress(OSError):
            self._error(code, f"{short}; send one well-formed HTTP request")

    def _refused(self) -> bool:
        """Host and Origin checks (:mod:`anyorder.serve.guard`); True when refused."""
        host = self.headers.get("Host")
        if not serve_guard.host_allowed(host, self.server.bound_host):
            self._error(
                403,
                f"Host {host!r} is not this server's address; open the page at "
                f"http://127.0.0.1:{self.server.server_address[1]}/",
            )
            return True
        origin = self.headers.get("Origin")
        if not serve_guard.origin_allowed(origin, host):
            self._error(403, f"cross-origin request from {origin!r} refused; use the page itself")
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
            return self._error(404, f"no page at {path}; the page is /")
        self._error(405, f"{self.command} is not served at {path}; use {allow}", {"Allow": allow})

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
        if name not in STATIC:
            return self._error(404, f"no page at {path}; the page is /")
        body = (resources.files("anyorder") / "web" / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", f"{STATIC[name]}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.write(body)

    def _read_request(self, app: App) -> GenRequest | None:
        """The checked body of a generation request, or None after sending the refusal."""
        if not serve_guard.is_json(self.headers.get("Content-Type")):
            self._error(415, "send the body as JSON with Content-Type: application/json")
            return None
        length = serve_guard.content_length(self.headers.get("Content-Length"))
        if length is None or self.headers.get("Transfer-Encoding"):
            self._error(411, "send the JSON body with a Content-Length (not chunked)")
            return None
        if length > app.limits.max_body_bytes:
            self._error(
                413,
                f"the request is {length} bytes; this server takes at most "
                f"{app.limits.max_body_bytes}",
            )
            return None
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self._error(408, f"the body did not arrive within {app.limits.read_timeout_s:g} s")
            return None
        if len(raw) < length:
            self.close_connection = True  # the client went away mid-body
            return None
        if serve_guard.json_too_deep(raw):
            self._error(400, f"the body nests deeper than {serve_guard.MAX_JSON_DEPTH} levels; "
                        "send one flat JSON object")  # fmt: skip
            return None
        try:
            return parse_request(json.loads(raw.decode("utf-8")), app.limits)
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, a 5000-digit number
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
            return self._error(404, f"nothing to POST at {self.path}; use /api/generate")
        app = self.server.app
        req = self._read_request(app)
        if req is None:
            return
        try:  # checked before taking a slot: a refusal never holds one
            plan = plan_request(app.loaded, req)
        except AnyorderError as e:
            return self._error(400, str(e))
        except Exception as e:  # a bug, not the user's: report it, keep serving
            return self._error(500, _internal_error(e))
        if not app.slots.acquire(blocking=False):
            return self._error(
                429,
                f"busy: this server runs {app.limits.max_concurrent} generation(s) at a time; "
                "try again when it finishes",
                {"Retry-After": "1"},
            )
        held = [True]

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
        except OSError:  # the page went away (Stop) or stopped reading: generation stopped
            self.close_connection = True
        except AnyorderError as e:
            if not started:
                return self._error(503 if isinstance(e, LimitError) else 400, str(e))
            with contextlib.suppress(OSError):
                emit("error", {"message": str(e)})
        except Exception as e:  # a bug, not the user's: report it, keep serving
            message = _internal_error(e)
            if started:
                with contextlib.suppress(OSError):
                    emit("error", {"message": message})
            else:
                self._error(500, message)


def _internal_error(e: Exception) -> str:
    """Print the traceback of an exception that is a bug (not the user's) to stderr; the
    message the client gets."""
    traceback.print_exc(file=sys.stderr)
    return f"internal error: {type(e).__name__}: {e}"


class _Server(ThreadingHTTPServer):
    """Threads per connection, at most ``limits.max_connections`` open at once: the next one
    gets a JSON 503 and is closed without a thread."""

    daemon_threads = True
    app: App
    verbose: bool = False
    bound_host: str = "127.0.0.1"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open = 0
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            full = self._open >= self.app.limits.max_connections
            if not full:
                self._open += 1
        if not full:
            return super().process_request(request, client_address)
        body = json.dumps(
            {"error": f"busy: {self.app.limits.max_connections} connections are open; retry"}
        ).encode()
        head = (
            "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            request.settimeout(0.1)  # short: this runs in the accepting thread
            request.sendall(head.encode() + body)
            request.shutdown(socket.SHUT_WR)
            while request.recv(65536):  # drain the request, so closing sends no reset
                pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open -= 1


def make_server(
    app: App, host: str = "127.0.0.1", port: int = 8000, *, verbose: bool = False
) -> ThreadingHTTPServer:
    """An HTTP server for ``app`` bound to ``host:port`` (port 0: any free port).

    Call ``serve_forever()`` on it (in a thread for tests); ``server_address`` has the port.
    """
    try:
        server = _Server((host, port), _Handler)
    except OSError as e:
        raise SamplingError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --host or --port"
        ) from None
    except OverflowError:
        raise SamplingError(f"--port {port} must lie in 0..65535 (0: any free port)") from None
    server.app, server.verbose, server.bound_host = app, verbose, host
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
    loaded = load_any(checkpoint, weights=weights, device=dev)
    app = App(loaded, limits, autocast=dtype == "bf16" or (dtype == "auto" and dev.type == "cuda"))
    server = make_server(app, host, port, verbose=verbose)
    h, p = server.server_address[:2]
    m = loaded.model
    print(
        f"serving {m.kind} ({m.num_params() / 1e6:.2f}M parameters, context {m.cfg.seq_len}) "
        f"from {loaded.path} at http://{h}:{p}/  (Ctrl-C stops)",
        flush=True,
    )
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: listening on {host}: other machines can reach this page", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
