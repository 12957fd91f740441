"""``anyorder eval`` (likelihood, zero-shot and generative-perplexity suites) and
``anyorder experiment`` (the paper comparisons).

Counts and controls are checked (:func:`_check_eval_args`) before a model is loaded, so a
bad flag costs no load; each suite writes its results with ``write_atomic`` (no half-written
files) and prints the paths it wrote.
"""

from __future__ import annotations

import argparse

# ----------------------------------------------------------------------------- eval

_ZERO_SHOT_SETS = "lambada,wikitext2,ptb,wikitext103,lm1b"
DEFAULT_TARGETS = 8
"""Ensemble target slots per block and order unless ``--targets`` says otherwise."""


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run folder (its latest checkpoint) or checkpoint folder")
    p.add_argument(
        "--suite",
        choices=("likelihood", "zero-shot", "gen", "lm-eval"),
        default="likelihood",
        help="likelihood: the checkpoint's own data (l2r, any-order, ensemble, ELBO; in bits "
        "per byte); zero-shot: the paper's test sets and table; gen: generative "
        "perplexity and entropy of samples; lm-eval: EleutherAI's evaluation harness "
        "(pip install anyorder[eval]; docs/evaluation.md)",
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
        "--no-progress",
        action="store_true",
        help="no progress bars/lines (the likelihood suite's cost estimate is still printed)",
    )
    p.add_argument(
        "--protocol",
        choices=("ours", "reference"),
        default="ours",
        help="zero-shot: ours reads every set's test split; reference reads the AO-GPT "
        "reference code's splits (WikiText-2 train, the others test) and cuts blocks per "
        "group of examples as its datasets map does. gen: ours cuts samples at the first "
        "EOS and pools the NLL; reference samples with its top-p (the token crossing p "
        "dropped), scores every generated id as it is and averages per-sample "
        "perplexities (AO-GPT's Table 2)",
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
    _add_harness_flags(p.add_argument_group("lm-eval"))


def _add_harness_flags(h) -> None:
    """The ``lm-eval`` suite's flags of ``anyorder eval``."""
    h.add_argument("--tasks", default=None, help="lm-eval: comma-separated task names")
    h.add_argument("--include-path", default=None, help="lm-eval: a folder of task YAML files")
    h.add_argument(
        "--trust-task-code",
        action="store_true",
        help="lm-eval: let the --include-path YAML run code (!function tags, metrics from HF "
        "evaluate, templates outside Jinja's sandbox); without it such a folder is refused",
    )
    h.add_argument("--limit", type=int, default=None, help="lm-eval: examples per task")
    h.add_argument("--num-fewshot", type=int, default=None, help="lm-eval: examples per prompt")
    h.add_argument(
        "--apply-chat-template", action="store_true", help="lm-eval: prompts in the chat template"
    )
    h.add_argument(
        "--model-args",
        default="",
        help="lm-eval: the anyorder model's arguments, e.g. order=any,num_orders=4 or "
        "order=ensemble:4 (docs/evaluation.md); --seed, --weights, --batch-size and --device "
        "are passed on",
    )


def _numbers(text: str | None, kind: type, name: str) -> list:
    from anyorder.errors import ConfigError, preview

    if text is None:
        return [None]
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--{name} {preview(text)}: give comma-separated numbers") from None
    if not values:  # a sweep of no rows: an empty table written over the last one
        example = "8,16" if kind is int else "0.8,1.0"
        raise ConfigError(
            f"--{name} {preview(text)} holds no number; give comma-separated numbers, e.g. "
            f"{example} "
            f"(or leave --{name} out)"
        )
    return values


def _check_ensemble_memory(args: argparse.Namespace, n: int, device) -> None:
    """The ensemble's draws for a call of blocks against the device's memory."""
    from anyorder.evaluation.corpus import rows_per_call
    from anyorder.evaluation.estimators import check_ensemble_memory

    rows = rows_per_call(n, args.batch_size, args.max_tokens)
    check_ensemble_memory(
        args.ensemble, rows, n, device, name=f"--ensemble {args.ensemble}",
        what=f"{rows} block(s) of {n} tokens",
        fix="use e.g. --ensemble 8 (or lower --batch-size)",
    )  # fmt: skip


def _check_eval_args(args: argparse.Namespace) -> None:
    """Counts and controls of ``anyorder eval``, before a model is loaded."""
    from anyorder import bounds
    from anyorder.errors import ConfigError
    from anyorder.evaluation.estimators import check_counts

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
    # each order is a pass over every block: weeks, not minutes
    check_counts(args.orders, args.ensemble, names=("--orders {}", "--ensemble {}"), unit="block")
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
    from anyorder.errors import ConfigError, preview

    if text is None:
        return DEFAULT_TARGETS if ensemble > 1 else None
    if text.strip().lower() == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(
            f"--targets {preview(text)}: give a number of target slots, or all"
        ) from None
    if value < 1:
        raise ConfigError("--targets must be at least 1")
    return value


def _eval_device(spec: str):
    import torch

    from anyorder.errors import ConfigError, preview

    name = "cuda" if spec == "auto" and torch.cuda.is_available() else spec
    name = "cpu" if name == "auto" else name
    if not (name == "cpu" or (name.startswith("cuda") and torch.cuda.is_available())):
        raise ConfigError(f"--device {preview(spec)} is not available here; use auto or cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {preview(spec)} is not a device; use cpu or cuda:N") from None


def run_eval(args: argparse.Namespace) -> int:
    import contextlib
    from pathlib import Path

    import torch

    from anyorder.atomic import missing_folders, remove_folders, write_errors
    from anyorder.checkpoint import load_model
    from anyorder.errors import ConfigError
    from anyorder.runlock import check_writable_dir

    _check_eval_args(args)
    if args.suite == "lm-eval":
        return _eval_harness(args)
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
    _check_ensemble_memory(args, ckpt.model.cfg.seq_len, device)
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
    made = missing_folders(out)  # a failed eval leaves no empty --out folder behind
    try:
        with write_errors(out, "another --out folder"):  # before the work, not after it
            out.mkdir(parents=True, exist_ok=True)
        with ctx:
            if args.suite == "likelihood":
                written = _eval_likelihood(args, ckpt, suite, out)
            elif args.suite == "zero-shot":
                written = _eval_zero_shot(args, ckpt, suite, out)
            else:
                written = _eval_gen(args, ckpt, device, out)
    except BaseException:
        remove_folders(made)
        raise
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _eval_likelihood(args: argparse.Namespace, ckpt, suite: dict, out) -> list:
    import json

    from anyorder.data import prepare
    from anyorder.evaluation.report import format_likelihood
    from anyorder.evaluation.suite import likelihood_suite
    from anyorder.evaluation.zeroshot_table import write_atomic

    progress = not args.no_progress
    data = prepare(ckpt.config.data, ckpt.model.cfg.seq_len, progress=progress)
    blocks = data.split(args.split)[: args.max_blocks]
    res = likelihood_suite(
        ckpt.model, blocks, bytes_per_token=data.bytes_per_token(args.split),
        progress=progress, estimate=True, **suite,
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
    from anyorder.evaluation.zeroshot import parse_splits
    from anyorder.evaluation.zeroshot_table import table_markdown, write_table, zero_shot

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

    from anyorder.evaluation.genppl import gen_markdown, gen_sweep, load_judge
    from anyorder.evaluation.zeroshot_table import write_atomic
    from anyorder.plots import plot_gen_sweep

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


_HARNESS_FLAGS = {
    "pretrained": "its first argument (the checkpoint)",
    "seed": "--seed",
    "weights": "--weights",
    "batch_size": "--batch-size",
    "device": "--device",
}
"""The harness model's arguments ``anyorder eval`` passes on from its own flags."""


def _eval_harness(args: argparse.Namespace) -> int:
    """``--suite lm-eval``: the harness's tasks through ``lm_eval.simple_evaluate``."""
    import json
    from pathlib import Path

    from anyorder.errors import ConfigError
    from anyorder.evaluation.zeroshot_table import write_atomic

    if not args.tasks:
        raise ConfigError("--suite lm-eval needs --tasks NAME[,NAME...]")
    try:
        from lm_eval.utils import make_table, simple_parse_args_string

        from anyorder.harness import run_harness
    except ImportError as e:
        raise ConfigError(
            f"--suite lm-eval needs the evaluation harness ({e.name} is missing); "
            'pip install "anyorder[eval]"'
        ) from None
    extra = simple_parse_args_string(args.model_args)
    for key, flag in _HARNESS_FLAGS.items():  # given twice, one would silently win
        if key in extra:
            raise ConfigError(
                f"--model-args {key}: anyorder eval takes it as {flag}; leave it out of "
                "--model-args"
            )
    extra.update(seed=args.seed, weights=args.weights)
    results = run_harness(
        args.checkpoint,
        [t.strip() for t in args.tasks.split(",") if t.strip()],
        model_args=extra,
        include_path=args.include_path,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        apply_chat_template=args.apply_chat_template,
        device=args.device,
        trust_task_code=args.trust_task_code,
    )
    print(make_table(results))
    if args.out:
        path = Path(args.out) / "lm_eval.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(results, indent=2, default=str))
        print(f"wrote {path}")
    return 0
