"""``anyorder info``, ``train``, ``data`` and ``demo``: the commands that build and train.

Each command is a pair ``add_<name>(parser)`` / ``run_<name>(args)``; heavy modules are
imported inside ``run_*`` so that ``anyorder --help`` stays instant. ``run_train`` also runs
under torchrun: there an error is printed by each rank and the process leaves with
``os._exit`` (gloo can abort at interpreter exit).
"""

from __future__ import annotations

import argparse
import sys

from anyorder.errors import AnyorderError, print_line

# ----------------------------------------------------------------------------- info


def add_info(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, help="only this preset (tiny, small, medium)")
    p.add_argument("--config-keys", action="store_true", help="list every config key with its help")


def run_info(args: argparse.Namespace) -> int:
    from anyorder.config import MODEL_KINDS, PRESETS, describe, preset
    from anyorder.models import count_params

    if args.config_keys:
        for key, default, help_text in describe():
            print(f"{key:28s} {default:18s} {help_text}")
        return 0
    names = [args.preset] if args.preset else list(PRESETS)
    print(f"{'preset':8s} " + " ".join(f"{k:>12s}" for k in MODEL_KINDS) + "   (parameters)")
    for name in names:
        counts = []
        for kind in MODEL_KINDS:
            counts.append(f"{count_params(preset(name, kind=kind)) / 1e6:11.2f}M")
        print(f"{name:8s} " + " ".join(counts))
    return 0


# ----------------------------------------------------------------------------- train


def add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100")
    p.add_argument(
        "--resume",
        action="store_true",
        help="resume the run folder's latest checkpoint, allowing train.* and order.* changes "
        "(without it, a run folder with checkpoints of the same config is resumed anyway)",
    )
    p.add_argument("--resume-from", default=None, metavar="PATH", help="resume this checkpoint")
    p.add_argument("--fresh", action="store_true", help="never resume (error if checkpoints)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build everything, take one step, write nothing (the run folder and the "
        "checkpoint to resume are checked as the run checks them)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_train(args: argparse.Namespace) -> int:
    import os

    from anyorder.config import load_config

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    code = 0
    try:
        cfg = load_config(args.config, args.overrides)
        from anyorder.training.distributed import print0
        from anyorder.training.loop import train

        resume: bool | str = args.resume_from or (True if args.resume else "auto")
        if args.fresh:
            resume = False
        summary = train(cfg, resume=resume, dry_run=args.dry_run, progress=not args.no_progress)
        if summary.get("interrupted"):  # SIGINT/SIGTERM: saved; exit 128 + signal number
            import signal

            print0(f"resume with the same command (the run folder is {summary['run_dir']})")
            code = 128 + int(signal.Signals[summary["interrupted"]])
        elif not summary["dry_run"] and summary["steps_run"]:
            print0(f"done: step {summary['step']}, {summary['tokens_per_s']:,.0f} tokens/s")
            print0(f"run folder: {summary['run_dir']}")
    except AnyorderError as e:
        if not distributed:
            raise
        print_line(f"anyorder train: error: {e}")
        code = e.exit_code
    except BaseException:
        if not distributed:
            raise
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        if distributed:
            # gloo can abort at interpreter exit (about 1 run in 10 on the CPU: "terminate called
            # without an active exception"); leave without the teardown.
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


# ----------------------------------------------------------------------------- data


def add_data(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", nargs="?", help="YAML run config (its data and model.seq_len are used)"
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.source=FILE")
    p.add_argument(
        "--instruct",
        default=None,
        metavar="DIR",
        help="instead: write the synthetic instruction task (sort letters, reverse words, add "
        "numbers) as DIR/train.jsonl and DIR/heldout.jsonl, prompt/response records with "
        "disjoint prompts",
    )
    p.add_argument("--n", type=int, default=20000, help="--instruct: training examples")
    p.add_argument("--heldout", type=int, default=1000, help="--instruct: held-out examples")
    p.add_argument("--seed", type=int, default=0, help="--instruct: seed of the draws")


def run_data(args: argparse.Namespace) -> int:
    from anyorder.config import load_config
    from anyorder.data import data_main
    from anyorder.errors import ConfigError

    if args.instruct is not None:
        if args.config is not None:
            raise ConfigError("--instruct writes a task and reads no config; leave out the config")
        from anyorder.data.instruct import write_instruct

        paths = write_instruct(args.instruct, n=args.n, heldout=args.heldout, seed=args.seed)
        print(f"wrote {paths['train']} ({args.n} examples) and {paths['heldout']} "
              f"({args.heldout})")  # fmt: skip
        return 0
    if args.config is None:
        raise ConfigError("anyorder data needs a config (or --instruct DIR); see --help")
    cfg = load_config(args.config, args.overrides)
    data_main(cfg.data, cfg.model.seq_len)
    return 0


# ----------------------------------------------------------------------------- demo


def add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="run folder for the demo and its report")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps (default 4500, about 8-9 minutes in all on 2 idle cores of the "
        "machine the README names; the same steps give the same report). Stopped by a signal, "
        "the same command again resumes it",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="a wall-clock budget for the whole demo instead of --steps (the steps fitted to "
        "this machine's speed measured on the first steps, cut short at the limit: the model "
        "then depends on the machine and its load)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default 2; the report does not depend on them)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")


def run_demo(args: argparse.Namespace) -> int:
    from anyorder.demo import STEPS, THREADS, demo

    if args.steps is not None and args.minutes is not None:
        from anyorder.errors import ConfigError

        raise ConfigError("give --steps or --minutes, not both")
    info = demo(
        args.out,
        steps=STEPS if args.steps is None else args.steps,
        minutes=args.minutes,
        threads=THREADS if args.threads is None else args.threads,
        progress=not args.no_progress,
    )
    if info.get("stopped"):  # SIGINT/SIGTERM: saved, no report; exit 128 + signal number
        import signal

        return 128 + int(signal.Signals[info["stopped"]])
    return 0
