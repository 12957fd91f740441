"""The weights a decode casts once under autocast (``layers/casts.py``).

Under bf16 autocast with fp32 weights, a decode makes each weight's bf16 copy when it begins
and its passes read the copies: a CUDA graph records without autocast's weight-cast cache,
so before, every replay cast every weight again. The copies are the very casts autocast
makes, so a decode reading them gives the tokens and logits of a decode through autocast's
own casts, bit for bit: checked at random models, samplers, sizes, prompts and paths
(eager, the captured replay emulated, compiled passes), against the same decode with the
casts turned off. And the count: a captured pass under the recording's autocast casts no
weight (it cast all of them before).
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from anyorder.layers import casts
from anyorder.sampling import graphs as graphs_mod
from anyorder.sampling import samplers
from anyorder.sampling.confidence import confidence_sample
from anyorder.sampling.graphs import compiled_passes
from anyorder.sampling.speculative import speculative_sample

from conftest import tiny_model

SAMPLERS = ("sequential", "lemma1", "strided", "speculative", "confidence", "confidence-spec")


def _model(kind: str, variant: str, seed: int):
    """A tiny model of ``kind`` whose weights moved off their initialisation; ``variant``
    adds what makes a layer read its weight otherwise: a padded head (a view of its first
    rows), biases, LayerNorm, an untied head, no QK-norm."""
    over = dict(vocab_size=7, seq_len=48)
    over.update(
        {
            "plain": {},
            "padded": dict(padded_vocab=16),
            "biases": dict(bias=True, head_bias=True, tie_embeddings=False),
            "layernorm": dict(norm="layernorm", qk_norm=False),
        }[variant]
    )
    model = tiny_model(kind, **over)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _decode(model, sampler: str, n: int, batch: int, graphs, seed: int, prompt: bool):
    g = torch.Generator().manual_seed(seed)
    known = None
    if prompt:
        known = torch.zeros(batch, n, dtype=torch.bool)
        known[:, : n // 3] = True
        given_ = dict(prompt=torch.randint(0, 7, (batch, n), generator=g), known=known)
    else:
        given_ = {}
    common = dict(batch=batch, generator=g, keep_logits=True, graphs=graphs, **given_)
    if sampler == "speculative":
        return speculative_sample(model, n, 3, **common)
    if sampler == "confidence":
        return confidence_sample(model, n, 2, **common)
    if sampler == "confidence-spec":
        return confidence_sample(model, n, speculative=3, **common)
    how = {"lemma1": dict(steps=max(1, n // 3)), "strided": dict(streams=2)}.get(sampler, {})
    return samplers.sample(model, n, **how, **common)


def _kinds(sampler: str) -> list[str]:
    if sampler == "strided":
        return ["armd"]
    if sampler == "sequential":
        return ["gpt", "aogpt", "armd"]
    return ["aogpt", "armd"]


@st.composite
def requests(draw):
    sampler = draw(st.sampled_from(SAMPLERS))
    kind = draw(st.sampled_from(_kinds(sampler)))
    n = draw(st.integers(2, 24))
    if sampler == "strided":
        n = 2 * max(1, n // 2)
    prompt = draw(st.booleans()) and kind != "gpt" and sampler != "strided"
    return dict(
        kind=kind,
        sampler=sampler,
        n=n,
        batch=draw(st.integers(1, 3)),
        graphs=draw(st.sampled_from([False, "emulate"])),
        variant=draw(st.sampled_from(["plain", "padded", "biases", "layernorm"])),
        seed=draw(st.integers(0, 2**16)),
        prompt=prompt,
    )


def _both(req: dict, compiled: bool = False):
    """The decode under bf16 autocast reading its casts, and the same decode through
    autocast's own casts (the casts turned off)."""
    model = _model(req["kind"], req["variant"], req["seed"])
    args = (req["sampler"], req["n"], req["batch"], req["graphs"], req["seed"], req["prompt"])
    outs = []
    real = casts.for_decode
    for on in (True, False):
        casts.for_decode = real if on else (lambda model: None)
        try:
            compiling = compiled_passes("aot_eager") if compiled else _null()
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), compiling:
                outs.append(_decode(model, *args))
        finally:
            casts.for_decode = real
    return outs


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _same(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert a.forward_passes == b.forward_passes
    if a.logits is not None or b.logits is not None:
        assert torch.equal(a.logits, b.logits)


@settings(
    max_examples=40, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
@given(req=requests())
def test_a_decode_reading_its_casts_gives_autocasts_tokens_and_logits(req) -> None:
    _same(*_both(req))


@pytest.mark.parametrize("sampler", ["sequential", "speculative", "confidence-spec"])
def test_compiled_passes_reading_the_casts_give_autocasts_tokens(sampler) -> None:
    torch._dynamo.reset()
    req = dict(kind="aogpt", sampler=sampler, n=12, batch=2, graphs="emulate",
               variant="padded", seed=3, prompt=False)  # fmt: skip
    try:
        _same(*_both(req, compiled=True))
    finally:
        torch._dynamo.reset()


class _Casts(TorchDispatchMode):
    """The casts of the model's parameters dispatched inside replays."""

    def __init__(self, params) -> None:
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.replaying = False
        self.casts = 0
        self.replays = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            self.replaying
            and func.overloadpacket.__name__ == "_to_copy"
            and args[0].data_ptr() in self.ptrs
        ):
            self.casts += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampler", ["sequential", "lemma1", "speculative", "confidence-spec"])
@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_a_captured_pass_casts_no_weight_under_autocast(kind, sampler, monkeypatch) -> None:
    """Under autocast without its cast cache (as CUDA records a graph), the replays of a
    captured decode cast none of the model's weights; with the casts turned off they cast
    every one a pass reads, at every replay (what a CUDA graph replayed before)."""
    model = _model(kind, "padded", 0)
    now: dict = {}
    for cls in (graphs_mod.PassRunner, graphs_mod.RoundRunner):

        def call(self, *a, _real=cls.__call__, **k):
            if self.graph is None:  # the first call: the warm-up and the recording
                return _real(self, *a, **k)
            mode = now["mode"]
            mode.replaying, mode.replays = True, mode.replays + 1
            try:
                return _real(self, *a, **k)
            finally:
                mode.replaying = False

        monkeypatch.setattr(cls, "__call__", call)
    real = casts.for_decode
    counts = {}
    for on in (True, False):
        monkeypatch.setattr(casts, "for_decode", real if on else (lambda model: None))
        mode = now["mode"] = _Casts(model.parameters())
        recording = torch.autocast("cpu", torch.bfloat16, cache_enabled=False)
        with torch.no_grad(), recording, mode:
            _decode(model, sampler, 24, 2, "emulate", 1, False)
        counts[on] = mode.casts, mode.replays
    (cast_on, replays_on), (cast_off, replays_off) = counts[True], counts[False]
    assert replays_on == replays_off > 0
    assert cast_on == 0
    assert cast_off >= replays_off * 2 * model.cfg.n_layer  # qkv, proj, MLP of each layer


def test_the_copies_are_autocasts_casts_and_views_of_them_read_their_rows() -> None:
    """A copy is autocast's cast of its parameter; the padded head and ARMD's query-only
    and key-value-only projections take their rows of the copy (a view of a parameter is
    not looked up: compiled passes trace no ``_base``)."""
    model = _model("armd", "padded", 1)
    c = casts.Casts(model, torch.bfloat16)
    for p, copy in c.copies.values():
        assert c.of(p) is copy and torch.equal(copy, p.to(torch.bfloat16))
    assert c.of(model.tok_emb.weight) is not model.tok_emb.weight  # the tied head reads it
    rows = model.head.weight[:3]
    assert c.of(rows) is rows and c.of(None) is None  # a view: itself
    x = torch.randn(2, 5, model.cfg.d_model)
    attn = model.blocks[0].attn
    d = attn.q_width
    for fn, rows in ((model.head, slice(0, model.cfg.vocab_size)),
                     (attn.project_q, slice(0, d)), (attn.project_kv, slice(d, None))):  # fmt: skip
        with torch.autocast("cpu", torch.bfloat16), casts.reading(c), _reads() as seen:
            fn(x) if fn is model.head else fn(x, torch.arange(5).repeat(2, 1))
        weight = model.head.weight if fn is model.head else attn.qkv.weight
        assert seen and all(t.dtype == torch.bfloat16 for t in seen)
        assert any(torch.equal(t, weight[rows].to(torch.bfloat16)) for t in seen)


class _reads:
    """The weights ``F.linear`` is given within."""

    def __enter__(self):
        import torch.nn.functional as F

        self.real, self.seen = F.linear, []

        def spy(x, w, b=None):
            self.seen.append(w)
            return self.real(x, w, b)

        F.linear = spy
        return self.seen

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.linear = self.real
        return False


def test_no_copy_of_what_no_pass_casts() -> None:
    """Token tables are looked up, never cast, and AO-GPT's adaLN fills a table once per
    decode: no copies of them (a tied head's weight is copied: the head reads it)."""
    untied = _model("aogpt", "biases", 0)
    c = casts.Casts(untied, torch.bfloat16)
    tables = [m.weight for m in untied.modules() if isinstance(m, torch.nn.Embedding)]
    tables += [p for a in untied.adas() for p in a.parameters()]
    copied = {id(p) for p, _ in c.copies.values()}
    assert tables and not copied & {id(p) for p in tables}
    assert id(untied.head.weight) in copied
    reads = {id(p) for p in untied.parameters()} - {id(p) for p in tables}
    assert reads <= copied
    tied = _model("gpt", "plain", 0)
    assert tied.head.weight is tied.tok_emb.weight
    assert id(tied.tok_emb.weight) in {
        id(p) for p, _ in casts.Casts(tied, torch.bfloat16).copies.values()
    }


def test_a_decode_makes_casts_only_under_autocast_of_other_weights() -> None:
    model = _model("gpt", "plain", 0)
    assert casts.for_decode(model) is None  # no autocast
    with torch.autocast("cpu", torch.bfloat16):
        made = casts.for_decode(model)
        assert made is not None and made.dtype == torch.bfloat16
        assert casts.for_decode(model.to(torch.bfloat16)) is None  # weights in bf16 already


def test_a_device_without_room_for_the_casts_decodes_with_autocasts(monkeypatch) -> None:
    def full(self, model, dtype):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(casts.Casts, "__init__", full)
    model = _model("aogpt", "plain", 0)
    with torch.autocast("cpu", torch.bfloat16):
        assert casts.for_decode(model) is None
        out = _decode(model, "speculative", 10, 2, "emulate", 0, False)
    assert out.tokens.shape == (2, 10)


def test_the_casts_a_thread_reads_are_its_own() -> None:
    model = _model("gpt", "plain", 0)
    mine = casts.Casts(model, torch.bfloat16)
    seen = []
    with casts.reading(mine):
        t = threading.Thread(target=lambda: seen.append(casts.current()))
        t.start()
        t.join()
        assert casts.current() is mine
    assert seen == [None] and casts.current() is None
