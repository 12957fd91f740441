"""The parser and the entry point: the table of subcommands, one-line argparse errors, and
:func:`main`, which turns every :class:`~anyorder.errors.AnyorderError` into one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from anyorder.atomic import os_error_line
from anyorder.cli.evaluate import add_eval, add_experiment, run_eval, run_experiment
from anyorder.cli.interop import add_convert, add_export, run_convert, run_export
from anyorder.cli.sample import add_sample, run_sample
from anyorder.cli.serve import add_serve, run_serve
from anyorder.cli.train import (
    add_data,
    add_demo,
    add_info,
    add_train,
    run_data,
    run_demo,
    run_info,
    run_train,
)
from anyorder.errors import PREVIEW_CHARS, AnyorderError, did_you_mean, preview, print_line

Command = tuple[
    str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]


def commands() -> list[Command]:
    """Every subcommand: (name, help, add_arguments, run)."""
    return [
        ("info", "parameter counts of the presets; config keys", add_info, run_info),
        ("train", "train a model from a YAML config (or under torchrun)", add_train, run_train),
        ("data", "tokenize and pack a config's data; print its statistics", add_data, run_data),
        ("demo", "train a tiny ARMD, sample, evaluate, write a report", add_demo, run_demo),
        ("eval", "likelihoods, zero-shot table, generative perplexity", add_eval, run_eval),
        (
            "convert",
            "GPT-2, Llama, Qwen2, Qwen3 or Mistral weights -> gpt, aogpt or armd; the AO-GPT "
            "authors' checkpoints -> aogpt",
            add_convert,
            run_convert,
        ),
        ("export", "training checkpoint -> uploadable model folder", add_export, run_export),
        ("sample", "generate or infill text from a checkpoint", add_sample, run_sample),
        ("serve", "a local web page that shows generation as it happens", add_serve, run_serve),
        ("experiment", "reproduce a paper comparison", add_experiment, run_experiment),
    ]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), like every other error of the CLI, the
    closest subcommand or choice suggested for a typo (Python 3.14's ``suggest_on_error``
    does this; 3.10-3.13 have no such option), and a value it refuses quoted as
    :func:`~anyorder.errors.preview` cuts it (argparse quotes a 100 KB value whole)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    def _get_value(self, action: argparse.Action, arg_string: str) -> object:
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as e:
            raise _quoted_short(e, action, arg_string) from None

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices:
            close = did_you_mean(str(value), action.choices)
            if close is not None:
                choices = ", ".join(repr(c) for c in action.choices)
                raise argparse.ArgumentError(
                    action,
                    f"invalid choice: {preview(value)} (did you mean {close!r}? choose from "
                    f"{choices})",
                )
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            raise _quoted_short(e, action, value) from None


def _quoted_short(e: argparse.ArgumentError, action: argparse.Action, value: object):
    """argparse's error ``e`` with its quote of ``value`` cut (:func:`preview`)."""
    return argparse.ArgumentError(action, e.message.replace(repr(value), preview(value)))


def _unrecognized(parser: argparse.ArgumentParser, words: list[str]) -> NoReturn:
    """The error for options ``parser`` does not know, with the closest known option of
    the first one when one is close (``--stpes`` -> ``--steps``)."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    close = did_you_mean(words[0].split("=", 1)[0], known)
    hint = f" (did you mean {close}?)" if close else ""
    shown = [w if len(w) <= PREVIEW_CHARS else preview(w) for w in words]
    parser.error(f"unrecognized arguments: {' '.join(shown)}{hint}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="anyorder",
        description="Decoder-only masked diffusion language models: AO-GPT, ARMD, GPT and MDM.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, add, run in commands():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.set_defaults(run=run, parser=p)
    return parser


SIGPIPE_EXIT = 128 + 13
"""Exit code when the reader of our output went away (``| head``): a Unix tool killed by
SIGPIPE exits so, and says nothing."""


def _closed_pipe() -> int:
    """Stop quietly when stdout's reader closed the pipe (``anyorder ... | head -1``): no
    traceback, and nothing more written (stdout now points at /dev/null, so the flush at
    interpreter exit cannot fail again)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return SIGPIPE_EXIT


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow the options (`train CONFIG --dry-run a.b=1`); argparse
    # stops filling a positional list at the first option, so collect the rest here.
    if extra and isinstance(getattr(args, "overrides", None), list):
        # a word without "=" goes to the overrides too, whose parser says what is wrong
        unknown = [e for e in extra if e.startswith("-")]
        if unknown:
            _unrecognized(args.parser, unknown)
        args.overrides += extra
    elif extra:
        _unrecognized(getattr(args, "parser", parser), extra)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except AnyorderError as e:
        print_line(f"anyorder {args.command}: error: {e}")
        return e.exit_code
    except OSError as e:
        # A backstop for paths the checks before it did not foresee (a name too long, a
        # path under /proc): one line naming the path and the system's cause, never a
        # traceback. Writers say more (anyorder.atomic); a closed pipe is handled above.
        print_line(f"anyorder {args.command}: error: {os_error_line(e)}")
        return 2
    except KeyboardInterrupt:
        print_line(f"anyorder {args.command}: interrupted")
        return 130
