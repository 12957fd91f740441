"""One generation request, from its JSON to the events of the stream: checks
(:func:`parse_request`), the mapping onto the sampler (:func:`plan_request`) and the run
(:func:`run_generation`), with no HTTP in sight.

Design choices:

* The stream *is* the sampler: one ``step`` event per call of the sampler's ``on_step``
  hook, so the events rebuild its :class:`~anyorder.sample.SampleResult` exactly (tokens
  and ``step_of``); ``done`` carries the result itself.
* Speculative decoding (``speculative=K``) adds a ``round`` event before each ``step``,
  from the sampler's ``on_round`` hook: the drafts the pass verified, how many it accepted
  and the token that closed the round (a replacement after a rejection, else a bonus
  draw), with running totals; its accepted drafts and closing token are exactly the
  positions of the ``step`` event that follows, and ``done`` adds the per-sample
  :class:`~anyorder.sample.SpeculativeStats`.
* Validation is the sampler's: nothing is emitted before its first pass, so every
  :class:`~anyorder.errors.AnyorderError` raised before it propagates with no event sent
  (the server answers it with a 400), and no second copy of those checks exists here.
* Bounded requests (:class:`Limits`): samples per request, the slow-motion pause, and the
  wall-clock time per request, checked after every pass (the hook raises to stop the
  sampler).
* ``tokens/s`` counts generated tokens over the time spent outside the optional
  slow-motion pause (``delay_ms``, for watching a fast model fill in).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from anyorder import bounds
from anyorder.data.chat_template import render_deadline
from anyorder.errors import CheckpointError, SamplingError, preview
from anyorder.serve.guard import cut  # a client's name or value, cut: a body holds 64 KiB
from anyorder.serve.rounds import Rounds, piece

if TYPE_CHECKING:
    from anyorder.checkpoint import Loaded

MODES = ("l2r", "random", "strided", "lemma1")
"""``l2r``/``random``: one token per pass in that order; ``strided``: ARMD's ``S`` streams;
``lemma1``: ``T`` reverse steps, several tokens per pass."""
MODES_OF_KIND = {
    "gpt": ("l2r",),
    "aogpt": ("l2r", "random", "lemma1"),
    "armd": MODES,
    "mdm": ("l2r", "random", "lemma1"),
}


SPECULATIVE_KINDS = ("aogpt", "armd")
"""The models that draft positions ahead, so can decode speculatively."""
SPECULATIVE_MODES = ("l2r", "random")
"""The modes speculative decoding follows: one order, one exact token at a time."""
MAX_DRAFT = 64
"""The largest ``--max-draft`` ``anyorder serve`` takes: each pass's widths grow with K."""

MAX_TIME_LIMIT_S = 86400.0
"""The longest time limit ``anyorder serve --time-limit`` takes (a day): a finite bound, so
that every generation ends."""


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
    max_draft: int = 16
    """Largest ``speculative`` K (tokens one pass may commit; a pass's width grows with it)."""
    max_concurrent: int = 1
    """Generations running at once; more get 429."""
    max_connections: int = 32
    """Whole requests answered at once (each holds a thread); more get 503."""
    max_waiting: int = 128
    """Connections still sending their request (they hold no thread); a newcomer beyond
    this drops the longest-waiting one of the client address that has the most (408)."""
    max_waiting_per_client: int = 32
    """Of those, how many one client address may have; its newcomer beyond this drops its
    own longest-waiting one (408), so one client cannot take every place."""
    request_timeout_s: float = 10.0
    """Seconds from connecting to the end of the request, headers and body together;
    later gets 408."""
    send_timeout_s: float = 10.0
    """Seconds an answer may take to be read by its client (a stream: beyond the time
    limit); then the connection is closed."""
    max_header_bytes: int = 65536
    """Largest request line and headers together; more gets 431."""


@dataclass
class GenRequest:
    """One generation request, as the page sends it (JSON keys = field names)."""

    text: str = ""
    """A prompt (a prefix), a template with ``[MASK:n]`` holes, or empty (unconditional);
    with ``chat``, the user's message."""
    mode: str = "random"
    """One of :data:`MODES`."""
    streams: int | None = None
    """``S`` for ``strided``."""
    steps: int | None = None
    """``T`` for ``lemma1``."""
    speculative: int | None = None
    """``K`` for speculative decoding (modes ``l2r`` and ``random``, aogpt and armd): each
    pass verifies the last pass's drafts and drafts the next, at most ``K`` tokens per pass,
    with the law of one token per pass."""
    length: int | None = None
    """Tokens per sample, prompt included (default: the model's context); a template sets
    its own length and ignores this."""
    temperature: float = 1.0
    top_p: float | None = None
    seed: int = 0
    num_samples: int = 1
    delay_ms: int = 0
    """Slow motion: pause after each pass (not counted in tokens/s)."""
    chat: bool = False
    """Chat mode: ``text`` goes through the chat template, the answer is decoded after it
    in the request's mode, and the ``done`` event's texts are the answers alone, cut at
    their first EOS."""
    max_new_tokens: int | None = None
    """``chat``: answer tokens at most (default: the context left after the prompt)."""


class LimitError(SamplingError):
    """A request stopped by one of the server's :class:`Limits`."""


_TYPES: dict[str, tuple[type, ...]] = {
    "text": (str,),
    "chat": (bool,),
    "max_new_tokens": (int,),
    "mode": (str,),
    "streams": (int,),
    "steps": (int,),
    "speculative": (int,),
    "length": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "seed": (int,),
    "num_samples": (int,),
    "delay_ms": (int,),
}
_OPTIONAL = {"streams", "steps", "speculative", "length", "top_p", "max_new_tokens"}
_MODE_FIELDS = {"streams": ("strided", "S streams"), "steps": ("lemma1", "T reverse steps")}
"""The fields only one mode reads: with another they would be ignored, so are refused."""


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
        listed = ", ".join(cut(name) for name in unknown[:5])
        listed += f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise SamplingError(f"unknown field(s) {listed}; known: {', '.join(names)}")
    values = {}
    for name, value in body.items():
        if value is None and name in _OPTIONAL:
            continue
        flag = _TYPES[name] == (bool,)
        ok = isinstance(value, bool) == flag and isinstance(value, _TYPES[name])
        if not ok:
            want = "a string" if _TYPES[name] == (str,) else "a number"
            want = "a whole number" if _TYPES[name] == (int,) else want
            want = "true or false" if flag else want
            raise SamplingError(f"field {name!r} must be {want}, not {cut(json.dumps(value))}")
        if isinstance(value, str) and not _encodable(value):
            raise SamplingError(
                f"field {name!r} is not valid Unicode (it holds an unpaired surrogate such as "
                "\\ud800); send UTF-8 text"
            )
        if name == "temperature" and isinstance(value, int) and value > 1e308:
            # a JSON integer of hundreds of digits: no float holds it (the sampler divides)
            raise SamplingError(
                f"temperature={preview(value)} is beyond any float; send a finite number > 0, "
                "e.g. 1.0"
            )
        values[name] = value
    req = GenRequest(**values)
    if req.mode not in MODES:
        raise SamplingError(f"mode {preview(req.mode)} is unknown; use one of {', '.join(MODES)}")
    if req.mode == "strided" and req.streams is None:
        raise SamplingError("mode strided needs the number of streams S (field streams)")
    if req.mode == "lemma1" and req.steps is None:
        raise SamplingError("mode lemma1 needs the number of steps T (field steps)")
    if req.chat and req.length is not None:
        raise SamplingError(
            "length counts the prompt's tokens too; a chat answer's is max_new_tokens: leave "
            "length out"
        )
    if not req.chat and req.max_new_tokens is not None:
        raise SamplingError(
            "max_new_tokens is the length of a chat answer; set chat, or use length"
        )
    if req.speculative is not None:
        _check_speculative(req, limits)
    for name, (mode, what) in _MODE_FIELDS.items():
        if getattr(req, name) is not None and req.mode != mode:
            raise SamplingError(
                f"{name} sets the {what} of mode {mode}, which was not asked for (mode "
                f"{req.mode}); set mode {mode}, or leave {name} out"
            )
    bounds.check_controls(
        temperature=req.temperature, top_p=req.top_p, num_samples=req.num_samples,
        seed=req.seed, steps=req.steps, length=req.length, max_samples=limits.max_samples,
        limit_note="this server's limit",
    )  # fmt: skip
    if not 0 <= req.delay_ms <= limits.max_delay_ms:
        raise SamplingError(
            f"delay_ms={bounds.shown(req.delay_ms)} must lie in 0..{limits.max_delay_ms}"
        )
    return req


def _check_speculative(req: GenRequest, limits: Limits) -> None:
    """``speculative``: K in ``1..max_draft``, with an order of one exact token per pass."""
    k = req.speculative
    if not 1 <= k <= limits.max_draft:
        shown = str(k) if len(str(k)) <= 30 else f"{str(k)[:20]}... ({len(str(k))} digits)"
        raise SamplingError(
            f"speculative={shown} must lie in 1..{limits.max_draft} (this server's limit; K is "
            "the most tokens one pass commits), e.g. 4"
        )
    if req.mode not in SPECULATIVE_MODES:
        raise SamplingError(
            f"speculative decoding follows one order, one exact token at a time: use mode "
            f"random or l2r, not {req.mode}"
        )
    if req.steps is not None or req.streams is not None:
        raise SamplingError(
            "speculative decoding takes no steps or streams (K sets the tokens per pass); "
            "leave them out"
        )


@dataclass
class Plan:
    """A request turned into the arguments of :func:`anyorder.sample.sample`."""

    n: int
    """Tokens per sample."""
    kwargs: dict[str, Any]
    """Everything else :func:`~anyorder.sample.sample` takes (generator excluded)."""
    template: bool
    """Whether the text was a template (then the text is not cut at EOS)."""
    chat: bool
    """Whether the texts are chat answers (the slots after the prompt alone)."""
    total_steps: int
    """Steps a full decode has (``step_of`` values lie in ``0..total_steps-1``)."""


def plan_request(loaded: Loaded, req: GenRequest) -> Plan:
    """Map a request onto the sampler's arguments (as ``anyorder sample`` does). A chat
    template renders within :func:`anyorder.data.chat_template.render_deadline`'s time.

    Raises:
        SamplingError: a malformed or too long template, a prompt not shorter than the
            length, a tokenizer the model cannot read.
    """
    from anyorder.orders import strided
    from anyorder.sample import parse_template
    from anyorder.sampling.templates import chat_prompt

    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise CheckpointError(f"{loaded.path} holds no tokenizer; serve needs one")
    seq_len = model.cfg.seq_len
    prompt = known = None
    template = "[MASK" in req.text and not req.chat
    steps = req.steps if req.mode == "lemma1" else None
    if req.chat:
        cfg = model.cfg
        streams = req.streams if req.mode == "strided" else None
        prompt, known = chat_prompt(
            req.text, tok, seq_len, cfg.vocab_size, req.max_new_tokens, streams=streams
        )
        n = len(prompt)
        bounds.check_steps(steps, n)
    elif template:
        bounds.check_holes(req.text, seq_len)
        prompt, known = parse_template(req.text, tok, seq_len)
        n = len(prompt)
        bounds.check_steps(steps, n)
    else:
        n = bounds.check_fit(seq_len, length=req.length, steps=steps)
        if req.text:
            ids = tok.encode(req.text)
            prompt, known = bounds.prefix_prompt(
                ids, n, length=f"the length {n}", name="the length"
            )
    kwargs: dict[str, Any] = dict(
        batch=req.num_samples,
        prompt=prompt,
        known=known,
        temperature=req.temperature,
        top_p=req.top_p,
    )
    k = 0 if known is None else int(known.sum())
    total = n - k
    if req.speculative is not None:
        if model.kind not in SPECULATIVE_KINDS:
            raise SamplingError(
                f"speculative decoding needs a model that drafts positions ahead (aogpt or "
                f"armd); this one is {model.kind}: leave speculative out"
            )
        kwargs.update(order=req.mode, speculative=req.speculative)
    elif req.mode in ("l2r", "random"):
        kwargs["order"] = req.mode
    elif req.mode == "lemma1":
        kwargs.update(order="random", steps=req.steps)
        total = req.steps
    else:
        kwargs["streams"] = req.streams
        if req.streams >= 1 and total % req.streams == 0:  # the streams cut what follows k
            total = int(strided(1, total, req.streams).blocks.max()) + 1
    return Plan(n, kwargs, template, req.chat, total)


def run_generation(
    loaded: Loaded,
    req: GenRequest,
    emit: Callable[[str, dict[str, Any]], None],
    limits: Limits = Limits(),
    *,
    autocast: bool = False,
    started: float | None = None,
    plan: Plan | None = None,
    on_finished: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run one request through the real sampler, calling ``emit(event, data)`` as it goes.

    The time limit counts from ``started`` (a ``time.perf_counter()`` value; default: now)
    and is checked before the sampler plans the request and after every pass. ``plan`` is
    :func:`plan_request`'s answer when the caller checked the request already. ``on_finished``
    is called once the sampler is done, before the ``done`` event: the server frees its
    generation slot there, so a client that reads ``done`` and asks again is not refused.

    Events: ``start`` (sizes, the prompt) and ``step`` (one per sampler pass) from inside the
    sampler's ``on_step`` hook (speculative decoding: a ``round`` event before each
    ``step``), then ``done`` (the texts and the whole result). Nothing is
    emitted before the sampler's first pass, so an error raised by the checks propagates
    with no event sent.

    Raises:
        AnyorderError: the request is invalid (before any event), or
        LimitError: the time limit ran out (after some events).
    """
    model, tok = loaded.model, loaded.tokenizer
    t0 = time.perf_counter() if started is None else started
    if plan is None:
        with render_deadline(t0, limits.time_limit_s):  # a chat template renders in time
            plan = plan_request(loaded, req)
    n = plan.n
    prompt = plan.kwargs["prompt"]
    known = plan.kwargs["known"]
    known_pos = [] if known is None else known.nonzero()[:, 0].tolist()
    prompt_cells = [[p, int(prompt[p]), piece(tok, int(prompt[p]))] for p in known_pos]
    state = {"passes": 0, "generated": 0, "slept": 0.0}
    rounds = Rounds(tok, n) if "speculative" in plan.kwargs else None

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
                    "speculative": req.speculative,
                    "total_steps": plan.total_steps,
                    "eos_id": tok.eos_id,
                    "prompt": prompt_cells,
                },
            )
        rows = [
            [[p, t, piece(tok, t)] for p, t in zip(pr, tr) if p < n] for pr, tr in zip(pos, toks)
        ]
        state["passes"] += 1
        state["generated"] += sum(len(r) for r in rows)
        if rounds is not None:
            emit("round", rounds.event(step, state["passes"]))
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
        result = _sample(model, n, plan, gen, on_step, rounds)
    seconds = time.perf_counter() - t0 - state["slept"]
    done = _done_event(tok, result, None if plan.template else tok.eos_id, seconds, plan.chat)
    if on_finished is not None:
        on_finished()
    emit("done", done)
    return done


def _sample(model: Any, n: int, plan: Plan, gen: torch.Generator, on_step, rounds) -> Any:
    """The sampler the plan asks for: :func:`~anyorder.sample.sample`, or the speculative
    sampler with the ``round`` events' hook."""
    from anyorder.sample import sample, speculative_sample

    if rounds is None:
        return sample(model, n, generator=gen, on_step=on_step, **plan.kwargs)
    kwargs = dict(plan.kwargs)
    K = kwargs.pop("speculative")
    return speculative_sample(
        model, n, K, generator=gen, on_step=on_step, on_round=rounds.hook, **kwargs
    )


def _done_event(
    tok: Any, result: Any, eos: int | None, seconds: float, chat: bool = False
) -> dict[str, Any]:
    """The ``done`` event: the texts (cut at ``eos`` unless None; a chat's answers alone,
    the slots after the prompt) and the whole result."""
    from anyorder.sample import decode_text

    tokens = result.tokens.cpu()
    generated = int((result.step_of >= 0).sum())
    given = result.step_of.cpu() == -1
    if chat:
        texts = [decode_text(tok, r[~g], eos) for r, g in zip(tokens, given)]
    else:
        texts = [decode_text(tok, r, eos, g) for r, g in zip(tokens, given)]
    out = {
        "texts": texts,
        "tokens": tokens.tolist(),
        "step_of": result.step_of.cpu().tolist(),
        "order": result.order.cpu().tolist(),
        "forward_passes": result.forward_passes,
        "generated": generated,
        "seconds": seconds,
        "tokens_per_s": generated / max(seconds, 1e-9),
    }
    stats = result.extra.get("speculative")
    if stats is not None:  # per sample
        keys = ("passes", "drafted", "accepted", "tokens")
        out["speculative"] = {k: getattr(stats, k).tolist() for k in keys}
    return out
