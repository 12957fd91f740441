"""Any-order speculative sampling: exact law by enumeration, logits against the uncached
oracle, rejected drafts invisible, passes never above tokens."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyorder.errors import SamplingError
from anyorder.sample import lemma1_sample, sequential_sample
from anyorder.sampling.rounds import HostCounts
from anyorder.sampling.speculative import speculative_sample
from test_trunk_options import FAMILY_TRUNKS

from conftest import tiny_model

KINDS = ["aogpt", "armd"]
PATHS = ["cpu", "static", "captured"]
"""The CPU's path (exact widths), the GPU's (fixed widths, key levels), and the GPU's with
its rounds captured (``graphs="emulate"``: the replay's bookkeeping, no CUDA graph)."""


def _variant(kind: str, **overrides):
    """aogpt, armd, or the aogpt-ref / sigmagpt-ref parameterisations (kind aogpt)."""
    if kind in ("aogpt-ref", "sigmagpt-ref"):
        from anyorder import build_model, preset

        torch.manual_seed(0)
        cfg = dict(vocab_size=11, seq_len=16, n_layer=2, n_head=4, d_model=64)
        cfg.update(overrides)
        return build_model(preset("tiny", variant=kind, **cfg)).eval()
    return tiny_model(kind, **overrides)


def _moved(model, seed: int, scale: float = 0.5):
    """Weights moved well off their init: sharp, context-dependent conditionals."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def _check_counts(out, n: int, k: int, static: bool = False) -> None:
    """Per row: passes never exceed tokens; tokens = the unknown slots; accepted <= drafted.
    The model calls: those of the longest row, plus (on the GPU's path, which reads the
    counts two passes late) at most two that find every row done, never more than tokens."""
    st_ = out.extra["speculative"]
    assert (st_.passes <= st_.tokens).all()
    assert (st_.tokens == n - k).all()
    assert (st_.accepted <= st_.drafted).all()
    assert (st_.passes >= min(1, n - k)).all()
    late = HostCounts.lag if static else 0
    assert st_.passes.max() <= out.forward_passes <= min(st_.passes.max() + late, n - k)


# ----------------------------------------------------------------------------- exactness


def _nucleus(logits: torch.Tensor, top_p: float | None) -> torch.Tensor:
    """Top-p written out token by token (not the library's filter): in each row, tokens by
    falling probability are kept while the mass of those kept before is below ``top_p``;
    the rest become -inf."""
    if top_p is None:
        return logits
    out = torch.full_like(logits, float("-inf"))
    flat, kept = logits.reshape(-1, logits.shape[-1]), out.view(-1, logits.shape[-1])
    for r, row in enumerate(flat):
        probs = torch.softmax(row, dim=-1).tolist()
        mass = 0.0
        for v in sorted(range(len(probs)), key=lambda v: -probs[v]):
            if mass >= top_p:
                break
            kept[r, v] = row[v]
            mass += probs[v]
    return out


@torch.no_grad()
def _sequential_law(model, order: torch.Tensor, temperature: float, top_p: float | None):
    """Exact law over all V^n sequences of the sequential sampler along ``order`` (n,): the
    product of the filtered conditionals, each from one full uncached forward."""
    V, n = model.cfg.vocab_size, len(order)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))  # (V^n, n)
    logits = model(seqs, order.expand(len(seqs), n)).double()  # (V^n, n, V), slot-aligned
    logp = _nucleus(logits / temperature, top_p).log_softmax(-1)
    picked = logp.gather(2, seqs.gather(1, order.expand(len(seqs), n))[..., None])[..., 0]
    return seqs, picked.sum(1).exp()


def _chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value, cells with expected count < 5 pooled into one."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):  # a sequence the law cannot produce
        return 0.0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def _histogram(tokens: torch.Tensor, V: int) -> torch.Tensor:
    n = tokens.shape[1]
    index = (tokens * V ** torch.arange(n - 1, -1, -1)).sum(1)
    return torch.bincount(index, minlength=V**n).double()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("controls", [(1.0, None), (0.7, 0.9)])
def test_speculative_follows_the_sequential_law_exactly(kind: str, controls) -> None:
    """20,000 samples at K = 2, 3 (rounds captured) and n (eager and captured) against the
    exact law (chi-square, p = 0.001); the same test rejects Lemma 1 at the same passes (it
    has power)."""
    V, n, B = 3, 4, 20000
    model = tiny_model(kind, vocab_size=V, seq_len=n, n_layer=2, d_model=16, n_head=2)
    model = _moved(model, 8, scale=0.3)  # sharp, yet many sequences likely at 0.7 / 0.9
    order = torch.tensor([2, 0, 3, 1])
    temperature, top_p = controls
    seqs, law = _sequential_law(model, order, temperature, top_p)
    assert float(law.sum()) == pytest.approx(1.0, abs=1e-9)
    assert float(law.max()) > 3 * float(law[law > 0].min())  # far from uniform
    assert int((law * B >= 5).sum()) >= 15  # enough cells for the test
    passes = {}
    for K, graphs in ((2, False), (3, "emulate"), (n, False), (n, "emulate")):
        out = speculative_sample(
            model, n, K, order=order.expand(B, n), temperature=temperature, top_p=top_p,
            generator=torch.Generator().manual_seed(K + 7 * bool(graphs)), graphs=graphs,
        )  # fmt: skip
        _check_counts(out, n, 0)
        stats = out.extra["speculative"]
        assert stats.accepted.sum() < stats.drafted.sum()  # rejections happened
        assert _chi2_pvalue(_histogram(out.tokens, V), law * B) > 1e-3, K
        passes[K] = stats.passes.mean()
    assert passes[n] < 0.75 * n  # fewer passes than tokens on the whole
    # Lemma 1 with as many passes (the reference's fixed counts: every step reveals some)
    steps = max(1, round(passes[n]))
    plain = lemma1_sample(
        model, n, steps, reveal="reference", order=order.expand(B, n),
        temperature=temperature, top_p=top_p, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert plain.forward_passes == steps
    assert _chi2_pvalue(_histogram(plain.tokens, V), law * B) < 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_one_token_per_pass_is_the_sequential_sampler(kind: str) -> None:
    """K = 1 draws exactly what sequential_sample draws from the same seed."""
    model = tiny_model(kind)
    a = speculative_sample(model, 12, 1, batch=3, generator=torch.Generator().manual_seed(0))
    b = sequential_sample(model, 12, batch=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.order, b.order) and torch.equal(a.tokens, b.tokens)
    assert a.forward_passes == 12
    _check_counts(a, 12, 0)


# ----------------------------------------------------------------------------- the oracle

_DIFF = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
_SLOW = int(os.environ.get("ANYORDER_SPEC_EXAMPLES", "2000"))


def _requests(n_max: int):
    return dict(
        kind=st.sampled_from(["aogpt", "armd", "aogpt-ref", "sigmagpt-ref"]),
        n=st.one_of(st.integers(2, 10), st.integers(11, n_max)),
        batch=st.integers(1, 4),
        K=st.integers(1, 9),
        prompt=st.sampled_from(["none", "prefix", "scattered", "per-row"]),
        seed=st.integers(0, 2**16),
        path=st.sampled_from(PATHS),
        direct=st.booleans(),
    )


@settings(max_examples=40, derandomize=True, **_DIFF)
@given(**_requests(24))
def test_accepted_tokens_use_the_uncached_logits_of_the_final_order(
    kind, n, batch, K, prompt, seed, path, direct
):
    """Every generated slot was drawn from (or verified against) the logits the uncached
    forward gives at that slot of the final order, whatever was drafted and rejected; on
    the CPU's path, the GPU's (static widths and key levels) and the GPU's captured, its
    lookup tables a row per count or shared (``direct``)."""
    _check_against_oracle(kind, n, batch, K, prompt, seed, path, direct=direct)


@pytest.mark.slow
@settings(max_examples=_SLOW, **_DIFF)
@given(**_requests(60))
def test_accepted_tokens_use_the_uncached_logits_many(
    kind, n, batch, K, prompt, seed, path, direct
):
    _check_against_oracle(kind, n, batch, K, prompt, seed, path, direct=direct)


@settings(max_examples=int(os.environ.get("ANYORDER_SPEC_EXAMPLES", "12")), derandomize=True,
          **_DIFF)  # fmt: skip
@given(**_requests(24), trunk=st.sampled_from(sorted(FAMILY_TRUNKS)))
def test_accepted_tokens_use_the_uncached_logits_on_family_trunks(
    kind, n, batch, K, prompt, seed, path, direct, trunk
):
    """The same on the trunks of Llama 3, Qwen2, Qwen3 and Mistral (issue 33): grouped-query
    attention with caches of the key/value heads, explicit widths, biases, RoPE scaling."""
    if kind.endswith("-ref"):
        kind = kind[: -len("-ref")].replace("sigmagpt", "aogpt")
    _check_against_oracle(kind, n, batch, K, prompt, seed, path, FAMILY_TRUNKS[trunk], direct)


def _check_against_oracle(kind, n, batch, K, prompt, seed, path, trunk=None, direct=True):
    from anyorder.sampling import lookups, rounds

    shape = dict(vocab_size=5, seq_len=64, d_model=32, **(trunk or {}))
    model = _moved(_variant(kind, **shape), seed % 5)
    g = torch.Generator().manual_seed(seed)
    known = torch.zeros(batch, n, dtype=torch.bool)
    if prompt == "prefix":
        known[:, : n // 2] = True
    elif prompt == "scattered":  # the same positions in every row
        known[:, torch.randperm(n, generator=g)[: (n - 1) // 2]] = True
    elif prompt == "per-row":
        for b in range(batch):
            known[b, torch.randperm(n, generator=g)[: (n - 1) // 2]] = True
    tokens = torch.randint(0, 5, (batch, n), generator=g)
    k = int(known[0].sum())
    static = path != "cpu"
    saved, rounds.STATIC_ON_CPU = rounds.STATIC_ON_CPU, path == "static"
    budget = lookups.DIRECT_BYTES
    lookups.DIRECT_BYTES = budget if direct else 0
    try:
        out = speculative_sample(
            model, n, K, batch=batch, prompt=tokens, known=known, generator=g,
            keep_logits=True, graphs="emulate" if path == "captured" else False,
        )  # fmt: skip
    finally:
        rounds.STATIC_ON_CPU, lookups.DIRECT_BYTES = saved, budget
    assert torch.equal(out.tokens[known], tokens[known])
    with torch.no_grad():
        oracle = model(out.tokens, out.order)
    # the family trunks without QK-norm give logits near 10 (weights at 0.5): float32 sums
    # taken in another order (cached or not) then differ by a few 1e-6 of them
    rtol = 1e-5 if trunk else 0
    torch.testing.assert_close(out.logits[:, k:], oracle[:, k:], atol=2e-5, rtol=rtol)
    _check_counts(out, n, k, static)


@pytest.mark.parametrize("kind", KINDS)
def test_rejected_drafts_are_never_seen(kind: str) -> None:
    """Rounds with rejections happen, the replaced drafts are visible to no later query
    (each later conditional equals the oracle's, which never saw them), and the drafts
    each round reports are the slots that follow the commit."""
    model = _moved(tiny_model(kind, vocab_size=5), 3)
    rounds = []
    out = speculative_sample(
        model, 14, 4, batch=4, generator=torch.Generator().manual_seed(5), keep_logits=True,
        on_round=lambda r: rounds.append({k: v.clone() for k, v in r.items()}),
    )  # fmt: skip
    replaced = 0
    for r in rounds:
        for b in range(4):
            m = int(r["accepted"][b])
            real = r["positions"][b] < 14
            if m < int(real.sum()):  # a rejection: the draft at m was replaced
                replaced += 1
                assert int(r["position"][b]) == int(r["positions"][b, m])
    assert replaced > 0
    ref = model(out.tokens, out.order)
    torch.testing.assert_close(out.logits, ref, atol=2e-5, rtol=0)
    _check_counts(out, 14, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_the_hooks_report_token_0_at_the_padding(kind, path, monkeypatch) -> None:
    """A pass's padding slot holds whatever padding drew there (no kernel zeroes it); the
    hooks report its tokens as 0: the steps' padding positions, the verified drafts' past
    ``D`` and a finished row's closing token, and the real ones as decoded."""
    from anyorder.sampling import rounds

    monkeypatch.setattr(rounds, "STATIC_ON_CPU", path == "static")
    n, B = 14, 4
    model = _moved(tiny_model(kind, vocab_size=5), 3)
    g = torch.Generator().manual_seed(1)
    known = torch.zeros(B, n, dtype=torch.bool)
    for b in range(B):  # rows accept different runs, and finish at different passes
        known[b, torch.randperm(n, generator=g)[:5]] = True
    steps, rounds_seen = [], []
    out = speculative_sample(
        model, n, 4, batch=B, prompt=torch.randint(1, 5, (B, n), generator=g), known=known,
        generator=g, graphs="emulate" if path == "captured" else False,
        on_step=lambda p, t, i: steps.append((p.clone(), t.clone())),
        on_round=lambda r: rounds_seen.append({k: v.clone() for k, v in r.items()}),
    )  # fmt: skip
    padded = closed = 0
    for p, t in steps:
        assert (t[p == n] == 0).all()
        real = p < n
        assert torch.equal(t[real], out.tokens.gather(1, p.clamp(max=n - 1))[real])
        padded += int((p == n).sum())
    for r in rounds_seen:
        assert (r["tokens"][r["positions"] == n] == 0).all()
        assert (r["token"][r["position"] == n] == 0).all()
        closed += int((r["position"] == n).sum())
    assert padded > 0 and closed > 0


def test_speculative_errors() -> None:
    with pytest.raises(SamplingError, match="gpt cannot draft positions ahead"):
        speculative_sample(tiny_model("gpt"), 8, 2)
    with pytest.raises(SamplingError, match="must be an integer >= 1"):
        speculative_sample(tiny_model("aogpt"), 8, 0)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    n=st.integers(2, 70), K=st.integers(1, 9), rows=st.lists(st.tuples(
        st.booleans(), st.floats(0, 1, exclude_max=True), st.floats(0, 1)), min_size=1,
        max_size=5), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_the_gpu_paths_lean_tables_are_the_general_ones(n, K, rows, seed) -> None:
    """speculative.spec_gpt_table / spec_armd_table (the GPU's passes after the first)
    equal what speculative._round and rounds.gpt_table / armd_table build for the same rows,
    at random sizes, K, counts c, draft counts D and finished rows, every entry."""
    from anyorder.sampling.lookups import spec_armd_table, spec_gpt_table
    from anyorder.sampling.rounds import armd_table, extend, gpt_table
    from anyorder.sampling.speculative import _round

    g = torch.Generator().manual_seed(seed)
    ext = extend(torch.stack([torch.randperm(n, generator=g) for _ in rows]))
    c, D = [], []
    for live, fc, fd in rows:  # a live row has committed 1..n-1 slots, drafts within room
        ci = 1 + int(fc * (n - 1)) if live else n
        c.append(ci)
        D.append(int(fd * min(K - 1, n - 1 - ci)) if live else 0)
    c, D = torch.tensor(c), torch.tensor(D)
    want = gpt_table(ext, _round(ext, c, c, c, D, K, n), 2 * K - 1)
    assert torch.equal(spec_gpt_table(ext, c, D, K), want)
    want, _ = armd_table(ext, _round(ext, c, c, c - 1, D, K, n), (K, 2 * K - 1))
    assert torch.equal(spec_armd_table(ext, c, D, c < n, K), want)


@pytest.mark.parametrize("armd", [False, True])
def test_the_lookup_tables_do_not_grow_with_n(armd, monkeypatch) -> None:
    """lookups.Counts (what a round after the first looks up by its counts) keeps a row per
    count while that takes at most lookups.DIRECT_BYTES, and past it takes the same bytes
    at any n (K = 16: under 1 MB at n = 4096 and 32,768, where a row per count takes 43 and
    347 MB; lookups.direct_bytes says how much). Its rows at every count equal the
    formulas' (count_codes, After.rows), in the steady counts and the last 2K alike, either
    way."""
    from anyorder.sampling import lookups
    from anyorder.sampling.lookups import Counts, count_codes

    def size(looks):
        tables = (looks.bounds, looks.codes, looks.after.table)
        return sum(t.nbytes for t in tables if t is not None)

    small, big = Counts(64, 16, armd, True, "cpu"), Counts(32768, 16, armd, True, "cpu")
    assert small.direct and not big.direct and not Counts(4096, 16, armd, True, "cpu").direct
    assert size(small) == lookups.direct_bytes(64, 16, armd, True)
    assert size(small) <= lookups.DIRECT_BYTES
    assert size(big) == size(Counts(4096, 16, armd, True, "cpu")) < 2**20
    for budget in (1 << 40, 0):  # a row per count always, never
        monkeypatch.setattr(lookups, "DIRECT_BYTES", budget)
        for n, K in ((4096, 8), (37, 5), (9, 4), (5, 1)):
            looks = Counts(n, K, armd, True, "cpu")
            assert looks.direct == (budget > 0 or lookups.tail_start(n, K) is None)
            c = torch.arange(1, n + 1)
            at = looks.index(c)
            assert torch.equal(looks.codes_at(at, c), count_codes(c, K, n, armd))
            rows = looks.after.rows(c)
            for r in range(K):
                assert torch.equal(looks.after_at(at, c, torch.full_like(c, r)), rows[:, r])


def test_counts_that_break_their_invariants_are_refused() -> None:
    """Every decode's counts are checked as they are made: more passes than tokens, or more
    accepted than drafted, is a sampler bug and raises."""
    import numpy as np

    from anyorder.sampling.speculative import SpeculativeStats

    ok = [np.array([2, 3]), np.array([4, 5]), np.array([3, 5]), np.array([5, 8])]
    SpeculativeStats(*ok)
    for i, bad in ((0, np.array([6, 3])), (2, np.array([5, 5]))):
        counts = list(ok)
        counts[i] = bad
        with pytest.raises(RuntimeError, match="broke their invariants"):
            SpeculativeStats(*counts)


@pytest.mark.parametrize("kind", KINDS)
def test_a_huge_draft_count_acts_as_the_slots_left(kind) -> None:
    """K = 10**30 (a user's typo) decodes as K = the slots to decode: the same tokens, no
    memory asked for K (the passes' widths and the cache grow with K)."""
    from anyorder.sampling.confidence import confidence_sample

    model = _moved(tiny_model(kind, vocab_size=5), 3)
    tokens = torch.randint(0, 5, (2, 12), generator=torch.Generator().manual_seed(0))
    known = torch.zeros(2, 12, dtype=torch.bool)
    known[:, :4] = True
    kw = dict(batch=2, prompt=tokens, known=known)
    for fn in (
        lambda K, g: speculative_sample(model, 12, K, generator=g, **kw),
        lambda K, g: confidence_sample(model, 12, K, speculative=K, subset=K, generator=g, **kw),
        lambda K, g: confidence_sample(model, 12, K, subset=K, generator=g, **kw),
    ):
        a = fn(10**30, torch.Generator().manual_seed(1))
        b = fn(8, torch.Generator().manual_seed(1))
        assert torch.equal(a.tokens, b.tokens) and a.forward_passes == b.forward_passes


# ----------------------------------------------------------------------------- CLI and API


def test_cli_and_api_speculative(tmp_path, capsys) -> None:
    import json

    from anyorder import load
    from anyorder.checkpoint import save_checkpoint
    from anyorder.cli import main
    from anyorder.config import RunConfig
    from anyorder.data import ByteTokenizer

    for kind in KINDS:
        model = tiny_model(kind, vocab_size=257, seq_len=32)
        config = RunConfig(model=model.cfg)
        save_checkpoint(tmp_path / kind, 1, model=model, config=config, tokenizer=ByteTokenizer())

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["sample", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    argv = ["--speculative", "3", "--length", "16", "--num-samples", "2", "--seed", "4"]
    code, out, _ = run(str(tmp_path / "aogpt"), *argv, "--json", "--no-stop-at-eos")
    res = json.loads(out)
    counts = res["speculative"]
    assert code == 0 and res["mode"] == "speculative" and counts["tokens"] == [16, 16]
    assert res["forward_passes"] == max(counts["passes"])
    assert all(p <= t for p, t in zip(counts["passes"], counts["tokens"]))
    # the API draws the same texts from the same seed
    texts = load(tmp_path / "aogpt").generate(
        16, 2, speculative=3, seed=4, stop_at_eos=False
    )  # fmt: skip
    assert texts == [s["text"] for s in res["samples"]]
    # --verbose prints the counts per sample
    code, _, err = run(str(tmp_path / "armd"), *argv, "--verbose")
    assert code == 0 and "speculative:" in err and "sample 2:" in err and " accepted" in err
    # infilling keeps the template's text
    code, out, _ = run(str(tmp_path / "armd"), "--infill", "a[MASK:6]b", "--speculative", "4",
                       "--json")  # fmt: skip
    tokens = json.loads(out)["samples"][0]["tokens"]
    assert code == 0 and tokens[0] == ord("a") and tokens[7] == ord("b") and len(tokens) == 8
    filled = load(tmp_path / "aogpt").infill("x[MASK:5]y", speculative=2)
    assert filled.startswith("x") and filled.endswith("y")
    # errors: one line, exit code 2
    code, _, err = run(str(tmp_path / "aogpt"), "--speculative", "2", "--steps", "4")
    assert code == 2 and err == (
        "anyorder sample: error: --speculative drafts and verifies along one order, one exact "
        "token at a time; leave out --steps/--streams\n"
    )
    code, _, err = run(str(tmp_path / "aogpt"), "--speculative", "0")
    assert code == 2 and err == (
        "anyorder sample: error: --speculative K=0 must be an integer >= 1 (tokens per pass)\n"
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt", [False, True])
def test_gpu_path_pads_and_buckets_into_at_most_eight_shapes(kind, prompt, monkeypatch) -> None:
    """The GPU's path (fixed widths, a few key levels; run here on the CPU) gives the same
    logits as the uncached forward and at most eight attention shapes per decode."""
    import anyorder.sampling.rounds as rounds
    from anyorder.sampling.confidence import confidence_sample

    monkeypatch.setattr(rounds, "STATIC_ON_CPU", True)
    model = _moved(tiny_model(kind, vocab_size=5, seq_len=16), 6)
    n, B = 16, 3
    known = torch.zeros(B, n, dtype=torch.bool)
    if prompt:
        known[:, [0, 4, 9]] = True
    tokens = torch.randint(0, 5, (B, n), generator=torch.Generator().manual_seed(0))
    kw = dict(batch=B, prompt=tokens, known=known, generator=torch.Generator().manual_seed(1))
    for out in (
        speculative_sample(model, n, 4, keep_logits=True, **kw),
        confidence_sample(model, n, speculative=3, keep_logits=True, **kw),
    ):
        k = int(known[0].sum())
        ref = model(out.tokens, out.order)
        torch.testing.assert_close(out.logits[:, k:], ref[:, k:], atol=2e-5, rtol=0)
        assert len(out.extra["attention_shapes"]) <= 8
        _check_counts(out, n, k, static=True)


def test_more_than_max_draft_tokens_a_pass_is_refused() -> None:
    """A K past :data:`MAX_DRAFT` that the slots left do not clip is refused before any
    table is made (the round's lookup tables grow as K**3: K = 1000 would ask ~160 GB)."""
    from anyorder.sampling.speculative import MAX_DRAFT

    model = tiny_model("aogpt", seq_len=2 * MAX_DRAFT + 8)
    with pytest.raises(SamplingError) as e:
        speculative_sample(model, 2 * MAX_DRAFT, 1000)
    assert str(e.value) == (
        f"--speculative K={2 * MAX_DRAFT} drafts more than {MAX_DRAFT} tokens a pass (a "
        f"round's lookup tables grow as K**3, and few drafts pass their tests); use K <= "
        f"{MAX_DRAFT}"
    )
    out = speculative_sample(model, 2 * MAX_DRAFT, MAX_DRAFT)
    assert out.tokens.shape == (1, 2 * MAX_DRAFT)
