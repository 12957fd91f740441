"""The user-facing bounds of a sampling request, shared by the CLI, the API and the server.

``anyorder sample``, :class:`anyorder.api.Model` and ``anyorder serve`` take the same
numbers from users (steps, length, number of samples, seed, hole widths, temperature,
top-p, top-k). They are checked here, once, before a sampler is invoked, so a request that
cannot run allocates nothing and every surface gives the same one-line message.

Design choices:

* Two stages. :func:`check_controls` needs no model and runs before one is loaded (a bad
  seed fails in milliseconds, not after loading a large checkpoint); :func:`check_fit`
  checks the length, the steps and the holes against the loaded model's context.
* ``steps`` lies in ``1..n``: a reverse step that reveals nothing costs no forward pass, so
  at most ``n`` steps are non-empty and more only cost planning time and memory.
* ``length`` lies in ``1..seq_len``; 0 is an error, not "the full context" (leave it out
  for that).
* Seeds lie in ``0..2**63 - 1``: every generator we seed (torch, numpy) takes them, and
  JSON clients cannot send a number that silently loses bits.
* ``num_samples`` is one batch; :data:`MAX_NUM_SAMPLES` bounds it on the CLI and in the API
  (the server has its own, lower ``--max-samples``).
* A hole's width is read from its digits only after checking how many there are, so
  ``[MASK:<5000 digits>]`` is "longer than the context", not Python's int-conversion limit.
* Names in messages are the JSON/API field names (``num_samples=0``); the CLI flag is the
  same word with dashes.
* The API's text arguments (a prompt, a template, messages) are checked for their type
  (:func:`check_text`): the command line and JSON can only give them as strings.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from collections.abc import Iterator
from typing import Any

from anyorder.errors import PREVIEW_CHARS, AnyorderError, SamplingError, preview

MAX_SEED = 2**63 - 1
"""Largest seed (the int64 range every generator takes)."""
MIN_TEMPERATURE = 1e-6
"""Smallest temperature: logits divided by less overflow (a subnormal such as 5e-324 is 0 in
fp32), and anything below 0.01 samples greedily already."""
MAX_NUM_SAMPLES = 1024
"""Most samples in one batch on the CLI and in the API."""
_HOLE_DIGITS = re.compile(r"\[MASK:([0-9]+)\]")  # ASCII digits only


def shown(value: object) -> str:
    """A user's number as the message quotes it: as written, or cut by
    :func:`~anyorder.errors.preview` past :data:`~anyorder.errors.PREVIEW_CHARS` characters
    (a JSON number may have thousands of digits)."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= PREVIEW_CHARS else preview(value)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    # True is not a temperature of 1: a flag passed by mistake is refused, not counted
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_float(value: numbers.Real) -> float:
    """``value`` as a float; an int too large for one (10**400) is infinite."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def check_text(
    value: object,
    name: str,
    *,
    messages: bool = False,
    optional: bool = False,
    error: type[AnyorderError] = SamplingError,
) -> Any:
    """A user's text at the API's boundary: a ``str`` (``None`` too with ``optional``; a
    list of chat messages too with ``messages``, which their reader checks). Returns it.
    Anything else failed deep inside a tokenizer (``'int' object has no attribute
    'encode'``), or was taken for something else (``b"hi"`` as a list of messages).

    Raises:
        error: naming ``name``, the type given and what is expected.
    """
    if isinstance(value, str) or (optional and value is None):
        return value
    if messages and isinstance(value, (list, tuple)):
        return value
    want = "a str or a list of {'role': ..., 'content': ...} messages" if messages else "a str"
    if isinstance(value, (bytes, bytearray)):
        fix = "decode it first, e.g. .decode('utf-8')"
    elif messages and isinstance(value, dict):
        fix = "pass one message as a list of one"
    else:
        fix = "pass the text as a str"
    raise error(f"{name} must be {want}, not {type(value).__name__} ({preview(value)}); {fix}")


def check_seed(seed: object, name: str = "seed") -> int:
    """A seed in ``0..MAX_SEED``.

    Raises:
        SamplingError: not a whole number, or out of range.
    """
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        shown = (
            str(seed) if len(str(seed)) <= 30 else f"{str(seed)[:20]}... ({len(str(seed))} digits)"
        )
        raise SamplingError(f"{name}={shown} must be a whole number in 0..{MAX_SEED} (2**63 - 1)")
    return seed


def check_controls(
    *,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    num_samples: int = 1,
    seed: int = 0,
    steps: int | None = None,
    length: int | None = None,
    max_samples: int = MAX_NUM_SAMPLES,
    limit_note: str = "",
) -> None:
    """What can be checked without the model: controls, counts and the seed.

    Args:
        temperature, top_p, top_k: the sampling controls.
        num_samples: samples in the batch (``1..max_samples``).
        seed: the seed (:func:`check_seed`).
        steps: reverse steps (>= 1; the upper bound needs the length, :func:`check_fit`).
        length: tokens per sample (>= 1; the upper bound is the model's context).
        max_samples: the largest batch this surface takes.
        limit_note: appended to the ``num_samples`` message (e.g. "this server's limit").

    Raises:
        SamplingError: the first value out of range.
    """
    if not _is_real(temperature):
        raise SamplingError(
            f"temperature={shown(temperature)} must be a number > 0, e.g. 1.0 (0.01 for "
            "near-greedy)"
        )
    t = _as_float(temperature)
    if t > 0 and not t < math.inf:
        raise SamplingError(
            f"temperature={shown(temperature)} must be a finite number > 0, e.g. 1.0"
        )
    if not 0 < t < math.inf:
        raise SamplingError(
            f"temperature={temperature} must be > 0 (use e.g. 0.01 for near-greedy)"
        )
    if t < MIN_TEMPERATURE:
        raise SamplingError(
            f"temperature={temperature} is below {MIN_TEMPERATURE:g}, where the scaled logits "
            "overflow; use e.g. 0.01 for near-greedy"
        )
    if top_p is not None and not (_is_real(top_p) and 0.0 < _as_float(top_p) <= 1.0):
        raise SamplingError(
            f"top-p={shown(top_p)} must lie in (0, 1]; use e.g. 0.9, or 1 for no cut"
        )
    if top_k is not None and not _is_int(top_k):
        raise SamplingError(
            f"top-k={shown(top_k)} must be a whole number, at least 1; leave it out to keep "
            "every token"
        )
    if top_k is not None and top_k < 1:
        raise SamplingError(
            f"top-k={shown(top_k)} must be at least 1; leave it out to keep every token"
        )
    if not _is_int(num_samples) or not 1 <= num_samples <= max_samples:
        note = f" ({limit_note})" if limit_note else ""
        raise SamplingError(f"num_samples={shown(num_samples)} must lie in 1..{max_samples}{note}")
    check_seed(seed)
    if steps is not None and not _is_int(steps):
        raise SamplingError(f"steps={shown(steps)} must be a whole number, at least 1")
    if length is not None and not _is_int(length):
        raise SamplingError(
            f"length={shown(length)} must be a whole number; leave it out for the model's "
            "full context"
        )
    if steps is not None and steps < 1:
        raise SamplingError(f"steps={shown(steps)} must be at least 1")
    if length is not None and length < 1:
        raise SamplingError(
            f"length={shown(length)} must be at least 1; leave it out for the model's full context"
        )


def check_length(length: int | None, seq_len: int) -> int:
    """Tokens per sample: ``length`` in ``1..seq_len``, or ``seq_len`` when None.

    Raises:
        SamplingError: out of range.
    """
    if length is None:
        return seq_len
    if not 1 <= length <= seq_len:
        raise SamplingError(
            f"length n={shown(length)} must lie in 1..{seq_len} (the model's context)"
        )
    return length


def check_steps(steps: int | None, n: int) -> None:
    """``steps`` in ``1..n`` (``n`` the sample's length): more steps reveal nothing more.

    Raises:
        SamplingError: not a whole number, or out of range.
    """
    if steps is not None and not _is_int(steps):
        raise SamplingError(f"steps={shown(steps)} must be a whole number, at least 1")
    if steps is not None and not 1 <= steps <= n:
        raise SamplingError(
            f"steps={shown(steps)} must lie in 1..n={n} (at most n reverse steps reveal a "
            f"token); use e.g. steps={max(1, n // 4)}"
        )


def check_holes(template: str, seq_len: int) -> None:
    """Every ``[MASK:n]`` hole of a template is at most the context wide, judged from the
    number of its digits first (``int()`` of thousands of digits is refused by Python).

    Raises:
        SamplingError: a hole wider than ``seq_len``.
    """
    for m in _HOLE_DIGITS.finditer(template):
        digits = m.group(1).lstrip("0") or "0"
        if len(digits) > len(str(seq_len)) or int(digits) > seq_len:
            shown = digits if len(digits) <= 12 else f"{digits[:6]}... ({len(digits)} digits)"
            raise SamplingError(
                f"hole [MASK:{shown}] is longer than the model's context ({seq_len} tokens)"
            )


def check_fit(seq_len: int, *, length: int | None = None, steps: int | None = None) -> int:
    """What needs the model: the length against its context, the steps against the length.
    Returns the length (``seq_len`` when None). A template's holes are checked with
    :func:`check_holes` before it is parsed, and its steps with :func:`check_steps` after.

    Raises:
        SamplingError: the first value out of range.
    """
    n = check_length(length, seq_len)
    check_steps(steps, n)
    return n


def check_new_tokens(
    new: int | None,
    seq_len: int,
    prompt_len: int,
    *,
    name: str = "max_new_tokens",
    streams: int | None = None,
) -> int:
    """Tokens to generate after a prompt of ``prompt_len`` tokens: ``new`` in
    ``1..seq_len - prompt_len``, or all of that room when None. ``name`` is how the caller
    spells ``new`` in the error. With ``streams=S`` (strided decoding cuts the answer into
    ``S`` equal streams) the default is the largest multiple of ``S`` that fits, and a
    ``new`` that ``S`` does not divide is refused.

    Raises:
        SamplingError: a prompt that leaves no room, or ``new`` out of range.
    """
    room = seq_len - prompt_len
    if room < 1:
        raise SamplingError(
            f"the chat prompt is {prompt_len} tokens with its template, leaving no room for an "
            f"answer in the model's context of {seq_len}; shorten the prompt"
        )
    if new is None:
        if streams is None or not _is_int(streams) or streams < 1 or room < streams:
            return room  # the sampler names a bad S
        return room - room % streams
    if not _is_int(new) or not 1 <= new <= room:
        raise SamplingError(
            f"{name}={shown(new)} must lie in 1..{room} (the model's context of {seq_len} "
            f"tokens less the prompt's {prompt_len})"
        )
    if streams is not None and _is_int(streams) and streams >= 1 and new % streams:
        raise SamplingError(
            f"{name}={new} is not a multiple of the {streams} streams (strided decoding cuts "
            f"the answer into equal streams); use {new - new % streams or streams} or leave "
            f"{name} out"
        )
    return int(new)


def prefix_prompt(ids: list[int], n: int, *, length: str, name: str):
    """A prompt of token ``ids`` as the known prefix of ``n`` slots: ``(prompt, known)``, (n,)
    each. ``length`` and ``name`` are how the caller's surface spells the length in the
    error (``"--length 64"`` and ``"--length"`` on the command line)."""
    import torch

    if len(ids) >= n:
        raise SamplingError(
            f"the prompt is {len(ids)} tokens, not shorter than {length}; raise {name} or "
            "shorten the prompt"
        )
    prompt = torch.zeros(n, dtype=torch.long)
    prompt[: len(ids)] = torch.tensor(ids, dtype=torch.long)
    known = torch.zeros(n, dtype=torch.bool)
    known[: len(ids)] = True
    return prompt, known


@contextlib.contextmanager
def out_of_memory_as_error(what: str) -> Iterator[None]:
    """Turn an allocation failure (CPU or CUDA) inside the block into a one-line
    :class:`SamplingError` naming ``what`` was asked for and the fix."""
    import torch

    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        text = str(e)
        if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and (
            "can't allocate memory" not in text and "out of memory" not in text
        ):
            raise
        raise SamplingError(
            f"out of memory for {what}; ask for fewer samples or a shorter length"
        ) from None
