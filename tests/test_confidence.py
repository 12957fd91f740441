"""Confidence-ordered decoding: the most confident position first, its logits those of the
uncached forward, and with speculative verification exact for the order chosen."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyorder.errors import SamplingError
from anyorder.sampling.confidence import confidence_sample
from test_sample import slot_oracle
from test_speculative import _check_counts, _moved
from test_trunk_options import FAMILY_TRUNKS

from conftest import tiny_model

KINDS = ["aogpt", "armd"]


def _prompt(n: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    known = torch.zeros(batch, n, dtype=torch.bool)
    known[:, [1, n - 2]] = True
    return torch.randint(0, 5, (batch, n), generator=g), known


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("per_pass", "subset"), [(1, None), (3, None), (2, 4)])
def test_parallel_confidence_logits_are_the_oracle_conditionals(kind, per_pass, subset):
    """Each committed token was drawn from its conditional given the tokens of earlier
    passes, as the uncached forward gives it; the prompt is kept; passes as counted."""
    n, B = 10, 3
    model = _moved(tiny_model(kind, vocab_size=5), 1)
    tokens, known = _prompt(n, B, 0)
    out = confidence_sample(
        model, n, per_pass, subset=subset, batch=B, prompt=tokens, known=known, keep_logits=True,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    assert torch.equal(out.tokens[known], tokens[known])
    assert out.forward_passes == -(-(n - 2) // per_pass)
    oracle = slot_oracle(model, out.tokens, out.order, out.step_of)
    torch.testing.assert_close(out.logits[:, 2:], oracle[:, 2:], atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_each_pass_commits_the_most_confident_position(kind):
    """One position per pass: the one whose conditional (uncached forward, the decided
    slots as context) has the largest top probability among the remaining positions."""
    n = 8
    model = _moved(tiny_model(kind, vocab_size=5), 4)
    out = confidence_sample(model, n, 1, batch=2, temperature=0.8,
                            generator=torch.Generator().manual_seed(3))  # fmt: skip
    for b in range(2):
        order, x = out.order[b], out.tokens[b : b + 1]
        for t in range(n):
            tops = {}
            for p in order[t:].tolist():
                o = torch.cat([order[:t], torch.tensor([p]), order[t:][order[t:] != p]])
                tops[p] = float((model(x, o[None])[0, t] / 0.8).softmax(-1).max())
            assert tops[int(order[t])] >= max(tops.values()) - 1e-5


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 3), J=st.integers(0, 9), V=st.integers(1, 40), seed=st.integers(0, 99),
    temperature=st.sampled_from([1.0, 0.7, 1.6]), bf16=st.booleans(), limit=st.integers(1, 300),
)  # fmt: skip
def test_a_score_is_the_largest_probability_of_its_conditional(
    B, J, V, seed, temperature, bf16, limit
):
    """The confidence of a column is the largest probability of softmax(logits / T), as a
    float64 softmax gives it, whatever the chunks of columns (a draw's bound, any size
    here), the dtype of the logits (bf16 under autocast) and the temperature; -inf off the
    candidates; equal logits, equal scores."""
    import anyorder.sampling.draws as draws
    from anyorder.sampling.confidence import _confidence

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, J, V, generator=g) * 4
    if J > 1:
        logits[:, 1] = logits[:, 0]  # a tie
    if bf16:
        logits = logits.bfloat16()
    candidate = torch.rand(B, J, generator=g) < 0.7
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(draws, "DRAW_ELEMENTS", limit)
        got = _confidence(logits, temperature, candidate)
    want = (logits.double() / temperature).softmax(dim=-1).amax(dim=-1)
    assert got.dtype == torch.float32 and got.shape == (B, J)
    assert torch.equal(torch.isinf(got), ~candidate) and bool((got[~candidate] < 0).all())
    torch.testing.assert_close(got[candidate].double(), want[candidate], atol=1e-6, rtol=1e-6)
    if J > 1:
        both = candidate[:, 0] & candidate[:, 1]
        assert torch.equal(got[both, 0], got[both, 1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", [1, 2, 4])
def test_speculative_confidence_is_exact_for_the_order_chosen(kind, K):
    """With verification every committed token's logits are the uncached forward's at its
    slot of the final order (the sequential conditional), whatever was drafted."""
    n, B = 10, 4
    model = _moved(tiny_model(kind, vocab_size=5), 2)
    tokens, known = _prompt(n, B, 1)
    out = confidence_sample(
        model, n, speculative=K, batch=B, prompt=tokens, known=known, keep_logits=True,
        generator=torch.Generator().manual_seed(K),
    )  # fmt: skip
    assert torch.equal(out.tokens[known], tokens[known])
    ref = model(out.tokens, out.order)
    torch.testing.assert_close(out.logits[:, 2:], ref[:, 2:], atol=2e-5, rtol=0)
    _check_counts(out, n, 2)
    stats = out.extra["speculative"]
    if K > 1:
        assert stats.passes.sum() < stats.tokens.sum()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40), batch=st.integers(1, 4), k=st.integers(0, 6), seed=st.integers(0, 2**16)
)
def test_reorder_moves_the_chosen_to_the_start_the_rest_in_order(n, batch, k, seed) -> None:
    """``_reorder`` (keys by a scatter of the chosen ranks) gives the order of its
    definition: the slots below ``start`` kept, the chosen positions (padding ``n``) at
    ``start..`` in their order, the other undecided positions after them in their old
    order."""
    from anyorder.sampling.confidence import _reorder

    g = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(n, generator=g) for _ in range(batch)])
    start = torch.randint(0, n + 1, (batch,), generator=g)
    chosen = torch.full((batch, k), n)
    want = []
    for b in range(batch):
        s = int(start[b])
        left = order[b, s:].tolist()
        many = int(torch.randint(0, min(k, len(left)) + 1, (), generator=g))
        pick = [left[i] for i in torch.randperm(len(left), generator=g)[:many].tolist()]
        chosen[b, :many] = torch.tensor(pick, dtype=torch.long)
        want.append(order[b, :s].tolist() + pick + [p for p in left if p not in pick])
    assert _reorder(order, start, chosen).tolist() == want


def test_confidence_errors():
    with pytest.raises(SamplingError, match="gpt cannot score positions out of order"):
        confidence_sample(tiny_model("gpt"), 8)
    with pytest.raises(SamplingError, match="per_pass=0 must be an integer >= 1"):
        confidence_sample(tiny_model("aogpt"), 8, 0)


def test_cli_confidence(tmp_path, capsys):
    import json

    from anyorder.checkpoint import save_checkpoint
    from anyorder.cli import main
    from anyorder.config import RunConfig
    from anyorder.data import ByteTokenizer

    model = tiny_model("armd", vocab_size=257, seq_len=32)
    save_checkpoint(tmp_path / "r", 1, model=model, config=RunConfig(model=model.cfg),
                    tokenizer=ByteTokenizer())  # fmt: skip

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["sample", str(tmp_path / "r"), *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = run("--order", "confidence", "--per-pass", "4", "--length", "16", "--json")
    res = json.loads(out)
    assert code == 0 and res["mode"] == "confidence" and res["forward_passes"] == 4
    code, out, err = run("--order", "confidence", "--speculative", "3",
                         "--verbose", "--infill", "a[MASK:6]b")  # fmt: skip
    assert code == 0 and out.startswith("a") and "speculative:" in err
    code, _, err = run("--order", "confidence", "--steps", "4")
    assert code == 2 and err == (
        "anyorder sample: error: --order confidence chooses its own positions per pass; leave "
        "out --steps/--streams (--per-pass N sets the tokens per pass)\n"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_parallel_confidence_on_the_gpu_path(kind, monkeypatch):
    """Fixed widths and key levels (the GPU's path, here on the CPU): the same logits as
    the uncached forward, at most eight attention shapes."""
    import anyorder.sampling.rounds as rounds

    monkeypatch.setattr(rounds, "STATIC_ON_CPU", True)
    n, B = 10, 2
    model = _moved(tiny_model(kind, vocab_size=5), 1)
    tokens, known = _prompt(n, B, 0)
    out = confidence_sample(model, n, 3, batch=B, prompt=tokens, known=known, keep_logits=True,
                            generator=torch.Generator().manual_seed(2))  # fmt: skip
    oracle = slot_oracle(model, out.tokens, out.order, out.step_of)
    torch.testing.assert_close(out.logits[:, 2:], oracle[:, 2:], atol=2e-5, rtol=0)
    assert len(out.extra["attention_shapes"]) <= 8


# ------------------------------------------------- the oracle, at sizes drawn at random

_DIFF = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
_SLOW = int(os.environ.get("ANYORDER_SPEC_EXAMPLES", "1000"))


def _requests(n_max: int):
    return dict(
        kind=st.sampled_from(KINDS),
        n=st.one_of(st.integers(2, 10), st.integers(11, n_max)),
        batch=st.integers(1, 4),
        per_pass=st.integers(1, 5),
        subset=st.one_of(st.none(), st.integers(1, 8)),
        K=st.one_of(st.none(), st.integers(1, 6)),
        prompt=st.sampled_from(["none", "scattered", "per-row"]),
        seed=st.integers(0, 2**16),
        path=st.sampled_from(["cpu", "static", "captured"]),
    )


@settings(max_examples=30, derandomize=True, **_DIFF)
@given(**_requests(24))
def test_confidence_logits_equal_the_uncached_oracle(
    kind, n, batch, per_pass, subset, K, prompt, seed, path
):
    """Drawn at random (sizes, batch, per-pass counts, scored subsets, verification, prompts,
    the CPU's path, the GPU's, and the GPU's with its steady passes captured): every
    committed token's logits are the uncached forward's
    for the tokens of earlier passes (parallel commits) or for the final order (verified)."""
    _check_confidence(kind, n, batch, per_pass, subset, K, prompt, seed, path)


@pytest.mark.slow
@settings(max_examples=_SLOW, **_DIFF)
@given(**_requests(60))
def test_confidence_logits_equal_the_uncached_oracle_many(
    kind, n, batch, per_pass, subset, K, prompt, seed, path
):
    _check_confidence(kind, n, batch, per_pass, subset, K, prompt, seed, path)


@settings(max_examples=int(os.environ.get("ANYORDER_SPEC_EXAMPLES", "12")), derandomize=True,
          **_DIFF)  # fmt: skip
@given(**_requests(24), trunk=st.sampled_from(sorted(FAMILY_TRUNKS)))
def test_confidence_logits_equal_the_uncached_oracle_on_family_trunks(
    kind, n, batch, per_pass, subset, K, prompt, seed, path, trunk
):
    """The same on the trunks of Llama 3, Qwen2, Qwen3 and Mistral (issue 33)."""
    _check_confidence(kind, n, batch, per_pass, subset, K, prompt, seed, path,
                      FAMILY_TRUNKS[trunk])  # fmt: skip


def _check_confidence(kind, n, batch, per_pass, subset, K, prompt, seed, path, trunk=None):
    from anyorder.sampling import rounds

    shape = dict(vocab_size=5, seq_len=64, d_model=32, **(trunk or {}))
    model = _moved(tiny_model(kind, **shape), seed % 5)
    g = torch.Generator().manual_seed(seed)
    known = torch.zeros(batch, n, dtype=torch.bool)
    for b in range(batch if prompt == "per-row" else 1 if prompt == "scattered" else 0):
        known[b, torch.randperm(n, generator=g)[: (n - 1) // 2]] = True
    if prompt == "scattered":
        known[:] = known[0]
    tokens = torch.randint(0, 5, (batch, n), generator=g)
    k = int(known[0].sum())
    saved, rounds.STATIC_ON_CPU = rounds.STATIC_ON_CPU, path == "static"
    try:
        out = confidence_sample(
            model, n, per_pass, speculative=K, subset=subset, batch=batch, prompt=tokens,
            known=known, keep_logits=True, generator=g,
            graphs="emulate" if path == "captured" else False,
        )  # fmt: skip
    finally:
        rounds.STATIC_ON_CPU = saved
    assert torch.equal(out.tokens[known], tokens[known])
    assert bool((out.step_of[~known] >= 0).all())  # every position after the prompt decided
    with torch.no_grad():
        want = (
            model(out.tokens, out.order)
            if K
            else slot_oracle(model, out.tokens, out.order, out.step_of)
        )
    rtol = 1e-5 if trunk else 0  # logits near 10 without QK-norm: see test_speculative.py
    torch.testing.assert_close(out.logits[:, k:], want[:, k:], atol=2e-5, rtol=rtol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", [None, 3])
def test_the_step_hook_sees_every_committed_token_once(kind, K) -> None:
    """``on_step`` (it was accepted and never called): every position after the prompt is
    reported exactly once, with its final token and the pass recorded in ``step_of``."""
    n, B = 12, 3
    model = _moved(tiny_model(kind, vocab_size=5), 1)
    tokens, known = _prompt(n, B, 2)
    seen = []
    out = confidence_sample(
        model, n, 2, speculative=K, batch=B, prompt=tokens, known=known,
        generator=torch.Generator().manual_seed(0),
        on_step=lambda pos, tok, step: seen.append((pos.clone(), tok.clone(), step)),
    )  # fmt: skip
    assert len(seen) == out.forward_passes
    count = torch.zeros(B, n + 1, dtype=torch.long)
    for pos, tok, step in seen:
        real = pos < n
        count.scatter_add_(1, pos, real.long())
        rows = torch.arange(B)[:, None].expand_as(pos)
        assert torch.equal(tok[real], out.tokens[rows[real], pos[real]])
        assert bool((out.step_of[rows[real], pos[real]] == step).all())
    assert torch.equal(count[:, :n], (~known).long())
