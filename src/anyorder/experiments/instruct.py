"""Experiment 9: instruction tuning on the synthetic task, answers decoded in any order.

Tiny models fine-tuned from scratch with ``order.condition=prompt`` on the task of
:mod:`anyorder.data.instruct` (sort letters, reverse words, add numbers), scored by exact
match on held-out prompts at several points of training, with every decoder that applies.

Design choices:

* One training run per model kind and seed, the library's own trainer on the task's
  ``train.jsonl`` (``data.format`` detected as chat), checkpoints every quarter of the
  steps; the same shape, batch, steps and learning rate for every kind. ``gpt`` learns the
  answer left to right; ``aogpt`` and ``armd`` in uniformly random orders of the answer
  after the prompt. Step 0 is the untrained model of the same seed: the floor.
* Decoders (:data:`DECODERS`): one token per pass left to right and in random order,
  Lemma 1 with ``steps = ANSWER / 4`` (4 tokens per pass on average), and speculative
  sampling with ``K = 4``, whose passes per token are measured. All sample at temperature
  1: the model's own law, not a greedy search, so accuracy measures the probability the
  model puts on the right answer.
* The answer's :data:`ANSWER` slots after the prompt are decoded (the longest answer and
  its EOS fit), the rest of the block is left undecoded (a marginal: the model trained on
  the EOS padding after every answer); the answer is cut at its first EOS.
* Held-out prompts of one rendered length are decoded as one batch (the samplers take a
  prompt per row); each batch draws from its own seeded generator.
* Error bars: mean ± standard error over training seeds, and beside it the binomial
  standard error of one seed's accuracy over the held-out prompts.
* A run's scores are kept beside it (``instruct-scores.json``, keyed by the decoders and
  the prompts), so runs trained apart (``--arms ARM``: that arm alone) make one table.
* LoRA against full fine-tuning (arms ``gpt-full`` and ``gpt-lora``, :data:`FINE_TUNED`):
  adapters only make sense on a model that already knows something, so both start from a
  *base*, the same gpt shape pretrained left to right on ``builtin:pydoc`` (the demo's and
  the other experiments' corpus) for :data:`BASE_STEPS` steps, one base per seed shared by
  the two arms of that seed (a paired comparison; the seed's bar then covers pretraining
  too). From it, the same steps, batch, schedule and task as the other arms: every weight
  at the from-scratch arms' lr (2e-3), or LoRA (``r = 8``, alpha 16, the default targets:
  the attention's qkv and output projections) at :data:`LORA_LR`. Step 0 of both is the
  base itself (peft's adapters start at zero), not an untrained model. Ablations of
  gpt-lora (:data:`ABLATIONS`) change its lr, targets or rank one at a time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from anyorder.experiments.runs import DATA_SOURCE, OURS, Context, model_overrides, train_run

ANSWER = 16
"""Answer slots decoded after the prompt (the task's longest answer is 15 bytes, + EOS)."""
DECODERS: dict[str, dict[str, Any]] = {
    "l2r, 1 token/pass": dict(order="l2r"),
    "random, 1 token/pass": dict(order="random"),
    "Lemma 1, 4 tokens/pass": dict(order="random", steps=ANSWER // 4),
    "speculative K=4": dict(order="random", speculative=4),
}
"""Decoder label -> sampler arguments (``gpt`` runs only the first)."""
KINDS = ("gpt", "aogpt", "armd")
BASE_STEPS = 1000
"""Left-to-right pretraining steps of the fine-tuned arms' base (smoke: the smoke steps)."""
LORA_LR = 2e-2
"""The LoRA arm's peak lr: 10x the full arm's 2e-3. An adapter starts at zero (peft's
``B = 0``) and its update ``(alpha / r) B A`` is a product of two small matrices, so at the
full run's lr it moves the layers far less per step than full training does; 10x is the
usual ratio of LoRA to full fine-tuning lrs in published recipes (e.g. 2e-4 against 2e-5
on 7B models). Both arms clip gradients at 1 and decay weights at 0.1 like the others.
Measured (docs/results.md): at r = 8 this lr and 2e-3 end alike; at r = 64 only 2e-3 learns."""
LORA = ["train.lora.r=8", "train.lora.alpha=16", f"train.lr={LORA_LR}"]
R64 = ["train.lora.targets=[attn,mlp]", "train.lora.r=64", "train.lora.alpha=128"]
FINE_TUNED: dict[str, list[str]] = {
    "gpt-full": [],
    "gpt-lora": LORA,
    # the choices LoRA's result depends on most, one at a time: the full arm's lr; adapters
    # on the MLP too (every linear layer of the blocks, as QLoRA recommends); and those at
    # rank 64 (60% of the model's parameters), alpha / r kept at 2, at both lrs
    "gpt-lora-lr2e-3": [*LORA, "train.lr=2e-3"],
    "gpt-lora-attn+mlp": [*LORA, "train.lora.targets=[attn,mlp]"],
    "gpt-lora-r64-attn+mlp": [*LORA, *R64],
    "gpt-lora-r64-attn+mlp-lr2e-3": [*LORA, *R64, "train.lr=2e-3"],
}
"""Arm -> overrides of the runs fine-tuned from the pretrained base (on top of gpt's)."""
ARMS = (*KINDS, *FINE_TUNED)
ABLATIONS = tuple(a for a in FINE_TUNED if a not in ("gpt-full", "gpt-lora"))
"""Arms the smoke run leaves out unless ``--arms`` names them (overrides of gpt-lora's)."""


def _shape(ctx: Context) -> list[str]:
    if ctx.smoke:
        return ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.target_dim=16",
                "model.seq_len=64"]  # fmt: skip
    return ["model.seq_len=64"]


def task_data(ctx: Context) -> dict[str, Path]:
    """The task's files under ``OUT/runs`` (written once: the data cache keys on them)."""
    from anyorder.data.instruct import write_instruct

    folder = ctx.runs / ("instruct-task-smoke" if ctx.smoke else "instruct-task")
    n, held = (64, 8) if ctx.smoke else (20000, 200)
    paths = {"train": folder / "train.jsonl", "heldout": folder / "heldout.jsonl"}
    if not all(p.exists() for p in paths.values()):
        write_instruct(folder, n=n, heldout=held, seed=0)
    return paths


def base_run(ctx: Context, seed: int) -> dict[str, Any]:
    """Train (or reuse) the fine-tuned arms' base: gpt left to right on the CPU corpus."""
    steps = ctx.steps if ctx.smoke else BASE_STEPS
    extra = [*model_overrides(ctx, "gpt")[1:], *_shape(ctx), "train.dtype=fp32"]
    return train_run(ctx, "instruct-base-gpt", "gpt", [], seed, steps=steps, extra=extra)


def instruct_run(
    ctx: Context, arm: str, seed: int, data: Path, steps: int, name: str | None = None
) -> dict[str, Any]:
    """Train (or reuse) one arm's run on the task (in ``instruct-ARM``, or ``name``);
    checkpoints every quarter. The arms of :data:`FINE_TUNED` start from :func:`base_run`'s
    model of the same seed."""
    kind = "gpt" if arm in FINE_TUNED else arm
    order = ["order.condition=prompt"] + ([] if kind == "gpt" else ["order.kind=uniform"])
    order += OURS if kind == "aogpt" else []
    extra = [
        *model_overrides(ctx, kind)[1:],
        *_shape(ctx),
        f"data.source={data}",
        "train.dtype=fp32",
        f"train.ckpt_every={steps if ctx.smoke else max(1, steps // 4)}",
        "train.keep_last=8",
    ]
    if arm in FINE_TUNED:
        extra += [f"train.init_from={base_run(ctx, seed)['run_dir']}", *FINE_TUNED[arm]]
    name = name or f"instruct-{arm}"
    return train_run(ctx, name, kind, order, seed, steps=steps, extra=extra)


def decode_answers(
    model: Any, tok: Any, prompts: list[str], seed: int, **decoder: Any
) -> tuple[list[str], float]:
    """Each prompt's answer (rendered with the chat template, :data:`ANSWER` slots decoded,
    cut at the first EOS), and the forward passes per decoded token."""
    from anyorder.data.chat import render_prompt
    from anyorder.sample import decode_text, sample, speculative_sample

    ids = [render_prompt(p, tok) for p in prompts]
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(ids):
        groups.setdefault(len(r), []).append(i)
    out: list[str] = [""] * len(prompts)
    passes = tokens = 0.0
    decoder = dict(decoder)
    k = decoder.pop("speculative", None)
    for length, rows in sorted(groups.items()):
        n = length + min(ANSWER, model.cfg.seq_len - length)
        prompt = torch.zeros(len(rows), n, dtype=torch.long)
        prompt[:, :length] = torch.tensor([ids[i] for i in rows])
        known = (torch.arange(n) < length).expand(len(rows), n)
        gen = torch.Generator().manual_seed(seed * 1000 + length)
        common = dict(batch=len(rows), prompt=prompt, known=known, generator=gen)
        with torch.no_grad():
            if k is not None:
                res = speculative_sample(model, n, k, **common, **decoder)
                stats = res.extra["speculative"]
                passes += float(stats.passes.sum())
                tokens += float(stats.tokens.sum())
            else:
                res = sample(model, n, **common, **decoder)
                passes += res.forward_passes * len(rows)
                tokens += (n - length) * len(rows)
        for i, row in zip(rows, res.tokens[:, length:].cpu()):
            out[i] = decode_text(tok, row, tok.eos_id)
    return out, passes / max(tokens, 1.0)


def score(model: Any, tok: Any, records: list[dict], seed: int, **decoder: Any) -> dict:
    """Exact-match accuracy over ``records``, per task too, and passes per token."""
    from anyorder.data.instruct import exact_match

    model.eval()
    answers, ppt = decode_answers(model, tok, [r["prompt"] for r in records], seed, **decoder)
    hits = [exact_match(a, r["response"]) for a, r in zip(answers, records)]
    tasks: dict[str, list[bool]] = {}
    for h, r in zip(hits, records):
        tasks.setdefault(r["task"], []).append(h)
    return {
        "accuracy": sum(hits) / len(hits),
        "tasks": {t: sum(v) / len(v) for t, v in sorted(tasks.items())},
        "passes_per_token": ppt,
        "n": len(hits),
        "examples": [[r["prompt"], a] for r, a in zip(records[:3], answers[:3])],
    }


def binomial_se(p: float, n: int) -> float:
    """The standard error of an accuracy ``p`` over ``n`` independent prompts."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


STEPS = 800
"""Training steps of a run (``--minutes`` overrides it; smoke: 4)."""


def _steps(ctx: Context) -> int:
    return ctx.steps if ctx.smoke or ctx.minutes is not None else STEPS


def _untrained(ctx: Context, run: dict[str, Any]) -> Any:
    """The run's model at step 0: its ``train.init_from`` weights (the base of a fine-tuned
    arm, as training read them), else the model of its config freshly initialised (torch
    seeded with its seed)."""
    from anyorder.checkpoint import load_model
    from anyorder.config import config_from_dict
    from anyorder.models import build_model

    cfg = config_from_dict(run["config"])
    if cfg.train.init_from:
        return load_model(cfg.train.init_from).model.eval()
    torch.manual_seed(cfg.train.seed)
    return build_model(cfg.model).eval()


def _curves(ctx: Context, arm: str, seed: int, data: dict[str, Path]) -> dict[str, Any]:
    """One run's scores: per decoder, per evaluated step (0 = untrained, or the base)."""
    run = instruct_run(ctx, arm, seed, data["train"], _steps(ctx))
    gpt = arm == "gpt" or arm in FINE_TUNED
    return run_scores(ctx, run, list(DECODERS)[:1] if gpt else list(DECODERS), data, seed)


def run_scores(
    ctx: Context, run: dict[str, Any], decoders: list[str], data: dict[str, Path], seed: int
) -> dict[str, Any]:
    """A trained run's scores (kept beside it): per decoder, per step (0: its start)."""
    import json

    from anyorder.checkpoint import list_checkpoints, load_model

    records = [json.loads(x) for x in data["heldout"].read_text().splitlines()]
    cache = Path(run["run_dir"]) / "instruct-scores.json"
    key = {"decoders": {d: DECODERS[d] for d in decoders}, "heldout": records}
    if cache.exists():  # the scores of this run's checkpoints on these prompts, kept
        kept = json.loads(cache.read_text())
        if kept["key"] == json.loads(json.dumps(key)):
            return {d: {int(s): v for s, v in kept["scores"][d].items()} for d in decoders}
    models = [(0, _untrained(ctx, run), None)]
    for path in list_checkpoints(run["run_dir"]):
        # a LoRA checkpoint loads as its base with the adapters merged (checkpoint.adapters)
        loaded = load_model(path, weights="raw")
        models.append((loaded.step, loaded.model, loaded.tokenizer))
    tok = models[-1][2]
    out: dict[str, Any] = {d: {} for d in decoders}
    for step, model, _ in models:
        for d in decoders:
            out[d][step] = score(model, tok, records, seed, **DECODERS[d])
    cache.write_text(json.dumps({"key": key, "scores": out}) + "\n")
    return out


def trainable(run: dict[str, Any]) -> tuple[int, int]:
    """``(parameters that train, parameters of the model)`` of a run: its adapters alone under
    ``train.lora`` (counted on a model of its config, no weights read)."""
    from anyorder.config import config_from_dict
    from anyorder.models import build_model
    from anyorder.models.lora import adapter_keys, add_adapters, lora_on

    cfg = config_from_dict(run["config"])
    with torch.device("meta"):
        model = build_model(cfg.model, init=False)  # shapes only
        total = sum(p.numel() for p in model.parameters())
        if not lora_on(cfg):
            return total, total
        add_adapters(model, cfg.train.lora)
    train = sum(p.numel() for n, p in model.named_parameters() if n in adapter_keys(model))
    return train, total


def _fine_tuned_lines(ctx: Context, arms: list[str], data: dict[str, Path]) -> str:
    """What the fine-tuned arms trained: the base, parameters that train, wall times."""
    rows = []
    for arm in (a for a in arms if a in FINE_TUNED):
        runs = [instruct_run(ctx, arm, s, data["train"], _steps(ctx)) for s in range(ctx.seeds)]
        train, total = trainable(runs[0])
        lr = runs[0]["config"]["train"]["lr"]
        walls = ", ".join(f"{r['wall_s']:.0f}" for r in runs)
        rows.append(f"| {arm} | {lr:g} | {train:,} of {total:,} | {walls} |")
    if not rows:
        return ""
    bases = [base_run(ctx, s) for s in range(ctx.seeds)]
    walls = ", ".join(f"{b['wall_s']:.0f}" for b in bases)
    return (
        f"\nThe fine-tuned arms start from a gpt of the same shape pretrained left to right on "
        f"`{DATA_SOURCE}` for {bases[0]['steps']} steps (one per seed: {walls} s; its step 0 "
        "row is that base):\n\n| arm | lr | parameters that train | wall s per seed |\n"
        "|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def exp_instruct(ctx: Context) -> dict[str, Any]:
    """Exact match on held-out prompts against training steps, per kind and decoder."""
    from anyorder.errors import ConfigError
    from anyorder.experiments.runs import fmt, mean_se

    if ctx.scale != "cpu":
        raise ConfigError("experiment instruct runs at --scale cpu only (tiny models, here)")
    arms = [a for a in ARMS if ctx.only in (None, a)]  # --arms ARM: that arm alone
    if ctx.smoke and ctx.only is None:  # the code path in seconds: gpt-lora's is theirs
        arms = [a for a in arms if a not in ABLATIONS]
    if not arms:
        raise ConfigError(f"--arms {ctx.only!r} matches no arm; the arms are: {', '.join(ARMS)}")
    data = task_data(ctx)
    scores = {a: [_curves(ctx, a, s, data) for s in range(ctx.seeds)] for a in arms}
    steps = sorted(next(iter(scores.values()))[0][next(iter(DECODERS))])
    head = "| model | decoder | " + " | ".join(f"step {s}" for s in steps)
    lines = [head + " | passes/token |", "|---|---|" + "---|" * (len(steps) + 1)]
    finals = ["| model | decoder | " + " | ".join(("sort", "reverse", "add")) + " |",
              "|---|---|---|---|---|"]  # fmt: skip
    for kind, runs in scores.items():
        for d in runs[0]:
            cells = []
            for s in steps:
                m, se = mean_se([r[d][s]["accuracy"] for r in runs])
                cells.append(fmt(m, se, 2))
            last = [r[d][steps[-1]] for r in runs]
            ppt = sum(x["passes_per_token"] for x in last) / len(last)
            lines.append(f"| {kind} | {d} | " + " | ".join(cells) + f" | {ppt:.2f} |")
            per = [fmt(*mean_se([x["tasks"][t] for x in last]), 2) for t in ("sort", "reverse",
                   "add")]  # fmt: skip
            finals.append(f"| {kind} | {d} | " + " | ".join(per) + " |")
    n = next(iter(scores.values()))[0][next(iter(DECODERS))][steps[-1]]["n"]
    bar = binomial_se(0.5, n)
    md = (
        f"Exact match on {n} held-out prompts (mean ± standard error over {ctx.seeds} "
        f"seed(s); one seed's binomial standard error is at most {bar:.3f}), against "
        f"training steps (step 0: untrained).\n\n" + "\n".join(lines) + "\n\nAt the last "
        "step, per task:\n\n" + "\n".join(finals) + "\n" + _fine_tuned_lines(ctx, arms, data)
    )
    return {"scores": scores, "steps": steps, "markdown": md}
