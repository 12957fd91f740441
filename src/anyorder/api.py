"""The Python API: load a model from anywhere, then generate, infill, chat and score text.

::

    import anyorder

    model = anyorder.load("runs/armd")          # run folder, checkpoint, export or hub id
    model.generate(n=128, num_samples=2, order="random", seed=0)   # -> list[str]
    model.infill("The [MASK:8] of Python is [MASK:4].", seed=0)   # -> str
    model.chat("sort: q d a", order="random", steps=4, seed=0)     # -> str, the answer
    model.score("Some text.", order="any", num_orders=8)           # -> dict

Design choices:

* One wrapper, :class:`Model`, around what :func:`anyorder.interop.hub.load_any` returns (a
  :class:`~anyorder.checkpoint.Loaded`): the model, its tokenizer and its run config.
  Everything it does goes through the library's own functions — the fast samplers of
  :mod:`anyorder.sample` (KV cache, Lemma-1 steps, strided streams, the encoder's sampler)
  and the corpus estimators of :mod:`anyorder.evaluation.corpus` — so the API and the CLI agree by
  construction; the arguments keep the CLI's names (``--num-samples`` is ``num_samples``).
* Every call takes a ``seed`` and draws from its own :class:`torch.Generator`: the same
  call gives the same text.
* Text longer than the model's context is scored in consecutive windows of ``seq_len``
  tokens (the last one shorter), each scored from scratch; the totals are summed, so the
  result is a per-token average over the whole text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from anyorder.errors import ConfigError, SamplingError

if TYPE_CHECKING:
    from anyorder.checkpoint import Loaded
    from anyorder.config import RunConfig
    from anyorder.data import Tokenizer
    from anyorder.models.base import AnyOrderLM

GENERATE_ORDERS = ("random", "l2r", "strided", "confidence")
SCORE_ORDERS = ("l2r", "any")


def decode_mode(
    kind: str, order: str | None, steps: int | None, streams: int | None, speculative: int | None
) -> tuple[str, bool]:
    """The order a generation request decodes in, and whether it is sequential (one token a
    pass): ``order`` checked, its default for ``kind``, ``strided`` when ``streams`` is given.
    Shared by :meth:`Model.generate` and ``transformers``' ``generate`` (:mod:`anyorder.hf`).

    Raises:
        SamplingError: an order with options that do not go together.
    """
    from anyorder.sampling.speculative import check_request

    check_request(speculative, steps, streams, order)
    order = order or ("l2r" if kind == "gpt" else "random")
    if order == "strided" and streams is None:
        raise SamplingError("order='strided' needs streams=S")
    if streams is not None:
        order = "strided"
    return order, steps is None and streams is None


def _device(device: str | torch.device) -> torch.device:
    auto = str(device) == "auto"
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if auto else device)


def load(
    path: str | Path,
    *,
    kind: str | None = None,
    weights: str = "ema",
    device: str | torch.device = "cpu",
    tokenizer: str | None = None,
    huge_pages: bool = False,
) -> Model:
    """Load a model for generation and scoring.

    Args:
        path: an exported folder (``anyorder export`` / ``anyorder convert``), a hub id
            (``user/name``), a training run folder (its latest checkpoint) or a checkpoint
            folder.
        kind: the model kind expected (``gpt``, ``aogpt``, ``armd``, ``mdm``); a model of
            another kind is a :class:`~anyorder.errors.CheckpointError`. None: any.
        weights: training checkpoints only: ``ema`` (default; raw when the run kept no EMA)
            or ``raw``. An export holds one set of weights.
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        tokenizer: a tokenizer spec (:func:`anyorder.data.load_tokenizer`) to use instead of
            the saved one (needed for an export saved without a tokenizer).
        huge_pages: on a CPU, copy the weights into 2 MB pages (Linux transparent huge
            pages; :mod:`anyorder.hugepages`): decoding reads them up to 10-15% faster, for
            seconds per GB of copying at load. For long work: a server, many generations.

    Returns:
        A :class:`Model`.

    Raises:
        CheckpointError: nothing loadable at ``path``, a damaged file, or the wrong kind.
    """
    from anyorder.interop.hub import load_any

    loaded = load_any(
        path, kind=kind, weights=weights, device=_device(device), huge_pages=huge_pages
    )
    if tokenizer is not None:
        from anyorder.checkpoint import check_tokenizer_fits
        from anyorder.data import load_tokenizer

        loaded.tokenizer = load_tokenizer(tokenizer)
        check_tokenizer_fits(loaded.tokenizer, loaded.model.cfg.vocab_size, repr(tokenizer))
    return Model(loaded)


@dataclass
class Model:
    """A loaded model with its tokenizer: ``generate``, ``infill``, ``chat``, ``score``."""

    loaded: Loaded

    @property
    def model(self) -> AnyOrderLM:
        """The underlying ``torch`` module (eval mode)."""
        return self.loaded.model

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer (None for an export saved without one)."""
        return self.loaded.tokenizer

    @property
    def config(self) -> RunConfig:
        """The run config (the model section describes :attr:`model`)."""
        return self.loaded.config

    @property
    def kind(self) -> str:
        """``gpt``, ``aogpt``, ``armd`` or ``mdm``."""
        return self.model.kind

    @property
    def seq_len(self) -> int:
        """The longest sequence the model handles."""
        return self.model.cfg.seq_len

    def __repr__(self) -> str:
        tok = self.tokenizer.name if self.tokenizer is not None else None
        return (
            f"Model(kind={self.kind!r}, params={self.model.num_params() / 1e6:.2f}M, "
            f"seq_len={self.seq_len}, tokenizer={tok!r}, step={self.loaded.step}, "
            f"path={str(self.loaded.path)!r})"
        )

    # -- helpers --------------------------------------------------------------------------

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise SamplingError(
                f"{self.loaded.path} holds no tokenizer; pass tokenizer=SPEC to anyorder.load "
                "(gpt2, bytes or a tokenizer folder)"
            )
        return self.tokenizer

    def _encode(self, text: str) -> list[int]:
        ids = self._tok().encode(text)
        if ids and max(ids) >= self.model.cfg.vocab_size:
            raise SamplingError(
                f"the tokenizer gives ids up to {max(ids)} but the model reads "
                f"{self.model.cfg.vocab_size}; use the model's own tokenizer"
            )
        return ids

    # -- the three verbs -----------------------------------------------------------------

    def generate(
        self,
        n: int | None = None,
        num_samples: int = 1,
        *,
        order: str | None = None,
        streams: int | None = None,
        steps: int | None = None,
        schedule: str = "linear",
        shared_counts: bool = False,
        prompt: str | None = None,
        temperature: float = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int = 0,
        stop_at_eos: bool = True,
        reveal: str = "binomial",
        cuda_graphs: bool | str = "auto",
        speculative: int | None = None,
        per_pass: int = 1,
    ) -> list[str]:
        """Generate ``num_samples`` texts of ``n`` tokens: ``anyorder sample`` in Python.

        Args:
            n: tokens per sample, prompt included (``--length``; default the model's
                ``seq_len``).
            num_samples: number of texts (``--num-samples``), drawn as one batch.
            order: ``random`` (any order; the default for aogpt, armd, mdm), ``l2r`` (the
                default and only choice for gpt), ``strided`` (armd, with ``streams``) or
                ``confidence`` (aogpt/armd: the most confident positions first, ``per_pass``
                per pass or checked by ``speculative``; a heuristic, not an exact sampler).
            streams: armd: strided block-parallel decoding with ``S`` streams (``S`` tokens
                per forward pass after the stream heads; ``n`` must be a multiple of ``S``).
            steps: aogpt/armd/mdm: masked-diffusion sampling in ``steps`` reverse steps
                (Lemma 1: several tokens per forward pass); None: one token per pass.
            schedule: masking schedule of ``steps``: ``linear`` or ``cosine``.
            shared_counts: with ``steps``, one reveal count per step for the whole batch.
            prompt: text the samples start with (its tokens are the known prefix).
            temperature: softmax temperature (> 0).
            top_p: nucleus sampling mass in (0, 1].
            top_k: keep the ``k`` most likely tokens.
            seed: seed of every random draw (orders and tokens).
            stop_at_eos: cut each text at its first generated EOS (left-to-right one-token
                decoding then stops early; an EOS in the prompt ends nothing); False keeps
                everything (EOS tokens are dropped).
            reveal: with ``steps``, how many tokens each step reveals: ``binomial`` (the
                exact reverse process, per sample) or ``reference`` (the AO-GPT reference
                code's deterministic counts, never an empty step).
            cuda_graphs: CUDA graphs of the decoders' passes: ``"auto"`` (default) on a CUDA
                device, eager on a CPU; False: always eager; True: CUDA required.
            speculative: aogpt/armd: any-order speculative sampling, at most ``K`` tokens
                per forward pass, drafted and checked against the one-token-per-pass
                conditionals: the same law as sequential decoding, in fewer passes.
            per_pass: ``order="confidence"`` without ``speculative``: positions per pass.

        Returns:
            The decoded texts, prompt included.

        Raises:
            SamplingError: a bad length or controls, a prompt that is not a str, or an order
                the model cannot follow.
        """
        from anyorder import bounds

        if order is not None and order not in GENERATE_ORDERS:
            raise SamplingError(f"order={order!r}: use one of {', '.join(GENERATE_ORDERS)}")
        bounds.check_controls(
            temperature=temperature, top_p=top_p, top_k=top_k, num_samples=num_samples,
            seed=seed, steps=steps, length=n,
        )  # fmt: skip
        n = bounds.check_fit(self.seq_len, length=n, steps=steps)
        prompt_ids = known = None
        if bounds.check_text(prompt, "prompt", optional=True):  # "" is no prompt
            ids = self._encode(prompt)
            prompt_ids, known = bounds.prefix_prompt(ids, n, length=f"n={n}", name="n")
        return self._sample(
            n, num_samples, prompt_ids, known, order, streams, steps, schedule, shared_counts,
            temperature, top_p, top_k, seed, stop_at_eos, reveal=reveal, graphs=cuda_graphs,
            speculative=speculative, per_pass=per_pass,
        )  # fmt: skip

    def infill(
        self,
        template: str,
        *,
        order: str | None = None,
        steps: int | None = None,
        schedule: str = "linear",
        temperature: float = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int = 0,
        speculative: int | None = None,
    ) -> str:
        """Fill the holes of a template: ``anyorder sample --infill TEMPLATE`` in Python.

        ``"The [MASK:8] of Python"`` has one hole of 8 tokens; everything else is literal
        and known. The holes are generated in ``order`` (``random``, the default, or
        ``l2r``; a ``gpt`` fills only a hole at the end), one token per forward pass, or in
        ``steps`` Lemma-1 steps.

        Args:
            template: literal text with holes ``[MASK:n]`` (``n`` >= 1 tokens each).
            order: ``random``, ``l2r`` or ``confidence`` (a heuristic) over the holes
                (default: l2r for gpt, else random).
            steps: fill in this many reverse steps (several tokens per pass).
            schedule: masking schedule of ``steps``: ``linear`` or ``cosine``.
            temperature, top_p, top_k: sampling controls.
            seed: seed of every random draw.
            speculative: fill by speculative sampling, at most ``K`` tokens per pass (the
                law of one token per pass).

        Returns:
            The filled text.

        Raises:
            SamplingError: a template not a str, malformed or too long; bad controls.
        """
        from anyorder import bounds
        from anyorder.sample import parse_template

        if order not in (None, "random", "l2r", "confidence"):
            raise SamplingError(f"order={order!r}: infilling takes random, l2r or confidence")
        bounds.check_controls(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        bounds.check_holes(bounds.check_text(template, "template"), self.seq_len)
        tokens, known = parse_template(template, self._tok(), self.seq_len)
        bounds.check_steps(steps, len(tokens))
        return self._sample(
            len(tokens), 1, tokens, known, order, None, steps, schedule, False,
            temperature, top_p, top_k, seed, False, speculative=speculative,
        )[0]  # fmt: skip

    def chat(
        self,
        prompt_or_messages: str | list[dict[str, str]],
        *,
        order: str | None = None,
        steps: int | None = None,
        speculative: int | None = None,
        streams: int | None = None,
        temperature: float = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int = 0,
        max_new_tokens: int | None = None,
    ) -> str:
        """The answer to a prompt, alone: ``anyorder sample --chat TEXT`` in Python.

        The prompt goes through the tokenizer's chat template
        (:func:`anyorder.data.chat.render_prompt`), its tokens are known (prefilled once),
        and the answer's ``max_new_tokens`` slots after it are decoded as
        :meth:`generate` decodes (``order``, ``steps``, ``speculative``, ``streams``: the
        same meanings), then cut at the first EOS.

        Args:
            prompt_or_messages: the user's message, or ``{"role", "content"}`` messages.
            max_new_tokens: answer tokens at most (default: the context after the prompt).
            order, steps, speculative, streams, temperature, top_p, top_k, seed: as
                :meth:`generate`.

        Returns:
            The answer's text, without the prompt, the template or the EOS.

        Raises:
            SamplingError: a prompt not a str or list, or with no room; bad controls or options.
        """
        from anyorder import bounds
        from anyorder.checkpoint.loaded import warn_if_not_for_chat
        from anyorder.sampling.templates import chat_prompt

        if order is not None and order not in GENERATE_ORDERS:
            raise SamplingError(f"order={order!r}: use one of {', '.join(GENERATE_ORDERS)}")
        bounds.check_controls(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        bounds.check_text(prompt_or_messages, "prompt_or_messages", messages=True)
        cfg = self.model.cfg
        prompt, known = chat_prompt(
            prompt_or_messages, self._tok(), cfg.seq_len, cfg.vocab_size, max_new_tokens,
            streams=streams,
        )  # fmt: skip
        bounds.check_steps(steps, len(prompt))
        warn_if_not_for_chat(self.loaded)  # a UserWarning where the run says it cannot answer
        return self._sample(
            len(prompt), 1, prompt, known, order, streams, steps, "linear", False, temperature,
            top_p, top_k, seed, True, speculative=speculative, answer_only=True,
        )[0]  # fmt: skip

    def _sample(
        self,
        n: int,
        num_samples: int,
        prompt: Tensor | None,
        known: Tensor | None,
        order: str | None,
        streams: int | None,
        steps: int | None,
        schedule: str,
        shared_counts: bool,
        temperature: float,
        top_p: float | None,
        top_k: int | None,
        seed: int,
        stop_at_eos: bool,
        reveal: str = "binomial",
        graphs: bool | str = "auto",
        speculative: int | None = None,
        per_pass: int = 1,
        answer_only: bool = False,
    ) -> list[str]:
        """The sampling path of ``anyorder sample`` (cli/sample.py:run_sample), step for step;
        ``answer_only``: the text of the unknown slots alone (a chat answer)."""
        from anyorder import bounds
        from anyorder.sample import decode_text, sample
        from anyorder.sampling.confidence import confidence_sample
        from anyorder.sampling.speculative import speculative_sample

        model, tok = self.model, self._tok()
        order, sequential = decode_mode(model.kind, order, steps, streams, speculative)
        l2r = sequential and order == "l2r" and model.kind != "mdm"  # stops at an EOS early
        stop = tok.eos_id if stop_at_eos and l2r else None
        gen = torch.Generator(model.device).manual_seed(seed)
        controls = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        with bounds.out_of_memory_as_error(f"num_samples={num_samples} x {n} tokens"):
            if order == "confidence":
                result = confidence_sample(
                    model, n, per_pass, speculative=speculative, batch=num_samples,
                    prompt=prompt, known=known, graphs=graphs, **controls,
                )  # fmt: skip
            elif speculative is not None:
                result = speculative_sample(
                    model, n, speculative, batch=num_samples, order=order, prompt=prompt,
                    known=known, graphs=graphs, **controls,
                )  # fmt: skip
            else:
                result = sample(
                    model, n, order=None if order == "strided" else order, streams=streams,
                    steps=steps, schedule=schedule, shared_counts=shared_counts, reveal=reveal,
                    graphs=graphs, batch=num_samples, prompt=prompt, known=known,
                    stop_at_eos=stop, **controls,
                )  # fmt: skip
        eos = tok.eos_id if stop_at_eos else None
        given = result.step_of.cpu() == -1  # a prompt's EOS ends no text
        if answer_only:
            return [decode_text(tok, row[~g], eos) for row, g in zip(result.tokens.cpu(), given)]
        return [decode_text(tok, row, eos, g) for row, g in zip(result.tokens.cpu(), given)]

    def score(
        self,
        text: str,
        *,
        context: str | None = None,
        order: str = "l2r",
        ensemble: int = 1,
        num_orders: int = 4,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Likelihood of ``text`` under the model, or of ``text`` given a known ``context``.

        Args:
            text: the text (scored in windows of ``seq_len`` tokens, see the module notes).
            context: known text before ``text`` (not scored): the result is then the
                log-likelihood of the continuation given the context, as the evaluation
                harness asks for it. ``context + text`` is encoded whole and split after the
                context's tokens, and must fit one window. None: score ``text`` alone.
            order: ``l2r`` (exact left-to-right NLL) or ``any`` (the any-order NLL over
                ``num_orders`` uniform random orders, Monte Carlo; for mdm its ELBO; with a
                context, random orders of the continuation after the context).
            ensemble: context-order ensemble size ``M`` (AO-GPT Eq. 7; aogpt/armd, with
                ``order="any"``): each conditional averages ``M`` context orders in
                probability space, the identity among them.
            num_orders: random orders per window (the standard error is over them).
            seed: seed of the orders and ensemble draws.

        Returns:
            ``{"nats_per_token", "nats", "stderr", "ppl", "bits_per_byte", "bpb_stderr",
            "tokens", "bytes", "order", "ensemble", "num_orders", "seed"}`` (``nats``: the
            total; ``tokens`` and ``bytes`` count ``text`` only); ``stderr`` is 0 for the
            exact left-to-right NLL and nan with a single order.

        Raises:
            ConfigError: an order or ensemble the model has no meaning for (any-order on a
                gpt, an ensemble with ``l2r``), text not a str or empty, a context too long.
        """
        from anyorder.bounds import check_seed, check_text
        from anyorder.evaluation.conditional import (
            check_order,
            combine_windows,
            given_totals,
            window_totals,
        )

        check_order(self.model, order, ensemble, num_orders)
        check_seed(seed)
        check_text(text, "text", error=ConfigError)
        if check_text(context, "context", optional=True, error=ConfigError) is not None:
            ctx = self._encode(context)
            ids = self._encode(context + text)[len(ctx) :]
            totals = given_totals(self.model, ctx, ids, order, ensemble, num_orders, seed)
        else:
            ids = self._encode(text)
            if not ids:
                raise ConfigError("the text encodes to no tokens; give some text to score")
            totals = window_totals(self.model, ids, order, ensemble, num_orders, seed)
        mean, stderr = combine_windows(totals, len(ids))
        num_bytes = len(text.encode("utf-8"))
        bpb = mean * len(ids) / math.log(2) / num_bytes if num_bytes else float("nan")
        return {
            "nats_per_token": mean,
            "nats": mean * len(ids),
            "stderr": stderr,
            "ppl": math.exp(mean),
            "bits_per_byte": bpb,
            "bpb_stderr": stderr * len(ids) / math.log(2) / num_bytes if num_bytes else None,
            "tokens": len(ids),
            "bytes": num_bytes,
            "order": order,
            "ensemble": ensemble if self.kind in ("aogpt", "armd") else 1,
            "num_orders": num_orders if order == "any" else 0,
            "seed": seed,
        }
