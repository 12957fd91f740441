"""Conversational records: prompt/response or messages, rendered to a prompt and an answer.

Design choices:

* A record is ``{"prompt": str, "response": str}`` or ``{"messages": [{"role", "content"},
  ...]}`` with roles ``system``, ``user`` and ``assistant``; the last message is the
  assistant's answer, the one trained on, and every message before it is the prompt (earlier
  assistant turns included). A prompt/response record is the messages ``[user, assistant]``.
* Rendering goes through the tokenizer's chat template when it has one (a ``transformers``
  tokenizer whose ``tokenizer_config.json`` holds ``chat_template``, as a converted Qwen or
  Llama does): the prompt is the conversation before the answer with the generation prompt,
  the answer is what the whole conversation adds after it. Tokenizers without a template
  (the byte tokenizer, BPEs trained here, GPT-2) get :data:`PLAIN_TEMPLATE`: each turn is
  ``<|ROLE|>`` and a newline, its content, and EOS; the generation prompt is
  ``<|assistant|>`` and a newline. So the answer there is its text and one EOS.
* A template is a model folder's Jinja code, untrusted: it renders as ``apply_chat_template``
  renders it, but bounded in work, size and time (:mod:`anyorder.data.chat_template`).
* The ids the model sees before the answer at generation time (:func:`render_prompt`) are
  exactly the prompt ids training conditions on (:func:`encode_example`).
* Every answer ends with EOS (appended when the template ends a turn otherwise), so a model
  learns to end; :meth:`Example.block` pads the block with more EOS (see docs/data.md).
* A prompt that leaves no room for an answer in ``seq_len`` is refused, naming the record;
  an answer too long for the block is cut at the block's end (it then has no EOS: the text
  does go on).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anyorder.data.files import bounded_lines
from anyorder.data.sources import (
    _first_line,
    _hf_local,
    _import_datasets,
    jsonl_records,
    resolve_files,
)
from anyorder.data.tokenizers import Tokenizer
from anyorder.errors import DataError, preview

ROLES = ("system", "user", "assistant")
"""The roles a message may have."""
PLAIN_TEMPLATE = "<|{role}|>\\n{content}<EOS>"
"""How a turn is rendered for a tokenizer without a chat template (documentation: the code
is :func:`_plain_ids`); the generation prompt is ``<|assistant|>\\n``."""


@dataclass(frozen=True)
class Example:
    """One conversational example as token ids.

    Attributes:
        prompt_ids: what the model reads before the answer (the generation prompt included).
        response_ids: the answer, ending with EOS unless it was cut at the block's end.
    """

    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def block(self, seq_len: int, eos_id: int) -> list[int]:
        """The example as one block of ``seq_len`` ids: prompt, answer, EOS padding."""
        ids = self.prompt_ids + self.response_ids
        return ids + [eos_id] * (seq_len - len(ids))


def has_template(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` brings its own chat template (a ``transformers`` one)."""
    raw = getattr(tokenizer, "tok", None)
    return bool(getattr(raw, "chat_template", None)) and hasattr(raw, "apply_chat_template")


def _plain_ids(messages: Sequence[dict[str, str]], tokenizer: Tokenizer, gen: bool) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids += tokenizer.encode(f"<|{m['role']}|>\n") + tokenizer.encode(m["content"])
        ids.append(tokenizer.eos_id)
    if gen:
        ids += tokenizer.encode("<|assistant|>\n")
    return ids


def render_messages(
    messages: Sequence[dict[str, str]], tokenizer: Tokenizer, *, add_generation_prompt: bool
) -> list[int]:
    """Token ids of a conversation: the tokenizer's chat template, else :data:`PLAIN_TEMPLATE`.

    Args:
        messages: ``{"role", "content"}`` dicts (checked by :func:`check_messages`).
        tokenizer: the run's tokenizer.
        add_generation_prompt: end with what opens the assistant's turn.
    """
    if not has_template(tokenizer):
        return _plain_ids(messages, tokenizer, add_generation_prompt)
    from anyorder.data.chat_template import TemplateLimit, render_chat

    raw = tokenizer.tok  # type: ignore[attr-defined]
    try:  # as raw.apply_chat_template(tokenize=False) renders it, within bounds
        text = render_chat(
            raw.get_chat_template(),
            **raw.special_tokens_map,
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateLimit as e:
        raise DataError(
            f"the chat template of tokenizer {tokenizer.spec!r} was stopped: {e}; use a "
            "template that renders within these bounds"
        ) from None
    except Exception as e:
        from jinja2.exceptions import TemplateError

        if type(e) is TemplateError:  # its own raise_exception (e.g. roles out of turn)
            raise DataError(
                f"the chat template of tokenizer {tokenizer.spec!r} refused the conversation "
                f"({_first_line(e)}); check the roles' order"
            ) from None
        raise DataError(  # it does not compile, or fails by itself
            f"the chat template of tokenizer {tokenizer.spec!r} cannot render the conversation "
            f"({_first_line(e)}); fix the template or remove it from the tokenizer's files"
        ) from None
    # The template writes its special tokens as text (<|im_start|>, <|begin_of_text|>):
    # they must become their ids, and nothing may be added around them.
    return list(raw.encode(text, add_special_tokens=False))


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts, checked.

    Raises:
        DataError: not a list of such objects, a role outside :data:`ROLES`, content that is
            not text, or no final assistant message with a non-empty answer.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(
                f"{where}: message {i} is not an object with 'role' and 'content'; fix the record"
            )
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}: message {i} has role {preview(m['role'])}; use system, user or assistant"
            )
        if not isinstance(m["content"], str):
            raise DataError(
                f"{where}: message {i}'s content is {type(m['content']).__name__}, not text"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message is the {out[-1]['role']}'s; end with the assistant's "
            "answer, the part trained on"
        )
    if not out[-1]["content"].strip():
        raise DataError(f"{where} has an empty answer; give it one or remove the record")
    return out


def record_messages(record: Any, where: str) -> list[dict[str, str]]:
    """The messages of a record: its ``messages``, or ``prompt``/``response`` as two turns.

    Raises:
        DataError: neither form, a field that is not text, an empty answer, a bad message.
    """
    if not isinstance(record, dict):
        raise DataError(f"{where} is {type(record).__name__}, not a JSON object; fix the record")
    if "messages" in record:
        return check_messages(record["messages"], where)
    if "prompt" not in record or "response" not in record:
        fields = ", ".join(map(str, record)) or "none"
        raise DataError(
            f"{where} has no prompt and response fields nor messages (it has: {fields}); "
            "give each record prompt and response, or messages"
        )
    for key in ("prompt", "response"):
        if not isinstance(record[key], str):
            raise DataError(f"{where}: field {key!r} holds {type(record[key]).__name__}, not text")
    pair = [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["response"]},
    ]
    return check_messages(pair, where)


def encode_example(
    record: Any, tokenizer: Tokenizer, seq_len: int, eos_id: int, *, where: str = "a record"
) -> Example:
    """A record (prompt/response or messages) as an :class:`Example` that fits ``seq_len``.

    The answer ends with ``eos_id``; one longer than the block leaves is cut at its end.

    Raises:
        DataError: a bad record (see :func:`record_messages`), a template that does not
            render the prompt as the start of the conversation, or a prompt that leaves no
            room for an answer in ``seq_len``. The message starts with ``where``.
    """
    messages = record_messages(record, where)
    prompt = render_messages(messages[:-1], tokenizer, add_generation_prompt=True)
    full = render_messages(messages, tokenizer, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise DataError(
            f"{where}: the chat template of tokenizer {tokenizer.spec!r} does not render the "
            "prompt as the start of the conversation; use a tokenizer whose template does"
        )
    answer = full[len(prompt) :]
    if not answer or answer[-1] != eos_id:
        answer.append(eos_id)
    if len(prompt) >= seq_len:
        raise DataError(
            f"{where}: the prompt is {len(prompt)} tokens, which leaves no room for an answer "
            f"in model.seq_len={seq_len}; shorten the prompt or raise model.seq_len"
        )
    return Example(prompt, answer[: seq_len - len(prompt)])


def render_prompt(
    prompt_or_messages: str | Sequence[dict[str, str]], tokenizer: Tokenizer
) -> list[int]:
    """The ids the model reads before the answer at generation time: a user prompt (a string)
    or a conversation (messages, not ending with the assistant's) with the generation prompt,
    exactly as :func:`encode_example` renders a training prompt.

    Raises:
        DataError: bad messages (a role outside :data:`ROLES`, content that is not text).
    """
    if isinstance(prompt_or_messages, str):
        messages = [{"role": "user", "content": prompt_or_messages}]
    else:
        messages = list(prompt_or_messages)
        # checked as a conversation with an answer to come
        check_messages([*messages, {"role": "assistant", "content": "x"}], "the prompt")
    return render_messages(messages, tokenizer, add_generation_prompt=True)


# ----------------------------------------------------------------------------- reading


def is_chat_record(record: Any) -> bool:
    """Whether a parsed record has the conversational fields (for ``data.format=auto``)."""
    return isinstance(record, dict) and (
        "messages" in record or ("prompt" in record and "response" in record)
    )


def detect_chat(source: str) -> bool:
    """``data.format=auto``: whether ``source`` is local ``.jsonl`` whose first record has
    ``prompt`` and ``response`` or ``messages``. Other sources (hub datasets included) need
    ``data.format=chat`` said."""
    if source.startswith(("hf:", "builtin:")):
        return False
    try:
        files = resolve_files(source)
    except DataError:
        return False  # reading the source raises it
    if not files or files[0].suffix.lower() != ".jsonl":
        return False
    try:
        with open(files[0], encoding="utf-8") as f:
            for _, line in bounded_lines(f, files[0]):
                if line.strip():
                    return is_chat_record(json.loads(line))
    except (OSError, ValueError, RecursionError, DataError):  # the reader names a bad line
        return False
    return False


def _jsonl_records(path: Path) -> Iterator[tuple[Any, str]]:
    try:
        yield from jsonl_records(path)
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; convert it to UTF-8") from None
    except OSError as e:
        raise DataError(f"cannot read {path} ({_first_line(e)}); fix or remove the file") from None


def _hf_records(rest: str, streaming: bool, split: str) -> Iterator[tuple[Any, str]]:
    datasets = _import_datasets()
    if _hf_local(rest):
        files = [str(f) for f in resolve_files(rest)]
        args: tuple[Any, ...] = ("json",)
        kwargs: dict[str, Any] = dict(data_files={split: files}, streaming=True)
    else:
        name, _, config = rest.partition(":")
        args, kwargs = (name, config or None), dict(streaming=streaming)
    try:
        ds = datasets.load_dataset(*args, split=split, trust_remote_code=False, **kwargs)
        for i, row in enumerate(ds):
            yield row, f"record {i} of hf:{rest}"
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"could not read dataset hf:{rest} split={split!r} ({_first_line(e)}); check the "
            "name, config and network, or download it and pass a local folder as hf:/path"
        ) from None


def iter_records(
    source: str, *, streaming: bool = False, max_records: int | None = None, split: str = "train"
) -> Iterator[tuple[Any, str]]:
    """The records of a conversational source with where each comes from (``file:line``).

    Local sources are ``.jsonl`` files (a file, folder or glob); ``hf:NAME[:CONFIG]`` and
    ``hf:/folder`` read through ``datasets``.

    Raises:
        DataError: a missing path, a file that is not ``.jsonl``, bad JSON (naming the line),
            a dataset that cannot be read.
    """
    if source.startswith("hf:"):
        records = _hf_records(source[3:], streaming, split)
    elif source.startswith("builtin:"):
        raise DataError(
            f"data.format=chat reads prompt/response records; {source} is plain text, so use "
            "data.format=text or a .jsonl of records"
        )
    else:
        files = resolve_files(source)
        for f in files:
            if f.suffix.lower() != ".jsonl":
                raise DataError(
                    f"{f} is not a .jsonl file; data.format=chat reads .jsonl records with "
                    "prompt/response or messages"
                )
        records = (r for f in files for r in _jsonl_records(f))
    for i, item in enumerate(records):
        if max_records is not None and i >= max_records:
            return
        yield item
