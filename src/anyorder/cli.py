"""The ``anyorder`` console script: one entry point, one subcommand per job.

Each subcommand is a pair of functions ``add_<name>(parser)`` and ``run_<name>(args)``;
heavy modules are imported inside ``run_*`` so that ``anyorder --help`` is instant. Every
:class:`~anyorder.errors.AnyorderError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from anyorder.errors import AnyorderError

# ----------------------------------------------------------------------------- info


def add_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="only this preset (tiny, small, medium)")
    p.add_argument("--config-keys", action="store_true", help="list every config key with its help")


def run_info(args: argparse.Namespace) -> int:
    from anyorder.config import MODEL_KINDS, PRESETS, describe, preset
    from anyorder.models import build_model

    if args.config_keys:
        for key, default, help_text in describe():
            print(f"{key:28s} {default:18s} {help_text}")
        return 0
    names = [args.preset] if args.preset else list(PRESETS)
    print(f"{'preset':8s} " + " ".join(f"{k:>12s}" for k in MODEL_KINDS) + "   (parameters)")
    for name in names:
        counts = []
        for kind in MODEL_KINDS:
            model = build_model(preset(name, kind=kind))
            counts.append(f"{model.num_params() / 1e6:11.2f}M")
            del model
        print(f"{name:8s} " + " ".join(counts))
    return 0


# ----------------------------------------------------------------------------- registry

Command = tuple[
    str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]


def commands() -> list[Command]:
    """Every subcommand: (name, help, add_arguments, run)."""
    return [
        ("info", "parameter counts of the presets; config keys", add_info, run_info),
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anyorder",
        description="Decoder-only masked diffusion language models: AO-GPT, ARMD, GPT and MDM.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, add, run in commands():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except AnyorderError as e:
        print(f"anyorder {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"anyorder {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
