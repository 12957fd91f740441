"""``anyorder sample``: generate, infill or answer a chat prompt from a checkpoint.

``run_sample`` reads as its phases: check the flags, build the prompt, run the sampler
(streaming a single left-to-right sample as its tokens are decided), print the texts or the
JSON record. The JSON record is what ``anyorder.api.Model`` reproduces step for step.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from anyorder.cli.decoding import graphs_line, run_sampler

# ----------------------------------------------------------------------------- sample


def add_sample(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run folder (its latest checkpoint) or checkpoint folder")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prompt", default=None, help="text the samples start with (a prefix)")
    what.add_argument(
        "--infill",
        default=None,
        metavar="TEMPLATE",
        help="fill the holes of a template, e.g. 'The [MASK:20] of Python' (hole = [MASK:n], "
        "n >= 1 tokens; everything else literal); its length is the template's",
    )
    what.add_argument(
        "--chat",
        default=None,
        metavar="TEXT",
        help="answer TEXT as a user's message: rendered with the tokenizer's chat template, "
        "the answer decoded after it by the sampler the other options choose and cut at its "
        "first EOS; prints the answer alone",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="for a model saved without a tokenizer: gpt2, bytes or a tokenizer folder "
        "(as anyorder.load(path, tokenizer=SPEC))",
    )
    _add_decoding(p)
    p.add_argument(
        "--length", type=int, default=None, help="tokens per sample, prompt included (default n)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="--chat: answer tokens at most (default: the context left after the prompt)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    p.add_argument("--num-samples", type=int, default=1, help="samples (one batch)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    p.add_argument(
        "--no-stop-at-eos",
        action="store_true",
        help=(
            "keep the text after the first generated EOS (default: cut there; l2r decoding "
            "stops; an EOS in the prompt ends nothing); not with --infill, whose template fixes "
            "the length and is never cut"
        ),
    )
    p.add_argument("--json", action="store_true", help="print tokens, orders and pass counts")
    p.add_argument("--weights", choices=("ema", "raw"), default="ema", help="default: ema")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--huge-pages",
        action="store_true",
        help="copy the weights into 2 MB pages on a CPU (Linux): faster decoding of many or "
        "long samples, a slower load",
    )
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default="auto",
        help="capture each forward-pass shape once as a CUDA graph and replay it (default: on "
        "with a CUDA device, off on a CPU; --no-cuda-graphs decodes eagerly)",
    )
    p.add_argument(
        "--compile-passes",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="compile every decoding pass whole with torch.compile (fullgraph) before it is "
        "captured or replayed (default backend inductor; the first pass of each shape pays the "
        "compilation: seconds to minutes)",
    )
    p.add_argument(
        "--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on CUDA"
    )


def _add_decoding(p: argparse.ArgumentParser) -> None:
    """The options that choose how a sample is decoded: order, steps, speculative."""
    p.add_argument(
        "--order",
        choices=("l2r", "random", "strided", "confidence"),
        default=None,
        help="generation order (default: l2r for gpt, random otherwise; strided: armd; "
        "confidence: aogpt/armd, each pass scores the remaining positions and commits the most "
        "confident (largest top probability), --per-pass per pass or checked by --speculative: "
        "a heuristic, not an exact sampler of the model)",
    )
    p.add_argument(
        "--per-pass",
        type=int,
        default=None,
        help="--order confidence without --speculative: positions committed per pass, drawn "
        "at once from their parallel conditionals (default 1)",
    )
    p.add_argument(
        "--score-subset",
        type=int,
        default=None,
        metavar="M",
        help="--order confidence: score a random subset of M remaining positions per pass "
        "(default: all)",
    )
    p.add_argument("--streams", type=int, default=None, help="strided: S streams (armd)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="masked-diffusion sampling in T reverse steps (Lemma 1 on aogpt/armd, the "
        "encoder on mdm); default: one token per forward pass",
    )
    p.add_argument(
        "--schedule",
        choices=("linear", "cosine"),
        default=None,
        help="--steps: the masking schedule m(t): linear (default) or cosine (cos((1 - t) pi / 2), "
        "few tokens first)",
    )
    p.add_argument(
        "--reveal",
        choices=("binomial", "reference"),
        default=None,
        help="--steps: tokens per step: binomial (default; the exact reverse process) or reference "
        "(the AO-GPT code's deterministic counts, never an empty step)",
    )
    p.add_argument(
        "--shared-counts",
        action="store_true",
        help="--steps: one reveal count per step for all samples (faster; samples then share "
        "their count trajectory)",
    )
    p.add_argument(
        "--speculative",
        type=int,
        default=None,
        metavar="K",
        help="any-order speculative sampling (aogpt/armd): each pass checks the drafts of the "
        "last one against the one-token-per-pass conditionals and drafts the next; up to K "
        "tokens per pass (K <= 64), the same law as one token per pass (exact)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the passes, drafted and accepted tokens (--speculative) per sample",
    )


class _Streamer:
    """Prints a left-to-right sample as its tokens are decided (one row)."""

    def __init__(self, tokenizer, eos_id: int | None) -> None:
        self.tok, self.eos, self.ids, self.shown, self.ended = tokenizer, eos_id, [], "", False

    def __call__(self, positions, tokens, step: int) -> None:
        if self.ended:
            return
        for t in tokens[0].tolist():
            if t == self.eos:
                self.ended = True
                break
            self.ids.append(t)
        self.flush(final=self.ended)

    def flush(self, final: bool = False) -> None:
        text = self.tok.decode(self.ids)
        if not final:  # an incomplete UTF-8 character shows as U+FFFD until it completes
            text = text.rstrip("\ufffd")
        if text.startswith(self.shown) and len(text) > len(self.shown):
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text


_STEP_FLAGS = (
    ("schedule", "--schedule"),
    ("reveal", "--reveal"),
    ("shared_counts", "--shared-counts"),
)
"""The flags that shape ``--steps`` sampling and nothing else."""
_CONFIDENCE_FLAGS = (("per_pass", "--per-pass"), ("score_subset", "--score-subset"))
"""The flags that shape ``--order confidence`` sampling and nothing else."""


def _flags_without(flags: tuple, args: argparse.Namespace, mode: str, fix: str) -> None:
    """Refuse ``flags`` given (not None/False) where ``mode`` was not asked for."""
    from anyorder.errors import SamplingError

    given = [flag for name, flag in flags if getattr(args, name) not in (None, False)]
    if given:
        raise SamplingError(
            f"{' and '.join(given)} shape{'s' if len(given) == 1 else ''} {mode} sampling, "
            f"which was not asked for; add {fix}, or leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )


def _check_mode_flags(args: argparse.Namespace, kind: str) -> None:
    """Refuse flags that the model or the mode would ignore, naming what does work."""
    from anyorder.errors import SamplingError

    if args.steps is None:
        _flags_without(_STEP_FLAGS, args, "--steps", "--steps T")
    if args.order != "confidence":
        _flags_without(_CONFIDENCE_FLAGS, args, "--order confidence", "--order confidence")
    elif args.per_pass is not None and args.speculative is not None:
        raise SamplingError(
            "--per-pass fixes the positions a pass commits, which --speculative K decides "
            "itself (up to K, each checked); leave out --per-pass or --speculative"
        )
    if kind == "gpt":
        wrong = [f"--order {args.order}"] if args.order not in (None, "l2r") else []
        wrong += ["--streams"] if args.streams is not None else []
        wrong += ["--steps"] if args.steps is not None else []
        if wrong:
            raise SamplingError(
                f"a gpt run samples left to right, one token per pass: leave out "
                f"{', '.join(wrong)} (--prompt gives a prefix); parallel decoding needs an aogpt, "
                "armd or mdm run (--steps T), strided decoding an armd run (--streams S)"
            )
    elif kind != "armd" and (args.streams is not None or args.order == "strided"):
        raise SamplingError(
            f"strided decoding is ARMD's and this is a {kind} run; for parallel decoding use "
            "--steps T (or sample one token per pass: leave out --order strided/--streams)"
        )


def _sample_order(args: argparse.Namespace, kind: str) -> tuple[str, int | None]:
    """The generation order and ``S`` from ``--order`` and ``--streams`` (strided when given)."""
    from anyorder.errors import SamplingError

    _check_mode_flags(args, kind)
    order = args.order or ("l2r" if kind == "gpt" else "random")
    if order == "strided" and args.streams is None:
        raise SamplingError("--order strided needs --streams S")
    if args.streams is not None and args.order not in (None, "strided"):
        raise SamplingError(f"--streams fixes the order (strided); leave out --order {order}")
    streams = args.streams
    if streams is not None:
        order = "strided"
    return order, streams


def _sample_prompt(args: argparse.Namespace, model, tok) -> tuple[int, Any, Any]:
    """``(n, prompt, known)``: the tokens per sample and the known tokens of ``--infill``,
    ``--chat`` or ``--prompt`` ((n,) ids and their mask; None and None for an unconditional
    sample)."""

    from anyorder import bounds
    from anyorder.sample import parse_template
    from anyorder.sampling.templates import chat_prompt

    prompt = known = None
    if args.chat is not None:
        cfg = model.cfg
        prompt, known = chat_prompt(
            args.chat, tok, cfg.seq_len, cfg.vocab_size, args.max_new_tokens,
            name="--max-new-tokens", streams=args.streams,
        )  # fmt: skip
        n = len(prompt)
        bounds.check_steps(args.steps, n)
    elif args.infill is not None:
        bounds.check_holes(args.infill, model.cfg.seq_len)
        prompt, known = parse_template(args.infill, tok, model.cfg.seq_len)
        n = len(prompt)
        bounds.check_steps(args.steps, n)
    else:
        n = bounds.check_fit(model.cfg.seq_len, length=args.length, steps=args.steps)
    if args.prompt:
        ids = tok.encode(args.prompt)
        prompt, known = bounds.prefix_prompt(ids, n, length=f"--length {n}", name="--length")
    return n, prompt, known


def _sample_json(
    args: argparse.Namespace,
    ckpt,
    result,
    texts: list[str],
    *,
    mode: str,
    order: str,
    n: int,
    streams: int | None,
    generated: int,
    seconds: float,
) -> dict[str, Any]:
    """The ``--json`` record: the settings, every sample's text, tokens, order and steps,
    and the per-step reveal counts where the sampler drew them."""
    tokens = result.tokens.cpu()
    out = {
        "checkpoint": str(ckpt.path),
        "step": ckpt.step,
        "seed": args.seed,
        "kind": ckpt.model.kind,
        "mode": mode,
        "order": order,
        "n": n,
        "steps": args.steps,
        "streams": streams,
        "forward_passes": result.forward_passes,
        "generated_tokens": generated,
        "seconds": round(seconds, 4),
        "samples": [
            {"text": text, "tokens": row.tolist(), "order": o.tolist(), "step_of": s.tolist()}
            for text, row, o, s in zip(texts, tokens, result.order.cpu(), result.step_of.cpu())
        ],
    }
    if result.reveals is not None and result.reveals.steps <= 1 << 16:
        out["counts"] = result.counts.T.tolist()  # per sample, per step
    elif result.reveals is not None:  # huge step counts: the non-empty steps only
        out["nonempty_steps"] = result.reveals.step.tolist()
        out["counts"] = result.reveals.counts.T.tolist()
    return out


def _check_utf8(flag: str, text: str | None) -> None:
    """Refuse an argument whose bytes are not UTF-8 (Python holds them as surrogates): a
    tokenizer would change them to ``?`` or fail."""
    from anyorder.errors import SamplingError

    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]  # argv's byte 0xNN is the surrogate U+DCNN (surrogateescape)
        what = f"byte 0x{ord(char) - 0xDC00:02x}" if "\udc80" <= char <= "\udcff" else repr(char)
        raise SamplingError(
            f"{flag} is not UTF-8 text ({what} at character {e.start}); pass the text in UTF-8"
        ) from None


def _check_lengths(args: argparse.Namespace) -> None:
    """The controls, and the length flags against the mode (a template or a chat answer
    takes its length elsewhere)."""
    from anyorder import bounds
    from anyorder.errors import SamplingError

    for flag, text in (("--prompt", args.prompt), ("--infill", args.infill), ("--chat", args.chat)):
        _check_utf8(flag, text)
    bounds.check_controls(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        num_samples=args.num_samples, seed=args.seed, steps=args.steps, length=args.length,
    )  # fmt: skip
    if args.infill is not None and args.length is not None:
        raise SamplingError("--infill takes its length from the template; leave out --length")
    if args.infill is not None and args.no_stop_at_eos:  # an EOS in a hole ends nothing
        raise SamplingError(
            "--no-stop-at-eos has no effect with --infill: the template fixes the length, so "
            "the filled text is never cut at an EOS; leave out --no-stop-at-eos"
        )
    if args.chat is not None and args.length is not None:
        raise SamplingError(
            "--chat takes the answer's length from --max-new-tokens; leave out --length"
        )
    if args.chat is None and args.max_new_tokens is not None:
        raise SamplingError("--max-new-tokens sets the length of a --chat answer; use --length")


def run_sample(args: argparse.Namespace) -> int:
    import contextlib
    import json
    import time

    import torch

    from anyorder import bounds
    from anyorder.checkpoint import load_model
    from anyorder.checkpoint.loaded import chat_warning
    from anyorder.errors import SamplingError
    from anyorder.sample import decode_text
    from anyorder.sampling.speculative import check_request
    from anyorder.training.distributed import resolve_device

    _check_lengths(args)
    device = resolve_device(args.device, what="--device")
    ckpt = load_model(args.checkpoint, weights=args.weights, device=device)
    if args.huge_pages:
        from anyorder.hugepages import place_in_huge_pages

        place_in_huge_pages(ckpt.model)
    if args.tokenizer is not None:
        from anyorder.checkpoint import check_tokenizer_fits
        from anyorder.data import load_tokenizer

        ckpt.tokenizer = load_tokenizer(args.tokenizer)
        check_tokenizer_fits(ckpt.tokenizer, ckpt.model.cfg.vocab_size, repr(args.tokenizer))
    model, tok = ckpt.model, ckpt.tokenizer
    if tok is None:  # as the API's Model.generate: no text without a tokenizer
        raise SamplingError(
            f"{args.checkpoint} holds no tokenizer; pass --tokenizer SPEC (gpt2, bytes or a "
            "tokenizer folder)"
        )
    check_request(args.speculative, args.steps, args.streams, args.order)
    order, streams = _sample_order(args, model.kind)
    n, prompt, known = _sample_prompt(args, model, tok)
    if args.chat is not None and (why := chat_warning(ckpt)) is not None:  # a valid request
        print(f"anyorder sample: warning: {why}", file=sys.stderr, flush=True)
    sequential = args.steps is None and streams is None and args.speculative is None
    sequential = sequential and order != "confidence"
    cut = not args.no_stop_at_eos and args.infill is None
    eos = tok.eos_id if tok is not None else None
    stop = eos if cut and sequential and order == "l2r" and model.kind != "mdm" else None
    stream = None
    if tok and sequential and order == "l2r" and args.num_samples == 1 and not args.json:
        stream = _Streamer(tok, tok.eos_id if cut else None)
        if prompt is not None and args.chat is None:  # a chat shows its answer alone
            stream.ids = prompt[known].tolist()
            stream.flush()
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
    gen = torch.Generator(device).manual_seed(args.seed)
    start = time.perf_counter()
    with ctx, bounds.out_of_memory_as_error(f"--num-samples {args.num_samples} x {n} tokens"):
        result = run_sampler(args, model, n, order, streams, prompt, known, gen, stop, stream)
    seconds = time.perf_counter() - start
    tokens = result.tokens.cpu()
    given = result.step_of.cpu() == -1  # a prompt's EOS ends no text
    if args.chat is not None:  # the answer alone: the slots after the prompt
        texts = [
            decode_text(tok, r[~g], tok.eos_id if cut else None) for r, g in zip(tokens, given)
        ]
    else:
        texts = [decode_text(tok, r, tok.eos_id if cut else None, g) for r, g in zip(tokens, given)]
    generated = int((result.step_of >= 0).sum())
    mode = "encoder" if model.kind == "mdm" else "strided" if streams else "lemma1"
    mode = "sequential" if sequential and model.kind != "mdm" else mode
    spec = result.extra.get("speculative")
    mode = "speculative" if spec is not None else mode
    mode = "confidence" if order == "confidence" else mode
    if args.json:
        record = _sample_json(
            args, ckpt, result, texts, mode=mode, order=order, n=n, streams=streams,
            generated=generated, seconds=seconds,
        )  # fmt: skip
        if spec is not None:
            record["speculative"] = _spec_counts(spec)
        print(json.dumps(record))
        return 0
    if stream is not None:
        stream.flush(final=True)
        print()
    else:
        for i, text in enumerate(texts):
            if len(texts) > 1:
                print(f"=== sample {i + 1} ===")
            print(text)
    summary = (
        f"{model.kind} {mode}: {generated} tokens, {result.forward_passes} forward passes, "
        f"{generated / max(seconds, 1e-9):,.0f} tokens/s"
    )
    captured = graphs_line(result.extra.get("graphs"))  # the capture's cost, not hidden
    print(summary if captured is None else f"{summary}\n{captured}", file=sys.stderr)
    if args.verbose and spec is not None:
        print(spec.summary(), file=sys.stderr)
        for i, row in enumerate(zip(*_spec_counts(spec).values())):
            print("  sample {}: {} passes, {} drafted, {} accepted, {} tokens".format(i + 1, *row),
                  file=sys.stderr)  # fmt: skip
    return 0


def _spec_counts(spec) -> dict[str, list[int]]:
    """Per sample: passes, drafted and accepted drafts, generated tokens."""
    keys = ("passes", "drafted", "accepted", "tokens")
    return {k: getattr(spec, k).tolist() for k in keys}
