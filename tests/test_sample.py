"""The fast samplers against the oracles: cached vs uncached logits, the parallel prediction
mask, strided blocks, Lemma 1's distribution by exact enumeration, infilling, controls."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from anyorder.data import load_tokenizer
from anyorder.errors import SamplingError
from anyorder.orders import strided
from anyorder.sample import (
    decode_text,
    encoder_sample,
    filter_logits,
    infill,
    lemma1_sample,
    naive_sample,
    parse_template,
    reveal_counts,
    reveal_probabilities,
    sample,
    sample_logits,
    sequential_sample,
    strided_sample,
)

from conftest import tiny_model

N = 12


def slot_oracle(model, tokens: torch.Tensor, order: torch.Tensor, step_of: torch.Tensor):
    """Uncached logits (B, n, V) of every decided slot, predicted alone from the slots decided
    in earlier steps (zeros at prompt slots): slot ``t`` decided in a step whose first slot is
    ``d`` is what the model's forward gives at slot ``d`` of the order with ``t`` moved to
    ``d``. One batched forward over every (row, slot)."""
    B, n = tokens.shape
    step_slot = step_of.gather(1, order)
    rows, orders, picks = [], [], []
    for b in range(B):
        first: dict[int, int] = {}
        for t in range(n):
            s = int(step_slot[b, t])
            if s < 0:
                continue
            d = first.setdefault(s, t)
            o = order[b].clone()
            o[d], o[t] = order[b, t], order[b, d]
            rows.append(b)
            orders.append(o)
            picks.append((b, t, d))
    out = torch.zeros(B, n, model.cfg.vocab_size)
    if not rows:
        return out
    with torch.no_grad():
        logits = model(tokens[rows], None if model.kind == "gpt" else torch.stack(orders))
    for i, (b, t, d) in enumerate(picks):
        out[b, t] = logits[i, d]
    return out


# ----------------------------------------------------------------------------- sequential


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd"])
def test_cached_sequential_equals_uncached_at_every_step(kind: str) -> None:
    model = tiny_model(kind)
    a = sequential_sample(
        model, N, batch=3, generator=torch.Generator().manual_seed(0), keep_logits=True
    )
    if kind != "gpt":  # a different random order per row
        assert len({tuple(r) for r in a.order.tolist()}) == 3
    ref = model(a.tokens, None if kind == "gpt" else a.order)
    torch.testing.assert_close(a.logits, ref, atol=1e-5, rtol=0)
    assert a.forward_passes == N
    # the same seed through the naive oracle draws the same order and the same tokens
    b = naive_sample(model, N, batch=3, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.order, b.order) and torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
@pytest.mark.parametrize("where", ["prefix", "suffix", "scattered"])
@pytest.mark.parametrize("shared", [True, False])
def test_prompted_sequential_keeps_the_prompt_and_matches_the_oracle(
    kind: str, where: str, shared: bool
) -> None:
    model = tiny_model(kind)
    idx = {"prefix": [0, 1, 2], "suffix": [9, 10, 11], "scattered": [0, 5, 11]}[where]
    known = torch.zeros(3, N, dtype=torch.bool)
    known[:, idx] = True
    prompt = torch.randint(0, 11, (1 if shared else 3, N), generator=torch.Generator())
    prompt = prompt.expand(3, N)
    out = sequential_sample(
        model,
        N,
        prompt=prompt,
        known=known,
        generator=torch.Generator().manual_seed(1),
        keep_logits=True,
    )
    assert torch.equal(out.tokens[known], prompt[known])
    assert bool(known.gather(1, out.order[:, :3]).all())
    ref = model(out.tokens, out.order)
    torch.testing.assert_close(out.logits[:, 3:], ref[:, 3:], atol=1e-5, rtol=0)
    # a shared prompt is prefilled once (one extra pass at batch 1), then forked
    assert out.forward_passes == N - 3 + (1 if shared else 0)
    assert bool((out.step_of[known] == -1).all()) and bool((out.step_of[~known] >= 0).all())


def test_gpt_prefix_prompt_and_its_limits() -> None:
    model = tiny_model("gpt")
    known = torch.zeros(2, N, dtype=torch.bool)
    known[:, :4] = True
    prompt = torch.randint(0, 11, (2, N), generator=torch.Generator())
    out = sequential_sample(
        model, N, prompt=prompt, known=known, generator=torch.Generator(), keep_logits=True
    )
    assert torch.equal(out.tokens[:, :4], prompt[:, :4])
    torch.testing.assert_close(out.logits[:, 4:], model(out.tokens)[:, 4:], atol=1e-5, rtol=0)
    msg = "gpt generates left to right: give order l2r and a prefix prompt"
    with pytest.raises(SamplingError, match=msg):
        sequential_sample(model, N, order="random", generator=torch.Generator())
    with pytest.raises(SamplingError, match=msg):
        sequential_sample(model, N, prompt=prompt, known=known.flip(1), generator=None)
    with pytest.raises(SamplingError, match="gpt cannot predict several positions per pass"):
        lemma1_sample(model, N, 4)


def test_cache_keeps_explicit_non_monotone_positions_and_forks() -> None:
    model = tiny_model("aogpt")
    order = torch.tensor([[7, 2, 9, 0, 11, 4, 1, 3, 5, 6, 8, 10]])
    tokens = torch.randint(0, 11, (1, N), generator=torch.Generator())
    cache = model.new_cache(1, N)
    x_in, pos_in = model.slot_inputs(tokens, order)
    mask = cache.mask(torch.ones(N, N).tril().bool()[None])
    logits = model.decode(cache, x_in, pos_in, order, mask)
    cache.advance(N, pos=pos_in)
    torch.testing.assert_close(logits, model(tokens, order), atol=1e-5, rtol=0)
    assert cache.pos[0].tolist() == [0, 7, 2, 9, 0, 11, 4, 1, 3, 5, 6, 8]
    forked = cache.fork(3)
    assert forked.length == N and forked.batch == 3
    for layer in range(model.cfg.n_layer):
        assert torch.equal(forked.k[layer][2], cache.k[layer][0])
        assert torch.equal(forked.v[layer][1], cache.v[layer][0])


# ----------------------------------------------------------------------------- parallel


def _prefilled(model, tokens: torch.Tensor, order: torch.Tensor, k: int):
    """A cache holding the first ``k`` slots of ``order`` exactly as training sees them."""
    B = tokens.shape[0]
    causal = torch.ones(k, k).tril().bool()[None].expand(B, k, k)
    cache = model.new_cache(B, 2 * N)
    if model.kind == "armd":
        pos = order[:, :k]
        model.decode(
            cache,
            tokens.gather(1, pos),
            pos,
            pos,
            content_mask=cache.content.mask(causal),
            query_content_mask=cache.content.mask(causal.tril(-1)),
            query_mask=cache.query.mask(causal),
        )
        cache.query.advance(k)
    else:
        x_in, pos_in = model.slot_inputs(tokens, order)
        model.decode(cache, x_in[:, :k], pos_in[:, :k], order[:, :k], cache.mask(causal))
        cache.advance(k)
    return cache


def _queries(model, cache, tokens: torch.Tensor, order: torch.Tensor, k: int, targets, mask):
    """Logits of query slots predicting ``targets`` (B, Q) from the cache of ``k`` slots."""
    B, Q = targets.shape
    if model.kind == "armd":
        empty = torch.zeros(B, 0, dtype=torch.long)
        qmask = None if mask is None else cache.query.mask(mask)
        return model.decode(cache, empty, empty, targets, query_mask=qmask)
    last = order[:, k - 1 : k].expand(B, Q)
    x_in = tokens.gather(1, last)
    return model.decode(cache, x_in, last, targets, None if mask is None else cache.mask(mask))


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_parallel_prediction_mask_equals_each_query_alone(kind: str) -> None:
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(3)
    B, k, Q = 2, 5, 4
    tokens = torch.randint(0, 11, (B, N), generator=g)
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B)])
    cache = _prefilled(model, tokens, order, k)
    targets = order[:, k : k + Q]
    together = _queries(model, cache, tokens, order, k, targets, torch.eye(Q).bool()[None])
    for j in range(Q):
        alone = _queries(model, cache.fork(1), tokens, order, k, targets[:, j : j + 1], None)
        torch.testing.assert_close(together[:, j : j + 1], alone, atol=1e-5, rtol=0)
        # and alone = the uncached model with that target moved to slot k
        o = order.clone()
        o[:, k], o[:, k + j] = order[:, k + j], order[:, k]
        torch.testing.assert_close(alone[:, 0], model(tokens, o)[:, k], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_lemma1_logits_are_the_conditionals_given_earlier_steps(kind: str) -> None:
    """Per-row reveal counts (padded passes), with and without a prompt."""
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(4)
    for steps in (3, 5):
        out = lemma1_sample(model, N, steps, batch=3, generator=g, keep_logits=True)
        assert len({tuple(r) for r in out.counts.T.tolist()}) > 1  # rows differ
        ref = slot_oracle(model, out.tokens, out.order, out.step_of)
        torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)
    shared = lemma1_sample(model, N, 5, batch=3, shared_counts=True, generator=g, keep_logits=True)
    assert len({tuple(r) for r in shared.counts.T.tolist()}) == 1  # one trajectory, no padding
    ref = slot_oracle(model, shared.tokens, shared.order, shared.step_of)
    torch.testing.assert_close(shared.logits, ref, atol=1e-5, rtol=0)
    known = torch.zeros(3, N, dtype=torch.bool)
    known[:, [1, 6, 10]] = True
    prompt = torch.randint(0, 11, (3, N), generator=g)
    out = lemma1_sample(
        model, N, 4, prompt=prompt, known=known, schedule="cosine", generator=g, keep_logits=True
    )
    assert torch.equal(out.tokens[known], prompt[known])
    ref = slot_oracle(model, out.tokens, out.order, out.step_of)
    torch.testing.assert_close(out.logits[:, 3:], ref[:, 3:], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- strided


@pytest.mark.parametrize("streams", [1, 2, 3, 4])
def test_strided_block_parallel_equals_the_blocked_forward(streams: int) -> None:
    model = tiny_model("armd")
    out = strided_sample(
        model, N, streams, batch=2, generator=torch.Generator().manual_seed(5), keep_logits=True
    )
    o = strided(2, N, streams)
    assert torch.equal(out.order, o.order)
    torch.testing.assert_close(
        out.logits, model(out.tokens, o.order, o.model_blocks), atol=1e-5, rtol=0
    )
    assert out.forward_passes == streams + N // streams - 1


@pytest.mark.parametrize(("k", "streams"), [(4, 1), (4, 4), (6, 2), (6, 3)])
@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_strided_after_a_prefix_prompt_equals_the_blocked_forward(
    k: int, streams: int, graphs: bool | str
) -> None:
    model = tiny_model("armd")
    prompt = torch.randint(0, 11, (2, N), generator=torch.Generator().manual_seed(1))
    known = torch.arange(N).expand(2, N) < k
    out = strided_sample(
        model, N, streams, prompt=prompt, known=known, keep_logits=True,
        generator=torch.Generator().manual_seed(5), graphs=graphs,
    )  # fmt: skip
    o = strided(2, N - k, streams)  # the streams cut the N - k positions after the prompt
    order = torch.cat([torch.arange(k).expand(2, k), o.order + k], dim=1)
    blocks = torch.cat([torch.arange(k).expand(2, k), o.blocks + k], dim=1)
    assert torch.equal(out.order, order) and torch.equal(out.tokens[:, :k], prompt[:, :k])
    torch.testing.assert_close(
        out.logits[:, k:], model(out.tokens, order, blocks)[:, k:], atol=1e-5, rtol=0
    )
    assert out.forward_passes == streams + (N - k) // streams - 1
    with pytest.raises(SamplingError, match="strided decoding takes a prefix prompt"):
        strided_sample(model, N, 2, prompt=prompt, known=known.flip(1))


# ----------------------------------------------------------------------------- Lemma 1


def _peaked(kind: str, seed: int):
    """A tiny real model with large random weights: sharp, context-dependent conditionals
    (at init they are nearly uniform, which would hide conditioning mistakes)."""
    model = tiny_model(kind, vocab_size=3, seq_len=3, n_layer=2, d_model=16, n_head=2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


@torch.no_grad()
def _exact_reverse_process(model, n: int, steps: int):
    """Exact law of (count trajectory, sample) of Lemma-1 sampling with a uniform order."""
    V = model.cfg.vocab_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))  # (V^n, n)
    probs_p = reveal_probabilities(steps)
    traj_p = {}
    for c in _compositions(n, steps):
        p, left = 1.0, n
        for ci, pi in zip(c, probs_p):
            p *= math.comb(left, ci) * pi**ci * (1 - pi) ** (left - ci)
            left -= ci
        if p > 0:
            traj_p[c] = p
    sample_p = torch.zeros(len(seqs), dtype=torch.float64)
    perms = list(itertools.permutations(range(n)))
    for sigma in perms:
        # cond[(d, j)]: (V^n,) probability of x[sigma[d+j]] from slots < d (alone at slot d)
        cond = {}
        for d in range(n):
            for j in range(n - d):
                o = list(sigma)
                o[d], o[d + j] = sigma[d + j], sigma[d]
                order = torch.tensor(o).expand(len(seqs), n)
                logp = model(seqs, order)[:, d].double().log_softmax(-1)
                cond[d, j] = logp.gather(1, seqs[:, sigma[d + j], None])[:, 0].exp()
        for c, pc in traj_p.items():
            p, d = torch.ones(len(seqs), dtype=torch.float64), 0
            for ci in c:
                for j in range(ci):
                    p = p * cond[d, j]
                d += ci
            sample_p += pc / len(perms) * p
    return seqs, traj_p, sample_p


def _chi2_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value, cells with expected count < 5 pooled into one."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_lemma1_matches_the_exact_reverse_process(kind: str) -> None:
    """Counts per step and final samples against exact enumeration, on a fixed seed."""
    model = _peaked(kind, seed=7)
    n, steps, B = 3, 3, 20000
    seqs, traj_p, sample_p = _exact_reverse_process(model, n, steps)
    assert float(sample_p.sum()) == pytest.approx(1.0, abs=1e-9)
    assert float(sample_p.max()) > 3 * float(sample_p.min())  # far from uniform
    with torch.no_grad():
        out = lemma1_sample(model, n, steps, batch=B, generator=torch.Generator().manual_seed(8))
    # count trajectories
    trajs = list(traj_p)
    seen = [tuple(c) for c in out.counts.T.tolist()]
    obs = torch.tensor([seen.count(c) for c in trajs], dtype=torch.float64)
    assert sum(obs) == B
    exp = torch.tensor([traj_p[c] for c in trajs], dtype=torch.float64) * B
    assert _chi2_pvalue(obs, exp) > 1e-3
    # final samples
    index = (out.tokens * torch.tensor([9, 3, 1])).sum(1)
    obs = torch.bincount(index, minlength=len(seqs)).double()
    assert _chi2_pvalue(obs, sample_p * B) > 1e-3
    # one pass per step in which some row revealed a token
    assert out.forward_passes == int((out.counts.sum(1) > 0).sum()) <= min(steps, n)


def test_aogpt_with_queries_at_targets_decodes_like_its_forward() -> None:
    """``rope_query=target`` rotates each query to the position it predicts: the cached
    samplers (sequential, and Lemma 1 with padded passes) give the uncached logits."""
    model = tiny_model("aogpt", pos_emb="rope", rope_query="target")
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in model.parameters():  # adaLN off zero, so the targets matter both ways
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    a = sequential_sample(model, N, batch=3, generator=g, keep_logits=True)
    torch.testing.assert_close(a.logits, model(a.tokens, a.order), atol=1e-5, rtol=0)
    out = lemma1_sample(model, N, 4, batch=3, generator=g, keep_logits=True)
    ref = slot_oracle(model, out.tokens, out.order, out.step_of)
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_lemma1_compacted_and_packed_passes_keep_every_conditional(kind: str, monkeypatch) -> None:
    """Per-row counts pad the passes, and rows keep different numbers of entries (each row's
    own slots in the static cache, so no gaps to compact). Running only the real entries
    through the per-entry layers (packing, forced on every pass) changes no logit (atol 1e-5
    against the uncached oracle)."""
    import anyorder.sampling.plan as plan_mod
    from anyorder.layers import Packing

    calls = {"pack": 0}
    pack = Packing.pack

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(Packing, "pack", counted("pack", pack))
    monkeypatch.setattr(plan_mod, "_PACK_BELOW", 1.0)
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(5)
    out = lemma1_sample(model, N, N, batch=4, generator=g, keep_logits=True)
    ref = slot_oracle(model, out.tokens, out.order, out.step_of)
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=0)
    assert calls["pack"] > 0
    # with prompts: scattered known positions per row, and one prompt shared by every row
    # (prefilled once on one row, then forked)
    known = torch.zeros(4, N, dtype=torch.bool)
    known[:, [0, 5, 9]] = True
    prompt = torch.randint(0, 11, (4, N), generator=g)
    for p in (prompt, prompt[:1]):
        out = lemma1_sample(
            model, N, N - 3, prompt=p, known=known, batch=4, generator=g, keep_logits=True
        )
        assert torch.equal(out.tokens[known], p.expand(4, N)[known])
        ref = slot_oracle(model, out.tokens, out.order, out.step_of)
        torch.testing.assert_close(out.logits[:, 3:], ref[:, 3:], atol=1e-5, rtol=0)


def test_packed_decode_equals_the_padded_one() -> None:
    from anyorder.layers import Packing

    model = tiny_model("aogpt")
    g = torch.Generator().manual_seed(6)
    B, k, Q = 3, 4, 5
    tokens = torch.randint(0, 11, (B, N), generator=g)
    order = torch.stack([torch.randperm(N, generator=g) for _ in range(B)])
    real = torch.rand(B, Q, generator=g) < 0.5
    real[:, 0] = True
    new = torch.eye(Q).bool()[None] & real[:, None, :] | torch.eye(Q).bool()[None]
    last = order[:, k - 1 : k].expand(B, Q)
    x_in, targets = tokens.gather(1, last), order[:, k : k + Q]
    logits = []
    for packing in (None, Packing(real.flatten().nonzero()[:, 0], B, Q)):
        cache = _prefilled(model, tokens, order, k)
        logits.append(
            model.decode(cache, x_in, last, targets, cache.mask(new), queries=Q, packing=packing)
        )
    torch.testing.assert_close(logits[1][real], logits[0][real], atol=1e-5, rtol=0)
    assert bool((~real).any()) and bool((logits[1][~real] == 0).all())  # padding: zeros


def test_cache_compaction_moves_the_kept_slots_to_the_front() -> None:
    from anyorder.cache import KVCache

    g = torch.Generator().manual_seed(7)
    cache = KVCache(2, batch=2, capacity=8)
    for layer in range(2):
        cache.write(
            layer, torch.randn(2, 3, 6, 4, generator=g), torch.randn(2, 3, 6, 4, generator=g)
        )
    keep = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 1, 0, 0, 1, 0]], dtype=torch.bool)
    cache.advance(6, keep, torch.arange(6).expand(2, 6) + 10)
    before = [(t.clone(), u.clone()) for t, u in zip(cache.k, cache.v, strict=True)]
    index = torch.tensor([[0, 2, 3], [1, 4, 0]])
    real = torch.tensor([[True, True, True], [True, True, False]])
    cache.compact(index, real, dense=False)
    assert cache.length == 3 and not cache.dense
    assert cache.pos[:, :3].tolist() == [[10, 12, 13], [11, 14, 10]]
    assert cache.valid[:, :3].tolist() == real.tolist()
    for layer, (k0, v0) in enumerate(before):
        for b in range(2):
            assert torch.equal(cache.k[layer][b, :, :3], k0[b, :, index[b]])
            assert torch.equal(cache.v[layer][b, :, :3], v0[b, :, index[b]])


def test_lemma1_plan_keeps_the_cache_near_n_with_per_row_counts() -> None:
    """T = n = 256, 16 rows of per-row counts: a padded cache that appends every pass's
    busiest row grows to about 3n slots; our plan places each row's kept entries at that
    row's own next slots (no gaps, so no compaction), and the cache stays at n plus one
    pass's width."""
    import numpy as np

    from anyorder.cache import BIG
    from anyorder.sampling.plan import G_KEEP, G_SLOT, Plan
    from anyorder.sampling.schedules import draw_reveals

    reveals = draw_reveals(256, 256, 16, generator=torch.Generator().manual_seed(0))
    counts = reveals.counts
    plan = Plan(False, 16, 256, 0, counts, reveals.step)
    assert plan.capacity <= 384
    plan.ship(torch.stack([torch.randperm(256) for _ in range(16)]))
    # every row's kept entries sit at slots 0, 1, 2, ... in the order they were kept
    filled = np.zeros(16, dtype=np.int64)
    for p in plan.passes:
        tab = plan.groups[p.group].table[p.index].numpy()
        kept = tab[:, G_KEEP] != BIG
        for b in range(16):
            slots = tab[b, G_SLOT][kept[b]]
            assert np.array_equal(slots, filled[b] + np.arange(len(slots)))
            filled[b] += len(slots)
    # a row keeps each of its slots once (the extra tokens of its last step are never
    # written: nothing reads them)
    last = np.array([c[c > 0][-1] for c in counts.T])
    assert np.all(filled <= 256) and np.all(filled >= 256 - last)
    packed = [p for p in plan.passes if p.pack is not None]
    assert len(packed) > len(plan.passes) // 2
    assert np.all(counts.sum(axis=0) == 256)
    assert len(plan.shapes()) <= 8


def test_lemma1_passes_are_the_nonempty_steps() -> None:
    model = tiny_model("aogpt")
    for seed in range(6):
        for steps in (2, 5, 12, 40):
            out = lemma1_sample(model, 8, steps, generator=torch.Generator().manual_seed(seed))
            nonempty = int((out.counts[:, 0] > 0).sum())
            assert out.forward_passes == nonempty <= min(steps, 8)
            assert int(out.counts.sum()) == 8


def test_reveal_counts_follow_the_schedule() -> None:
    assert reveal_probabilities(4) == pytest.approx([0.25, 1 / 3, 0.5, 1.0])
    c = reveal_counts(10, 4, 5000, "linear", torch.Generator().manual_seed(0)).double()
    assert bool((c.sum(0) == 10).all())
    # first step: Binomial(10, 1/4)
    assert float(c[0].mean()) == pytest.approx(2.5, abs=0.06)
    # cosine: m(t) = cos((1 - t) pi / 2) (the reference code's; was the mirror image), so the
    # first of two steps (t = 1 -> s = 1/2) reveals 1 - m(1/2) = 1 - cos(pi / 4): few early
    cos = reveal_probabilities(2, "cosine")
    assert cos[0] == pytest.approx(1 - math.cos(math.pi / 4))
    with pytest.raises(SamplingError, match="schedule 'cubic' is unknown"):
        reveal_probabilities(3, "cubic")


# ----------------------------------------------------------------------------- encoder


def test_encoder_sampler_conditionals_prompt_and_passes() -> None:
    model = tiny_model("mdm")
    known = torch.zeros(2, N, dtype=torch.bool)
    known[:, [3, 8]] = True
    prompt = torch.randint(0, 11, (2, N), generator=torch.Generator())
    out = encoder_sample(
        model,
        N,
        steps=5,
        prompt=prompt,
        known=known,
        generator=torch.Generator().manual_seed(2),
        keep_logits=True,
    )
    assert torch.equal(out.tokens[known], prompt[known])
    assert out.forward_passes == int((out.counts.sum(1) > 0).sum())
    for b in range(2):  # each token drawn from denoise(x with the earlier steps visible)
        for pos in (~known[b]).nonzero()[:, 0].tolist():
            s = int(out.step_of[b, pos])
            vis = (out.step_of[b] < s) & (out.step_of[b] >= -1)
            x_t = torch.where(vis, out.tokens[b], model.mask_id)
            slot = int((out.order[b] == pos).nonzero())
            want = model.denoise(x_t[None])[0, pos]
            torch.testing.assert_close(out.logits[b, slot], want, atol=1e-5, rtol=0)
    one = encoder_sample(model, N, generator=torch.Generator())
    assert one.forward_passes == N


# ----------------------------------------------------------------------------- controls


@pytest.mark.parametrize("kind", ["aogpt", "armd", "mdm"])
def test_same_seed_same_sample_and_supports_respected(kind: str) -> None:
    model = tiny_model(kind)
    kw = dict(batch=4, temperature=0.8, top_k=3, steps=6 if kind == "mdm" else None)
    a = sample(model, N, generator=torch.Generator().manual_seed(9), keep_logits=True, **kw)
    b = sample(model, N, generator=torch.Generator().manual_seed(9), **kw)
    c = sample(model, N, generator=torch.Generator().manual_seed(10), **kw)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.order, b.order)
    assert not torch.equal(a.tokens, c.tokens)
    drawn = a.tokens.gather(1, a.order)
    support = ~torch.isinf(filter_logits(a.logits.double() / 0.8, top_k=3))
    assert bool(support.gather(2, drawn[..., None]).all())
    assert int(support.sum(-1).max()) == 3
    p = sample(model, N, top_p=0.5, generator=torch.Generator(), keep_logits=True, **kw)
    support = ~torch.isinf(filter_logits(p.logits.double() / 0.8, top_k=3, top_p=0.5))
    assert bool(support.gather(2, p.tokens.gather(1, p.order)[..., None]).all())


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_draws_are_sample_logits_float64_draws(kind: str) -> None:
    """Replaying the recorded logits through ``sample_logits`` (float64) with the same
    generator gives the same tokens: the sampler draws exactly that way."""
    model = tiny_model(kind)
    order = torch.stack(
        [torch.randperm(N, generator=torch.Generator().manual_seed(i)) for i in (0, 1)]
    )
    out = sequential_sample(
        model, N, order=order, temperature=1.3, top_p=0.9,
        generator=torch.Generator().manual_seed(11), keep_logits=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(11)
    for t in range(N):
        tok = sample_logits(out.logits[:, t], g, temperature=1.3, top_p=0.9)
        assert torch.equal(tok, out.tokens.gather(1, order[:, t : t + 1])[:, 0])


def test_stop_at_eos_truncates_left_to_right() -> None:
    model = tiny_model("gpt")
    eos = 4
    full = sequential_sample(model, N, batch=2, generator=torch.Generator().manual_seed(1))
    first = [row.index(eos) for row in full.tokens.tolist()]
    assert max(first) <= 7  # this seed: both rows draw EOS within 8 steps (checked every 8)
    out = sequential_sample(
        model, N, batch=2, generator=torch.Generator().manual_seed(1), stop_at_eos=eos
    )
    for b, f in enumerate(first):
        assert torch.equal(out.tokens[b, : f + 1], full.tokens[b, : f + 1])
        assert bool((out.tokens[b, f:] == eos).all())
    assert out.forward_passes < N
    assert bool((out.step_of[:, -1] == -2).all())  # never generated
    with pytest.raises(SamplingError, match="stop at EOS needs a left-to-right order"):
        sequential_sample(tiny_model("aogpt"), N, stop_at_eos=eos, generator=torch.Generator())


def test_stop_at_eos_keeps_a_prompt_that_holds_eos() -> None:
    """Issue 32 (4): the prompt [5, 6, 3, 7, 8, 9] with EOS = 3 came back as [5, 6, 3, 3, ...].
    Only a generated EOS ends a row; the rest of the row is EOS, never generated (step -2,
    zero logits), whichever pass the loop stopped at. The expectation is built from the same
    seed's sample without the stop, which draws the same tokens up to each row's EOS."""
    model, eos = tiny_model("gpt"), 3
    prompt = torch.tensor([5, 6, 3, 7, 8, 9] + [0] * 6)
    known = torch.arange(N) < 6
    kw = dict(batch=2, prompt=prompt, known=known, keep_logits=True)
    full = sequential_sample(model, N, generator=torch.Generator().manual_seed(17), **kw)
    out = sequential_sample(
        model, N, generator=torch.Generator().manual_seed(17), stop_at_eos=eos, **kw
    )
    first = [6 + row[6:].index(eos) for row in full.tokens.tolist()]
    assert first == [10, 7]  # this seed: the rows end at different steps
    for b, f in enumerate(first):
        drawn = full.tokens[b, 6 : f + 1].tolist()  # up to and with the EOS
        assert out.tokens[b].tolist() == [5, 6, 3, 7, 8, 9] + drawn + [eos] * (N - 1 - f)
        assert out.step_of[b].tolist() == [-1] * 6 + list(range(f - 5)) + [-2] * (N - 1 - f)
        torch.testing.assert_close(out.logits[b, : f + 1], full.logits[b, : f + 1])
        assert bool((out.logits[b, f + 1 :] == 0).all())


def test_stop_at_eos_along_holes_keeps_known_text_after_them() -> None:
    """Known tokens after the holes (EOS among them) stay; the holes after a row's first
    generated EOS are EOS. Any other order, and the samplers that would ignore the stop,
    refuse it."""
    model, eos = tiny_model("aogpt"), 3
    known = torch.zeros(N, dtype=torch.bool)
    known[[0, 1, 8, 9, 11]] = True
    prompt = torch.tensor([4, 3, 0, 0, 0, 0, 0, 0, 3, 5, 0, 3])
    kw = dict(order="l2r", batch=3, prompt=prompt, known=known)
    full = sequential_sample(model, N, generator=torch.Generator().manual_seed(2), **kw)
    out = sequential_sample(
        model, N, generator=torch.Generator().manual_seed(2), stop_at_eos=eos, **kw
    )
    holes = [2, 3, 4, 5, 6, 7, 10]
    ended = 0
    for b in range(3):
        hits = [p for p in holes if int(full.tokens[b, p]) == eos]
        after = [p for p in holes if hits and p > hits[0]]
        ended += bool(after)
        want = full.tokens[b].clone()
        want[after] = eos
        assert torch.equal(out.tokens[b], want)
        assert [p for p in range(N) if out.step_of[b, p] == -2] == after
    assert ended >= 1  # this seed: a row ends inside the holes
    with pytest.raises(SamplingError, match=r"stop at EOS needs a left-to-right order \(order="):
        sequential_sample(model, N, prompt=prompt, known=known, stop_at_eos=eos)
    refusal = (
        "stop at EOS is for one-token-per-pass decoding (no steps, no streams, not mdm); "
        "truncate the text at EOS instead"
    )
    for m, extra in [(model, dict(steps=4)), (tiny_model("armd"), dict(streams=2))]:
        with pytest.raises(SamplingError, match=re.escape(refusal)):
            sample(m, N, stop_at_eos=eos, generator=torch.Generator(), **extra)
    with pytest.raises(SamplingError, match=re.escape(refusal)):
        sample(tiny_model("mdm"), N, stop_at_eos=eos, generator=torch.Generator())


def test_dispatch_errors() -> None:
    armd, aogpt = tiny_model("armd"), tiny_model("aogpt")
    with pytest.raises(SamplingError, match="give steps .* or streams .*, not both"):
        sample(armd, N, steps=3, streams=2)
    with pytest.raises(SamplingError, match="strided block-parallel decoding is ARMD's"):
        sample(aogpt, N, streams=2)
    with pytest.raises(SamplingError, match="streams S=5 does not divide the sequence length"):
        sample(armd, N, streams=5)
    with pytest.raises(SamplingError, match="the strided order needs a number of streams"):
        sample(armd, N, order="strided")
    for streams in (2.0, True):  # a TypeError from torch; True ran as S=1
        message = f"streams S={streams} must be a whole number, at least 1 (S tokens per pass"
        with pytest.raises(SamplingError, match=re.escape(message)):
            sample(armd, N, streams=streams)
    with pytest.raises(SamplingError, match="length n=17 must lie in 1..16"):
        sample(armd, 17)
    with pytest.raises(SamplingError, match="steps=0 must be at least 1"):
        sample(armd, N, steps=0)


# ----------------------------------------------------------------------------- infilling

BYTES = load_tokenizer("bytes")


def test_parse_template_grammar() -> None:
    tokens, known = parse_template("ab[MASK:3]c[MASK:1]", BYTES)
    assert tokens.tolist() == [97, 98, 0, 0, 0, 99, 0]
    assert known.tolist() == [True, True, False, False, False, True, False]
    tokens, known = parse_template("[MASK:2] [x]", BYTES)
    assert known.tolist() == [False, False, True, True, True, True]


@pytest.mark.parametrize(
    "template, message",
    [
        ("no holes here", "the template has no hole; mark the text to fill with [MASK:n]"),
        ("a [MASK:4", "unterminated hole at character 2 of the template; close it as [MASK:n]"),
        ("a [MASK:0] b", "bad hole '[MASK:0]' at character 2; write [MASK:n] with a whole number"),
        ("[MASK:x]", "bad hole '[MASK:x]' at character 0; write [MASK:n] with a whole number"),
        ("[MASK] b", "bad hole '[MASK]' at character 0; write [MASK:n] with a whole number"),
        ("abcdefgh [MASK:9]", "the template is 18 tokens, longer than the model's context (16)"),
        ("[MASK:99]", "hole [MASK:99] is longer than the model's context (16 tokens)"),
    ],
)
def test_parse_template_errors(template: str, message: str) -> None:
    with pytest.raises(SamplingError, match=re.escape(message)):
        parse_template(template, BYTES, max_len=16)


@pytest.mark.parametrize(
    "template, message",
    [
        (
            "[MASK:3" + "x" * 60000 + "]",
            "bad hole '[MASK:3xxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxx]' at character "
            "0; write [MASK:n] with a whole number n >= 1",
        ),
        (
            "a[MASK:3" + "x" * 60000 + "[MASK:2]",
            "holes overlap at character 1 of the template ('[MASK:3xxxxxxxxxxxxxxxxxxxx..."
            "xxxxxxxxxxxxxxxxxxxx[MASK:2]'); put them side by side, e.g. [MASK:3][MASK:2]",
        ),
    ],
)
def test_a_bad_hole_is_quoted_cut(template: str, message: str) -> None:
    """The text up to the next "]" was quoted whole: a 60,000-character error line (and a
    60 KB answer from anyorder serve)."""
    with pytest.raises(SamplingError) as e:
        parse_template(template, BYTES, max_len=16)
    assert str(e.value) == message


def test_a_template_over_the_context_is_refused_before_it_is_built() -> None:
    """5,900 holes of the context's width fit in a 64 KiB request: they are counted, not
    laid out as 48 million ids (about 700 MB) before the length check refuses them."""
    import tracemalloc

    template = "[MASK:8192]" * 5900
    tracemalloc.start()
    try:
        with pytest.raises(SamplingError) as e:
            parse_template(template, BYTES, max_len=8192)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value) == (
        "the template is 48332800 tokens, longer than the model's context (8192); shorten "
        "the text or the holes"
    )
    assert peak < 10_000_000


@pytest.mark.parametrize("kind", ["aogpt", "armd", "mdm"])
def test_infill_never_changes_the_known_text(kind: str) -> None:
    model = tiny_model(kind, vocab_size=257, seq_len=64)
    for template, steps in [
        ("The [MASK:6] of Python", None),  # scattered: text on both sides
        ("[MASK:5] end.", None),  # suffix known
        ("Start: [MASK:7]", 3),  # prefix known, Lemma-1 / encoder steps
    ]:
        texts = infill(
            model, BYTES, template, num_samples=3, steps=steps,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        assert len(texts) == 3
        head, tail = template.split("[MASK:")[0], template.split("]")[-1]
        for text in texts:
            assert text.startswith(head) and text.endswith(tail)
    tokens, known = parse_template("a[MASK:3]b[MASK:2]c", BYTES)
    out = sample(model, len(tokens), prompt=tokens, known=known, batch=4, generator=None)
    assert bool((out.tokens[:, known] == tokens[known]).all())


def test_infill_with_gpt_fills_only_the_end() -> None:
    model = tiny_model("gpt", vocab_size=257, seq_len=64)
    (text,) = infill(model, BYTES, "Hello [MASK:5]", generator=torch.Generator())
    assert text.startswith("Hello ")
    with pytest.raises(SamplingError, match="gpt generates left to right"):
        infill(model, BYTES, "[MASK:5] world", generator=torch.Generator())


def test_decode_text_cuts_at_eos() -> None:
    ids = torch.tensor([72, 105, 256, 65, 66])
    assert decode_text(BYTES, ids) == "HiAB"
    assert decode_text(BYTES, ids, eos_id=256) == "Hi"
    # a prompt's EOS ends nothing: the text is cut at the first generated one
    ids = torch.tensor([72, 256, 105, 65, 256, 66])
    known = torch.tensor([True, True, True, False, False, False])
    assert decode_text(BYTES, ids, eos_id=256, known=known) == "HiA"


# ----------------------------------------------------------------------------- CLI


def _save_run(run, kind: str) -> None:
    from anyorder.checkpoint import save_checkpoint
    from anyorder.config import RunConfig

    model = tiny_model(kind, vocab_size=257, seq_len=32)
    save_checkpoint(run, 1, model=model, config=RunConfig(model=model.cfg), tokenizer=BYTES)


def test_cli_sample(tmp_path, capsys) -> None:
    import json

    from anyorder.cli import main

    for kind in ("gpt", "aogpt", "armd"):
        _save_run(tmp_path / kind, kind)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["sample", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    # streamed left-to-right text = the text of the same sample in --json
    code, streamed, err = run(str(tmp_path / "gpt"), "--prompt", "Hi", "--length", "16")
    assert code == 0 and streamed.startswith("Hi") and "forward passes" in err
    code, out, _ = run(str(tmp_path / "gpt"), "--prompt", "Hi", "--length", "16", "--json")
    (s,) = json.loads(out)["samples"]
    assert streamed == s["text"] + "\n" and s["tokens"][:2] == [72, 105]
    # Lemma 1: one pass per non-empty step
    code, out, _ = run(str(tmp_path / "aogpt"), "--steps", "5", "--length", "12", "--json")
    res = json.loads(out)
    (counts,) = res["counts"]
    assert res["mode"] == "lemma1" and sum(counts) == 12
    assert res["forward_passes"] == sum(c > 0 for c in counts)
    # infilling keeps the template's text
    code, out, _ = run(str(tmp_path / "armd"), "--infill", "a[MASK:4]b", "--json", "--seed", "2")
    tokens = json.loads(out)["samples"][0]["tokens"]
    assert tokens[0] == ord("a") and tokens[5] == ord("b") and len(tokens) == 6
    # strided: S + n/S - 1 passes, several samples
    argv = [str(tmp_path / "armd"), "--streams", "4", "--length", "16", "--num-samples", "2"]
    code, out, _ = run(*argv, "--json")
    res = json.loads(out)
    assert res["forward_passes"] == 4 + 4 - 1 and len(res["samples"]) == 2
    code, out, _ = run(*argv)
    assert out.startswith("=== sample 1 ===\n") and "=== sample 2 ===" in out
    # user errors: one line, exit code 2
    code, _, err = run(str(tmp_path / "aogpt"), "--infill", "no holes")
    assert code == 2 and err == (
        "anyorder sample: error: the template has no hole; mark the text to fill with [MASK:n]\n"
    )
    code, _, err = run(str(tmp_path / "armd"), "--order", "strided")
    assert code == 2 and err == "anyorder sample: error: --order strided needs --streams S\n"
    code, _, err = run(str(tmp_path / "gpt"), "--steps", "4")
    assert code == 2 and "a gpt run samples left to right, one token per pass" in err


def test_cli_sample_refusals_name_what_works(tmp_path, capsys) -> None:
    from anyorder.cli import main

    for kind in ("gpt", "aogpt"):
        _save_run(tmp_path / kind, kind)

    def err(*argv: str) -> str:
        code = main(["sample", *argv, "--length", "8"])
        out = capsys.readouterr()
        assert code == 2 and out.out == "", (code, out)
        return out.err

    gpt = (
        "a gpt run samples left to right, one token per pass: leave out {} (--prompt gives a "
        "prefix); parallel decoding needs an aogpt, armd or mdm run (--steps T), strided "
        "decoding an armd run (--streams S)"
    )
    head = "anyorder sample: error: "
    # no circle: each refusal names flags that work, and none of them is refused in turn
    run = str(tmp_path / "gpt")
    assert err(run, "--order", "strided") == head + gpt.format("--order strided") + "\n"
    assert err(run, "--steps", "4") == head + gpt.format("--steps") + "\n"
    assert (
        err(run, "--streams", "2", "--steps", "2") == head + gpt.format("--streams, --steps") + "\n"
    )
    assert main(["sample", run, "--length", "8", "--prompt", "ab"]) == 0
    capsys.readouterr()
    assert err(str(tmp_path / "aogpt"), "--streams", "2") == head + (
        "strided decoding is ARMD's and this is a aogpt run; for parallel decoding use "
        "--steps T (or sample one token per pass: leave out --order strided/--streams)\n"
    )
    # step-shaping flags without --steps were silently ignored: refused, naming --steps
    run = str(tmp_path / "aogpt")
    assert err(run, "--reveal", "reference") == head + (
        "--reveal shapes --steps sampling, which was not asked for; add --steps T, or leave it "
        "out\n"
    )
    assert err(run, "--schedule", "cosine", "--shared-counts") == head + (
        "--schedule and --shared-counts shape --steps sampling, which was not asked for; add "
        "--steps T, or leave them out\n"
    )
    code = main(["sample", run, "--length", "8", "--steps", "3", "--reveal", "reference"])
    assert code == 0


# ----------------------------------------------------------------------------- draws


def test_top_p_rules_nucleus_and_the_reference_code() -> None:
    """probs 0.5, 0.3, 0.15, 0.05 (cumulative 0.5, 0.8, 0.95, 1): at p = 0.7 the nucleus
    keeps the token that crosses p (two kept), the reference code's
    top_p_sampling_from_probs drops it (one kept); the top token always stays."""
    from anyorder.sampling.draws import filter_logits, top_p_rule

    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).log()

    def kept(p: float) -> int:
        return int(torch.isfinite(filter_logits(logits, top_p=p)).sum())

    ps = (0.3, 0.7, 0.85, 0.97, 0.99)
    assert [kept(p) for p in ps] == [1, 2, 3, 4, 4]
    with top_p_rule("reference"):
        assert [kept(p) for p in ps] == [1, 1, 2, 3, 3]
    assert kept(0.7) == 2  # the rule ends with its block
    msg = "top-p rule 'hf': use one of nucleus, reference"
    with pytest.raises(SamplingError, match=msg), top_p_rule("hf"):
        pass


def test_draws_are_made_in_chunks_of_bounded_size(monkeypatch) -> None:
    """A draw's float64 tensors cover at most DRAW_ELEMENTS values at a time; drawing in
    chunks consumes the generator row after row, so the tokens are the ones a single
    draw gives."""
    import anyorder.sampling.draws as draws

    logits = torch.randn(5, 33, 97, generator=torch.Generator().manual_seed(0))
    whole = [
        draws.sample_logits(logits, torch.Generator().manual_seed(1), t, k, p)
        for t, k, p in [(1.0, None, None), (0.7, 9, None), (1.3, None, 0.9)]
    ]
    seen = []
    real = draws.filter_logits
    monkeypatch.setattr(draws, "filter_logits", lambda x, *a: seen.append(x.numel()) or real(x, *a))
    monkeypatch.setattr(draws, "DRAW_ELEMENTS", 97 * 8)
    for want, (t, k, p) in zip(whole, [(1.0, None, None), (0.7, 9, None), (1.3, None, 0.9)]):
        got = draws.sample_logits(logits, torch.Generator().manual_seed(1), t, k, p)
        assert torch.equal(got, want)
    assert max(seen) <= 97 * 8 and len(seen) == 3 * -(-5 * 33 // 8)
