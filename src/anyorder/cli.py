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


# ----------------------------------------------------------------------------- eval

_ZERO_SHOT_SETS = "lambada,wikitext2,ptb,wikitext103,lm1b"


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run folder (its latest checkpoint) or checkpoint folder")
    p.add_argument(
        "--suite",
        choices=("likelihood", "zero-shot", "gen"),
        default="likelihood",
        help="likelihood: the checkpoint's own data (l2r, any-order, ensemble, ELBO; nats, "
        "ppl, bits/byte); zero-shot: the paper's test sets and table; gen: generative "
        "perplexity and entropy of samples",
    )
    p.add_argument("--weights", choices=("ema", "raw"), default="ema", help="default: ema")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on CUDA"
    )
    p.add_argument("--out", default=None, help="results folder (default: RUN/eval)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    p.add_argument("--batch-size", type=int, default=8, help="blocks or samples per batch")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("likelihood and zero-shot")
    g.add_argument("--orders", type=int, default=4, help="random orders K per block (error bars)")
    g.add_argument("--ensemble", type=int, default=1, help="context-order ensemble size M")
    g.add_argument(
        "--targets", type=int, default=None, help="ensemble: random target slots per block"
    )
    g.add_argument("--max-blocks", type=int, default=None, help="only the first blocks")
    g.add_argument("--split", choices=("val", "train"), default="val", help="likelihood split")
    g.add_argument("--no-l2r", action="store_true", help="skip the left-to-right NLL")
    g.add_argument(
        "--max-tokens", type=int, default=1 << 15, help="ensemble: slots per forward call"
    )
    g.add_argument("--datasets", default=_ZERO_SHOT_SETS, help="zero-shot: comma-separated")
    g.add_argument(
        "--data-dir",
        default=None,
        help="zero-shot offline: DIR/<dataset>/ holds that test split as .txt (one example "
        "per line), .jsonl or .parquet, e.g. DIR/lambada/lambada_test.jsonl",
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


def run_eval(args: argparse.Namespace) -> int:
    import contextlib
    import json
    from pathlib import Path

    import torch

    from anyorder.checkpoint import load_model
    from anyorder.errors import ConfigError

    for name in ("orders", "ensemble", "batch_size", "num_samples"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    name = "cpu" if name == "auto" else name
    if not (name == "cpu" or (name.startswith("cuda") and torch.cuda.is_available())):
        raise ConfigError(f"--device {args.device!r} is not available here; use auto or cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {args.device!r} is not a device; use cpu or cuda:N") from None
    ckpt = load_model(args.checkpoint, weights=args.weights, device=device)
    model, progress = ckpt.model, not args.no_progress
    run_dir = ckpt.path.parent.parent if ckpt.path.parent.name == "checkpoints" else ckpt.path
    out = Path(args.out) if args.out else run_dir / "eval"
    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
    ctx = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
    print(f"{model.kind} step {ckpt.step} ({ckpt.weights} weights) from {ckpt.path} on {device}")
    suite = dict(
        orders=args.orders,
        ensemble=args.ensemble,
        targets=args.targets,
        seed=args.seed,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        left_to_right=not args.no_l2r,
    )
    written = []
    if args.suite == "likelihood":
        from anyorder.corpus import format_likelihood, likelihood_suite
        from anyorder.data import prepare
        from anyorder.zeroshot import write_atomic

        data = prepare(ckpt.config.data, model.cfg.seq_len, progress=progress)
        blocks = data.split(args.split)[: args.max_blocks]
        with ctx:
            res = likelihood_suite(
                model, blocks, bytes_per_token=data.bytes_per_token(args.split),
                progress=progress, **suite,
            )  # fmt: skip
        res.update(split=args.split, source=ckpt.config.data.source, step=ckpt.step)
        text = format_likelihood(res)
        print(text)
        write_atomic(out / "likelihood.json", json.dumps(res, indent=2) + "\n")
        write_atomic(out / "likelihood.md", "```\n" + text + "\n```\n")
        written += [out / "likelihood.json", out / "likelihood.md"]
        if args.ensemble > 1 and res["ensemble"] and res["ensemble"].get("by_size"):
            from anyorder.plots import plot_ensemble_curve

            written.append(plot_ensemble_curve({args.split: res}, out / "ensemble.png"))
    elif args.suite == "zero-shot":
        from anyorder.zeroshot import table_markdown, write_table, zero_shot

        names = [s.strip() for s in args.datasets.split(",") if s.strip()]
        with ctx:
            table = zero_shot(
                model, ckpt.tokenizer, names, data_dir=args.data_dir,
                max_blocks=args.max_blocks, progress=progress, **suite,
            )  # fmt: skip
        table.update(checkpoint=str(ckpt.path), step=ckpt.step)
        print(table_markdown(table))
        written += write_table(table, out)
        if args.ensemble > 1 and model.kind in ("aogpt", "armd"):
            from anyorder.plots import plot_ensemble_curve

            written.append(plot_ensemble_curve(table["datasets"], out / "ensemble.png"))
    else:
        from anyorder.genppl import gen_markdown, gen_sweep, load_judge
        from anyorder.plots import plot_gen_sweep
        from anyorder.zeroshot import write_atomic

        judge = load_judge(args.judge, device)
        steps = _numbers(args.steps, int, "steps")
        temps = _numbers(args.temperature, float, "temperature")
        n = args.length or model.cfg.seq_len
        with ctx:
            rows = gen_sweep(
                model, ckpt.tokenizer, judge, n=n, num=args.num_samples, steps=steps,
                temperatures=temps, top_p=args.top_p, mode=args.order, seed=args.seed,
                batch_size=args.batch_size, progress=progress,
            )  # fmt: skip
        md = gen_markdown(rows, judge.name)
        print(md)
        write_atomic(out / "gen.json", json.dumps({"judge": judge.name, "rows": rows}, indent=2))
        write_atomic(out / "gen.md", md)
        written += [out / "gen.json", out / "gen.md"]
        if len(steps) > 1:
            written.append(plot_gen_sweep(rows, out / "gen_steps.png", x="steps"))
        if len(temps) > 1:
            written.append(plot_gen_sweep(rows, out / "gen_temperature.png", x="temperature"))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


# ----------------------------------------------------------------------------- registry

Command = tuple[
    str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]


def commands() -> list[Command]:
    """Every subcommand: (name, help, add_arguments, run)."""
    return [
        ("info", "parameter counts of the presets; config keys", add_info, run_info),
        ("eval", "likelihoods, zero-shot table, generative perplexity", add_eval, run_eval),
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
