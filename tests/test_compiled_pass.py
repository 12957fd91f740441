"""A decoding pass compiles whole: ``torch.compile(fullgraph=True)`` of the pass every
fast decoder sampler runs (``sampling/passes.py``: the table row read, the static caches
written, the model's ``decode``) takes it as one graph for gpt, aogpt and armd, and the
decode through compiled passes gives the eager decode's tokens and logits (within 1e-5).

The passes are compiled where the CUDA-graph runner calls them (``PassRunner``, in its CPU
emulation): the same callable, the same order, each group's static buffers. The reference
is the eager decode with graphs off, computed independently of the runner.
"""

from __future__ import annotations

import pytest
import torch

from anyorder.sampling import graphs as graphs_mod
from anyorder.sampling import samplers

from conftest import tiny_model

N = 16


@pytest.fixture
def compiled_passes(monkeypatch):
    """Every PassRunner's pass compiled with ``fullgraph=True`` (a graph break raises);
    returns how many runners compiled one."""
    made = []
    real = graphs_mod.PassRunner.__init__

    def init(self, fn, table, mode):
        backend = compiled_passes.backend
        made.append(table.shape)
        real(self, torch.compile(fn, fullgraph=True, dynamic=False, backend=backend), table, mode)

    compiled_passes.backend = "aot_eager"
    monkeypatch.setattr(graphs_mod.PassRunner, "__init__", init)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):  # a group's shapes: one graph each
        yield made, compiled_passes
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
def test_decoding_through_compiled_passes_equals_eager(compiled_passes, kind, how, backend):
    made, opts = compiled_passes
    opts.backend = backend
    how = dict(how)
    if how.pop("prompt", None):  # the first half known, the same prompt for both rows
        prompt = torch.randint(0, 11, (N,), generator=torch.Generator().manual_seed(3))
        known = torch.arange(N) < N // 2
        how.update(prompt=prompt, known=known)
    eager = _decode(kind, how, "off")
    assert not made
    compiled = _decode(kind, how, "emulate")
    assert made  # the passes went through the compiled runners
    assert torch.equal(compiled.tokens, eager.tokens)
    assert torch.equal(compiled.step_of, eager.step_of)
    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-5, rtol=0)
