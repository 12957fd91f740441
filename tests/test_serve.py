"""``anyorder serve``: the stream is the sampler, bad requests get 4xx, limits hold, and the
page works in a real headless Chromium (skipped where none is installed)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.errors import SamplingError
from anyorder.interop.hub import load_any
from anyorder.sample import decode_text, parse_template, sample
from anyorder.serve import App, Limits, make_server

from conftest import REPO, tiny_model

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TEMPLATE = "x = [MASK:6] + y[MASK:3]"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Tiny real models with the byte tokenizer, saved and loaded as `serve` loads them."""
    root = tmp_path_factory.mktemp("serve")
    out = {}
    for kind in ("gpt", "armd", "mdm"):
        folder = save_pretrained(
            tiny_model(kind, seed=3, vocab_size=257, seq_len=32), root / kind, ByteTokenizer()
        )
        out[kind] = load_any(folder)
    return out


class Running:
    """An `anyorder serve` server on a free port, in a thread."""

    def __init__(self, loaded, limits: Limits | None = None, autocast: bool = False) -> None:
        app = App(loaded, limits or Limits(), autocast=autocast)
        self.server = make_server(app, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def post(self, body, raw: bytes | None = None) -> tuple[int, str]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/api/generate", data=data)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


@pytest.fixture
def server(exports, request):
    kind, limits = getattr(request, "param", ("armd", Limits()))
    s = Running(exports[kind], limits)
    yield s
    s.close()


def parse_sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for chunk in text.split("\n\n"):
        if not chunk.strip():
            continue
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


# (kind, request) -> the same draw made directly with the sampler's public API
CASES = [
    ("armd", {"text": "def ", "mode": "l2r", "length": 20, "seed": 1}),
    ("armd", {"text": TEMPLATE, "mode": "random", "seed": 2, "temperature": 0.8}),
    ("armd", {"text": "", "mode": "strided", "streams": 4, "length": 16, "seed": 3}),
    ("armd", {"text": TEMPLATE, "mode": "lemma1", "steps": 5, "num_samples": 3, "seed": 4}),
    ("gpt", {"text": "ab", "mode": "l2r", "length": 12, "seed": 5, "top_p": 0.9}),
    ("mdm", {"text": TEMPLATE, "mode": "lemma1", "steps": 4, "num_samples": 2, "seed": 6}),
]


def direct(loaded, body: dict, autocast: bool = False):
    """The request's sample drawn by calling :func:`anyorder.sample.sample` directly."""
    tok, model = loaded.tokenizer, loaded.model
    prompt = known = None
    if "[MASK" in body["text"]:
        prompt, known = parse_template(body["text"], tok, model.cfg.seq_len)
        n = len(prompt)
    else:
        n = body["length"]
        if body["text"]:
            ids = tok.encode(body["text"])
            prompt = torch.tensor(ids + [0] * (n - len(ids)))
            known = torch.arange(n) < len(ids)
    mode = body["mode"]
    steps: list = []
    device = model.device
    ctx = torch.autocast(device.type, torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        result = sample(
            model,
            n,
            order={"l2r": "l2r", "random": "random", "lemma1": "random"}.get(mode),
            streams=body.get("streams"),
            steps=body.get("steps"),
            batch=body.get("num_samples", 1),
            prompt=prompt,
            known=known,
            temperature=body.get("temperature", 1.0),
            top_p=body.get("top_p"),
            generator=torch.Generator(device).manual_seed(body["seed"]),
            on_step=lambda pos, new, step: steps.append((pos.tolist(), new.tolist(), step)),
        )
    eos = None if "[MASK" in body["text"] else tok.eos_id  # a template's text is not cut
    texts = [decode_text(tok, row, eos) for row in result.tokens.cpu()]
    return result, steps, texts


@pytest.mark.parametrize("kind, body", CASES, ids=[f"{k}-{b['mode']}" for k, b in CASES])
def test_stream_is_exactly_the_samplers_steps(exports, kind: str, body: dict) -> None:
    check_stream(exports[kind], body)


def check_stream(loaded, body: dict, autocast: bool = False) -> None:
    """Serve ``body`` and check its events against the same draw made directly."""
    server = Running(loaded, autocast=autocast)
    try:
        status, text = server.post(body)
    finally:
        server.close()
    assert status == 200, text
    events = parse_sse(text)
    names = [e for e, _ in events]
    assert names[0] == "start" and names[-1] == "done" and set(names[1:-1]) == {"step"}
    start, steps, done = events[0][1], [d for e, d in events if e == "step"], events[-1][1]
    result, hook_calls, texts = direct(loaded, body, autocast)
    result.tokens, result.step_of = result.tokens.cpu(), result.step_of.cpu()
    # one event per sampler pass, with the same step, positions and tokens (padding dropped)
    n = start["n"]
    assert n == result.tokens.shape[1] and len(steps) == len(hook_calls)
    for event, (pos, new, step) in zip(steps, hook_calls):
        assert event["step"] == step
        want = [[[p, t] for p, t in zip(pr, tr) if p < n] for pr, tr in zip(pos, new)]
        assert [[cell[:2] for cell in row] for row in event["rows"]] == want
    # the events rebuild the SampleResult: tokens and step_of, position by position
    B = result.tokens.shape[0]
    tokens = torch.full((B, n), -9)
    step_of = torch.full((B, n), -2)
    for p, t, _ in start["prompt"]:
        tokens[:, p], step_of[:, p] = t, -1
    for event in steps:
        for i, row in enumerate(event["rows"]):
            for p, t, _ in row:
                assert step_of[i, p] == -2, "a position was decided twice"
                tokens[i, p], step_of[i, p] = t, event["step"]
    torch.testing.assert_close(tokens, result.tokens, rtol=0, atol=0)
    torch.testing.assert_close(step_of, result.step_of, rtol=0, atol=0)
    assert done["tokens"] == result.tokens.tolist()
    assert done["step_of"] == result.step_of.tolist()
    assert done["texts"] == texts
    assert done["forward_passes"] == result.forward_passes
    assert 0 <= max(max(r) for r in done["step_of"]) < start["total_steps"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind, body", CASES[1:4], ids=[b["mode"] for _, b in CASES[1:4]])
def test_stream_on_cuda_with_bf16(tmp_path, kind: str, body: dict) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_model(kind, seed=3, vocab_size=257, seq_len=32)
    folder = save_pretrained(model, tmp_path / kind, ByteTokenizer())
    check_stream(load_any(folder, device="cuda"), body, autocast=True)


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"text": "[MASK:0] x"}, 400, "bad hole '[MASK:0]' at character 0; write [MASK:n]"),
        ({"text": "a [MASK:3"}, 400, "unterminated hole at character 2"),
        ({"text": "a [MASK:40]"}, 400, "hole [MASK:40] is longer than the model's context (32"),
        ({"text": "no holes", "length": 64}, 400, "length n=64 must lie in 1..32"),
        ({"text": "x" * 40}, 400, "the prompt is 40 tokens, not shorter than the length 32"),
        ({"mode": "sideways"}, 400, "mode 'sideways' is unknown; use one of l2r, random"),
        ({"mode": "strided"}, 400, "mode strided needs the number of streams S"),
        ({"mode": "strided", "streams": 5}, 400, "streams S=5 does not divide"),
        ({"mode": "lemma1", "steps": 0}, 400, "steps=0 must be at least 1"),
        # a field only another mode reads was ignored (200): refused, as the CLI refuses
        # --schedule without --steps
        (
            {"mode": "random", "steps": 4},
            400,
            "steps sets the T reverse steps of mode lemma1, "
            "which was not asked for (mode random); set mode lemma1, or leave steps out",
        ),
        (
            {"streams": 4},
            400,
            "streams sets the S streams of mode strided, which was not asked "
            "for (mode random); set mode strided, or leave streams out",
        ),
        (
            {"mode": "lemma1", "steps": 4, "streams": 2},
            400,
            "streams sets the S streams of mode strided, which was not asked for (mode lemma1)",
        ),
        (
            {"mode": "strided", "streams": 4, "steps": 2},
            400,
            "steps sets the T reverse steps of mode lemma1, which was not asked for (mode strided)",
        ),
        ({"mode": "l2r", "steps": None, "streams": None}, 200, "event: done"),  # null: absent
        ({"temperature": 0}, 400, "temperature=0 must be > 0"),
        ({"top_p": 1.5}, 400, "top-p=1.5 must lie in (0, 1]"),
        ({"seed": "one"}, 400, "field 'seed' must be a whole number, not \"one\""),
        ({"colour": 1}, 400, "unknown field(s) colour; known: text, mode"),
        ({"num_samples": 5}, 400, "num_samples=5 must lie in 1..4 (this server's limit)"),
        ([1, 2], 400, "the request must be a JSON object"),
    ],
)
def test_invalid_requests_get_4xx_with_a_message(server, body, status: int, message: str):
    got, text = server.post(body)
    assert got == status
    assert message in (json.loads(text)["error"] if status != 200 else text)


def test_other_refusals(server, exports) -> None:
    status, text = server.post(None, raw=b"{not json")
    assert status == 400 and "the body is not JSON" in json.loads(text)["error"]
    status, text = server.post(None, raw=b'{"text": "' + b"a" * 70000 + b'"}')
    assert status == 413
    assert json.loads(text)["error"].startswith("the request is 70012 bytes; this server takes")
    assert server.get("/api/generate")[0] == 405
    assert server.get("/nothing")[0] == 404
    gpt = Running(exports["gpt"])
    try:
        status, text = gpt.post({"text": TEMPLATE, "mode": "random"})
    finally:
        gpt.close()
    assert status == 400 and "gpt generates left to right" in json.loads(text)["error"]
    # the server is still up and serves the page and its model's description
    status, page = server.get("/")
    assert status == 200 and 'id="text"' in page and "/static/app.js" in page
    assert server.get("/static/app.js")[0] == 200 and server.get("/static/style.css")[0] == 200
    info = json.loads(server.get("/api/info")[1])
    assert info["kind"] == "armd" and info["seq_len"] == 32 and info["limits"]["max_samples"] == 4
    assert info["modes"] == ["l2r", "random", "strided", "lemma1"]


@pytest.mark.parametrize("server", [("armd", Limits(time_limit_s=0.0))], indirect=True)
def test_time_limit_is_checked_before_planning(server) -> None:
    status, text = server.post({"mode": "lemma1", "steps": 24, "length": 24})
    assert status == 503
    assert "this server's limit is 0 s per request" in json.loads(text)["error"]
    # the slot is free again: the next request runs (and is stopped the same way)
    assert server.post({"mode": "l2r", "length": 24})[0] == 503


@pytest.mark.parametrize("server", [("armd", Limits(time_limit_s=3.0))], indirect=True)
def test_time_limit_stops_a_generation_between_passes(server) -> None:
    # 32 passes with a 0.5 s pause each would take 16 s; the limit stops it after ~3 s
    status, text = server.post({"mode": "l2r", "length": 32, "delay_ms": 500})
    events = parse_sse(text)
    assert status == 200 and events[0][0] == "start" and events[-1][0] == "error"
    assert 1 <= sum(e == "step" for e, _ in events) < 32
    assert "this server's limit is 3 s per request" in events[-1][1]["message"]


def test_one_generation_at_a_time_and_a_closed_page_frees_the_server(server) -> None:
    slow = {"mode": "l2r", "length": 32, "delay_ms": 200}  # about 6 s if left to run
    req = urllib.request.Request(
        f"{server.url}/api/generate",
        data=json.dumps(slow).encode(),
        headers={"Content-Type": "application/json"},
    )
    first = urllib.request.urlopen(req, timeout=60)
    assert first.readline().decode().startswith("event: start")  # running now
    status, text = server.post({"mode": "l2r", "length": 8})
    assert status == 429
    assert json.loads(text)["error"].startswith("busy: this server runs 1 generation(s) at a")
    first.close()  # the page went away: the generation stops at its next pass
    for _ in range(100):
        status, text = server.post({"mode": "l2r", "length": 8})
        if status != 429:
            break
        threading.Event().wait(0.1)
    assert status == 200 and parse_sse(text)[-1][0] == "done"


class SlowRelease(threading.BoundedSemaphore):
    """A slot that takes 0.5 s to come free: a server that sends its answer before it frees
    the slot shows the race to the client's next request every time."""

    def release(self, n: int = 1) -> None:
        threading.Event().wait(0.5)
        super().release(n)


def test_a_client_that_has_its_answer_is_never_told_busy(server) -> None:
    server.server.app.slots = SlowRelease(1)
    for _ in range(3):  # a refused request takes no slot
        status, text = server.post({"mode": "lemma1", "steps": 1_000_000})
        assert status == 400 and "must lie in 1..n=32" in json.loads(text)["error"]
    req = urllib.request.Request(
        f"{server.url}/api/generate",
        data=json.dumps({"mode": "l2r", "length": 8}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as first:  # read up to `done`, then ask again
        while not first.readline().decode().startswith("event: done"):
            pass
        status, text = server.post({"mode": "l2r", "length": 8})
    assert status == 200 and parse_sse(text)[-1][0] == "done"


def test_a_bug_in_the_checks_is_a_500_and_the_server_keeps_serving(server, monkeypatch) -> None:
    import anyorder.serve.server as srv

    real = srv.plan_request

    def broken(loaded, req):
        if req.text == "boom":
            raise RuntimeError("boom")
        return real(loaded, req)

    monkeypatch.setattr(srv, "plan_request", broken)
    status, text = server.post({"text": "boom", "mode": "l2r", "length": 8})
    assert status == 500 and json.loads(text)["error"] == "internal error: RuntimeError: boom"
    status, text = server.post({"mode": "l2r", "length": 8})  # no slot was taken
    assert status == 200 and parse_sse(text)[-1][0] == "done"


def test_cli_serve(exports, tmp_path, monkeypatch, capsys) -> None:
    from anyorder.cli import main

    monkeypatch.chdir(tmp_path)  # no runs/demo here
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == (
        "anyorder serve: error: no model at runs/demo: run `make demo` first or pass a checkpoint"
    )
    # a real process on a free port answers, then stops on SIGTERM
    folder = str(exports["armd"].path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "anyorder.cli", "serve", folder, "--port", "0", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving armd (0.12M parameters, context 32) from"), line
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url + "api/info", timeout=60) as r:
            assert json.loads(r.read())["kind"] == "armd"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_port_in_use_or_a_bad_host_is_one_line(exports, capsys) -> None:
    """The refusal to listen named the fix only in theory: socketserver closes the server it
    could not bind, and that close read the intake not made yet (AttributeError, a
    traceback, for every port in use and every --host that does not resolve)."""
    from anyorder.cli import main

    folder = str(exports["armd"].path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", folder, "--port", str(port), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        f"anyorder serve: error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "pick another --host or --port\n"
    )
    app = App(exports["armd"], Limits())
    with pytest.raises(SamplingError, match=r"^cannot listen on a\.\.b:0 \(.+\); pick another "):
        make_server(app, "a..b", 0)


# ----------------------------------------------------------------------------- the browser


def _playwright():
    """Playwright's sync API, or a skip with the reason (a failure where CI requires it)."""
    missing = pytest.fail if os.environ.get("ANYORDER_REQUIRE_BROWSER") else pytest.skip
    if not CHROMIUM.exists():
        missing(
            "headless Chromium is not installed (/usr/bin/chromium; Debian: apt-get install "
            "chromium): the browser checks of the live page need it"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed (pip install -e '.[dev]')")
    return sync_playwright


def test_page_in_headless_chromium(exports, tmp_path) -> None:
    sync_playwright = _playwright()
    loaded = exports["armd"]
    body = {"text": TEMPLATE, "mode": "lemma1", "steps": 4, "seed": 11, "temperature": 0.9}
    _, _, (expected,) = direct(loaded, body)
    server = Running(loaded)
    shot = tmp_path / "serve.png"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 700})
                page.goto(server.url + "/")
                page.wait_for_selector("body[data-state=ready]", timeout=30_000)
                assert "armd" in page.inner_text("#model-info")
                # a plain prompt has a Length field; a template sets its own length
                page.fill("#text", "def ")
                assert page.is_visible("#length") and page.is_hidden("#length-note")
                page.fill("#text", TEMPLATE)
                assert page.is_hidden("#length") and page.is_visible("#length-note")
                # a bad template: a message on the page, no crash
                page.fill("#text", "a [MASK:0] b")
                page.click("#generate")
                page.wait_for_selector("body[data-state=error]", timeout=30_000)
                assert page.inner_text("#error").startswith("bad hole '[MASK:0]' at character 2")
                # the real request, with a fixed seed
                page.fill("#text", TEMPLATE)
                page.select_option("#mode", "lemma1")
                page.fill("#steps", "4")
                page.fill("#seed", "11")
                page.fill("#temperature", "0.9")
                page.click("#generate")
                page.wait_for_selector("body[data-state=done]", timeout=60_000)
                assert page.is_hidden("#error")
                assert page.input_value("#final-0") == expected
                assert page.inner_text("#step-counter").endswith("/ 4")
                cells = page.locator("#grid-0 .cell")
                assert cells.count() == 17
                assert page.locator("#grid-0 .cell.pending").count() == 0
                assert page.locator("#grid-0 .cell.known").count() == 8
                page.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
    finally:
        server.close()
    assert shot.stat().st_size > 1000
    print(f"screenshot: {shot}")
    out = os.environ.get("ANYORDER_ARTIFACTS")  # CI may keep it
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(out) / "serve.png")


def test_page_is_shipped_as_package_data() -> None:
    from importlib import resources

    for name in ("index.html", "app.js", "style.css"):
        assert (resources.files("anyorder") / "web" / name).is_file()
    assert 'anyorder = ["web/*"]' in (REPO / "pyproject.toml").read_text()


# ----------------------------------------------------------------------------- as an attacker


def raw(server, request: bytes, timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are (no client library fixing them up); the status line, headers
    and body of the answer."""
    import socket

    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def post_raw(server, body: bytes, **headers: str) -> bytes:
    fields = {"Host": "127.0.0.1", "Content-Type": "application/json"}
    fields.update({k.replace("_", "-"): v for k, v in headers.items()})
    fields.setdefault("Content-Length", str(len(body)))
    head = "".join(f"{k}: {v}\r\n" for k, v in fields.items() if v is not None)
    return f"POST /api/generate HTTP/1.1\r\n{head}\r\n".encode() + body


def test_huge_steps_are_refused_before_any_work(server) -> None:
    import time

    t0 = time.perf_counter()
    status, text = server.post({"mode": "lemma1", "steps": 1_000_000})
    assert status == 400 and time.perf_counter() - t0 < 30
    assert json.loads(text)["error"] == (
        "steps=1000000 must lie in 1..n=32 (at most n reverse steps reveal a token); use e.g. "
        "steps=8"
    )
    big = {"mode": "lemma1", "steps": 3_000_000, "text": "a[MASK:4]"}
    assert "must lie in 1..n=5" in json.loads(server.post(big)[1])["error"]


@pytest.mark.parametrize(
    "body, message",
    [
        ({"seed": 2**70}, "seed=1180591620717411303424 must be a whole number in 0..9223372"),
        ({"seed": -1}, "seed=-1 must be a whole number in 0.."),
        ({"text": "a[MASK:" + "9" * 5000 + "]"}, "hole [MASK:999999... (5000 digits)] is longer"),
        ({"length": 0}, "length=0 must be at least 1"),
        ({"temperature": 1e400}, "Infinity is not a JSON number; send a finite number"),
    ],
)
def test_out_of_range_numbers_get_400(server, body, message) -> None:
    status, text = server.post(None, raw=json.dumps(body).encode())
    assert status == 400 and message in json.loads(text)["error"]


def test_malformed_http_gets_json_errors(server) -> None:
    deep = b"[" * 30_000 + b"]" * 30_000
    status, _, body = raw(server, post_raw(server, deep))
    assert status == 400 and "nests deeper than 4 levels" in json.loads(body)["error"]
    status, _, body = raw(
        server, post_raw(server, b"{}", Content_Length="\u00b2".encode().decode("latin-1"))
    )
    assert status == 411 and "Content-Length" in json.loads(body)["error"]
    status, _, body = raw(server, post_raw(server, b'{"steps": ' + b"9" * 5000 + b"}"))
    assert status == 400 and "Exceeds the limit (4300 digits)" in json.loads(body)["error"]
    status, _, body = raw(server, post_raw(server, b"{}", Content_Length="9" * 5000))
    assert status == 413 and json.loads(body)["error"].startswith("the request is 99999999")
    chunked = post_raw(
        server, b"2\r\n{}\r\n0\r\n\r\n", Transfer_Encoding="chunked", Content_Length=None
    )
    assert raw(server, chunked)[0] == 411
    status, headers, body = raw(server, b"GARBAGE\r\n\r\n")
    assert status == 400 and headers["Content-Type"] == "application/json"
    assert json.loads(body)["error"]
    for method in ("PUT", "DELETE", "OPTIONS", "PATCH", "BREW"):
        status, headers, body = raw(
            server, f"{method} /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        )
        assert status == 405 and headers["Allow"] == "POST", method
        assert json.loads(body)["error"] == f"{method} is not served at /api/generate; use POST"
        status, _, body = raw(
            server, f"{method} /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        )
        assert status == 404 and json.loads(body)["error"] == "no page at /nowhere; the page is /"
    status, headers, body = raw(server, b"HEAD / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 405 and headers["Allow"] == "GET" and body == b""
    # the server is still up
    assert server.get("/api/info")[0] == 200


def test_other_sites_cannot_drive_or_read_the_server(server) -> None:
    body = json.dumps({"mode": "l2r", "length": 4}).encode()
    # a cross-site form or fetch: text/plain needs no preflight, so the server must refuse it
    status, _, text = raw(server, post_raw(server, body, Content_Type="text/plain"))
    assert status == 415 and "Content-Type: application/json" in json.loads(text)["error"]
    status, _, text = raw(server, post_raw(server, body, Origin="http://evil.example"))
    assert status == 403
    assert json.loads(text)["error"].startswith("cross-origin request from 'http://evil.example'")
    assert raw(server, post_raw(server, body, Origin="null"))[0] == 403
    # DNS rebinding: the page's own name in the Host header, on every path
    for request in (
        post_raw(server, body, Host="evil.example:8000"),
        b"GET /api/info HTTP/1.1\r\nHost: evil.example\r\n\r\n",
        b"GET /api/info HTTP/1.1\r\nHost: 127.0.0.1.evil.example\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 10.1.2.3\r\n\r\n",
        b"GET /api/info HTTP/1.0\r\n\r\n",
    ):
        status, _, text = raw(server, request)
        assert status == 403, request
        assert "is not this server's address" in json.loads(text)["error"]
    # the page itself: loopback names and the same origin
    port = server.url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]"):
        same = post_raw(server, body, Host=host, Origin=f"http://{host}")
        status, _, text = raw(server, same)
        assert status == 200 and parse_sse(text.decode())[-1][0] == "done", host


def _stuck(server, count: int) -> list:
    """``count`` connections holding half a request each."""
    import socket

    port = int(server.url.rsplit(":", 1)[1])
    out = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.sendall(b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        out.append(s)
    return out


@pytest.mark.parametrize("server", [("armd", Limits(request_timeout_s=1.0))], indirect=True)
def test_partial_requests_are_dropped_at_the_request_deadline(server) -> None:
    stuck = _stuck(server, 20)
    for s in stuck:  # the server answers and closes each one by itself (the client waits 60 s)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
        assert answer.startswith(b"HTTP/1.0 408 Request Timeout\r\n")
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"] == (
            "the request was not sent whole within 1 s and is dropped (it took too long); "
            "send the headers and body at once"
        )
    assert server.get("/api/info")[0] == 200


@pytest.mark.parametrize("server", [("armd", Limits(max_connections=1))], indirect=True)
def test_requests_answered_at_once_are_capped(server, monkeypatch) -> None:
    """A second request while the one worker is held gets 503; a client that closes its
    stream frees the worker at the generation's next pass, before the end it asked for.

    Nothing here depends on the machine's speed: the server's passes are counted (the real
    sampler runs, its step hook is wrapped), and the wait for the worker ends as soon as
    it is free (its generous deadline is reached only where the stop never comes)."""
    from anyorder.serve import generation

    passes = []
    real = generation._sample

    def counted(model, n, plan, gen, on_step, rounds):
        def step(*args):
            passes.append(1)
            return on_step(*args)

        return real(model, n, plan, gen, step, rounds)

    monkeypatch.setattr(generation, "_sample", counted)
    slow = {"mode": "l2r", "length": 32, "delay_ms": 500}  # 32 passes, >= 16 s if left to run
    req = urllib.request.Request(
        f"{server.url}/api/generate",
        data=json.dumps(slow).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as first:
        assert first.readline().decode().startswith("event: start")  # it holds the one worker
        status, headers, body = raw(server, b"GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 503 and headers["Content-Type"] == "application/json"
        assert headers["Retry-After"] == "1"
        assert json.loads(body)["error"] == "busy: this server answers 1 request(s) at once; retry"
        assert len(passes) < 32  # still generating when the second request was refused
    # closed by its client: the generation stops at its next pass and the worker is free
    for _ in range(3000):
        if server.get("/api/info")[0] == 200:
            break
        threading.Event().wait(0.1)
    assert server.get("/api/info")[0] == 200
    assert len(passes) < 32, "the generation ran to its end after its client had gone"


# ----------------------------------------------------------------------------- the docs


def test_docs_figures_are_the_codes() -> None:
    """docs/serve.md's parameter count of the demo model and its table of limits."""
    from dataclasses import fields

    from anyorder.config import load_config
    from anyorder.models import build_model

    doc = (REPO / "docs" / "serve.md").read_text()
    model = build_model(load_config(REPO / "configs" / "demo.yaml").model)
    assert f"a {model.num_params() / 1e6:.2f}M-parameter ARMD" in doc
    limits = Limits()
    rows = [line for line in doc.splitlines() if line.startswith("| ")]
    for f in fields(Limits):
        value = getattr(limits, f.name)
        shown = (
            f"{value:g} s" if f.name.endswith("_s")
            else f"{value} ms" if f.name.endswith("_ms")
            else f"{value // 1024} KiB" if f.name.endswith("_bytes")
            else str(value)
        )  # fmt: skip
        row = [r for r in rows if f"`{f.name}`" in r or f"`--{f.name.replace('_', '-')}`" in r]
        assert len(row) == 1, f.name
        assert row[0].split(" | ")[1].startswith(shown), (f.name, shown, row[0])
