"""Text in and out: infilling templates (holes ``[MASK:n]``), chat prompts, decoding,
:func:`infill`.

Design choices:

* A template is literal text and holes; each literal run is encoded on its own, so a subword
  tokenizer never merges across a hole, and ``[MASK`` always opens a hole (no escaping).
* :func:`infill` is :func:`anyorder.sampling.samplers.sample` with the template's known
  tokens as a prompt shared by every sample (prefilled once).
* A chat request (:func:`chat_prompt`) is a prefix prompt like ``--prompt``'s: the ids the
  chat template puts before the answer (:func:`anyorder.data.chat.render_prompt`), then
  ``max_new`` unknown slots that any sampler fills; the answer is what follows the prompt,
  cut at its first EOS (:func:`decode_text` of the unknown slots).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from anyorder.errors import SamplingError, preview
from anyorder.models.base import AnyOrderLM
from anyorder.sampling.samplers import sample

if TYPE_CHECKING:
    from anyorder.data import Tokenizer

HOLE_GRAMMAR = (
    "a template is literal text with holes; a hole is [MASK:n] with n a whole number >= 1 "
    "(n tokens to fill); the text '[MASK' always opens a hole"
)
_HOLE = re.compile(r"\[MASK:([0-9]+)\]")  # ASCII digits only: int("٣") is 3


def parse_template(
    text: str, tokenizer: Tokenizer, max_len: int | None = None
) -> tuple[Tensor, Tensor]:
    """Tokens and known mask of an infilling template such as ``"The [MASK:20] of Python"``.

    Grammar: the template is literal text and holes; a hole is ``[MASK:n]`` with ``n`` a
    decimal integer >= 1 and stands for ``n`` unknown tokens; every other character is
    literal. Each literal run is encoded on its own (so a subword tokenizer never merges
    across a hole); the text ``[MASK`` cannot appear literally.

    Args:
        text: the template.
        tokenizer: encodes the literal runs.
        max_len: longest allowed result (the model's context).

    Returns:
        ``(tokens, known)``: (n,) int64 ids (0 in the holes) and (n,) bool.

    Raises:
        SamplingError: an unterminated or malformed hole, a template without holes, or one
            longer than ``max_len``.
    """
    ids: list[int] = []
    known: list[bool] = []
    holes = total = 0  # total: the template's length, counted past max_len but not laid out
    i = 0
    while True:
        j = text.find("[MASK", i)
        literal = text[i:] if j < 0 else text[i:j]
        if literal:
            piece = tokenizer.encode(literal)
            total += len(piece)
            if max_len is None or total <= max_len:
                ids += piece
                known += [True] * len(piece)
        if j < 0:
            break
        m = _HOLE.match(text, j)
        digits = m.group(1).lstrip("0") if m else ""  # "" for no hole or [MASK:0]
        if not digits:
            close = text.find("]", j)
            if close < 0:
                raise SamplingError(
                    f"unterminated hole at character {j} of the template; close it as [MASK:n]"
                )
            hole = preview(text[j : close + 1])  # cut: the next "]" may be 60,000 characters on
            if 0 <= text.find("[MASK", j + 1) < close:
                raise SamplingError(
                    f"holes overlap at character {j} of the template ({hole}); "
                    "put them side by side, e.g. [MASK:3][MASK:2]"
                )
            raise SamplingError(
                f"bad hole {hole} at character {j}; write [MASK:n] with a whole number n >= 1"
            )
        # int() refuses thousands of digits: judge a long number by its length first
        if max_len is not None and (len(digits) > 18 or int(digits) > max_len):
            shown = digits if len(digits) <= 12 else f"{digits[:6]}... ({len(digits)} digits)"
            raise SamplingError(
                f"hole [MASK:{shown}] is longer than the model's context ({max_len} tokens)"
            )
        size = int(digits)
        total += size
        if max_len is None or total <= max_len:  # thousands of wide holes fit in 64 KiB
            ids += [0] * size
            known += [False] * size
        holes += 1
        i = m.end()
    if holes == 0:
        raise SamplingError("the template has no hole; mark the text to fill with [MASK:n]")
    if max_len is not None and total > max_len:
        raise SamplingError(
            f"the template is {total} tokens, longer than the model's context ({max_len}); "
            "shorten the text or the holes"
        )
    return torch.tensor(ids, dtype=torch.long), torch.tensor(known, dtype=torch.bool)


def chat_prompt(
    prompt_or_messages: object,
    tokenizer: Tokenizer,
    seq_len: int,
    vocab_size: int,
    max_new: int | None = None,
    *,
    name: str = "max_new_tokens",
    streams: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Tokens and known mask of a chat request: the rendered prompt, then ``max_new`` slots
    for the answer (default: the rest of the context).

    Args:
        prompt_or_messages: a user message (text) or a list of ``{"role", "content"}``
            messages, rendered with the tokenizer's chat template up to the answer.
        tokenizer: the model's tokenizer.
        seq_len: the model's context.
        vocab_size: the model's vocabulary (the rendered ids must lie below it).
        max_new: answer tokens at most.
        name: how the caller spells ``max_new`` in errors (``--max-new-tokens``).
        streams: strided decoding's ``S``: the answer's length is a multiple of it
            (:func:`anyorder.bounds.check_new_tokens`).

    Returns:
        ``(tokens, known)``: (n,) int64 ids (0 in the answer's slots) and (n,) bool, the
        prompt's ``len(ids)`` slots known and the ``n - len(ids)`` after them not.

    Raises:
        SamplingError: a prompt that leaves no room for an answer, ``max_new`` out of range,
            or ids the model cannot read.
    """
    from anyorder import bounds
    from anyorder.data.chat import render_prompt

    ids = render_prompt(prompt_or_messages, tokenizer)
    if ids and max(ids) >= vocab_size:
        raise SamplingError(
            f"the tokenizer gives ids up to {max(ids)} but the model reads {vocab_size}; use "
            "the model's own tokenizer"
        )
    new = bounds.check_new_tokens(max_new, seq_len, len(ids), name=name, streams=streams)
    n = len(ids) + new
    return bounds.prefix_prompt(ids, n, length=f"n={n}", name=name)


def decode_text(
    tokenizer: Tokenizer, tokens: Tensor, eos_id: int | None = None, known: Tensor | None = None
) -> str:
    """Text of one sequence (n,), cut at the first ``eos_id`` when given; with ``known``
    (n,), the prompt's positions, only a generated EOS cuts it (a prompt's EOS is text the
    caller gave, dropped like every EOS but never the end)."""
    ids = tokens.tolist()
    if eos_id is not None:
        given = [False] * len(ids) if known is None else known.tolist()
        ends = [i for i, (t, g) in enumerate(zip(ids, given)) if t == eos_id and not g]
        ids = ids[: ends[0]] if ends else ids
    return tokenizer.decode(ids)


def infill(
    model: AnyOrderLM,
    tokenizer: Tokenizer,
    template: str,
    *,
    num_samples: int = 1,
    order: str = "random",
    steps: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> list[str]:
    """Fill the holes of ``template`` (:func:`parse_template`); one text per sample.

    The known tokens are prefilled first (one pass, shared by the samples); the holes are
    generated in ``order`` (``random`` or ``l2r``), one token per pass, or by Lemma 1 in
    ``steps`` steps. A ``gpt`` fills only a hole at the end.
    """
    tokens, known = parse_template(template, tokenizer, model.cfg.seq_len)
    if int(tokens.max()) >= model.cfg.vocab_size:
        raise SamplingError(
            f"the tokenizer gives ids up to {int(tokens.max())} but the model reads "
            f"{model.cfg.vocab_size}; use the model's own tokenizer"
        )
    if model.kind == "gpt":
        order = "l2r"
    result = sample(
        model,
        len(tokens),
        order=order,
        steps=steps,
        batch=num_samples,
        prompt=tokens,
        known=known,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    return [decode_text(tokenizer, row) for row in result.tokens]
