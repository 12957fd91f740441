"""The fast samplers: sequential, Lemma 1, strided, the encoder's, and :func:`sample`.

Every decoder sampler is one engine (:mod:`anyorder.sampling.passes`) run on a different
*plan* (:mod:`anyorder.sampling.plan`) of reveal counts:

* :func:`sequential_sample`: one token per pass along an order with a KV cache, O(1) model
  cost per token (gpt, aogpt, armd).
* :func:`lemma1_sample`: ``T``-step masked-diffusion sampling by Lemma 1 on a decoder: one
  random order; per step a number of tokens, all predicted in one pass with the parallel
  prediction mask; an empty step costs nothing. Counts are drawn **per row** by default
  (rows are independent samples of the reverse process); a pass is padded to the row
  revealing most, and padding entries are masked out and never kept.
* :func:`strided_sample`: ARMD's strided block-parallel order, ``S`` tokens per pass.
* :func:`encoder_sample`: the encoder MDM's ancestral sampler, a full pass per step.

Design choices:

* Samplers are functions of ``(model, ..., generator)``; every random draw goes through the
  explicit :class:`torch.Generator`, so the same seed gives the same sample.
* Orders and reveal counts are drawn before the loop; a prompt shared by the whole batch is
  prefilled once and the cache forked. Known slots come first in the order, left to right.
* ``graphs``: capture each pass shape once as a CUDA graph and replay it
  (:mod:`anyorder.sampling.graphs`); ``auto`` (the default) on CUDA, always eager on a CPU.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from anyorder.errors import ConfigError, SamplingError
from anyorder.layers.linear import MANY_ROWS, prepacked, prepacked_for, worth_reading
from anyorder.models.armd import ARMD
from anyorder.models.base import AnyOrderLM
from anyorder.models.mdm import MDM
from anyorder.orders import is_permutation, strided
from anyorder.sampling import plan as plan_mod
from anyorder.sampling.draws import (
    SampleResult,
    StepHook,
    check_controls,
    prompt_order,
    sample_logits,
)
from anyorder.sampling.graphs import resolve_mode
from anyorder.sampling.passes import EARN_PASSES, Controls, check_stop_order, run_plan
from anyorder.sampling.plan import Plan
from anyorder.sampling.schedules import RevealPlan, check_reveal, draw_reveals


def _prepare(
    model: AnyOrderLM,
    n: int,
    batch: int,
    prompt: Tensor | None,
    known: Tensor | None,
    order: str | Tensor | None,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Check the request; return ``(tokens, known, order, k)`` on the model's device."""
    device = model.device
    if not 1 <= n <= model.cfg.seq_len:
        raise SamplingError(
            f"length n={n} must lie in 1..{model.cfg.seq_len} (the model's context)"
        )
    if batch < 1:
        raise SamplingError(f"batch={batch} must be at least 1")
    if isinstance(order, Tensor) and order.dim() == 2 and (prompt is None or prompt.dim() == 1):
        batch = order.shape[0]  # a batch of orders sets the batch
    if prompt is None:
        tokens = torch.zeros(batch, n, dtype=torch.long, device=device)
        known = torch.zeros(batch, n, dtype=torch.bool, device=device)
    else:
        if known is None:
            raise SamplingError("a prompt needs its known-position mask")
        prompt, known = prompt.to(device).long(), known.to(device).bool()
        if prompt.dim() == 1 or prompt.shape[0] == 1:  # one prompt for the whole batch
            prompt, known = prompt.expand(batch, -1), known.expand(batch, -1)
        if prompt.shape != known.shape or prompt.shape[1] != n:
            raise SamplingError(
                f"prompt {tuple(prompt.shape)} and known {tuple(known.shape)} must both be "
                f"(batch, n={n})"
            )
        tokens = torch.where(known, prompt, 0)
        if bool(((tokens < 0) | (tokens >= model.cfg.vocab_size)).any()):
            raise SamplingError(
                f"prompt token ids must lie in 0..{model.cfg.vocab_size - 1} (the model's "
                "vocabulary); was it encoded with the model's tokenizer?"
            )
    num_known = known.sum(dim=1)
    if not bool((num_known == num_known[0]).all()):
        raise SamplingError("every row of a batch needs the same number of known positions")
    k = int(num_known[0])
    if order is None:
        order = "l2r" if model.kind == "gpt" else "random"
    if isinstance(order, str):
        order = prompt_order(known, generator, order)
        # known slots left to right, the same in every row: a shared prompt is prefilled once
        order = torch.cat([order[:, :k].sort(dim=1).values, order[:, k:]], dim=1)
    else:
        order = order.to(device).long()
        if order.dim() == 1:
            order = order.expand(tokens.shape[0], -1)
        if order.shape != tokens.shape or not is_permutation(order):
            raise SamplingError(f"order must be (batch, n={n}) permutations of 0..{n - 1}")
        if not bool(known.gather(1, order[:, :k]).all()):
            raise SamplingError("the order must list the known positions first")
    if model.kind == "gpt" and not torch.equal(
        order, torch.arange(n, device=device).expand_as(order)
    ):
        raise SamplingError(
            "gpt generates left to right: give order l2r and a prefix prompt (the unknown "
            "positions last); use aogpt, armd or mdm to fill holes"
        )
    return tokens, known, order.contiguous(), k


def _shared_prompt(tokens: Tensor, order: Tensor, k: int) -> bool:
    """Whether every row has the same prompt in the same slots (prefill once, then fork)."""
    B = tokens.shape[0]
    return (
        B > 1
        and k > 0
        and bool((tokens == tokens[:1]).all())
        and bool((order[:, :k] == order[:1, :k]).all())
    )


def _decoder_only(model: AnyOrderLM, what: str) -> None:
    if isinstance(model, MDM):
        raise SamplingError(f"{what} needs a decoder (gpt, aogpt, armd); mdm uses encoder_sample")


@torch.no_grad()
def sequential_sample(
    model: AnyOrderLM,
    n: int,
    *,
    batch: int = 1,
    order: str | Tensor | None = None,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_at_eos: int | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
    graphs: bool | str = "auto",
) -> SampleResult:
    """One token per step along an order, with a KV cache: O(1) model cost per token.

    Args:
        model: ``gpt`` (left to right only), ``aogpt`` or ``armd``.
        n: sequence length.
        batch: rows (taken from ``prompt`` when it is 2-D).
        order: ``random`` (default; ``l2r`` for gpt), ``l2r``, or a (B, n) tensor listing
            the known positions first.
        prompt, known: (B, n) or (n,) tokens and the mask of the known positions; they are
            prefilled in one pass (once for the whole batch when every row shares them).
        temperature, top_k, top_p: sampling controls (float64 draws).
        generator: every random draw; the same seed gives the same sample.
        stop_at_eos: with a left-to-right order (the unknown positions left to right, the
            known ones anywhere), the EOS id: a row ends at its first *generated* EOS (a
            prompt's EOS does not count); every later unknown position becomes EOS with
            ``step_of`` -2 and zero kept logits, and decoding stops once every row has
            ended (looked at every few passes, without waiting for the device). Known
            tokens are never changed.
        keep_logits: return the logits each token was drawn from (slot-aligned).
        on_step: called after each pass with the decided positions and tokens, (B, Q) each
            (padding positions are ``n``), and their step (:data:`StepHook`).
        graphs: ``"auto"`` (default): capture each pass shape once as a CUDA graph and
            replay it on CUDA, eager elsewhere; True: the same, CUDA required; False: eager;
            ``"emulate"`` runs the replay logic without a graph, for tests.

    Returns:
        A :class:`SampleResult`; ``forward_passes`` is the number of model calls.
    """
    check_controls(temperature, top_k, top_p)
    _decoder_only(model, "sequential sampling")
    tokens, _, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    B = tokens.shape[0]
    if stop_at_eos is not None:
        check_stop_order(order, k)
    reveals = RevealPlan(n - k, np.arange(n - k), np.ones((n - k, B), dtype=np.int64))
    return _decode(
        model, tokens, order, k, reveals, None, Controls(temperature, top_k, top_p), generator,
        graphs, keep_logits=keep_logits, on_step=on_step, stop_at_eos=stop_at_eos,
    )  # fmt: skip


def _decode(
    model: AnyOrderLM,
    tokens: Tensor,
    order: Tensor,
    k: int,
    reveals: RevealPlan,
    block_of: np.ndarray | None,
    ctl: Controls,
    generator: torch.Generator | None,
    graphs: bool | str,
    **kw,
) -> SampleResult:
    """Plan the passes of a decode and run them. On the CPU's eager path the passes are packed
    (fewer matmul rows, more index ops) and read the keys they need; on a GPU, bound by
    launches and planning at these sizes, and under CUDA graphs they are bucketed into at
    most eight attention shapes and never packed."""
    mode = resolve_mode(graphs, tokens.device)
    B = tokens.shape[0]
    prefill = block_of is None and _shared_prompt(tokens, order, k)
    cpu = mode == "off" and tokens.device.type == "cpu"
    plan = Plan(
        isinstance(model, ARMD), B, tokens.shape[1], k, reveals.counts, reveals.step,
        block_of, prefill, pack=cpu, bucket=not cpu or plan_mod.BUCKET_ON_CPU,
    )  # fmt: skip
    return run_plan(model, tokens, order, k, plan, ctl, generator, graphs=mode, **kw)


@torch.no_grad()
def lemma1_sample(
    model: AnyOrderLM,
    n: int,
    steps: int,
    *,
    schedule: str = "linear",
    shared_counts: bool = False,
    reveal: str = "binomial",
    batch: int = 1,
    order: str | Tensor | None = None,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
    graphs: bool | str = "auto",
) -> SampleResult:
    """``steps``-step masked-diffusion sampling by Lemma 1, on a decoder with a KV cache.

    Follows one order (random by default); at each reverse step ``t -> s`` a row reveals
    ``Binomial(#masked, 1 - m(s)/m(t))`` tokens (:func:`~anyorder.sampling.schedules.
    draw_reveals`, per row), the next
    ones in its order, all predicted in ONE forward pass with the parallel prediction mask
    (each query sees the cache, not the other queries: AO-GPT repeats the last decided token
    with the different targets; ARMD uses as many query-stream slots). A step that reveals
    nothing costs no pass. Rows revealing different counts share a pass, padded.

    Args:
        model: ``aogpt`` or ``armd``.
        steps: ``T``, the number of reverse steps.
        schedule: masking probability ``m(t)``: ``linear`` or ``cosine``.
        shared_counts: draw one reveal count per step for the whole batch instead of one
            per row. Each row is still an exact sample of the reverse process, but the rows
            share their count trajectory (not independent); no padding, so faster.
        reveal: ``binomial`` (the exact reverse process, above) or ``reference`` (the AO-GPT
            reference code's deterministic counts: ``max(floor(m (1 - m(t_{i+1}))),
            previous + 1)`` revealed by step ``i``, never an empty step).
        Others: as :func:`sequential_sample`; the plan costs O(B n) whatever ``steps`` is.

    Returns:
        A :class:`SampleResult` with ``reveals`` (the non-empty steps; ``counts`` gives the
        dense (steps, B) table); ``forward_passes`` is the number of steps in which some row
        revealed a token (plus one prefill for a shared prompt).
    """
    check_controls(temperature, top_k, top_p)
    _decoder_only(model, "Lemma-1 sampling")
    if model.kind == "gpt":
        raise SamplingError(
            "gpt cannot predict several positions per pass (it has no target position); "
            "sample it one token per pass (no steps), or use aogpt, armd or mdm for steps"
        )
    check_reveal(steps, schedule, reveal)
    tokens, _, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    B = tokens.shape[0]
    rows = 1 if shared_counts or reveal == "reference" else B
    reveals = draw_reveals(n - k, steps, rows, schedule, reveal, generator)
    if rows != B:
        reveals = reveals.expand(B)
    out = _decode(
        model, tokens, order, k, reveals, None, Controls(temperature, top_k, top_p), generator,
        graphs, keep_logits=keep_logits, on_step=on_step,
    )  # fmt: skip
    out.reveals = reveals
    return out


@torch.no_grad()
def strided_sample(
    model: ARMD,
    n: int,
    streams: int,
    *,
    batch: int = 1,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
    graphs: bool | str = "auto",
) -> SampleResult:
    """ARMD's strided block-parallel decoding: the ``S`` stream heads one at a time, then
    ``S`` tokens per forward pass (``S + m/S - 1`` passes for ``m`` unknown tokens), with the
    training forward's block semantics (:func:`anyorder.orders.strided`).

    A prompt must be a prefix (``known`` True at positions ``0..k-1``, the same ``k`` in
    every row): it is read one token per block, left to right, and the ``m = n - k``
    positions after it are cut into the ``S`` streams.
    """
    check_controls(temperature, top_k, top_p)
    if not isinstance(model, ARMD):
        raise SamplingError(
            f"strided block-parallel decoding is ARMD's; {model.kind} was not trained on "
            "blocks (sample it one token per pass, without streams; aogpt also takes steps)"
        )
    k = 0
    if known is not None:
        known = known.bool().expand(batch if known.dim() == 1 else known.shape[0], -1)
        k = int(known[0].sum())
        prefix = torch.arange(known.shape[1], device=known.device) < k
        if not bool((known == prefix).all()):
            raise SamplingError(
                "strided decoding takes a prefix prompt (the same known positions 0..k-1 in "
                "every row); use --steps or a random order to fill holes"
            )
        batch = known.shape[0]
    try:
        ordering = strided(batch, n - k, streams, model.device)
    except ConfigError as e:
        after = f"n={n - k} (the unknown tokens after the prompt)" if k else f"n={n}"
        raise SamplingError(str(e).replace(f"n={n - k}", after)) from None
    head = torch.arange(k, device=model.device)
    order = torch.cat([head.expand(batch, k), ordering.order + k], dim=1)
    tokens, _, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    block_of = torch.cat([head, ordering.blocks[0] + k]).cpu().numpy()
    counts = np.bincount(block_of[k:] - k)[:, None].repeat(batch, axis=1)
    reveals = RevealPlan(len(counts), np.arange(len(counts)), counts)
    return _decode(
        model, tokens, order, k, reveals, block_of, Controls(temperature, top_k, top_p),
        generator, graphs, keep_logits=keep_logits, on_step=on_step,
    )  # fmt: skip


@torch.no_grad()
def encoder_sample(
    model: MDM,
    n: int,
    *,
    steps: int | None = None,
    schedule: str = "linear",
    shared_counts: bool = False,
    reveal: str = "binomial",
    batch: int = 1,
    order: str | Tensor | None = None,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
) -> SampleResult:
    """Ancestral sampling of the encoder-only MDM: a full bidirectional pass per step.

    With ``steps=T`` the reveal counts are those of the reverse process (as in
    :func:`lemma1_sample`: the revealed set of a step is a uniform subset of the masked
    positions, here the next ones of a random order); a step revealing nothing makes no
    pass. ``steps=None`` reveals one token per pass (``n - k`` passes). No cache: every pass
    re-reads the whole sequence (the O(n^2) the decoders avoid). ``shared_counts`` and
    ``reveal``: as in :func:`lemma1_sample`. Every pass has the same shape.
    """
    check_controls(temperature, top_k, top_p)
    if not isinstance(model, MDM):
        raise SamplingError(f"encoder_sample runs the mdm encoder; {model.kind} is a decoder")
    if steps is not None:
        check_reveal(steps, schedule, reveal)
    tokens, known, order, k = _prepare(model, n, batch, prompt, known, order, generator)
    B = tokens.shape[0]
    if steps is None:
        reveals = RevealPlan(n - k, np.arange(n - k), np.ones((n - k, B), dtype=np.int64))
    else:
        rows = 1 if shared_counts or reveal == "reference" else B
        reveals = draw_reveals(n - k, steps, rows, schedule, reveal, generator)
        reveals = reveals.expand(B) if rows != B else reveals
    # the slots each pass decides, (B, Q) per pass (padding: n), in one device copy
    d, spans, parts, offset = np.full(B, k), [], [], 0
    for c in reveals.counts:
        q = np.arange(int(c.max()))[None]
        parts.append(np.where(q < c[:, None], d[:, None] + q, n))
        spans.append(offset)
        offset, d = offset + q.shape[1], d + c
    device = tokens.device
    pad = torch.full((B, 1), n, dtype=torch.long, device=device)
    order_ext = torch.cat([order, pad], dim=1)
    slots = torch.from_numpy(np.concatenate([np.zeros((B, 0), np.int64), *parts], 1))
    slots = slots.to(device)
    positions = order_ext.gather(1, slots)
    x = torch.cat([torch.where(known, tokens, model.mask_id), pad], dim=1)  # column n: padding
    step_of = torch.full((B, n + 1), -2, dtype=torch.long, device=device)
    step_of.scatter_(1, order[:, :k], -1)
    V = model.cfg.vocab_size
    logits_buf = torch.zeros(B, n + 1, V, device=device) if keep_logits else None
    # the CPU's prepacked weights (layers/linear.py), in a decode long enough to pay for them
    packs = prepacked_for(model) if worth_reading(len(parts), 0) else None
    for step, start, part in zip(reveals.step.tolist(), spans, parts):
        q_slot = slots[:, start : start + part.shape[1]]
        q_pos = positions[:, start : start + part.shape[1]]  # (B, Q)
        with prepacked(packs, make=(MANY_ROWS,) if len(parts) >= EARN_PASSES else ()):
            logits = model.denoise(x[:, :n])
        logits = logits.gather(1, q_pos.clamp(max=n - 1)[..., None].expand(-1, -1, V))
        new = sample_logits(logits, generator, temperature, top_k, top_p)
        x.scatter_(1, q_pos, new)
        step_of.scatter_(1, q_pos, step)
        if logits_buf is not None:
            logits_buf.scatter_(1, q_slot[..., None].expand(-1, -1, V), logits.float())
        if on_step is not None:
            on_step(q_pos, new, step)
    return SampleResult(
        x[:, :n],
        order,
        forward_passes=len(parts),
        step_of=step_of[:, :n],
        logits=None if logits_buf is None else logits_buf[:, :n],
        reveals=reveals if steps is not None else None,
    )


def sample(
    model: AnyOrderLM,
    n: int,
    *,
    order: str | Tensor | None = None,
    streams: int | None = None,
    steps: int | None = None,
    schedule: str = "linear",
    shared_counts: bool = False,
    reveal: str = "binomial",
    batch: int = 1,
    prompt: Tensor | None = None,
    known: Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    stop_at_eos: int | None = None,
    keep_logits: bool = False,
    on_step: StepHook | None = None,
    graphs: bool | str = "auto",
) -> SampleResult:
    """The fast sampler that fits the model and the request.

    * ``mdm``: :func:`encoder_sample` (``steps`` reverse steps; default one token per pass);
    * ``streams=S`` (``armd``): :func:`strided_sample`;
    * ``steps=T`` (``aogpt``, ``armd``): :func:`lemma1_sample`;
    * otherwise :func:`sequential_sample` (``gpt``: left to right).

    ``stop_at_eos`` applies to sequential left-to-right decoding only (refused elsewhere);
    ``graphs`` (CUDA graphs) to the decoders, ``reveal`` (the count mode) to ``steps``.
    """
    common = dict(
        batch=batch, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
        keep_logits=keep_logits, on_step=on_step,
    )  # fmt: skip
    diffusion = dict(
        schedule=schedule, shared_counts=shared_counts, reveal=reveal, order=order,
        prompt=prompt, known=known,
    )  # fmt: skip
    if streams is not None and steps is not None:
        raise SamplingError("give steps (Lemma-1 sampling) or streams (strided), not both")
    if stop_at_eos is not None and (isinstance(model, MDM) or (steps, streams) != (None, None)):
        raise SamplingError(
            "stop at EOS is for one-token-per-pass decoding (no steps, no streams, not mdm); "
            "truncate the text at EOS instead"
        )
    if isinstance(model, MDM):
        if streams is not None:
            raise SamplingError("strided decoding is ARMD's; mdm takes --steps")
        if graphs not in (False, "off", "auto"):
            raise SamplingError("CUDA graphs are for the decoders; mdm runs eagerly")
        return encoder_sample(model, n, steps=steps, **diffusion, **common)
    common["graphs"] = graphs
    if streams is not None:
        if isinstance(order, Tensor) or order not in (None, "strided"):
            raise SamplingError("streams fix the order (strided); leave the order out")
        return strided_sample(model, n, streams, prompt=prompt, known=known, **common)
    if order == "strided":
        raise SamplingError("the strided order needs a number of streams S (--streams)")
    if steps is not None:
        return lemma1_sample(model, n, steps, **diffusion, **common)
    return sequential_sample(
        model, n, order=order, prompt=prompt, known=known, stop_at_eos=stop_at_eos, **common
    )
