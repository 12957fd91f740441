"""The ``anyorder`` console script: one entry point, one subcommand per job.

Each subcommand is a pair of functions ``add_<name>(parser)`` and ``run_<name>(args)``;
heavy modules are imported inside ``run_*`` so that ``anyorder --help`` is instant. Every
:class:`~anyorder.errors.AnyorderError` becomes one line on stderr and exit code 2.

Modules, by command group: :mod:`~anyorder.cli.main` (the parser, the table of commands,
:func:`main`), :mod:`~anyorder.cli.train` (info, train, data, demo),
:mod:`~anyorder.cli.sample` (sample), :mod:`~anyorder.cli.serve` (serve),
:mod:`~anyorder.cli.evaluate` (eval, experiment), :mod:`~anyorder.cli.interop` (convert,
export). ``python -m anyorder.cli`` runs :func:`main` (``__main__.py``).
"""

from anyorder.cli.evaluate import (
    DEFAULT_TARGETS,
    add_eval,
    add_experiment,
    run_eval,
    run_experiment,
)
from anyorder.cli.interop import add_convert, add_export, run_convert, run_export
from anyorder.cli.main import Command, build_parser, commands, main
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

__all__ = [
    "DEFAULT_TARGETS",
    "Command",
    "add_convert",
    "add_data",
    "add_demo",
    "add_eval",
    "add_experiment",
    "add_export",
    "add_info",
    "add_sample",
    "add_serve",
    "add_train",
    "build_parser",
    "commands",
    "main",
    "run_convert",
    "run_data",
    "run_demo",
    "run_eval",
    "run_experiment",
    "run_export",
    "run_info",
    "run_sample",
    "run_serve",
    "run_train",
]
