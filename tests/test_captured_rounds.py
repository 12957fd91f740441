"""Issue 41, item 2: speculative rounds captured as CUDA graphs. The randoms drawn ahead give
the live draws' tokens bit for bit, and the captured decode (``graphs="emulate"``: the
replay's bookkeeping without a graph) equals the eager decode of the same widths bit for bit:
tokens, steps, logits, counts and every hook's stream, at random sizes, batches, orders,
prompts, controls and K. (Its law and its logits against the uncached forward:
tests/test_speculative.py, whose exact-law and oracle tests draw the captured path too.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyorder.sampling import rounds
from anyorder.sampling.graphs import RoundRunner
from anyorder.sampling.speculative import speculative_sample
from anyorder.sampling.verify import AheadRandoms, LiveRandoms, accept

from conftest import tiny_model


def _moved(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@settings(max_examples=60, derandomize=True, deadline=None)
@given(
    B=st.integers(1, 5), Kd=st.integers(0, 6), V=st.integers(2, 300),
    seed=st.integers(0, 2**16), zeros=st.booleans(),
)  # fmt: skip
def test_randoms_drawn_ahead_are_the_live_draws(B, Kd, V, seed, zeros) -> None:
    """A pass's uniforms and picks drawn ahead (``AheadRandoms``) equal those drawn as
    needed (``torch.rand``, then ``torch.multinomial``: the exponential race), bit for bit,
    unnormalised rows and zero probabilities included."""
    g = torch.Generator().manual_seed(seed)
    close = torch.rand(B, V, generator=g, dtype=torch.float64) * 3
    drafts = torch.rand(B, Kd, V, generator=g, dtype=torch.float64).softmax(-1)
    if zeros:  # whole stretches of a row impossible (top-k, top-p, a residual)
        close[:, : V // 2] = 0
    live = LiveRandoms(torch.Generator().manual_seed(seed))
    draws = [("uniform", (B, Kd)), ("pick", (B, V))] + ([("pick", (B, Kd, V))] if Kd else [])
    ahead = AheadRandoms(draws, torch.device("cpu"), torch.Generator().manual_seed(seed))
    ahead.fill()
    ahead.begin()
    like = close
    assert torch.equal(live.uniform((B, Kd), like), ahead.uniform((B, Kd), like))
    picked = ahead.pick(close)
    assert torch.equal(live.pick(close), picked)
    if Kd:
        assert torch.equal(live.pick(drafts), ahead.pick(drafts))
    if zeros:  # an impossible token is never picked
        assert bool((picked >= V // 2).all())


def test_accept_takes_a_generator_or_randoms_alike() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.rand(3, 4, 7, generator=g, dtype=torch.float64).softmax(-1)
    p = torch.rand(3, 3, 7, generator=g, dtype=torch.float64).softmax(-1)
    drafts = torch.randint(0, 7, (3, 3), generator=g)
    D = torch.tensor([3, 1, 0])
    a = accept(q, p, drafts, D, torch.Generator().manual_seed(9))
    draws = [("uniform", (3, 3)), ("pick", (3, 7))]
    ahead = AheadRandoms(draws, torch.device("cpu"), torch.Generator().manual_seed(9))
    ahead.fill()
    b = accept(q, p, drafts, D, ahead)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _request(kind, n, batch, K, prompt, seed):
    model = _moved(tiny_model(kind, vocab_size=6, seq_len=64), seed % 7)
    g = torch.Generator().manual_seed(seed)
    known = torch.zeros(batch, n, dtype=torch.bool)
    if prompt == "prefix":
        known[:, : n // 2] = True
    elif prompt == "per-row":
        for b in range(batch):
            known[b, torch.randperm(n, generator=g)[: (n - 1) // 2]] = True
    tokens = torch.randint(0, 6, (batch, n), generator=g)
    return model, dict(batch=batch, prompt=tokens, known=known)


def _decode(model, n, K, kw, seed, graphs, controls):
    seen = {"rounds": [], "steps": []}
    out = speculative_sample(
        model, n, K, generator=torch.Generator().manual_seed(seed), keep_logits=True,
        graphs=graphs, on_round=seen["rounds"].append,
        on_step=lambda pos, tok, step: seen["steps"].append((pos, tok, step)), **controls, **kw,
    )  # fmt: skip
    return out, seen


@settings(max_examples=40, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(
    kind=st.sampled_from(["aogpt", "armd"]), n=st.integers(2, 40), batch=st.integers(1, 4),
    K=st.integers(1, 8), prompt=st.sampled_from(["none", "prefix", "per-row"]),
    order=st.sampled_from(["random", "l2r"]), seed=st.integers(0, 2**16),
    controls=st.sampled_from([{}, {"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.8}]),
)  # fmt: skip
def test_captured_rounds_equal_the_eager_rounds_bit_for_bit(
    kind, n, batch, K, prompt, order, seed, controls, monkeypatch
) -> None:
    """The captured decode (every round after the first replayed through its key level's
    runner) against the eager decode of the same fixed widths, same seed: identical."""
    model, kw = _request(kind, n, batch, K, prompt, seed)
    kw["order"] = order
    monkeypatch.setattr(rounds, "STATIC_ON_CPU", True)  # the eager GPU path
    eager, seen_e = _decode(model, n, K, kw, seed, False, controls)
    monkeypatch.setattr(rounds, "STATIC_ON_CPU", False)  # graphs= asks for it alone
    captured, seen_c = _decode(model, n, K, kw, seed, "emulate", controls)
    for name in ("tokens", "order", "step_of", "logits"):
        assert torch.equal(getattr(eager, name), getattr(captured, name)), name
    assert eager.forward_passes == captured.forward_passes
    a, b = eager.extra["speculative"], captured.extra["speculative"]
    assert all((x == y).all() for x, y in zip(vars(a).values(), vars(b).values()))
    assert eager.extra["attention_shapes"] == captured.extra["attention_shapes"]
    assert len(seen_e["rounds"]) == len(seen_c["rounds"]) == eager.forward_passes
    for r, s in zip(seen_e["rounds"], seen_c["rounds"]):
        assert r.keys() == s.keys() and all(torch.equal(r[f], s[f]) for f in r)
    for (p, t, i), (q, u, j) in zip(seen_e["steps"], seen_c["steps"]):
        assert torch.equal(p, q) and torch.equal(t, u) and i == j
    graphs = captured.extra.get("graphs")
    if captured.forward_passes > 1:  # a runner per key level, each a few passes or more
        assert 1 <= graphs["shapes"] <= (2 if kind == "armd" else 7)
        assert graphs["mode"] == "emulate"
    else:
        assert graphs is None


@settings(max_examples=40, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(
    kind=st.sampled_from(["aogpt", "armd"]), n=st.integers(2, 36), batch=st.integers(1, 4),
    per_pass=st.integers(1, 5), K=st.one_of(st.none(), st.integers(1, 6)),
    subset=st.one_of(st.none(), st.integers(1, 8)),
    prompt=st.sampled_from(["none", "prefix", "per-row"]), seed=st.integers(0, 2**16),
    controls=st.sampled_from([{}, {"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.8}]),
)  # fmt: skip
def test_captured_confidence_passes_equal_the_eager_passes_bit_for_bit(
    kind, n, batch, per_pass, K, subset, prompt, seed, controls, monkeypatch
) -> None:
    """Confidence-ordered decoding, parallel or verified, all positions scored or a random
    subset: the captured decode (its steady passes replayed per key level) against the eager
    decode of the same fixed widths, same seed: identical tokens, order, steps, logits,
    counts and hook stream."""
    from anyorder.sampling.confidence import confidence_sample

    model, kw = _request(kind, n, batch, K, prompt, seed)
    runs = []
    for graphs, static in ((False, True), ("emulate", False)):
        monkeypatch.setattr(rounds, "STATIC_ON_CPU", static)
        steps = []
        out = confidence_sample(
            model, n, per_pass, speculative=K, subset=subset, keep_logits=True,
            generator=torch.Generator().manual_seed(seed), graphs=graphs,
            on_step=lambda pos, tok, i, steps=steps: steps.append((pos, tok, i)),
            **controls, **kw,
        )  # fmt: skip
        runs.append((out, steps))
    (eager, s_e), (captured, s_c) = runs
    for name in ("tokens", "order", "step_of", "logits"):
        assert torch.equal(getattr(eager, name), getattr(captured, name)), name
    assert eager.forward_passes == captured.forward_passes == len(s_e) == len(s_c)
    if K:
        a, b = eager.extra["speculative"], captured.extra["speculative"]
        assert all((x == y).all() for x, y in zip(vars(a).values(), vars(b).values()))
    for (p, t, i), (q, u, j) in zip(s_e, s_c):
        assert torch.equal(p, q) and torch.equal(t, u) and i == j
    graphs = captured.extra.get("graphs")
    if captured.forward_passes >= 4:  # steady passes after the first two and before the last
        assert 1 <= graphs["shapes"] <= (2 if kind == "armd" else 7)
    else:
        assert graphs is None or graphs["shapes"] <= 2


def test_the_hooks_keep_what_they_were_given() -> None:
    """A replay rewrites the round's outputs in place: each hook gets its own copies, so a
    hook that keeps them sees each pass's values, not the last pass's."""
    model, kw = _request("aogpt", 20, 2, 4, "none", 3)
    out, seen = _decode(model, 20, 4, kw, 3, "emulate", {})
    closing = torch.stack([r["position"] for r in seen["rounds"]])  # (passes, B)
    assert len({tuple(x.tolist()) for x in closing}) > 1  # not the same tensor each time
    # every generated position closed a round once, or was an accepted draft
    pos = torch.cat([p for p, _, _ in seen["steps"]], dim=1)
    for b in range(2):
        assert sorted(x for x in pos[b].tolist() if x < 20) == list(range(20))
    assert out.forward_passes == len(seen["rounds"])


def test_a_round_that_rebinds_its_state_is_refused() -> None:
    """A captured graph keeps reading the storage it recorded: the emulation refuses a round
    that rebinds a static tensor instead of writing it in place."""
    state = {"c": torch.zeros(3)}

    def good():
        state["c"].add_(1)

    def bad():
        state["c"] = state["c"] + 1

    runner = RoundRunner(good, "emulate", lambda: [state["c"]])
    for _ in range(3):
        runner()
    assert state["c"].tolist() == [3.0, 3.0, 3.0]
    runner = RoundRunner(bad, "emulate", lambda: [state["c"]])
    with pytest.raises(RuntimeError, match="a captured round rebound a static tensor"):
        runner()


def test_graphs_on_a_cpu_are_refused_and_off_by_default() -> None:
    from anyorder.errors import SamplingError

    model = tiny_model("aogpt")
    with pytest.raises(SamplingError, match="CUDA graphs need a CUDA device"):
        speculative_sample(model, 8, 2, graphs=True)
    out = speculative_sample(model, 8, 2, generator=torch.Generator().manual_seed(0))
    assert "graphs" not in out.extra  # auto on a CPU: eager


@pytest.mark.parametrize(
    "kind, sampler, most",
    [("aogpt", "speculative", 6), ("armd", "speculative", 6), ("aogpt", "confidence-spec", 6),
     ("armd", "confidence", 2)],
)  # fmt: skip
def test_a_replayed_round_is_a_few_host_launches_and_reads_nothing(
    kind, sampler, most, monkeypatch
) -> None:
    """Issue 41's CPU proxies on the captured path, counted as a GPU runs it (a replay is one
    launch): between two replays the host launches at most ``most`` kernels (the randoms
    drawn ahead, the counts' copy), reads nothing back from the device inside the loop, and
    the decode has at most eight attention shapes."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from anyorder.sampling import graphs
    from anyorder.sampling.confidence import confidence_sample
    from launch_overhead import Counter, host_reads, replays_counted

    monkeypatch.setattr(rounds, "STATIC_ON_CPU", True)  # the GPU's path: no width reads
    model = tiny_model(kind, seq_len=64, vocab_size=11)
    counter, marks = Counter(), []
    real = graphs.RoundRunner.__call__

    def call(self, *a, **k):
        marks.append((self.graph is not None, counter.launches))
        return real(self, *a, **k)

    monkeypatch.setattr(graphs.RoundRunner, "__call__", call)
    g = torch.Generator().manual_seed(1)
    with counter, host_reads(counter), replays_counted(counter):
        if sampler == "speculative":
            out = speculative_sample(model, 64, 4, batch=4, generator=g, graphs="emulate")
        else:
            K = 4 if sampler == "confidence-spec" else None
            out = confidence_sample(model, 64, 4, speculative=K, batch=4, generator=g,
                                    graphs="emulate")  # fmt: skip
    steady = [b[1] - a[1] for a, b in zip(marks, marks[1:]) if a[0] and b[0]]
    assert len(steady) >= out.forward_passes // 2  # most passes are replays
    assert max(steady) <= most, sorted(set(steady))
    events = counter.events
    attn = [i for i, (kind_, _) in enumerate(events) if kind_ == "attn"]
    syncs = [
        d for i, (kind_, d) in enumerate(events) if kind_ == "sync" and attn[0] <= i <= attn[-1]
    ]
    assert syncs == []
    assert len({d for kind_, d in events if kind_ == "attn"}) <= 8


@settings(max_examples=30, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))  # fmt: skip
@given(
    kind=st.sampled_from(["aogpt", "armd"]), n=st.integers(2, 60), batch=st.integers(1, 4),
    K=st.integers(1, 8), prompt=st.sampled_from(["none", "prefix", "per-row"]),
    confidence=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_the_counts_are_read_every_eight_passes_or_when_the_decode_may_end(
    kind, n, batch, K, prompt, confidence, seed, monkeypatch
) -> None:
    """On the GPU's path the host reads the rows' counts (two passes late) once in eight
    passes, and besides only when the read may end the decode: the decode ends on the same
    pass as when it reads after every pass (``every = 1``), with the same tokens."""
    from anyorder.sampling import confidence as conf
    from anyorder.sampling import speculative as spec

    model, kw = _request(kind, n, batch, K, prompt, seed)
    monkeypatch.setattr(rounds, "STATIC_ON_CPU", True)
    made = []

    class Kept(rounds.HostCounts):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(spec, "HostCounts", Kept)
    monkeypatch.setattr(conf, "HostCounts", Kept)
    runs = []
    for every in (1, rounds.HostCounts.every):
        monkeypatch.setattr(rounds.HostCounts, "every", every)
        g = torch.Generator().manual_seed(seed)
        if confidence:
            out = conf.confidence_sample(model, n, speculative=K, generator=g, **kw)
        else:
            out = spec.speculative_sample(model, n, K, generator=g, **kw)
        runs.append(out)
    (every_pass, sparse), host = runs, made[-1]
    assert torch.equal(every_pass.tokens, sparse.tokens)
    assert torch.equal(every_pass.order, sparse.order)
    assert every_pass.forward_passes == sparse.forward_passes == host.passes
    assert sparse.extra["count_reads"] == host.reads
    assert host.reads - host.end_checks <= host.passes // 8
    if host.passes > 2:  # reads only from the third pass (two passes late): at least one
        assert made[0].reads == host.passes - rounds.HostCounts.lag


def test_the_gpu_count_takes_each_rmsnorm_as_the_one_fused_kernel_cuda_runs() -> None:
    """``launch_overhead.py``'s GPU path counts ``F.rms_norm`` as one kernel (CUDA's fused
    ``_fused_rms_norm``; the CPU runs it as pow, mean, add, rsqrt, mul, mul), inside a
    replay as one graph kernel, and the pass computes what it computed uncounted."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from anyorder.layers.norm import RMSNorm
    from launch_overhead import Counter, fused_norms

    model = tiny_model("gpt", seq_len=16, vocab_size=11).eval()
    calls = []
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(0))
    plain, fused, replayed = Counter(), Counter(), Counter()
    with torch.no_grad():
        with plain:
            a = model(x)
        norms = len(calls)
        with fused_norms(), fused:
            b = model(x)
        replayed.in_replay = True
        with fused_norms(), replayed:
            model(x)
    assert norms >= 9 and len(calls) == 3 * norms  # 2 layers x 4 (QK-norm), the final one
    assert torch.equal(a, b)
    assert plain.launches - fused.launches == 5 * norms
    assert replayed.launches == 0 and replayed.graph_kernels == fused.launches


def test_the_gpu_count_chunks_scores_and_draws_as_a_gpu_does() -> None:
    """On ``launch_overhead.py``'s GPU path a confidence score and a draw are chunked by the
    GPU's bound (a paper-size pass is one chunk there), not by the CPU's 32 MB: a score of
    many columns then costs the kernels of one column; the scores are the same."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from anyorder.sampling import draws
    from anyorder.sampling.confidence import _confidence
    from launch_overhead import Counter, gpu_path

    B, V = 2, 1 << 16  # the CPU's bound takes 32 columns at a time
    g = torch.Generator().manual_seed(0)

    def counted(logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        counter = Counter()
        with counter:
            score = _confidence(logits, 1.0, torch.ones(logits.shape[:2], dtype=torch.bool))
        return counter.launches, score

    one, _ = counted(torch.randn(B, 1, V, generator=g))
    logits = torch.randn(B, 100, V, generator=g)
    cpu, cpu_score = counted(logits)
    with gpu_path():
        assert draws.draw_limit(torch.device("cpu")) == draws.DRAW_ELEMENTS_GPU
        gpu, gpu_score = counted(logits)
    assert draws.draw_limit(torch.device("cpu")) == draws.DRAW_ELEMENTS
    assert gpu == one < cpu
    assert torch.equal(cpu_score, gpu_score)


def test_the_gpu_count_merges_attention_heads_as_a_view_as_cuda_does() -> None:
    """``launch_overhead.py``'s GPU path returns SDPA's output in CUDA's layout (flash,
    memory-efficient and cuDNN attention write (B, T, H, D) and return its transpose), so
    merging the heads of several slots under a mask (a speculative or ARMD pass) is a
    view, not the copy the CPU's (B, H, T, D) output needs: one kernel fewer a layer, the
    same numbers."""
    import sys
    from pathlib import Path

    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from launch_overhead import Counter, cuda_attention_layout

    attn = tiny_model("armd", seq_len=16, vocab_size=11).blocks[0].attn
    g = torch.Generator().manual_seed(0)
    H, D = attn.n_head, attn.head_dim
    q, k, v = (torch.randn(2, H, 5, D, generator=g) for _ in range(3))
    mask = (torch.rand(2, 1, 5, 5, generator=g) < 0.5) | torch.eye(5, dtype=torch.bool)
    plain, laid_out = Counter(), Counter()
    with torch.no_grad():
        with plain:
            a = attn.attend(q, k, v, mask, empty=False)
        with cuda_attention_layout():
            with Counter():
                y = F.scaled_dot_product_attention(q, k, v)
            with laid_out:
                b = attn.attend(q, k, v, mask, empty=False)
    assert y.shape == q.shape and y.transpose(1, 2).is_contiguous()
    assert F.scaled_dot_product_attention(q, k, v).is_contiguous()  # restored
    assert torch.equal(a, b)
    assert plain.launches - laid_out.launches == 1
