"""Paper scale: the experiments as ``torchrun`` command lines with the paper configs
(``configs/*.yaml``) plus each arm's overrides, run one after another or printed
(``--print-only``). Nothing trains here at this scale.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from typing import Any

from anyorder.errors import ConfigError
from anyorder.experiments.runs import OURS, PUBLISHED, ROPE_TARGET, Context

PAPER_STEPS_NOTE = "the paper configs' own step counts and batch sizes"


def torchrun_command(config: str, overrides: list[str], nproc: int) -> list[str]:
    """The ``torchrun`` command line that trains ``configs/CONFIG`` with ``overrides``."""
    return [
        "torchrun",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "anyorder.cli",
        "train",
        f"configs/{config}",
        "--no-progress",
        *overrides,
    ]


def paper_commands(
    config: str, arms: dict[str, tuple[str, list[str]]], nproc: int, seeds: int, root: str
) -> list[list[str]]:
    """One torchrun command per arm and seed: the paper config, the arm's kind and order."""
    cmds = []
    for label, (kind, order) in arms.items():
        name = label.replace(" ", "_").replace("%", "pct").replace("(", "").replace(")", "")
        for s in range(seeds):
            ov = [f"model.kind={kind}", *order, f"train.seed={s}",
                  f"train.out_dir={root}/{name}-s{s}"]  # fmt: skip
            cmds.append(torchrun_command(config, ov, nproc))
    return cmds


_PAPER_PROGRESSIVE = ["order.kind=progressive", "order.i_ar=9000", "order.i_perm=48000",
                      "order.rho=32"]  # fmt: skip


def _paper_arms(arms: dict[str, tuple[str, list[str]]]) -> dict[str, tuple[str, list[str]]]:
    # the CPU-scaled progressive schedule -> the paper's (9K / 48K / 32)
    return {
        k: (kind, _PAPER_PROGRESSIVE if any("progressive" in o for o in order) else order)
        for k, (kind, order) in arms.items()
    }


def _run_commands(ctx: Context, cmds: list[list[str]], note: str = "") -> dict[str, Any]:
    ctx.commands.extend(cmds)
    text = "\n".join(shlex.join(c) for c in cmds)
    if ctx.print_only:
        print(text)
    else:
        for c in cmds:
            print("+ " + shlex.join(c), flush=True)
            rc = subprocess.call(c)
            if rc:
                raise ConfigError(f"paper-scale run failed (exit code {rc}): {shlex.join(c)}")
    md = f"Paper scale ({'printed' if ctx.print_only else 'run'}):\n\n```\n{text}\n```\n{note}"
    return {"commands": [shlex.join(c) for c in cmds], "markdown": md}


def _paper(
    ctx: Context,
    config: str,
    arms: dict[str, tuple[str, list[str]]],
    *,
    evaluate: str | None = None,
    sbp: bool = False,
    decode: bool = False,
) -> dict[str, Any]:
    root = str(ctx.out / "runs")
    cmds = paper_commands(config, _paper_arms(arms), ctx.nproc, ctx.seeds, root)
    note = f"Budget: {PAPER_STEPS_NOTE}.\n"
    if evaluate:
        run_dir = cmds[0][-1].split("=", 1)[1]  # the first arm's train.out_dir
        cmds.append(["anyorder", "eval", run_dir, *evaluate.split()])
    if sbp:
        base = f"{root}/armd_progressive-s0"
        ov = ["order.kind=sbp", "order.sbp_streams=[1,2,4]", "train.steps=20000",
              f"train.init_from={base}", f"train.out_dir={root}/armd_sbp-s0"]  # fmt: skip
        cmds.append(torchrun_command(config, ov, ctx.nproc))
    if decode:
        cmds = [[sys.executable, "benchmarks/decode.py"]]
        note = "Timing on the GPU: the decode benchmark at the paper's sizes.\n"
    return _run_commands(ctx, cmds, note)


def _paper_four(ctx: Context) -> dict[str, Any]:
    cfgs = {"gpt": ("gpt-small-owt.yaml", []), "aogpt": ("aogpt-small-owt.yaml", PUBLISHED),
            "aogpt-ours": ("aogpt-small-owt.yaml", OURS),
            "armd": ("armd-small-owt.yaml", []), "mdm": ("mdm-small-owt.yaml", []),
            "aogpt-rope-target": ("aogpt-small-owt.yaml", [*OURS, *ROPE_TARGET])}  # fmt: skip
    root = str(ctx.out / "runs")
    cmds = []
    for name, (cfg, extra) in cfgs.items():
        for s in range(ctx.seeds):
            # equal tokens: every run takes ARMD's 180K steps of 512 x 1024 tokens
            ov = [f"train.seed={s}", "train.steps=180000", f"train.out_dir={root}/{name}-s{s}"]
            cmds.append(torchrun_command(cfg, ov + extra, ctx.nproc))
    return _run_commands(ctx, cmds, "Budget: 180K steps x 512 x 1024 tokens for every model.\n")
