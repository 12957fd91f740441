"""A decoding pass compiles whole: under :func:`~anyorder.sampling.graphs.compiled_passes`
every runner's pass is ``torch.compile(fullgraph=True)``-ed (a graph break raises): the
planned samplers' passes (``sampling/passes.py``: the table row read, the static caches
written, the model's ``decode``) for gpt, aogpt and armd, and the speculative and
confidence-ordered rounds (their tables, ratio tests and drafts included). The decode
through compiled passes gives the eager decode's tokens and logits (within 1e-5).

The passes are compiled where the CUDA-graph runners call them (in their CPU emulation:
``compiled_passes`` turns a CPU decode's runners on): the same callable, the same order,
each group's static buffers. The reference is the eager decode with graphs off, computed
independently of the runners.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyorder.sampling import graphs as graphs_mod
from anyorder.sampling import rounds, samplers
from anyorder.sampling.graphs import compiled_passes

from conftest import tiny_model

N = 16


@pytest.fixture
def compiled(monkeypatch):
    """Count the runners made (each compiles its pass) under ``compiled_passes``."""
    made = []
    for cls in (graphs_mod.PassRunner, graphs_mod.RoundRunner):
        real = cls.__init__

        def init(self, *a, _real=real, **k):
            _real(self, *a, **k)
            made.append(type(self).__name__)

        monkeypatch.setattr(cls, "__init__", init)
    torch._dynamo.reset()
    yield made
    torch._dynamo.reset()


def _decode(kind: str, how: dict, mode: str, seed: int = 1):
    model = tiny_model(kind, seq_len=N)
    g = torch.Generator().manual_seed(seed)
    return samplers.sample(model, N, batch=2, generator=g, graphs=mode, keep_logits=True, **how)


@pytest.mark.parametrize(
    ("kind", "how", "backend"),
    [
        ("gpt", {}, "aot_eager"),
        ("aogpt", {}, "aot_eager"),
        ("aogpt", {"steps": 6}, "aot_eager"),  # Lemma 1: several slots a pass
        ("aogpt", {"prompt": "half"}, "aot_eager"),  # a prefill, then the rest
        ("armd", {}, "aot_eager"),
        ("armd", {"streams": 4}, "aot_eager"),  # strided blocks
        ("aogpt", {}, "inductor"),  # inductor's CPU kernels
        pytest.param("gpt", {}, "inductor", marks=pytest.mark.slow),
        pytest.param("armd", {"streams": 4}, "inductor", marks=pytest.mark.slow),
    ],
)
def test_decoding_through_compiled_passes_equals_eager(compiled, kind, how, backend):
    how = dict(how)
    if how.pop("prompt", None):  # the first half known, the same prompt for both rows
        prompt = torch.randint(0, 11, (N,), generator=torch.Generator().manual_seed(3))
        known = torch.arange(N) < N // 2
        how.update(prompt=prompt, known=known)
    eager = _decode(kind, how, "off")
    assert not compiled
    with compiled_passes(backend):
        out = _decode(kind, how, "auto")  # a CPU: the runners without a graph
    assert compiled  # the passes went through the compiled runners
    assert out.extra["graphs"]["mode"] == "emulate"
    assert torch.equal(out.tokens, eager.tokens)
    assert torch.equal(out.step_of, eager.step_of)
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-5, rtol=0)


_ROUNDS = int(os.environ.get("ANYORDER_COMPILE_EXAMPLES", "5"))


@settings(max_examples=_ROUNDS, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(
    kind=st.sampled_from(["aogpt", "armd"]), n=st.integers(6, 24), batch=st.integers(1, 3),
    sampler=st.sampled_from(["speculative", "confidence", "confidence-spec"]),
    K=st.integers(2, 5), seed=st.integers(0, 2**16), prompt=st.booleans(),
    controls=st.sampled_from([{}, {"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.8},
                              {"top_p": 0.6, "rule": "reference"}]),
)  # fmt: skip
def test_compiled_rounds_equal_the_eager_rounds(
    compiled, kind, n, batch, sampler, K, seed, prompt, controls, monkeypatch
):
    """Speculative and confidence-ordered rounds compiled whole (aot_eager: dynamo's graph,
    functionalised, no break) at random sizes and controls (the top-p rule read before the
    rounds: a compiled pass cannot read it): the eager decode of the same fixed widths'
    tokens bit for bit, its logits within 1e-5."""
    import contextlib

    from anyorder.sampling.confidence import confidence_sample
    from anyorder.sampling.draws import top_p_rule
    from anyorder.sampling.speculative import speculative_sample

    model = tiny_model(kind, vocab_size=7, seq_len=32)
    controls = dict(controls)
    rule = controls.pop("rule", None)
    kw = dict(batch=batch, keep_logits=True, **controls)
    if prompt:
        kw.update(prompt=torch.randint(0, 7, (n,)), known=torch.arange(n) < n // 3)

    def decode():
        g = torch.Generator().manual_seed(seed)
        if sampler == "speculative":
            return speculative_sample(model, n, K, generator=g, **kw)
        return confidence_sample(
            model, n, 2, speculative=K if sampler == "confidence-spec" else None, generator=g,
            **kw,
        )  # fmt: skip

    def ruled():
        return top_p_rule(rule) if rule else contextlib.nullcontext()

    monkeypatch.setattr(rounds, "STATIC_ON_CPU", True)
    with ruled():
        eager = decode()
    monkeypatch.setattr(rounds, "STATIC_ON_CPU", False)
    with compiled_passes("aot_eager"), ruled():
        out = decode()
    assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.order, eager.order)
    assert torch.equal(out.step_of, eager.step_of)
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-5, rtol=0)
    if out.forward_passes >= 4:
        assert "RoundRunner" in compiled


@pytest.mark.slow
def test_speculative_rounds_through_inductor_equal_eager(compiled, monkeypatch) -> None:
    """The rounds compiled into inductor's CPU kernels (about a minute): the same tokens as
    the eager rounds, logits within 1e-5."""
    from anyorder.sampling.speculative import speculative_sample

    model = tiny_model("aogpt", vocab_size=7, seq_len=32)

    def decode():
        g = torch.Generator().manual_seed(1)
        return speculative_sample(model, 20, 3, batch=2, generator=g, keep_logits=True)

    monkeypatch.setattr(rounds, "STATIC_ON_CPU", True)
    eager = decode()
    monkeypatch.setattr(rounds, "STATIC_ON_CPU", False)
    with compiled_passes("inductor"):
        out = decode()
    assert "RoundRunner" in compiled
    assert torch.equal(out.tokens, eager.tokens)
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-5, rtol=0)


def _compiled_kernels():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import compiled_kernels

    return compiled_kernels


def test_the_kernel_count_reads_inductors_generated_code() -> None:
    """``benchmarks/compiled_kernels.py`` counts the kernel calls of inductor's generated
    ``call()``: a matmul and its fused epilogue (relu, then a row sum) are two calls, the
    views and allocations none."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: (x @ w).relu().sum(-1), fullgraph=True)
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    out, codes = run_and_get_code(fn, x, w)
    torch.testing.assert_close(out, (x @ w).relu().sum(-1))
    calls = [c for code in codes for c in _compiled_kernels().kernel_calls(code)]
    assert sorted(calls) == ["cpp_fused", "extern_kernels.mm"], calls
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["aogpt-spec-K4", "armd-spec-K4", "armd-confidence-P4"])
def test_a_compiled_round_runs_at_most_one_and_a_half_gpt_passes_kernels(name) -> None:
    """Issue 41's launch proxy on the compiled path (inductor's CPU kernels, about a minute
    each): a compiled speculative or confidence round runs at most 1.5x the kernels of a
    compiled gpt pass, and far fewer than its eager round's (about 270)."""
    ck = _compiled_kernels()
    torch._dynamo.reset()
    gpt = ck.count("gpt-seq", 16, 2, "cpu")["kernels"]
    row = ck.count(name, 16, 2, "cpu")["kernels"]
    torch._dynamo.reset()
    assert gpt > 17 and 17 < row <= 1.5 * gpt, (gpt, row)  # 17: the matmuls alone


_CASES = {
    "gpt sequential": ("gpt", {}),
    "aogpt Lemma 1": ("aogpt", {"steps": 5}),
    "armd strided": ("armd", {"streams": 4}),
    "aogpt speculative": ("aogpt", {"speculative": 3}),
    "armd speculative": ("armd", {"speculative": 3}),
    "aogpt confidence, verified": ("aogpt", {"confidence": 3}),
    "armd confidence": ("armd", {"confidence": None}),
}


def _recording_autocast(dtype: str):
    """bf16 autocast as a CUDA graph records under it (no weight-cast cache), on the CPU."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", torch.bfloat16, cache_enabled=False)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(_CASES))
def test_a_compiled_runner_compiles_on_its_first_call_only(case, dtype, monkeypatch) -> None:
    """On CUDA a runner's second call is recorded into its graph, and compiling while a
    graph records fails. So every runner compiles on its first call and never again (the
    decode's tables are filled before, a round stands for its key level, no memo is read
    inside), and the same request decoded again compiles nothing; under bf16 autocast too,
    where each decode reads its own casts of the weights (``layers/casts.py``)."""
    from torch._dynamo.utils import counters

    from anyorder.sampling.confidence import confidence_sample
    from anyorder.sampling.speculative import speculative_sample

    kind, how = _CASES[case]
    model, n = tiny_model(kind, seq_len=24), 24
    later = []
    for cls in (graphs_mod.PassRunner, graphs_mod.RoundRunner):
        real = cls.__call__

        def call(self, *a, _real=real, **k):
            first, before = self.graph is None, counters["stats"]["unique_graphs"]
            out = _real(self, *a, **k)
            if not first:
                later.append(counters["stats"]["unique_graphs"] - before)
            return out

        monkeypatch.setattr(cls, "__call__", call)

    def decode():
        g = torch.Generator().manual_seed(2)
        if "speculative" in how:
            return speculative_sample(model, n, how["speculative"], batch=2, generator=g)
        if "confidence" in how:
            return confidence_sample(model, n, 2, speculative=how["confidence"], batch=2,
                                     generator=g)  # fmt: skip
        return samplers.sample(model, n, batch=2, generator=g, **how)

    torch._dynamo.reset()
    counters.clear()
    with compiled_passes("aot_eager"), _recording_autocast(dtype):
        out = decode()
        made = counters["stats"]["unique_graphs"]
        again = decode()
    torch._dynamo.reset()
    assert later and set(later) == {0}  # every replay ran the graphs compiled at first
    assert 1 <= made <= out.extra["graphs"]["shapes"]
    assert counters["stats"]["unique_graphs"] == made  # the second decode compiled nothing
    assert torch.equal(out.tokens, again.tokens)
