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
* ``loglikelihood_rolling`` scores a document in the harness's own windows
  (``lm_eval.utils.get_rolling_token_windows``, made disjoint): windows of the model's
  ``seq_len``, a later one seeing the tokens before it as context, as for every other model
  in the harness; the harness's prefix token (EOT) is our BOS, so the first window starts
  from scratch. ``rolling=scratch`` scores every window from scratch instead, as
  :meth:`anyorder.api.Model.score` does. A pair longer than the window is cut from the left,
  as the harness's ``hf`` model cuts it: the context first, then the continuation's first
  tokens (a warning says so once).
* ``generate_until``: the context is a known prefix and ``max_gen_toks`` tokens are decoded
  after it (fewer where the window is full: the context keeps at least half of it), one per
  pass (``gen_order=l2r`` or ``random``) or in ``steps`` Lemma-1 steps; then the text is cut
  at EOS and at the first stop sequence. Any-order decoding cannot stop early, so a stop
  sequence only cuts the text. A request that draws at random decodes alone, from a
  generator seeded from ``(seed, its index)``: repeats are independent samples and the
  texts do not depend on the batch size.
* ``--apply_chat_template``: the harness renders a conversation to a string
  (:meth:`AnyorderLM.apply_chat_template`) and hands it back to be tokenised, glued to the
  continuation. The ids of a chat template need not survive text: the byte template's EOS
  has no text at all, and a converted model's special tokens decode to nothing. So the
  string carries the rendered ids themselves (:func:`anyorder.data.chat.render_messages`,
  the ids training conditioned on) between private-use marks, after their readable text,
  and :meth:`AnyorderLM.tok_encode` reads them back exactly.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from tqdm import tqdm

from anyorder.api import load
from anyorder.errors import ConfigError
from anyorder.evaluation.estimators import check_ensemble_memory
from anyorder.harness.settings import GenSettings, Settings, gen_settings, parse_settings

log = logging.getLogger(__name__)
GENERATION_STREAM = 4
"""The stream of :func:`~anyorder.evaluation.corpus.block_generator` a request's sampling
draws from (block: the request's index)."""


CHAT_OPEN, CHAT_IDS, CHAT_CLOSE = "\ue000", "\ue001", "\ue002"
"""Private-use marks around a rendered conversation: ``OPEN text IDS 1,2,3 CLOSE``."""
_CHAT = re.compile("\ue000[^\ue000-\ue002]*\ue001([0-9,]*)\ue002")


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
        self._warned_long = False
        n = self.api.seq_len
        # a request's member orders: (continuation, M - 1, length), a continuation up to n
        check_ensemble_memory(
            s.ensemble, n, n, self.model.device, name=f"--model_args order='ensemble:{s.ensemble}'",
            what=f"a continuation of up to {n} tokens", fix="use e.g. order=ensemble:8",
        )  # fmt: skip

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
        """Token ids of ``string``; a conversation rendered by :meth:`apply_chat_template`
        inside it gives back its ids exactly."""
        ids: list[int] = []
        at = 0
        for m in _CHAT.finditer(string):
            ids += self.tok.encode(string[at : m.start()]) if m.start() > at else []
            ids += [int(t) for t in m.group(1).split(",") if t]
            at = m.end()
        return ids + (self.tok.encode(string[at:]) if at < len(string) else [])

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The harness's ``--apply_chat_template``: the conversation through the tokenizer's
        chat template (the byte tokenizer's plain one without), as a string that
        :meth:`tok_encode` turns back into exactly those ids (see the module notes)."""
        from anyorder.data.chat import render_messages

        ids = render_messages(chat_history, self.tok, add_generation_prompt=add_generation_prompt)
        shown = re.sub("[\ue000-\ue002]", "", self.tok.decode(ids))
        return f"{CHAT_OPEN}{shown}{CHAT_IDS}{','.join(map(str, ids))}{CHAT_CLOSE}"

    def chat_template(self, chat_template: bool | str = False) -> str:
        """The template the harness records with its results: the tokenizer's own, else
        the plain one (:data:`anyorder.data.chat.PLAIN_TEMPLATE`)."""
        from anyorder.data.chat import PLAIN_TEMPLATE, has_template

        return self.tok.tok.chat_template if has_template(self.tok) else PLAIN_TEMPLATE

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        res = self._score(pairs, "Running loglikelihood requests", disable_tqdm)
        means = -res.nll.mean(dim=1)
        return [(float(v), bool(g)) for v, g in zip(means, res.greedy)]

    def _score(self, pairs: list[tuple[list[int], list[int]]], desc: str, disable_tqdm: bool):
        """:func:`continuation_nll` of ``(context, continuation)`` pairs, each cut from the
        left to the window as the harness's ``hf`` model cuts them: the context first, then
        a continuation longer than the window loses its first tokens (said once)."""
        from anyorder.evaluation.conditional import continuation_nll

        n, fitted = self.max_length, []
        for ctx, cont in pairs:
            if len(cont) > n and not self._warned_long:
                self._warned_long = True
                log.warning(
                    "a continuation of %d tokens is longer than the model's context of %d: its "
                    "first tokens are cut and its last %d scored (as the harness's hf model "
                    "cuts from the left); said once",
                    len(cont), n, n,
                )  # fmt: skip
            ids = (list(ctx) + list(cont))[-n:]
            k = len(ids) - min(len(cont), n)
            fitted.append((ids[:k], ids[k:]))
        s = self.settings
        with tqdm(total=len(fitted), desc=desc, disable=self._quiet(disable_tqdm)) as bar:
            return continuation_nll(
                self.model, fitted, order=s.order, num_orders=s.num_orders,
                ensemble=s.ensemble, seed=s.seed, batch_size=s.batch_size, on_done=bar.update,
            )  # fmt: skip

    # -- the other two request types ---------------------------------------------------

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text in the harness's windows (``get_rolling_token_windows`` with one token
        of context, made disjoint): a window after the first sees the tokens before it, as
        for every other model of the harness. The harness's prefix token (EOT, so the first
        token has something to condition on) is our BOS, which every sequence starts with:
        the first window's context is empty. ``rolling=scratch``: windows of ``seq_len``
        each from scratch, the computation of :meth:`anyorder.api.Model.score`."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        if self.settings.rolling == "scratch":
            return self._rolling_from_scratch(requests, disable_tqdm)
        pairs, owner = [], []
        for r, req in enumerate(requests):
            windows = get_rolling_token_windows(
                token_list=self.tok.encode(req.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )  # fmt: skip
            for w, (ctx, cont) in enumerate(map(make_disjoint_window, windows)):
                pairs.append(([] if w == 0 else ctx, cont))
                owner.append(r)
        out = [0.0] * len(requests)
        if pairs:
            res = self._score(pairs, "Running loglikelihood_rolling windows", disable_tqdm)
            for r, v in zip(owner, (-res.nll.mean(dim=1)).tolist()):
                out[r] += v
        return out

    def _rolling_from_scratch(self, requests, disable_tqdm: bool) -> list[float]:
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
        """Greedy left-to-right requests run in batches; any request that draws at random
        (sampling, ``gen_order=random``, ``steps``) runs alone, with a generator of its own
        seeded from ``(seed, its index)``: the harness's repeats (maj@k, pass@k) are
        independent samples, and a seed gives the same texts at any batch size."""
        s = self.settings
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, list[int]]]] = {}
        for i, req in enumerate(requests):
            context, kwargs = req.args
            g = gen_settings(kwargs, self.tok.decode([self.tok.eos_id]))
            ids = self.tok_encode(context)
            # the context keeps what max_gen_toks leaves of the window, and at least half of
            # it: a long generation is cut short by the window rather than lose its prompt
            keep = max(self.max_length - g.max_tokens, min(len(ids), self.max_length // 2))
            ids = ids[max(0, len(ids) - keep) :] if keep else []
            n = min(self.max_length, len(ids) + g.max_tokens)
            drawn = not g.greedy or s.gen_order == "random" or s.steps is not None
            groups.setdefault((len(ids), n, g, i if drawn else -1), []).append((i, ids))
        bar = tqdm(
            total=len(requests),
            desc="Running generate_until requests",
            disable=self._quiet(disable_tqdm),
        )
        with bar:
            for (k, n, g, _), items in groups.items():
                for start in range(0, len(items), s.batch_size):
                    chunk = items[start : start + s.batch_size]
                    texts = self._generate([ids for _, ids in chunk], k, n, g, chunk[0][0])
                    for (i, _), text in zip(chunk, texts):
                        out[i] = text
                    bar.update(len(chunk))
        return [t or "" for t in out]

    def _generate(
        self, prompts: list[list[int]], k: int, n: int, g: GenSettings, index: int
    ) -> list[str]:
        """Decode ``n - k`` tokens after each of the ``k``-token prompts, cut at the stops;
        the draws from a generator seeded from ``(seed, index)``."""
        from anyorder import bounds
        from anyorder.evaluation.corpus import block_generator
        from anyorder.sample import decode_text, sample

        s, B = self.settings, len(prompts)
        prompt = torch.zeros(B, n, dtype=torch.long)
        if k:
            prompt[:, :k] = torch.tensor(prompts, dtype=torch.long)
        known = torch.zeros(B, n, dtype=torch.bool)
        known[:, :k] = True
        steps = min(s.steps, n - k) if s.steps is not None else None
        seed = block_generator(s.seed, index, GENERATION_STREAM).initial_seed()
        gen = torch.Generator(self.model.device).manual_seed(seed)
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
