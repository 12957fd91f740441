"""The ``anyorder`` console script: one entry point, one subcommand per job.

Each subcommand is a pair of functions ``add_<name>(parser)`` and ``run_<name>(args)``;
heavy modules are imported inside ``run_*`` so that ``anyorder --help`` is instant. Every
:class:`~anyorder.errors.AnyorderError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from anyorder.errors import AnyorderError

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
        "--dry-run", action="store_true", help="build everything, take one step, write nothing"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_train(args: argparse.Namespace) -> int:
    import os

    from anyorder.config import load_config

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    code = 0
    try:
        cfg = load_config(args.config, args.overrides)
        from anyorder.train import print0, train

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
        print(f"anyorder train: error: {e}", file=sys.stderr)
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
    p.add_argument("config", help="YAML run config (its data and model.seq_len are used)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.source=FILE")


def run_data(args: argparse.Namespace) -> int:
    from anyorder.config import load_config
    from anyorder.data import data_main

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
        help="training steps (default: the calibrated budget, about 8 minutes in all on 2 idle "
        "cores; the same steps give the same report)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="a wall-clock budget for the whole demo instead of --steps (the steps the "
        "calibration fits into it, cut short where this machine is slower: the model then "
        "depends on the machine and its load)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default 2; the report does not depend on them, and on a busy "
        "machine 1 is faster)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")


def run_demo(args: argparse.Namespace) -> int:
    from anyorder.demo import STEPS, THREADS, demo

    if args.steps is not None and args.minutes is not None:
        from anyorder.errors import ConfigError

        raise ConfigError("give --steps or --minutes, not both")
    demo(
        args.out,
        steps=STEPS if args.steps is None else args.steps,
        minutes=args.minutes,
        threads=THREADS if args.threads is None else args.threads,
        progress=not args.no_progress,
    )
    return 0


# ----------------------------------------------------------------------------- eval

_ZERO_SHOT_SETS = "lambada,wikitext2,ptb,wikitext103,lm1b"
DEFAULT_TARGETS = 8
"""Ensemble target slots per block and order unless ``--targets`` says otherwise."""


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run folder (its latest checkpoint) or checkpoint folder")
    p.add_argument(
        "--suite",
        choices=("likelihood", "zero-shot", "gen"),
        default="likelihood",
        help="likelihood: the checkpoint's own data (l2r, any-order, ensemble, ELBO; in bits "
        "per byte); zero-shot: the paper's test sets and table; gen: generative "
        "perplexity and entropy of samples",
    )
    p.add_argument(
        "--weights",
        choices=("ema", "raw"),
        default="ema",
        help="default: ema (a run trained with train.ema: 0 has only raw weights; eval says so)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on CUDA"
    )
    p.add_argument("--out", default=None, help="results folder (default: RUN/eval)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    p.add_argument("--batch-size", type=int, default=8, help="blocks or samples per batch")
    p.add_argument(
        "--no-progress", action="store_true", help="no cost estimate and no progress bars/lines"
    )
    p.add_argument(
        "--protocol",
        choices=("ours", "reference"),
        default="ours",
        help="zero-shot: ours reads every set's test split; reference reads the AO-GPT "
        "reference code's splits (WikiText-2 train, the others test). gen: ours cuts "
        "samples at the first EOS and pools the NLL; reference scores every generated id "
        "as it is and averages per-sample perplexities (AO-GPT's Table 2)",
    )
    g = p.add_argument_group("likelihood and zero-shot")
    g.add_argument(
        "--orders", type=int, default=4, help="random orders K per block (mask draws for mdm)"
    )
    g.add_argument("--ensemble", type=int, default=1, help="context-order ensemble size M")
    g.add_argument(
        "--targets",
        default=None,
        help=f"ensemble: random target slots scored per block and order (default "
        f"{DEFAULT_TARGETS}, about 1 + (M-1)*{DEFAULT_TARGETS}/2 passes per block); 'all' "
        "scores every slot, the paper's full cost of 1 + (M-1)(n+1)/2 passes per block",
    )
    g.add_argument("--max-blocks", type=int, default=None, help="only the first blocks")
    g.add_argument("--split", choices=("val", "train"), default="val", help="likelihood split")
    g.add_argument("--no-l2r", action="store_true", help="skip the left-to-right NLL")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=8192,  # anyorder.models.base.DEFAULT_MAX_TOKENS (not imported: --help stays fast)
        help="memory bound of every likelihood path: token positions per trunk call, and "
        "as many logits elements as max-tokens x d_model per head call (default 8192; "
        "raise it on a GPU with memory to spare)",
    )
    g.add_argument("--datasets", default=_ZERO_SHOT_SETS, help="zero-shot: comma-separated")
    g.add_argument(
        "--splits",
        default=None,
        metavar="NAME=SPLIT,...",
        help="zero-shot: per-set splits over the protocol's, e.g. wikitext2=test,lm1b=train",
    )
    g.add_argument(
        "--data-dir",
        default=None,
        help="zero-shot offline: DIR/<dataset>/ holds that test split as .txt (one example "
        "per line), .jsonl or .parquet, e.g. DIR/lambada/lambada_test.jsonl; another split "
        "in DIR/<dataset>/<split>/, e.g. DIR/wikitext2/train/",
    )
    q = p.add_argument_group("gen")
    q.add_argument("--judge", default="gpt2-large", help="transformers LM, folder, or gpt run")
    q.add_argument("--num-samples", type=int, default=16, help="samples per setting")
    q.add_argument("--length", type=int, default=None, help="tokens per sample (default n)")
    q.add_argument("--steps", default=None, help="comma-separated step counts (default n)")
    q.add_argument("--temperature", default="1.0", help="comma-separated temperatures")
    q.add_argument("--top-p", type=float, default=None, help="nucleus sampling")
    q.add_argument("--order", choices=("random", "l2r"), default="random", help="sample order")


def _numbers(text: str | None, kind: type, name: str) -> list:
    from anyorder.errors import ConfigError

    if text is None:
        return [None]
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--{name} {text!r}: give comma-separated numbers") from None


def _check_eval_args(args: argparse.Namespace) -> None:
    """Counts and controls of ``anyorder eval``, before a model is loaded."""
    from anyorder import bounds
    from anyorder.errors import ConfigError

    for name in (
        "orders",
        "ensemble",
        "batch_size",
        "num_samples",
        "max_blocks",
        "max_tokens",
        "length",
    ):  # fmt: skip (--targets: see _targets)
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.batch_size > bounds.MAX_NUM_SAMPLES:
        raise ConfigError(f"--batch-size must be at most {bounds.MAX_NUM_SAMPLES}")
    bounds.check_seed(args.seed, "--seed")
    if args.suite == "gen":
        for temp in _numbers(args.temperature, float, "temperature"):
            bounds.check_controls(temperature=temp, top_p=args.top_p)
        for steps in _numbers(args.steps, int, "steps"):
            bounds.check_controls(steps=steps)


def _targets(text: str | None, ensemble: int) -> int | None:
    """``--targets``: a count, ``all`` (None) or the default where an ensemble runs."""
    from anyorder.errors import ConfigError

    if text is None:
        return DEFAULT_TARGETS if ensemble > 1 else None
    if text.strip().lower() == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--targets {text!r}: give a number of target slots, or all") from None
    if value < 1:
        raise ConfigError("--targets must be at least 1")
    return value


def _eval_device(spec: str):
    import torch

    from anyorder.errors import ConfigError

    name = "cuda" if spec == "auto" and torch.cuda.is_available() else spec
    name = "cpu" if name == "auto" else name
    if not (name == "cpu" or (name.startswith("cuda") and torch.cuda.is_available())):
        raise ConfigError(f"--device {spec!r} is not available here; use auto or cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {spec!r} is not a device; use cpu or cuda:N") from None


def run_eval(args: argparse.Namespace) -> int:
    import contextlib
    from pathlib import Path

    import torch

    from anyorder.checkpoint import load_model
    from anyorder.errors import ConfigError
    from anyorder.runlock import check_writable_dir

    _check_eval_args(args)
    targets = _targets(args.targets, args.ensemble)
    if args.suite == "likelihood" and args.protocol != "ours":
        raise ConfigError(
            f"--protocol {args.protocol} applies to --suite zero-shot and gen; the likelihood "
            "suite scores the run's own data"
        )
    if args.splits and args.suite != "zero-shot":
        raise ConfigError("--splits applies to --suite zero-shot; use --split for likelihood")
    device = _eval_device(args.device)
    ckpt = load_model(args.checkpoint, weights=args.weights, device=device)
    if ckpt.tokenizer is None:
        raise ConfigError(
            f"{args.checkpoint} holds no tokenizer, so eval cannot tokenize text for it; "
            "convert or export it again with --tokenizer"
        )
    run_dir = ckpt.path.parent.parent if ckpt.path.parent.name == "checkpoints" else ckpt.path
    out = Path(args.out) if args.out else run_dir / "eval"
    check_writable_dir(out, "--out")
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
    model = ckpt.model
    print(f"{model.kind} step {ckpt.step} ({ckpt.weights} weights) from {ckpt.path} on {device}")
    if args.weights == "ema" and ckpt.weights == "raw":
        print(
            "note: this run kept no EMA of its weights (train.ema: 0), so its raw weights are "
            "evaluated; --weights ema and --weights raw are the same here"
        )
    suite = dict(
        orders=args.orders,
        ensemble=args.ensemble,
        targets=targets,
        seed=args.seed,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        left_to_right=not args.no_l2r,
    )
    with ctx:
        if args.suite == "likelihood":
            written = _eval_likelihood(args, ckpt, suite, out)
        elif args.suite == "zero-shot":
            written = _eval_zero_shot(args, ckpt, suite, out)
        else:
            written = _eval_gen(args, ckpt, device, out)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _eval_likelihood(args: argparse.Namespace, ckpt, suite: dict, out) -> list:
    import json

    from anyorder.corpus import format_likelihood, likelihood_suite
    from anyorder.data import prepare
    from anyorder.zeroshot import write_atomic

    progress = not args.no_progress
    data = prepare(ckpt.config.data, ckpt.model.cfg.seq_len, progress=progress)
    blocks = data.split(args.split)[: args.max_blocks]
    res = likelihood_suite(
        ckpt.model, blocks, bytes_per_token=data.bytes_per_token(args.split),
        progress=progress, **suite,
    )  # fmt: skip
    res.update(split=args.split, source=ckpt.config.data.source, step=ckpt.step)
    res["weights"] = ckpt.weights
    text = format_likelihood(res)
    print(text)
    write_atomic(out / "likelihood.json", json.dumps(res, indent=2) + "\n")
    write_atomic(out / "likelihood.md", "```\n" + text + "\n```\n")
    written = [out / "likelihood.json", out / "likelihood.md"]
    if args.ensemble > 1 and res["ensemble"] and res["ensemble"].get("by_size"):
        from anyorder.plots import plot_ensemble_curve

        unit = "bits/byte" if res["bytes_per_token"] else "ppl"
        written.append(plot_ensemble_curve({args.split: res}, out / "ensemble.png", unit=unit))
    return written


def _eval_zero_shot(args: argparse.Namespace, ckpt, suite: dict, out) -> list:
    from anyorder.zeroshot import parse_splits, table_markdown, write_table, zero_shot

    names = [s.strip() for s in args.datasets.split(",") if s.strip()]
    table = zero_shot(
        ckpt.model, ckpt.tokenizer, names, data_dir=args.data_dir, max_blocks=args.max_blocks,
        protocol=args.protocol, splits=parse_splits(args.splits),
        progress=not args.no_progress, **suite,
    )  # fmt: skip
    table.update(checkpoint=str(ckpt.path), step=ckpt.step, seed=args.seed, weights=ckpt.weights)
    print(table_markdown(table))
    written = write_table(table, out)
    if args.ensemble > 1 and ckpt.model.kind in ("aogpt", "armd"):
        from anyorder.plots import plot_ensemble_curve

        unit = table["unit"]
        written.append(plot_ensemble_curve(table["datasets"], out / "ensemble.png", unit=unit))
    return written


def _eval_gen(args: argparse.Namespace, ckpt, device, out) -> list:
    import json

    from anyorder.genppl import gen_markdown, gen_sweep, load_judge
    from anyorder.plots import plot_gen_sweep
    from anyorder.zeroshot import write_atomic

    judge = load_judge(args.judge, device)
    steps = _numbers(args.steps, int, "steps")
    temps = _numbers(args.temperature, float, "temperature")
    from anyorder.bounds import check_length

    n = check_length(args.length, ckpt.model.cfg.seq_len)
    rows = gen_sweep(
        ckpt.model, ckpt.tokenizer, judge, n=n, num=args.num_samples, steps=steps,
        temperatures=temps, top_p=args.top_p, mode=args.order, seed=args.seed,
        batch_size=args.batch_size, progress=not args.no_progress, protocol=args.protocol,
    )  # fmt: skip
    md = gen_markdown(rows, judge.name)
    print(md)
    gen_out = {"judge": judge.name, "seed": args.seed, "protocol": args.protocol, "rows": rows}
    write_atomic(out / "gen.json", json.dumps(gen_out, indent=2))
    write_atomic(out / "gen.md", md)
    written = [out / "gen.json", out / "gen.md"]
    if len(steps) > 1:
        written.append(plot_gen_sweep(rows, out / "gen_steps.png", x="steps"))
    if len(temps) > 1:
        written.append(plot_gen_sweep(rows, out / "gen_temperature.png", x="temperature"))
    return written


# ----------------------------------------------------------------------------- convert, export


def add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="gpt2: a transformers GPT-2 (hub id or folder with config.json); aogpt-ref / "
        "sigmagpt-ref: the authors' ckpt_N.pt, or hf:OWNER/REPO/PATH/ckpt_N.pt",
    )
    p.add_argument(
        "--from",
        dest="source_format",
        choices=("gpt2", "aogpt-ref", "sigmagpt-ref"),
        default="gpt2",
        help="what the source is: a GPT-2, or a checkpoint of the AO-GPT authors' code "
        "(scxue/AO-GPT-MDM: AO-GPT or sigma-GPT)",
    )
    p.add_argument(
        "--to",
        default=None,
        choices=("gpt", "aogpt", "armd"),
        help="model kind (--from gpt2: required; the reference formats give aogpt)",
    )
    p.add_argument("--out", required=True, help="folder to write the converted model to")
    p.add_argument(
        "--weights",
        choices=("ema", "raw"),
        default=None,
        help="reference formats: the EMA or the raw weights (default: EMA when kept)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer to ship with it (default: the source folder's own, when it has one; "
        "GPT-2's for a reference checkpoint with GPT-2's vocabulary; none: no tokenizer)",
    )
    p.add_argument("--seq-len", type=int, default=None, help="context (default n_positions - 1)")
    p.add_argument("--l2s", type=int, default=None, help="armd: two-stream layers (n_layer/2)")
    p.add_argument("--target-dim", type=int, default=128, help="aogpt: target embedding width")
    p.add_argument("--bos-id", type=int, default=None, help="BOS token (default bos_token_id)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="stored dtype"
    )


def _convert_reference(args: argparse.Namespace):
    from anyorder.convert_ref import convert_ref
    from anyorder.errors import ConfigError

    if args.to not in (None, "aogpt"):
        raise ConfigError(f"--from {args.source_format} converts into aogpt; leave out --to")
    gpt2_only = {"--seq-len": args.seq_len, "--l2s": args.l2s, "--bos-id": args.bos_id}
    given = [k for k, v in gpt2_only.items() if v is not None]
    if given or args.target_dim != 128:
        flag = given[0] if given else "--target-dim"
        raise ConfigError(f"{flag} is for --from gpt2; a reference checkpoint fixes its own sizes")
    return convert_ref(
        args.source,
        args.out,
        args.source_format,
        dtype=args.dtype,
        weights=args.weights,
        tokenizer=args.tokenizer,
    )


def run_convert(args: argparse.Namespace) -> int:
    from anyorder.convert import convert
    from anyorder.errors import ConfigError

    if args.source_format != "gpt2":
        conv = _convert_reference(args)
    else:
        if args.to is None:
            raise ConfigError("--from gpt2 needs --to gpt, aogpt or armd")
        if args.weights is not None:
            raise ConfigError("--weights is for the reference formats; a GPT-2 has one set")
        conv = convert(
            args.source,
            args.to,
            args.out,
            dtype=args.dtype,
            seq_len=args.seq_len,
            l2s=args.l2s,
            target_dim=args.target_dim,
            bos_id=args.bos_id,
            tokenizer=args.tokenizer,
        )
    m = conv.model
    tok = conv.tokenizer.name if conv.tokenizer is not None else "none (pass --tokenizer)"
    what = (
        f" ({conv.info['reference_weights']} weights)" if "reference_weights" in conv.info else ""
    )
    print(
        f"{m.kind}{what}: {m.num_params() / 1e6:.2f}M parameters, {m.cfg.n_layer} layers x "
        f"{m.cfg.d_model}, seq_len {m.cfg.seq_len}, tokenizer {tok}"
    )
    print(f"wrote {conv.folder}")
    return 0


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run folder (its latest checkpoint) or checkpoint folder")
    p.add_argument("--out", required=True, help="folder to write (uploadable to the hub as is)")
    p.add_argument(
        "--weights", choices=("ema", "raw"), default="ema", help="default: ema (raw if no EMA)"
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="stored dtype"
    )
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="then upload it")
    p.add_argument("--private", action="store_true", help="create the hub repository private")


def run_export(args: argparse.Namespace) -> int:
    from anyorder.hub import export, push_to_hub, read_export_config

    folder = export(args.checkpoint, args.out, weights=args.weights, dtype=args.dtype)
    cfg = read_export_config(folder)
    print(f"{cfg['anyorder_kind']} step {cfg['step']} ({cfg['weights']} weights): wrote {folder}")
    if args.push_to_hub:
        url = push_to_hub(folder, args.push_to_hub, private=args.private)
        print(f"pushed to {url}")
    return 0


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
    p.add_argument(
        "--order",
        choices=("l2r", "random", "strided"),
        default=None,
        help="generation order (default: l2r for gpt, random otherwise; strided: armd)",
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
        default="linear",
        help="--steps: the masking schedule m(t) (cosine: cos((1 - t) pi / 2), few tokens first)",
    )
    p.add_argument(
        "--reveal",
        choices=("binomial", "reference"),
        default="binomial",
        help="--steps: tokens per step: binomial (the exact reverse process) or reference (the "
        "AO-GPT code's deterministic counts, never an empty step)",
    )
    p.add_argument(
        "--shared-counts",
        action="store_true",
        help="--steps: one reveal count per step for all samples (faster; samples then share "
        "their count trajectory)",
    )
    p.add_argument(
        "--length", type=int, default=None, help="tokens per sample, prompt included (default n)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    p.add_argument("--num-samples", type=int, default=1, help="samples (one batch)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    p.add_argument(
        "--no-stop-at-eos",
        action="store_true",
        help="keep the text after the first EOS (default: cut there; l2r decoding stops)",
    )
    p.add_argument("--json", action="store_true", help="print tokens, orders and pass counts")
    p.add_argument("--weights", choices=("ema", "raw"), default="ema", help="default: ema")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture each forward-pass shape once as a CUDA graph and replay it (CUDA only)",
    )
    p.add_argument(
        "--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on CUDA"
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


def run_sample(args: argparse.Namespace) -> int:
    import contextlib
    import json
    import time

    import torch

    from anyorder import bounds
    from anyorder.checkpoint import load_model
    from anyorder.errors import SamplingError
    from anyorder.sample import decode_text, parse_template, sample
    from anyorder.train import resolve_device

    bounds.check_controls(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        num_samples=args.num_samples, seed=args.seed, steps=args.steps, length=args.length,
    )  # fmt: skip
    if args.infill is not None and args.length is not None:
        raise SamplingError("--infill takes its length from the template; leave out --length")
    device = resolve_device(args.device, what="--device")
    ckpt = load_model(args.checkpoint, weights=args.weights, device=device)
    model, tok = ckpt.model, ckpt.tokenizer
    if tok is None and (args.prompt or args.infill is not None):
        raise SamplingError(
            f"{args.checkpoint} holds no tokenizer, so text cannot be encoded; sample without "
            "--prompt/--infill (token ids), or convert/export it again with --tokenizer"
        )
    order = args.order or ("l2r" if model.kind == "gpt" else "random")
    if order == "strided" and args.streams is None:
        raise SamplingError("--order strided needs --streams S")
    if args.streams is not None and args.order not in (None, "strided"):
        raise SamplingError(f"--streams fixes the order (strided); leave out --order {order}")
    streams = args.streams
    if streams is not None:
        order = "strided"
    prompt = known = None
    if args.infill is not None:
        bounds.check_holes(args.infill, model.cfg.seq_len)
        prompt, known = parse_template(args.infill, tok, model.cfg.seq_len)
        n = len(prompt)
        bounds.check_steps(args.steps, n)
    else:
        n = bounds.check_fit(model.cfg.seq_len, length=args.length, steps=args.steps)
    if args.prompt:
        ids = tok.encode(args.prompt)
        if len(ids) >= n:
            raise SamplingError(
                f"the prompt is {len(ids)} tokens, not shorter than --length {n}; raise "
                "--length or shorten the prompt"
            )
        prompt = torch.zeros(n, dtype=torch.long)
        prompt[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        known = torch.zeros(n, dtype=torch.bool)
        known[: len(ids)] = True
    sequential = args.steps is None and streams is None
    cut = not args.no_stop_at_eos and args.infill is None
    eos = tok.eos_id if tok is not None else None
    stop = eos if cut and sequential and order == "l2r" and model.kind != "mdm" else None
    stream = None
    if tok and sequential and order == "l2r" and args.num_samples == 1 and not args.json:
        stream = _Streamer(tok, tok.eos_id if cut else None)
        if prompt is not None:
            stream.ids = prompt[known].tolist()
            stream.flush()
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
    gen = torch.Generator(device).manual_seed(args.seed)
    start = time.perf_counter()
    with ctx, bounds.out_of_memory_as_error(f"--num-samples {args.num_samples} x {n} tokens"):
        result = sample(
            model,
            n,
            order=None if order == "strided" else order,
            streams=streams,
            steps=args.steps,
            schedule=args.schedule,
            shared_counts=args.shared_counts,
            reveal=args.reveal,
            graphs=args.cuda_graphs,
            batch=args.num_samples,
            prompt=prompt,
            known=known,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            generator=gen,
            stop_at_eos=stop,
            on_step=stream,
        )
    seconds = time.perf_counter() - start
    tokens = result.tokens.cpu()
    if tok is None:  # no tokenizer: the token ids themselves
        texts = [" ".join(map(str, row.tolist())) for row in tokens]
    else:
        texts = [decode_text(tok, row, tok.eos_id if cut else None) for row in tokens]
    generated = int((result.step_of >= 0).sum())
    mode = "encoder" if model.kind == "mdm" else "strided" if streams else "lemma1"
    mode = "sequential" if sequential and model.kind != "mdm" else mode
    if args.json:
        out = {
            "checkpoint": str(ckpt.path),
            "step": ckpt.step,
            "seed": args.seed,
            "kind": model.kind,
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
        print(json.dumps(out))
        return 0
    if stream is not None:
        stream.flush(final=True)
        print()
    else:
        for i, text in enumerate(texts):
            if len(texts) > 1:
                print(f"=== sample {i + 1} ===")
            print(text)
    print(
        f"{model.kind} {mode}: {generated} tokens, {result.forward_passes} forward passes, "
        f"{generated / max(seconds, 1e-9):,.0f} tokens/s",
        file=sys.stderr,
    )
    return 0


# ----------------------------------------------------------------------------- serve


def add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        help="export, hub id, run folder or checkpoint (default: runs/demo, the main job's model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: local only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--max-samples", type=int, default=4, help="samples per request at most")
    p.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds per request at most (wall clock)"
    )
    p.add_argument("--weights", choices=("ema", "raw"), default="ema", help="default: ema")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on CUDA"
    )
    p.add_argument("--verbose", action="store_true", help="log every request")


def run_serve(args: argparse.Namespace) -> int:
    from anyorder.bounds import MAX_NUM_SAMPLES
    from anyorder.errors import ConfigError
    from anyorder.serve import Limits, serve

    if not 1 <= args.max_samples <= MAX_NUM_SAMPLES or not args.time_limit > 0:
        raise ConfigError(
            f"--max-samples must lie in 1..{MAX_NUM_SAMPLES} and --time-limit be above 0"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} must lie in 0..65535 (0: any free port)")
    limits = Limits(max_samples=args.max_samples, time_limit_s=args.time_limit)
    serve(
        args.checkpoint,
        host=args.host,
        port=args.port,
        limits=limits,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        verbose=args.verbose,
    )
    return 0


# ----------------------------------------------------------------------------- registry

Command = tuple[
    str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]


# ----------------------------------------------------------------------------- experiment


def add_experiment(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="experiment name (anyorder.experiments.EXPERIMENTS) or all")
    p.add_argument("--scale", choices=("cpu", "paper"), default="cpu",
                   help="cpu: train here; paper: torchrun with the paper configs")  # fmt: skip
    p.add_argument("--minutes", type=float, default=None, help="training budget per run")
    p.add_argument("--seeds", type=int, default=1, help="training seeds per arm")
    p.add_argument("--out", default="runs/experiments", help="output folder")
    p.add_argument("--nproc", type=int, default=8, help="paper scale: GPUs for torchrun")
    p.add_argument("--print-only", action="store_true", help="paper scale: print the commands")
    p.add_argument("--smoke", action="store_true", help="minimal sizes (tests the code path)")
    p.add_argument(
        "--arms", default=None, metavar="TEXT", help="only the arms whose label contains TEXT"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress messages")


def run_experiment(args: argparse.Namespace) -> int:
    from pathlib import Path

    from anyorder.experiments import EXPERIMENTS, Context
    from anyorder.experiments import run_experiment as run_one

    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    root = Path(args.out)
    for name in names:
        ctx = Context(
            out=root / name, runs=root / "runs", scale=args.scale, minutes=args.minutes,
            seeds=args.seeds, smoke=args.smoke, progress=not args.no_progress,
            nproc=args.nproc, print_only=args.print_only, only=args.arms,
        )  # fmt: skip
        res = run_one(name, ctx)
        print(f"experiment {name}: {ctx.out / 'section.md'} ({res['wall_s']:.0f} s)", flush=True)
    return 0


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
            "GPT-2 weights -> gpt, aogpt or armd; the AO-GPT authors' checkpoints -> aogpt",
            add_convert,
            run_convert,
        ),
        ("export", "training checkpoint -> uploadable model folder", add_export, run_export),
        ("sample", "generate or infill text from a checkpoint", add_sample, run_sample),
        ("serve", "a local web page that shows generation as it happens", add_serve, run_serve),
        ("experiment", "reproduce a paper comparison", add_experiment, run_experiment),
    ]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), like every other error of the CLI."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may follow the options (`train CONFIG --dry-run a.b=1`); argparse
    # stops filling a positional list at the first option, so collect the rest here.
    if extra and isinstance(getattr(args, "overrides", None), list):
        # a word without "=" goes to the overrides too, whose parser says what is wrong
        unknown = [e for e in extra if e.startswith("-")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
