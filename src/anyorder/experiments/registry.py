"""The experiments' registry: :data:`EXPERIMENTS` (name -> title and function) and
:func:`run_experiment`, the one entry the CLI, the tests and ``anyorder experiment all`` go
through.

Design choices: one signature, ``fn(ctx) -> dict`` with the section's Markdown under
``"markdown"``; :func:`run_experiment` writes ``result.json`` (non-finite numbers as null)
and ``section.md``, and pins torch to one thread (the CPU budget is calibrated on one).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from anyorder.errors import ConfigError
from anyorder.experiments.comparisons import exp_finding1, exp_finding3, exp_four, exp_progressive
from anyorder.experiments.decoding import exp_decode, exp_sbp
from anyorder.experiments.instruct import exp_instruct
from anyorder.experiments.likelihood import exp_eq5, exp_finding5
from anyorder.experiments.runs import Context

Experiment = Callable[[Context], dict[str, Any]]

EXPERIMENTS: dict[str, tuple[str, Experiment]] = {
    "eq5": ("1. Eq. 5 by enumeration; aogpt's order dependence", exp_eq5),
    "decode": ("8. Decoder vs encoder: generation time and quality vs steps", exp_decode),
    "finding5": ("4. AO-GPT Finding 5: ensemble size M", exp_finding5),
    "finding1": ("2. AO-GPT Finding 1: l2r vs any-order training", exp_finding1),
    "finding3": ("3. AO-GPT Finding 3: left-to-right mix", exp_finding3),
    "four": ("5. ARMD vs AO-GPT vs mdm vs gpt at equal tokens", exp_four),
    "progressive": ("6. ARMD progressive schedule vs uniform", exp_progressive),
    "sbp": ("7. SBP: strided generation before and after fine-tuning", exp_sbp),
    "instruct": ("9. Instruction tuning: exact match vs steps, any-order decoding", exp_instruct),
}
"""name -> (title, function), in the order ``all`` runs them (cheap and exact first)."""


def run_experiment(name: str, ctx: Context) -> dict[str, Any]:
    """Run one experiment; write ``result.json`` and ``section.md`` into ``ctx.out``.

    Raises:
        ConfigError: an unknown name or scale.
    """
    if name not in EXPERIMENTS:
        raise ConfigError(
            f"unknown experiment {name!r}; use one of {', '.join(EXPERIMENTS)} or all"
        )
    if ctx.scale not in ("cpu", "paper"):
        raise ConfigError(f"--scale {ctx.scale!r}: use cpu or paper")
    title, fn = EXPERIMENTS[name]
    ctx.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = fn(ctx)
    res["wall_s"] = time.perf_counter() - t0
    res["name"], res["title"], res["scale"] = name, title, ctx.scale
    (ctx.out / "result.json").write_text(json.dumps(_jsonable(res), indent=2) + "\n")
    (ctx.out / "section.md").write_text(f"## {title}\n\n{res['markdown']}")
    return res


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
