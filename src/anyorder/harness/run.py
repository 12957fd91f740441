"""Running the harness on an anyorder model: :func:`run_harness` (``lm_eval.simple_evaluate``,
what ``anyorder eval --suite lm-eval`` calls) and :func:`main` (``python -m anyorder.harness``,
the harness's own command line with the ``anyorder`` model registered)."""

from __future__ import annotations

import sys
from typing import Any

from anyorder.errors import AnyorderError, print_line
from anyorder.harness.backend import AnyorderLM


def run_harness(
    pretrained: str,
    tasks: list[str],
    *,
    model_args: dict[str, Any] | None = None,
    include_path: str | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    log_samples: bool = False,
    apply_chat_template: bool = False,
    trust_task_code: bool = False,
) -> dict[str, Any]:
    """Evaluate ``pretrained`` on the harness's ``tasks``; returns its results dict.

    Args:
        pretrained: a run folder, checkpoint, export or hub id.
        tasks: task or group names (the harness's catalogue, or YAML under ``include_path``).
        model_args: the backend's other arguments (``order``, ``num_orders``, ``seed``, ...).
        include_path: a folder of task YAML files beside the harness's own.
        limit: only the first examples of each task.
        num_fewshot: examples in each prompt (None: the task's default).
        batch_size: requests per forward pass.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        log_samples: keep every request and response under ``results["samples"]``.
        apply_chat_template: render each prompt with the model's chat template
            (:meth:`AnyorderLM.apply_chat_template`), as the harness's own flag.
        trust_task_code: let the YAML under ``include_path`` run code (``!function`` tags,
            metrics from HF evaluate, templates outside Jinja's sandbox); without it such a
            folder is refused (:mod:`anyorder.harness.trust`).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from anyorder.errors import ConfigError
    from anyorder.harness.trust import check_task_folder, sandboxed_templates

    # the model's arguments first: they cost nothing to check, the task index seconds
    clash = sorted(set(model_args or {}) & {"pretrained", "batch_size", "device"})
    if clash:
        raise ConfigError(
            f"model_args {clash[0]}: run_harness takes it as its own argument; leave it out "
            "of model_args"
        )
    if include_path is not None:  # read, not run: before the model loads
        check_task_folder(include_path, trust=trust_task_code)
    args = dict(model_args or {}, batch_size=batch_size, device=device)
    lm = AnyorderLM(pretrained, **args)
    manager = TaskManager(include_path=include_path)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise ConfigError(
            f"--tasks {missing[0]}: not a task the harness knows; list them with "
            "python -m anyorder.harness ls tasks (add --include-path DIR for your own YAML)"
        )
    sandbox = sandboxed_templates(include_path, trust=trust_task_code or include_path is None)
    with sandbox:
        return simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=log_samples,
            apply_chat_template=apply_chat_template,
            device=device,
            batch_size=batch_size,
        )


def main(argv: list[str] | None = None) -> None:
    """``python -m anyorder.harness ARGS``: ``lm_eval ARGS`` with ``--model anyorder`` known."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except AnyorderError as e:
        print_line(f"anyorder harness: error: {e}")
        raise SystemExit(e.exit_code) from None
