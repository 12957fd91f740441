"""Serving an aogpt export three ways, side by side in one run: tokens/s and requests/s for
1, 8 and 32 concurrent requests, left to right and in a random order per request.

* vLLM: its OpenAI-compatible server with the anyorder plugin (``python -m
  vllm.entrypoints.openai.api_server``), one HTTP completion per request
  (random order: ``vllm_xargs: {"anyorder_seed": i}``);
* ``anyorder serve``: its HTTP API, one ``/api/generate`` per request (one generation at a
  time: a client answered 429 waits for ``Retry-After`` and asks again);
* anyorder's own batched sampler, in this process: ``sample(model, n, batch=N)``.

Run it in the vLLM environment (``make test-vllm`` builds it)::

    .venv-vllm/bin/python benchmarks/vllm_serving.py            # about 5 minutes on 2 cores

The model is random (weights do not change the work): aogpt, 4 x 256, 4 heads, n = 128, a
byte vocabulary; prompts of 4 tokens, 124 generated. On a CPU, vLLM's worker runs torch on
one thread and keeps one core for its front end; ``--threads`` sets anyorder's sampler's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import machine, print_table, write_json  # noqa: E402

PROMPT = "The "
N = 128
CONCURRENCY = [1, 8, 32]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(1)


class Server:
    """A server subprocess, its log in the work folder, stopped on exit."""

    def __init__(self, cmd: list[str], health: str, work: Path, name: str) -> None:
        self.log = work / f"{name}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _wait(health, self.proc, self.log)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _concurrently(requests: int, one) -> float:
    """Wall seconds for ``requests`` calls of ``one(i)``, all sent at once."""
    start = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        list(pool.map(one, range(requests)))
    return time.perf_counter() - start


def vllm_rows(folder: Path, work: Path, generated: int) -> list[dict]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
        "--dtype", "float32", "--max-num-seqs", str(max(CONCURRENCY)),
        "--kv-cache-memory-bytes", str(1 << 28),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    rows = []
    with Server(cmd, f"{url}/health", work, "vllm"):

        def one(mode: str, i: int) -> None:
            body = {"model": "bench", "prompt": PROMPT, "max_tokens": generated,
                    "temperature": 1.0, "seed": i, "ignore_eos": True}  # fmt: skip
            if mode == "random":
                body["vllm_xargs"] = {"anyorder_seed": i}
            status, text, _ = _post(f"{url}/v1/completions", body)
            got = json.loads(text)
            if status != 200 or got["usage"]["completion_tokens"] != generated:
                raise RuntimeError(f"vLLM answered {status}: {text[:300]!r}")

        for mode in ("l2r", "random"):
            one(mode, 0)  # warm-up
            for c in CONCURRENCY:
                wall = _concurrently(c, lambda i, mode=mode: one(mode, i))
                rows.append(dict(server="vLLM", mode=mode, concurrency=c, seconds=wall))
    return rows


def serve_rows(folder: Path, work: Path, generated: int) -> list[dict]:
    port = _free_port()
    cmd = [sys.executable, "-m", "anyorder.cli", "serve", str(folder), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    rows = []
    with Server(cmd, f"{url}/api/info", work, "anyorder-serve"):

        def one(mode: str, i: int) -> None:
            body = {"text": PROMPT, "mode": mode, "length": N, "seed": i, "temperature": 1.0}
            while True:
                status, text, headers = _post(f"{url}/api/generate", body)
                if status == 429:  # one generation at a time: wait and ask again
                    time.sleep(min(float(headers.get("Retry-After", 1)), 0.05))
                    continue
                if status != 200 or b"event: done" not in text:
                    raise RuntimeError(f"anyorder serve answered {status}: {text[-300:]!r}")
                return

        for mode in ("l2r", "random"):
            one(mode, 0)
            for c in CONCURRENCY:
                wall = _concurrently(c, lambda i, mode=mode: one(mode, i))
                rows.append(dict(server="anyorder serve", mode=mode, concurrency=c, seconds=wall))
    return rows


def sampler_rows(model, tokenizer) -> list[dict]:
    from anyorder.sampling import sample

    ids = tokenizer.encode(PROMPT)
    prompt = torch.zeros(1, N, dtype=torch.long)
    prompt[0, : len(ids)] = torch.tensor(ids)
    known = torch.arange(N)[None] < len(ids)
    rows = []
    for mode in ("l2r", "random"):
        for c in (1, *CONCURRENCY):  # the first: a warm-up
            g = torch.Generator().manual_seed(0)
            start = time.perf_counter()
            sample(model, N, order=mode, batch=c, prompt=prompt, known=known, generator=g)
            wall = time.perf_counter() - start
            rows.append(dict(server="anyorder sampler", mode=mode, concurrency=c, seconds=wall))
        del rows[-len(CONCURRENCY) - 1]  # drop the warm-up
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="anyorder's sampler's threads")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/vllm_serving.json"))
    ap.add_argument("--quick", action="store_true", help="n = 32, 1 and 2 requests (a check)")
    args = ap.parse_args()
    global N
    if args.quick:
        N, CONCURRENCY[:] = 32, [1, 2]
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    torch.set_num_threads(args.threads)
    from anyorder.checkpoint.exporting import save_pretrained
    from anyorder.config import preset
    from anyorder.data.tokenizers import ByteTokenizer
    from anyorder.models import build_model

    torch.manual_seed(0)
    size = (
        dict(n_layer=2, n_head=2, d_model=64)
        if args.quick
        else dict(n_layer=4, n_head=4, d_model=256)
    )
    cfg = preset("tiny", kind="aogpt", vocab_size=257, seq_len=N, **size)
    model, tokenizer = build_model(cfg).eval(), ByteTokenizer()
    generated = N - len(tokenizer.encode(PROMPT))
    with tempfile.TemporaryDirectory(prefix="anyorder-vllm-bench-") as tmp:
        work = Path(tmp)
        folder = save_pretrained(model, work / "export", tokenizer)
        rows = vllm_rows(folder, work, generated)
        rows += serve_rows(folder, work, generated)
        rows += sampler_rows(model, tokenizer)
    for r in rows:
        r["tokens_per_s"] = r["concurrency"] * generated / r["seconds"]
        r["requests_per_s"] = r["concurrency"] / r["seconds"]
    table = [
        [r["server"], r["mode"], r["concurrency"], r["seconds"], r["tokens_per_s"],
         r["requests_per_s"]]
        for r in rows
    ]  # fmt: skip
    print_table(
        f"aogpt {cfg.n_layer} x {cfg.d_model}, n = {N} ({generated} generated a request), fp32",
        ["server", "order", "requests", "wall s", "tokens/s", "requests/s"],
        table,
    )
    cost = {
        c: next(r for r in rows if r["server"] == "vLLM" and r["mode"] == "random"
                and r["concurrency"] == c)["tokens_per_s"]
        / next(r for r in rows if r["server"] == "vLLM" and r["mode"] == "l2r"
               and r["concurrency"] == c)["tokens_per_s"]
        for c in CONCURRENCY
    }  # fmt: skip
    print("vLLM, random order over left to right (tokens/s): "
          + ", ".join(f"{c}: {v:.2f}x" for c, v in cost.items()))  # fmt: skip
    payload = {"machine": machine(), "rows": rows, "random_over_l2r": cost}
    write_json(args.json, {**payload, "threads": args.threads, "n": N, "generated": generated})


if __name__ == "__main__":
    main()
