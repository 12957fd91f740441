"""A vLLM request's order: the per-request fields, checked, and the order they name.

Kept free of vLLM so that its rules are tested in the main environment too. The engine runs
them twice: at admission, where a bad request gets vLLM's usual 400 naming the field
(:mod:`anyorder.vllm.admission`), and in the worker, where the order becomes the tables the
model reads (:mod:`anyorder.vllm.tables`).

A request chooses its order through ``SamplingParams.extra_args`` (``vllm_xargs`` over
HTTP); with neither field it is left to right:

* ``anyorder_order``: the positions in the order they are filled, the prompt's tokens first.
  With a prompt of ``k`` tokens and ``max_tokens`` ``m`` it is a permutation of
  ``0 .. k + m - 1``: the prompt's tokens sit at its first ``k`` positions (anywhere: this is
  infilling), the ``m`` generated tokens fill the rest in the order given.
* ``anyorder_seed``: a random order: the prompt's tokens first, left to right, the rest
  uniformly at random, drawn from this seed by :func:`seeded_order` (the same draw as
  anyorder's samplers give a prompt, :func:`anyorder.sampling.draws.prompt_order`).

The generated tokens come back in the order they were generated; :func:`place` puts the
prompt's and the generated tokens at their positions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

ORDER_KEY = "anyorder_order"
SEED_KEY = "anyorder_seed"
ADMITTED_KEY = "anyorder_admitted"
"""Set by admission on every request it let in (the worker checks it: a request that did not
pass admission has no BOS slot, and decoding it would be silently wrong)."""

_WHERE = "(vllm_xargs over HTTP, SamplingParams.extra_args in Python)"


class RequestError(ValueError):
    """A request's order fields that cannot be served; ``parameter`` names the field."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_seed(seed: Any) -> int:
    if not _whole(seed) or not 0 <= seed < 2**63:
        raise RequestError(
            f"{SEED_KEY} {_WHERE} must be a whole number in [0, 2**63), not "
            f"{json.dumps(seed, default=str)[:40]}",
            SEED_KEY,
        )
    return seed


def _check_order(order: Any, length: int, prompt_len: int, max_tokens: int) -> list[int]:
    if not isinstance(order, list) or not all(_whole(p) for p in order):
        raise RequestError(
            f"{ORDER_KEY} {_WHERE} must be a list of whole numbers (positions), not "
            f"{json.dumps(order, default=str)[:60]}",
            ORDER_KEY,
        )
    if len(order) != length:
        raise RequestError(
            f"{ORDER_KEY} has {len(order)} positions, but the prompt's {prompt_len} tokens and "
            f"max_tokens {max_tokens} make {length}: give a permutation of 0..{length - 1} "
            "(the prompt's positions first), or change max_tokens",
            ORDER_KEY,
        )
    seen: set[int] = set()
    for p in order:
        if not 0 <= p < length:
            raise RequestError(
                f"{ORDER_KEY} is not a permutation of 0..{length - 1}: position {p} is out of "
                "range",
                ORDER_KEY,
            )
        if p in seen:
            raise RequestError(
                f"{ORDER_KEY} is not a permutation of 0..{length - 1}: position {p} appears twice",
                ORDER_KEY,
            )
        seen.add(p)
    return list(order)


def seeded_order(prompt_len: int, length: int, seed: int) -> list[int]:
    """The order ``anyorder_seed`` names: positions ``0 .. prompt_len - 1`` first, the other
    positions of ``0 .. length - 1`` after them in a uniformly random order drawn from
    ``seed`` (a CPU ``torch.Generator``)."""
    known = (torch.arange(length) < prompt_len)[None]
    from anyorder.sampling.draws import prompt_order

    generator = torch.Generator().manual_seed(seed)
    return prompt_order(known, generator, "random")[0].tolist()


def resolve_order(
    extra_args: Mapping[str, Any] | None,
    *,
    prompt_len: int,
    max_tokens: int,
    seq_len: int,
    kind: str,
    ignore_eos: bool = True,
    stops: bool = False,
) -> list[int] | None:
    """The order a request asks for: None for left to right, else every position in the
    order it is filled (the prompt's first).

    Args:
        extra_args: the request's ``SamplingParams.extra_args``.
        prompt_len: the prompt's tokens (the BOS slot not counted).
        max_tokens: the tokens to generate.
        seq_len: the model's positions.
        kind: the export's kind (``gpt`` reads left to right only).
        ignore_eos: whether the request ignores EOS (an any-order request must).
        stops: whether it names stop strings or stop tokens (an any-order request must not).

    Raises:
        RequestError: the fields cannot be served, with the field's name.
    """
    args = extra_args or {}
    has_order, has_seed = ORDER_KEY in args, SEED_KEY in args
    if not (has_order or has_seed):
        return None
    if has_order and has_seed:
        raise RequestError(f"give {ORDER_KEY} or {SEED_KEY}, not both", ORDER_KEY)
    key = ORDER_KEY if has_order else SEED_KEY
    if kind == "gpt":
        raise RequestError(
            f"this export is a gpt model, which reads left to right only: drop {key}, or "
            "serve an aogpt export for any order",
            key,
        )
    length = prompt_len + max_tokens
    if length > seq_len:
        raise RequestError(
            f"the prompt's {prompt_len} tokens and max_tokens {max_tokens} make {length} "
            f"positions, but the model has {seq_len}: lower max_tokens to "
            f"{max(seq_len - prompt_len, 0)} or less",
            "max_tokens",
        )
    if has_order:
        order = _check_order(args[ORDER_KEY], length, prompt_len, max_tokens)
    else:
        order = seeded_order(prompt_len, length, _check_seed(args[SEED_KEY]))
    if order == list(range(length)):
        return None  # left to right after all
    if not ignore_eos:
        raise RequestError(
            f"a request with {key} must set ignore_eos: true (in any order the first EOS "
            "drawn would end it before every position is filled)",
            "ignore_eos",
        )
    if stops:
        raise RequestError(
            f"a request with {key} cannot take stop strings or stop_token_ids (they end a "
            "text left to right); drop them",
            "stop",
        )
    return order


def cache_salt(order: Sequence[int]) -> str:
    """A prefix-cache salt for an order: the cached keys and values of a slot depend on the
    positions it holds and predicts, so only requests with the same order share them."""
    digest = hashlib.sha256(json.dumps(list(order)).encode()).hexdigest()
    return f"anyorder-order-{digest[:32]}"


def place(
    prompt: Sequence[int], generated: Sequence[int], order: Sequence[int] | None
) -> list[int | None]:
    """The tokens at their positions: ``prompt`` (without the BOS) then ``generated``, in the
    order's positions (left to right without one); positions not yet filled are None."""
    tokens = list(prompt) + list(generated)
    if order is None:
        return list(tokens)
    out: list[int | None] = [None] * len(order)
    for position, token in zip(order, tokens, strict=False):
        out[position] = token
    return out
