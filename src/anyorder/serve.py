"""``anyorder serve``: a local web page that shows any-order generation as it happens.

The page (``anyorder/web``: plain HTML, JS and CSS, no build) sends a prompt or a template
with holes (``[MASK:n]``) and the sampling controls; the server runs the library's own fast
sampler (:func:`anyorder.sample.sample`) and streams every forward pass to the page as a
server-sent event: the positions decided, their tokens and text, and the step recorded in
``step_of``. The page only draws what it receives; it never samples.

Design choices:

* Standard library only (:class:`http.server.ThreadingHTTPServer`): no new dependency, and
  page loads are answered while a generation runs.
* The stream *is* the sampler: one ``step`` event per call of the sampler's ``on_step``
  hook, so the events rebuild its :class:`~anyorder.sample.SampleResult` exactly (tokens
  and ``step_of``); ``done`` carries the result itself.
* Validation is the sampler's: the response headers are sent at the first pass, so every
  :class:`~anyorder.errors.AnyorderError` raised before it (a bad template, a length over
  the context, a mode the model cannot run) becomes a 400 with its one-line message, and
  the server needs no second copy of those checks. Errors after it arrive as an ``error``
  event. Unexpected exceptions become a 500 or an ``error`` event; the server keeps going.
* Bounded requests (:class:`Limits`): body size (413), samples per request, length (the
  model's context, checked by the sampler), wall-clock time per request (checked after
  every pass; the hook raises to stop the sampler), and one generation at a time (429 with
  ``Retry-After`` while busy). A client that goes away stops its generation at the next
  pass (the write fails).
* Binds ``127.0.0.1`` by default: the page is meant for the machine it runs on.
* ``tokens/s`` counts generated tokens over the time spent outside the optional
  slow-motion pause (``delay_ms``, for watching a fast model fill in).

Endpoints: ``GET /`` (the page), ``GET /static/<file>``, ``GET /api/info`` (the model and
the limits), ``POST /api/generate`` (JSON in, ``text/event-stream`` out: ``start``,
``step``..., then ``done`` or ``error``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from anyorder import bounds, serve_guard
from anyorder.errors import AnyorderError, CheckpointError, SamplingError

if TYPE_CHECKING:
    from anyorder.checkpoint import Loaded

DEFAULT_CHECKPOINT = "runs/demo"
"""What ``anyorder serve`` loads without an argument: the main job's model."""
MODES = ("l2r", "random", "strided", "lemma1")
"""``l2r``/``random``: one token per pass in that order; ``strided``: ARMD's ``S`` streams;
``lemma1``: ``T`` reverse steps, several tokens per pass."""
MODES_OF_KIND = {
    "gpt": ("l2r",),
    "aogpt": ("l2r", "random", "lemma1"),
    "armd": MODES,
    "mdm": ("l2r", "random", "lemma1"),
}
STATIC = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server."""

    max_samples: int = 4
    """Samples per request (one batch)."""
    time_limit_s: float = 60.0
    """Wall-clock seconds per request, slow-motion pauses included."""
    max_body_bytes: int = 65536
    """Largest request body."""
    max_delay_ms: int = 500
    """Longest slow-motion pause per pass."""
    max_concurrent: int = 1
    """Generations running at once; more get 429."""
    max_connections: int = 32
    """Connections open at once (each holds a thread); more get 503 and are closed."""
    read_timeout_s: float = 10.0
    """Seconds a connection may stay silent (a partial request) or not read the stream."""


@dataclass
class GenRequest:
    """One generation request, as the page sends it (JSON keys = field names)."""

    text: str = ""
    """A prompt (a prefix), a template with ``[MASK:n]`` holes, or empty (unconditional)."""
    mode: str = "random"
    """One of :data:`MODES`."""
    streams: int | None = None
    """``S`` for ``strided``."""
    steps: int | None = None
    """``T`` for ``lemma1``."""
    length: int | None = None
    """Tokens per sample, prompt included (default: the model's context); a template sets
    its own length and ignores this."""
    temperature: float = 1.0
    top_p: float | None = None
    seed: int = 0
    num_samples: int = 1
    delay_ms: int = 0
    """Slow motion: pause after each pass (not counted in tokens/s)."""


class LimitError(SamplingError):
    """A request stopped by one of the server's :class:`Limits`."""


_TYPES: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "mode": (str,),
    "streams": (int,),
    "steps": (int,),
    "length": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "seed": (int,),
    "num_samples": (int,),
    "delay_ms": (int,),
}
_OPTIONAL = {"streams", "steps", "length", "top_p"}


def parse_request(body: Any, limits: Limits) -> GenRequest:
    """Check the JSON of a request (types, names, limits) and build a :class:`GenRequest`.

    Raises:
        SamplingError: an unknown key, a value of the wrong type, an unknown mode, a mode
            without its ``S``/``T``, or more samples than the server allows.
    """
    if not isinstance(body, dict):
        raise SamplingError('the request must be a JSON object such as {"text": "..."}')
    names = [f.name for f in fields(GenRequest)]
    unknown = sorted(set(body) - set(names))
    if unknown:
        raise SamplingError(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(names)}")
    values = {}
    for name, value in body.items():
        if value is None and name in _OPTIONAL:
            continue
        ok = isinstance(value, _TYPES[name]) and not isinstance(value, bool)
        if not ok:
            want = "a string" if _TYPES[name] == (str,) else "a number"
            want = "a whole number" if _TYPES[name] == (int,) else want
            raise SamplingError(f"field {name!r} must be {want}, not {json.dumps(value)}")
        values[name] = value
    req = GenRequest(**values)
    if req.mode not in MODES:
        raise SamplingError(f"mode {req.mode!r} is unknown; use one of {', '.join(MODES)}")
    if req.mode == "strided" and req.streams is None:
        raise SamplingError("mode strided needs the number of streams S (field streams)")
    if req.mode == "lemma1" and req.steps is None:
        raise SamplingError("mode lemma1 needs the number of steps T (field steps)")
    bounds.check_controls(
        temperature=req.temperature, top_p=req.top_p, num_samples=req.num_samples,
        seed=req.seed, steps=req.steps, length=req.length, max_samples=limits.max_samples,
        limit_note="this server's limit",
    )  # fmt: skip
    if not 0 <= req.delay_ms <= limits.max_delay_ms:
        raise SamplingError(f"delay_ms={req.delay_ms} must lie in 0..{limits.max_delay_ms}")
    return req


@dataclass
class Plan:
    """A request turned into the arguments of :func:`anyorder.sample.sample`."""

    n: int
    """Tokens per sample."""
    kwargs: dict[str, Any]
    """Everything else :func:`~anyorder.sample.sample` takes (generator excluded)."""
    template: bool
    """Whether the text was a template (then the text is not cut at EOS)."""
    total_steps: int
    """Steps a full decode has (``step_of`` values lie in ``0..total_steps-1``)."""


def plan_request(loaded: Loaded, req: GenRequest) -> Plan:
    """Map a request onto the sampler's arguments (as ``anyorder sample`` does).

    Raises:
        SamplingError: a malformed or too long template, a prompt not shorter than the
            length, a tokenizer the model cannot read.
    """
    from anyorder.orders import strided
    from anyorder.sample import parse_template

    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise CheckpointError(f"{loaded.path} holds no tokenizer; serve needs one")
    seq_len = model.cfg.seq_len
    prompt = known = None
    template = "[MASK" in req.text
    steps = req.steps if req.mode == "lemma1" else None
    if template:
        bounds.check_holes(req.text, seq_len)
        prompt, known = parse_template(req.text, tok, seq_len)
        n = len(prompt)
        bounds.check_steps(steps, n)
    else:
        n = bounds.check_fit(seq_len, length=req.length, steps=steps)
        if req.text:
            ids = tok.encode(req.text)
            if len(ids) >= n:
                raise SamplingError(
                    f"the prompt is {len(ids)} tokens, not shorter than the length {n}; raise "
                    "the length or shorten the prompt"
                )
            prompt = torch.zeros(n, dtype=torch.long)
            prompt[: len(ids)] = torch.tensor(ids, dtype=torch.long)
            known = torch.zeros(n, dtype=torch.bool)
            known[: len(ids)] = True
    kwargs: dict[str, Any] = dict(
        batch=req.num_samples,
        prompt=prompt,
        known=known,
        temperature=req.temperature,
        top_p=req.top_p,
    )
    k = 0 if known is None else int(known.sum())
    total = n - k
    if req.mode in ("l2r", "random"):
        kwargs["order"] = req.mode
    elif req.mode == "lemma1":
        kwargs.update(order="random", steps=req.steps)
        total = req.steps
    else:
        kwargs["streams"] = req.streams
        if req.streams >= 1 and n % req.streams == 0:
            total = int(strided(1, n, req.streams).blocks.max()) + 1
    return Plan(n, kwargs, template, total)


def _piece(tok: Any, token: int) -> str:
    return tok.decode([token])


def run_generation(
    loaded: Loaded,
    req: GenRequest,
    emit: Callable[[str, dict[str, Any]], None],
    limits: Limits = Limits(),
    *,
    autocast: bool = False,
    started: float | None = None,
) -> dict[str, Any]:
    """Run one request through the real sampler, calling ``emit(event, data)`` as it goes.

    The time limit counts from ``started`` (a ``time.perf_counter()`` value; default: now)
    and is checked before the sampler plans the request and after every pass.

    Events: ``start`` (sizes, the prompt) and ``step`` (one per sampler pass) from inside the
    sampler's ``on_step`` hook, then ``done`` (the texts and the whole result). Nothing is
    emitted before the sampler's first pass, so an error raised by the checks propagates
    with no event sent.

    Raises:
        AnyorderError: the request is invalid (before any event), or
        LimitError: the time limit ran out (after some events).
    """
    from anyorder.sample import decode_text, sample

    model, tok = loaded.model, loaded.tokenizer
    t0 = time.perf_counter() if started is None else started
    plan = plan_request(loaded, req)
    n = plan.n
    prompt = plan.kwargs["prompt"]
    known = plan.kwargs["known"]
    known_pos = [] if known is None else known.nonzero()[:, 0].tolist()
    prompt_cells = [[p, int(prompt[p]), _piece(tok, int(prompt[p]))] for p in known_pos]
    state = {"passes": 0, "generated": 0, "slept": 0.0}

    def over_time() -> None:
        now = time.perf_counter()
        if now - t0 > limits.time_limit_s:
            raise LimitError(
                f"stopped after {now - t0:.1f} s: this server's limit is "
                f"{limits.time_limit_s:g} s per request; ask for fewer tokens or samples"
            )

    def on_step(positions: Tensor, tokens: Tensor, step: int) -> None:
        pos, toks = positions.tolist(), tokens.tolist()  # the stream's one sync per pass
        if state["passes"] == 0:
            emit(
                "start",
                {
                    "n": n,
                    "num_samples": req.num_samples,
                    "mode": req.mode,
                    "total_steps": plan.total_steps,
                    "eos_id": tok.eos_id,
                    "prompt": prompt_cells,
                },
            )
        rows = [
            [[p, t, _piece(tok, t)] for p, t in zip(pr, tr) if p < n] for pr, tr in zip(pos, toks)
        ]
        state["passes"] += 1
        state["generated"] += sum(len(r) for r in rows)
        now = time.perf_counter()
        emit(
            "step",
            {
                "step": step,
                "pass": state["passes"],
                "rows": rows,
                "generated": state["generated"],
                "elapsed_s": now - t0 - state["slept"],
            },
        )
        over_time()
        if req.delay_ms:
            time.sleep(req.delay_ms / 1000)
            state["slept"] += req.delay_ms / 1000

    device = model.device
    ctx = torch.autocast(device.type, torch.bfloat16) if autocast else contextlib.nullcontext()
    gen = torch.Generator(device).manual_seed(req.seed)
    over_time()  # before the sampler plans the request (a slow body or tokenizer counts)
    with ctx:
        result = sample(model, n, generator=gen, on_step=on_step, **plan.kwargs)
    seconds = time.perf_counter() - t0 - state["slept"]
    tokens = result.tokens.cpu()
    eos = None if plan.template else tok.eos_id
    generated = int((result.step_of >= 0).sum())
    done = {
        "texts": [decode_text(tok, row, eos) for row in tokens],
        "tokens": tokens.tolist(),
        "step_of": result.step_of.cpu().tolist(),
        "order": result.order.cpu().tolist(),
        "forward_passes": result.forward_passes,
        "generated": generated,
        "seconds": seconds,
        "tokens_per_s": generated / max(seconds, 1e-9),
    }
    emit("done", done)
    return done


# ----------------------------------------------------------------------------- HTTP


class App:
    """A loaded model, its limits and the lock that keeps generations bounded."""

    def __init__(self, loaded: Loaded, limits: Limits = Limits(), *, autocast: bool = False):
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
        """Host and Origin checks (:mod:`anyorder.serve_guard`); True when refused."""
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
        if not app.slots.acquire(blocking=False):
            return self._error(
                429,
                f"busy: this server runs {app.limits.max_concurrent} generation(s) at a time; "
                "try again when it finishes",
                {"Retry-After": "1"},
            )
        try:
            self._stream(app, req, started)
        finally:
            app.slots.release()

    def _stream(self, app: App, req: GenRequest, t0: float) -> None:
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
                app.loaded, req, emit, app.limits, autocast=app.autocast, started=t0
            )
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
            traceback.print_exc(file=sys.stderr)
            message = f"internal error: {type(e).__name__}: {e}"
            if started:
                with contextlib.suppress(OSError):
                    emit("error", {"message": message})
            else:
                self._error(500, message)


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
    limits: Limits = Limits(),
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
    from anyorder.hub import load_any
    from anyorder.train import resolve_device

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
