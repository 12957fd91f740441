"""The likelihood experiments: Eq. 5 by enumeration with the decoder's order dependence
(experiment 1), and context-order ensembles, AO-GPT's Finding 5 (experiment 4).

Design choices:

* Eq. 5 is checked exactly, not sampled: toy lengths ``n = 5..7`` on a random Markov chain,
  all ``n!`` orders and ``2^n - 1`` mask sets enumerated, so the encoder's ELBO and its
  average over orders must agree to rounding.
* Ensemble gains are small: they are scored on many random target slots per block and
  reported *paired* (size ``M`` minus size 1 on the same blocks, orders and targets), with
  the standard error over blocks (:func:`anyorder.evaluation.suite.likelihood_suite`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from anyorder.experiments.comparisons import _only, _variant_arms
from anyorder.experiments.figures import _plot_xy
from anyorder.experiments.paper import _paper
from anyorder.experiments.runs import (
    OURS_FIELDS,
    Context,
    _budget_line,
    _load,
    _val_data,
    fmt,
    run_name,
    train_run,
)
from anyorder.progress import progress

# ============================================================================ 1. Eq. 5


def _toy_chain(vocab: int, seed: int) -> torch.Tensor:
    """A random first-order Markov chain (vocab, vocab) with a peaked transition table."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3.0 * torch.randn(vocab, vocab, generator=g), dim=-1)


def _toy_draw(trans: torch.Tensor, num: int, n: int, g: torch.Generator) -> torch.Tensor:
    V = trans.shape[0]
    x = torch.empty(num, n, dtype=torch.long)
    x[:, 0] = torch.randint(0, V, (num,), generator=g)
    for t in range(1, n):
        x[:, t] = torch.multinomial(trans[x[:, t - 1]], 1, generator=g).squeeze(1)
    return x


def _toy_nll(trans: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The true NLL (B,) in nats of the chain's sequences."""
    V = trans.shape[0]
    lp = math.log(1.0 / V) + torch.log(trans[x[:, :-1], x[:, 1:]]).sum(dim=1)
    return -lp.double()


@torch.no_grad()
def context_order_spread(
    model: Any, tokens: torch.Tensor, order: torch.Tensor, members: int, g: torch.Generator
) -> tuple[float, float]:
    """How much a conditional depends on the order of its context (Eq. 6).

    For every sequence and target slot ``t >= 1`` of ``order``, the target's log-probability
    given the same context set ``order[:t]`` presented in ``members`` random orders (the
    first: ``order`` itself); returns the mean over targets of the standard deviation over
    the members, with its standard error. An encoder gives 0 up to rounding.
    """
    B, n = tokens.shape
    rows, orders_, slots = [], [], []
    for b in range(B):
        for t in range(1, n):
            for m in range(members):
                ctx_perm = order[b, :t] if m == 0 else order[b, :t][torch.randperm(t, generator=g)]
                orders_.append(torch.cat([ctx_perm, order[b, t:]]))
                rows.append(b)
                slots.append(t)
    o = torch.stack(orders_)  # (B*(n-1)*M, n)
    x = tokens[torch.tensor(rows)]
    slot = torch.tensor(slots)
    logits = model(x, o)[torch.arange(len(o)), slot].float()  # (R, V)
    target = x[torch.arange(len(o)), o[torch.arange(len(o)), slot]]
    lp = logits.log_softmax(-1).gather(1, target[:, None]).squeeze(1).double()
    sd = lp.view(-1, members).std(dim=1)  # (B*(n-1),)
    return float(sd.mean()), float(sd.std() / math.sqrt(sd.numel()))


def _eq5_models(
    trans: torch.Tensor, n: int, train_steps: int, g: torch.Generator, bar: Any = None
) -> dict:
    """The three toy models of one length, each trained ``train_steps`` steps on draws of the
    chain (batch 64, uniform orders): mdm, aogpt published (``aogpt-ref``) and aogpt ours.
    ``bar`` (a :func:`~anyorder.progress.progress`) counts the steps."""
    from anyorder import orders
    from anyorder.config import preset
    from anyorder.models import build_model

    V = trans.shape[0]
    models = {}
    for kind in ("mdm", "aogpt", "aogpt-ours"):
        torch.manual_seed(0)
        shape = dict(vocab_size=V, seq_len=n, n_layer=2, n_head=4, d_model=64)
        if kind == "mdm":
            cfg = preset("tiny", kind="mdm", target_dim=32, **shape)
        elif kind == "aogpt":  # the published parameterization
            cfg = preset("tiny", variant="aogpt-ref", **shape)
        else:
            cfg = preset("tiny", kind="aogpt", target_dim=32, **shape, **OURS_FIELDS)
        model = build_model(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(train_steps):
            x = _toy_draw(trans, 64, n, g)
            o = orders.uniform(64, n, g).order
            loss = model.loss(x, o, generator=g)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if bar is not None:
                bar.update(1)
        models[kind] = model.eval()
    return models


def _eq5_row(
    models: dict, trans: torch.Tensor, test: torch.Tensor, members: int, g: torch.Generator
) -> dict[str, Any]:
    """One length's row: the exact enumerations, left to right and the spread over context
    orders of every model on the test sequences."""
    from anyorder import orders
    from anyorder.evaluation.estimators import exact_any_order_nll, exact_mdm_elbo, sequence_nll

    n = test.shape[1]
    mdm, ao, ours = models["mdm"], models["aogpt"], models["aogpt-ours"]
    t0 = time.perf_counter()
    elbo = exact_mdm_elbo(mdm, test)  # (B,)
    avg = exact_any_order_nll(mdm, test)
    ao_avg = exact_any_order_nll(ao, test)
    ours_avg = exact_any_order_nll(ours, test)
    enum_s = time.perf_counter() - t0
    with torch.no_grad():
        ao_l2r = sequence_nll(ao, test, orders.l2r(len(test), n).order).double()
        ours_l2r = sequence_nll(ours, test, orders.l2r(len(test), n).order).double()
        # order dependence: one random order per sequence; every target's conditional
        # under `members` random orders of its context (member 0: the order itself)
        o = orders.uniform(len(test), n, g).order
        spread = {k: context_order_spread(m, test, o, members, g) for k, m in models.items()}
    truth = _toy_nll(trans, test)
    return {
        "n": n,
        "orders": math.factorial(n),
        "mask_sets": 2**n - 1,
        "true_nll": float(truth.mean()),
        "mdm_elbo": float(elbo.mean()),
        "mdm_avg_orders": float(avg.mean()),
        "max_abs_diff": float((elbo - avg).abs().max()),
        "aogpt_avg_orders": float(ao_avg.mean()),
        "aogpt_l2r": float(ao_l2r.mean()),
        "aogpt_spread": spread["aogpt"],
        "aogpt_ours_avg_orders": float(ours_avg.mean()),
        "aogpt_ours_l2r": float(ours_l2r.mean()),
        "aogpt_ours_spread": spread["aogpt-ours"],
        "mdm_spread": spread["mdm"],
        "enum_s": enum_s,
    }


def exp_eq5(ctx: Context) -> dict[str, Any]:
    """Eq. 5 by enumeration (mdm) and the decoder's order dependence (aogpt), n = 5..7."""
    if ctx.scale == "paper":
        return {"markdown": "Exact enumeration is a toy-scale check: it has no paper scale.\n"}
    V = 4
    lengths = [4] if ctx.smoke else [5, 6, 7]
    train_steps = 5 if ctx.smoke else 400
    members = 8
    rows = []
    # one unit per training step of the 3 models, and one per length's enumeration
    total = len(lengths) * (3 * train_steps + 1)
    with progress(total=total, desc="eq5", unit="steps", enabled=ctx.progress) as bar:
        for n in lengths:
            g = torch.Generator().manual_seed(100 + n)
            trans = _toy_chain(V, n)
            test = _toy_draw(trans, 4 if ctx.smoke else 16, n, g)
            bar.set_postfix_str(f"n = {n}: training mdm, aogpt and aogpt (ours)")
            models = _eq5_models(trans, n, train_steps, g, bar)
            bar.set_postfix_str(f"n = {n}: enumerating {math.factorial(n):,} orders")
            rows.append(_eq5_row(models, trans, test, members, g))
            bar.update(1)
    plot = _eq5_plot(rows, ctx.out / "plot.png")
    return {"rows": rows, "plot": plot, "markdown": _eq5_markdown(rows, train_steps, members)}


def _eq5_markdown(rows: list[dict[str, Any]], train_steps: int, members: int) -> str:
    """The section: the encoder's ELBO against its average over orders, then the decoders."""
    md = [
        "Toy source: a random first-order Markov chain over 4 symbols; models 2 x 64 trained "
        f"{train_steps} steps (batch 64, uniform orders) per length. NLL in nats per sequence "
        "(mean over the test sequences). Spread: standard deviation of log p(target | context) "
        f"over {members} random orders of the same context set, mean over targets (± se).\n",
        "| n | orders | mdm exact ELBO | mdm avg over all orders | max abs diff | true NLL "
        "| mdm spread (nats) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['n']} | {r['orders']} | {r['mdm_elbo']:.5f} | {r['mdm_avg_orders']:.5f} | "
            f"{r['max_abs_diff']:.1e} | {r['true_nll']:.3f} | {fmt(*r['mdm_spread'], 4)} |"
        )
    md += [
        "\nThe decoder, trained the same way: the published parameterization (`model.variant="
        "aogpt-ref`, target_dim 128) and ours (gates centred on one, zero-initialised adaLN, "
        "the target embedding at unit scale, target_dim 32).\n",
        "| n | aogpt | avg over all orders | l2r | spread over context orders (nats) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        for name, key in (("published", "aogpt"), ("ours", "aogpt_ours")):
            md.append(
                f"| {r['n']} | {name} | {r[key + '_avg_orders']:.3f} | {r[key + '_l2r']:.3f} "
                f"| {fmt(*r[key + '_spread'], 4)} |"
            )
    return "\n".join(md) + "\n"


def _eq5_plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """The spreads over context orders and |ELBO - average over orders| against n."""
    return _plot_xy(
        {
            "aogpt published: spread over context orders": (
                [r["n"] for r in rows],
                [r["aogpt_spread"][0] for r in rows],
                [r["aogpt_spread"][1] for r in rows],
            ),
            "aogpt ours: spread over context orders": (
                [r["n"] for r in rows],
                [r["aogpt_ours_spread"][0] for r in rows],
                [r["aogpt_ours_spread"][1] for r in rows],
            ),
            "mdm: spread (0 by construction)": (
                [r["n"] for r in rows],
                [r["mdm_spread"][0] for r in rows],
                None,
            ),
            "|ELBO - avg over orders| (mdm, max)": (
                [r["n"] for r in rows],
                [r["max_abs_diff"] for r in rows],
                None,
            ),
        },
        "n",
        "nats",
        "Eq. 5 and order dependence",
        path,
    )


# ============================================================================ 4. Finding 5


def exp_finding5(ctx: Context) -> dict[str, Any]:
    """AO-GPT Finding 5: any-order NLL vs context-order ensemble size M."""
    from anyorder.evaluation.suite import likelihood_suite

    mix = ["order.kind=mix", "order.p_l2r=0.1"]
    # our extension too: a model of the same budget that has learnt much more about
    # uniform orders (experiment 5), so that there is order-dependent skill to average
    arms = _only(ctx, _variant_arms({"10% l2r": mix}, rope=ctx.scale != "paper"))
    if ctx.scale == "paper":
        return _paper(ctx, "aogpt-small-owt.yaml", arms, evaluate="--ensemble 16")
    sizes = [1, 2, 4] if ctx.smoke else [1, 2, 4, 8, 16]
    data = _val_data(ctx)
    nblocks = 2 if ctx.smoke else 32
    blocks = data.batch("val", range(min(nblocks, data.num_blocks("val"))))
    targets = 4 if ctx.smoke else 64  # the gains are small: enough targets to resolve them
    t0 = time.perf_counter()
    series, gains, results, paired = {}, [], {}, {}
    for label, (kind, order) in arms.items():
        loaded = _load(train_run(ctx, run_name(kind, order), kind, order))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = likelihood_suite(
                loaded.model, blocks, bytes_per_token=data.bytes_per_token("val"),
                orders=2 if ctx.smoke else 4, ensemble=sizes[-1], targets=targets,
                seed=0, batch_size=8, progress=ctx.progress, left_to_right=False,
            )  # fmt: skip
        by = res["ensemble"]["by_size"]
        ms = [m for m in sizes if m in by]
        series[label] = (
            ms,
            [by[m]["bits_per_byte"] for m in ms],
            [by[m]["bpb_stderr"] for m in ms],
        )
        ens = res["ensemble"]
        gains.append(f"{label}: {ens['gain_nats']:.4f} ± {ens['gain_stderr']:.4f}")
        by_m = ens["gain_by_size"]
        paired[label] = (ms, [by_m[m]["nats"] for m in ms], [by_m[m]["stderr"] for m in ms])
        results[label] = res
    wall = time.perf_counter() - t0
    # the absolute levels differ by 1.3 bits/byte and hide the effect: plot the paired gains
    plot = _plot_xy(
        paired,
        "ensemble size M",
        "gain over M = 1 (nats/token, paired)",
        "Finding 5: context-order ensembles",
        ctx.out / "plot.png",
        logx=True,
    )
    md = (
        _budget_line(ctx, len(arms))
        + f" Scored on {len(blocks)} validation blocks x {res['orders']} random orders, "
        f"{targets} random target slots per block and order (unbiased for the per-token mean); "
        f"± is the standard error over the blocks (the text sample, the order draw included; "
        f"paired for the gains). Gain M=1 -> M={ms[-1]} in nats/token "
        f"(paired): {'; '.join(gains)}. Evaluation took {wall:.0f} s.\n\n"
        f"| M | {' | '.join(f'{a}: any-order bits/byte | gain (nats/token)' for a in series)} "
        "| forward passes per block (formula) |\n"
        f"|---|{'---|---|' * len(series)}---|\n"
    )
    from anyorder.evaluation.estimators import ensemble_cost

    n = blocks.shape[1]
    for i, m in enumerate(ms):
        cells = " | ".join(
            f"{fmt(s[1][i], s[2][i], 4)} | {fmt(g[1][i], g[2][i], 4)}"
            for s, g in zip(series.values(), paired.values(), strict=True)
        )
        md += f"| {m} | {cells} | {ensemble_cost(n, m, targets):.1f} |\n"
    return {"suites": results, "sizes": ms, "series": series, "plot": plot, "markdown": md}
