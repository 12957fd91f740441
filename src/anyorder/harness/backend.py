"""The ``anyorder`` model of EleutherAI's evaluation harness (``lm_eval``).

::

    python -m anyorder.harness run --model anyorder --model_args pretrained=runs/demo \\
        --tasks wikitext --device cpu --batch_size 8
    anyorder eval runs/demo --suite lm-eval --tasks wikitext

Design choices:

* lm_eval 0.4.13 finds out-of-repository models only through its registry (it reads no
  plugin entry points), so importing this module registers :class:`AnyorderLM` as
  ``anyorder``; ``python -m anyorder.harness`` is the harness's own command line with that
  import done first, and ``anyorder eval --suite lm-eval`` calls ``lm_eval.simple_evaluate``.
* Everything is the harness's or ours: the harness tokenises the pairs
  (:class:`lm_eval.api.model.TemplateLM`: the context's trailing spaces move to the
  continuation; an empty context becomes the EOS token), computes every metric and loads
  every task; the numbers come from :mod:`anyorder.evaluation.conditional`, the code of
  :meth:`anyorder.api.Model.score`, and the text from :func:`anyorder.sample.sample`.
* ``order``: ``l2r`` (default), ``any`` (``num_orders`` random orders of the continuation,
  the context known and read first) or ``ensemble:M`` (random orders, each conditional an
  AO-GPT Eq. 7 ensemble of ``M`` context orders). The harness gets ``-mean`` over the
  orders; ``is_greedy`` holds when every continuation token is the argmax of what it was
  scored under, in every order.
* ``loglikelihood_rolling`` scores a document in windows of the model's ``seq_len``, each
  from scratch (the first token of a window is predicted with no context), exactly as
  ``Model.score`` (the harness's own ``hf`` model gives later windows the previous tokens as
  context; here every window is scored as the model was trained, from scratch).
* ``generate_until``: the context is a known prefix and ``max_gen_toks`` tokens are decoded
  after it (fewer where the window is full: the context keeps at least half of it), one per
  pass (``gen_order=l2r`` or ``random``) or in ``steps`` Lemma-1 steps; then the text is cut
  at EOS and at the first stop sequence. Any-order decoding cannot stop early, so a stop
  sequence only cuts the text.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from tqdm import tqdm

from anyorder.api import load
from anyorder.errors import ConfigError
from anyorder.harness.settings import GenSettings, Settings, gen_settings, parse_settings


class AnyorderLM(TemplateLM):
    """An anyorder model (run, checkpoint, export or hub id) behind the harness's interface."""

    def __init__(self, pretrained: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.settings: Settings = parse_settings(pretrained, kwargs)
        s = self.settings
        self.api = load(s.pretrained, weights=s.weights, device=s.device, tokenizer=s.tokenizer)
        if self.api.tokenizer is None:
            raise ConfigError(
                f"{s.pretrained} holds no tokenizer; pass --model_args tokenizer=SPEC "
                "(for example tokenizer=gpt2 or tokenizer=bytes)"
            )
        self.tok = self.api.tokenizer
        self.model = self.api.model

    # -- what TemplateLM needs ---------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self.api.seq_len

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return self.tok.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        from anyorder.evaluation.conditional import continuation_nll

        pairs = []
        for (_, cont_text), ctx, cont in requests:
            if len(cont) > self.max_length:
                raise ConfigError(
                    f"a continuation of {len(cont)} tokens ({cont_text[:30]!r}...) is longer "
                    f"than the model's context of {self.max_length}; use a shorter task"
                )
            keep = self.max_length - len(cont)  # the context is cut from the left to fit
            pairs.append((ctx[max(0, len(ctx) - keep) :] if keep else [], cont))
        s = self.settings
        with tqdm(
            total=len(pairs),
            desc="Running loglikelihood requests",
            disable=self._quiet(disable_tqdm),
        ) as bar:
            res = continuation_nll(
                self.model, pairs, order=s.order, num_orders=s.num_orders,
                ensemble=s.ensemble, seed=s.seed, batch_size=s.batch_size, on_done=bar.update,
            )  # fmt: skip
        means = -res.nll.mean(dim=1)
        return [(float(v), bool(g)) for v, g in zip(means, res.greedy)]

    # -- the other two request types ---------------------------------------------------

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from anyorder.evaluation.conditional import window_totals

        s, out = self.settings, []
        for req in tqdm(
            requests,
            desc="Running loglikelihood_rolling requests",
            disable=self._quiet(disable_tqdm),
        ):
            ids = self.tok.encode(req.args[0])
            if not ids:
                out.append(0.0)
                continue
            totals = window_totals(self.model, ids, s.order, s.ensemble, s.num_orders, s.seed)
            out.append(-sum(float(t.mean()) for t in totals))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, list[int]]]] = {}
        for i, req in enumerate(requests):
            context, kwargs = req.args
            g = gen_settings(kwargs, self.tok.decode([self.tok.eos_id]))
            ids = self.tok.encode(context)
            # the context keeps what max_gen_toks leaves of the window, and at least half of
            # it: a long generation is cut short by the window rather than lose its prompt
            keep = max(self.max_length - g.max_tokens, min(len(ids), self.max_length // 2))
            ids = ids[max(0, len(ids) - keep) :] if keep else []
            n = min(self.max_length, len(ids) + g.max_tokens)
            groups.setdefault((len(ids), n, g), []).append((i, ids))
        bar = tqdm(
            total=len(requests),
            desc="Running generate_until requests",
            disable=self._quiet(disable_tqdm),
        )
        with bar:
            for (k, n, g), items in groups.items():
                for start in range(0, len(items), self.settings.batch_size):
                    chunk = items[start : start + self.settings.batch_size]
                    texts = self._generate([ids for _, ids in chunk], k, n, g)
                    for (i, _), text in zip(chunk, texts):
                        out[i] = text
                    bar.update(len(chunk))
        return [t or "" for t in out]

    def _generate(self, prompts: list[list[int]], k: int, n: int, g: GenSettings) -> list[str]:
        """Decode ``n - k`` tokens after each of the ``k``-token prompts, cut at the stops."""
        from anyorder import bounds
        from anyorder.sample import decode_text, sample

        s, B = self.settings, len(prompts)
        prompt = torch.zeros(B, n, dtype=torch.long)
        if k:
            prompt[:, :k] = torch.tensor(prompts, dtype=torch.long)
        known = torch.zeros(B, n, dtype=torch.bool)
        known[:, :k] = True
        steps = min(s.steps, n - k) if s.steps is not None else None
        gen = torch.Generator(self.model.device).manual_seed(s.seed)
        with bounds.out_of_memory_as_error(f"batch_size={B} x {n} tokens"):
            result = sample(
                self.model, n, order=s.gen_order, steps=steps, schedule=s.schedule, batch=B,
                prompt=prompt.to(self.model.device), known=known.to(self.model.device),
                temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, generator=gen,
            )  # fmt: skip
        texts = []
        for row in result.tokens[:, k:].cpu():
            text = decode_text(self.tok, row, self.tok.eos_id)
            for stop in g.until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            texts.append(text)
        return texts

    def _quiet(self, disable_tqdm: bool) -> bool:
        return disable_tqdm or self.rank != 0

    def get_model_info(self) -> dict[str, Any]:
        """What the harness records about the model in its results."""
        return {
            "model_kind": self.api.kind,
            "model_num_parameters": self.model.num_params(),
            "anyorder_settings": self.settings.describe(),
        }


if "anyorder" not in model_registry:
    register_model("anyorder")(AnyorderLM)
