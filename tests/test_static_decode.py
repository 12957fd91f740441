"""Static-shape decoding: the graph-replay logic on the CPU, the shape budget, no sync inside
the loop, the plan's cost for any number of steps, and the reveal schedules (issue 15's
reference counts, the cosine schedule)."""

from __future__ import annotations

import math
import time
import tracemalloc

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import anyorder.sampling.plan as plan_mod
from anyorder.orders import strided
from anyorder.sample import lemma1_sample, masked_fraction, sample, sequential_sample
from anyorder.sampling.plan import BUDGET, Plan
from anyorder.sampling.schedules import draw_reveals, reference_reveals
from test_sample import slot_oracle

from conftest import tiny_model

N = 12


def _known(B: int) -> tuple[torch.Tensor, torch.Tensor]:
    known = torch.zeros(B, N, dtype=torch.bool)
    known[:, [1, 6, 10]] = True
    return torch.randint(0, 11, (B, N), generator=torch.Generator().manual_seed(3)), known


CASES = [
    ("gpt", {}),
    ("aogpt", {}),
    ("armd", {}),
    ("aogpt", dict(steps=5)),
    ("armd", dict(steps=5)),
    ("aogpt", dict(steps=5, shared_counts=True)),
    ("armd", dict(steps=4, shared_counts=True)),
    ("aogpt", dict(steps=7, reveal="reference")),
    ("armd", dict(streams=4)),
    ("armd", dict(streams=3)),
    ("aogpt", dict(prompt="rows")),
    ("armd", dict(prompt="shared", steps=4)),
    ("aogpt", dict(prompt="shared", steps=N)),
    ("armd-all-two-stream", dict(steps=4)),
    ("armd-all-two-stream", {}),
]


def _run(kind: str, kw: dict, graphs: str, B: int = 3):
    kw = dict(kw)
    if "prompt" in kw:
        prompt, known = _known(B)
        kw["prompt"], kw["known"] = (prompt[:1] if kw["prompt"] == "shared" else prompt), known
    model = tiny_model("armd", l2s=2) if kind == "armd-all-two-stream" else tiny_model(kind)
    with torch.no_grad():  # adaLN and every weight off their initialisation
        g = torch.Generator().manual_seed(11)
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    out = sample(
        model, N, batch=B, generator=torch.Generator().manual_seed(0), keep_logits=True,
        graphs=graphs, **kw,
    )  # fmt: skip
    return model, out, kw


def _oracle(model, out, kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits the sampler drew from, the uncached model's) over the generated slots."""
    if "streams" in kw:
        o = strided(out.tokens.shape[0], N, kw["streams"])
        return out.logits, model(out.tokens, o.order, o.model_blocks)
    k = 3 if "prompt" in kw else 0
    if "steps" in kw:
        ref = slot_oracle(model, out.tokens, out.order, out.step_of)
    else:
        ref = model(out.tokens, None if model.kind == "gpt" else out.order)
    return out.logits[:, k:], ref[:, k:]


@pytest.mark.parametrize("kind, kw", CASES)
def test_graph_replay_logic_equals_the_uncached_oracle(kind: str, kw: dict) -> None:
    """``graphs="emulate"``: each group's first pass runs and is recorded, later passes are
    replays driven by the device counter into a static output, with no packing; the same
    code path as CUDA graphs, without a GPU. Every logit equals the uncached forward (and
    the eager path's tokens)."""
    model, out, full = _run(kind, kw, "emulate")
    got, want = _oracle(model, out, full)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    _, eager, _ = _run(kind, kw, "off")
    assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.step_of, eager.step_of)
    assert out.forward_passes == eager.forward_passes


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_replays_walk_each_group_table_in_order(kind: str, monkeypatch) -> None:
    """A replay takes no argument from the host: a device counter picks its group's table
    row. Each pass must read its own row, the one the eager path reads by the pass's index.
    Issue 23's example (n = 32, T = 32, batch 2) merges groups, whose passes interleave in
    decode order; the replay read another pass's row (a logit error of 3.17)."""
    import anyorder.sampling.passes as passes_mod

    read: list[torch.Tensor] = []
    engine = passes_mod.ARMDPasses if kind == "armd" else passes_mod.GPTPasses
    real = engine.run

    def run(self, tab, *a, **k):
        read.append(tab.clone())
        return real(self, tab, *a, **k)

    monkeypatch.setattr(engine, "run", run)
    monkeypatch.setattr(plan_mod, "BUCKET_ON_CPU", True)
    monkeypatch.setattr(plan_mod, "_PACK_BELOW", -1.0)  # the plan a GPU runs, eagerly
    model = tiny_model(kind, seq_len=32)
    rows = {}
    for graphs in ("off", "emulate"):
        read.clear()
        gen = torch.Generator().manual_seed(0)
        out = lemma1_sample(model, 32, 32, batch=2, graphs=graphs, generator=gen)
        rows[graphs] = list(read)
    assert len(rows["off"]) == len(rows["emulate"]) == out.forward_passes
    plan = Plan(kind == "armd", 2, 32, 0, out.reveals.counts, out.reveals.step)
    assert len({g.widths for g in plan.groups}) < len({p.dims for p in plan.passes})  # merged
    for i, (want, got) in enumerate(zip(rows["off"], rows["emulate"])):
        assert torch.equal(got, want), f"pass {i} read another pass's table row"


class _Ops(TorchDispatchMode):
    """Attention shapes and host reads, in dispatch order."""

    SYNC = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "_unique", "masked_select")

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name:
            self.events.append(("attn", (args[0].shape[-2], args[1].shape[-2])))
        elif name == "multinomial":
            self.events.append(("draw", None))
        elif name.startswith(self.SYNC) and not getattr(args[0], "_anyorder_host_staging", 0):
            self.events.append(("sync", name))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "kind, kw",
    [
        ("gpt", {}),
        ("aogpt", {}),
        ("armd", {}),
        ("aogpt", dict(steps=16)),
        ("aogpt", dict(steps=64)),
        ("armd", dict(steps=16)),
        ("armd", dict(steps=64, shared_counts=True)),
        ("armd", dict(streams=4)),
        ("gpt", dict(stop_at_eos=3)),
    ],
)
def test_at_most_eight_attention_shapes_and_no_sync_in_the_loop(
    kind: str, kw: dict, monkeypatch
) -> None:
    """As a GPU runs them (bucketed; the CPU's eager path reads exactly the keys it needs)."""
    import anyorder.sampling.plan as plan_mod

    monkeypatch.setattr(plan_mod, "BUCKET_ON_CPU", True)
    model = tiny_model(kind, seq_len=64, vocab_size=11)
    ops = _Ops()
    with ops:
        out = sample(model, 64, batch=8, generator=torch.Generator().manual_seed(1), **kw)
    attn = [i for i, (e, _) in enumerate(ops.events) if e == "attn"]
    last = max(i for i, (e, _) in enumerate(ops.events) if e == "draw")
    shapes = {s for e, s in ops.events if e == "attn"}
    assert len(shapes) <= BUDGET, shapes
    syncs = [s for i, (e, s) in enumerate(ops.events) if e == "sync" and attn[0] <= i <= last]
    assert syncs == []
    assert out.forward_passes > 0


@pytest.mark.parametrize("armd", [False, True])
@pytest.mark.parametrize("steps", [8, 64, 256])
def test_plans_stay_within_the_shape_budget(armd: bool, steps: int) -> None:
    """n = 256, batch 8, per-row and shared counts, with and without a shared prompt."""
    for rows in (8, 1):
        r = draw_reveals(256 - 32, steps, rows, generator=torch.Generator().manual_seed(0))
        r = r.expand(8) if rows == 1 else r
        for prefill in (False, True):
            plan = Plan(armd, 8, 256, 32, r.counts, r.step, prefill=prefill)
            assert len(plan.shapes()) <= BUDGET
            assert plan.capacity <= 256 + 2 * max(g.width for g in plan.groups) + 8


def test_a_huge_step_count_costs_what_n_steps_cost() -> None:
    """Only non-empty steps exist: 10**8 steps plan in O(B n) time and memory."""
    tracemalloc.start()
    start = time.perf_counter()
    r = draw_reveals(1024, 10**8, 8, generator=torch.Generator().manual_seed(0))
    plan = Plan(False, 8, 1024, 0, r.counts, r.step)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert r.counts.shape[0] <= 8 * 1024 and np.all(r.counts.sum(0) == 1024)
    assert peak < 64 * 2**20 and seconds < 20
    assert len(plan.shapes()) <= BUDGET
    model = tiny_model("aogpt")
    out = lemma1_sample(model, N, 10**8, batch=2, generator=torch.Generator().manual_seed(2))
    assert out.forward_passes == len(out.reveals.step) <= 2 * N
    assert out.reveals.steps == 10**8 and int(out.reveals.counts.sum()) == 2 * N
    assert sorted(out.step_of[0].tolist()) == sorted(out.reveals.step[out.reveals.counts[:, 0] > 0])


def _reference_counts(masked: int, steps: int, schedule: str) -> list[int]:
    """The AO-GPT reference code's loop (``generate`` in model_AOGPT_generate.py), written
    out independently: float32 times by ``torch.linspace(1, 0, T + 1)``, the cosine
    ``torch.cos((1 - t) * pi * 0.5)``, and ``next = max(int(m * (1 - timesteps[i + 1])),
    current + 1)`` revealed by step ``i``, slicing the order (so never past ``m``)."""
    t = torch.linspace(1, 0, steps + 1)
    timesteps = t if schedule == "linear" else torch.cos((1 - t) * math.pi * 0.5)
    targets = (masked * (1 - timesteps)).tolist()  # float32 products, exactly as there
    out, current = [], 0
    for i in range(steps):
        nxt = max(int(targets[i + 1]), current + 1)
        out.append(min(nxt, masked) - min(current, masked))
        current = nxt
    return out


def test_reference_counts_are_the_reference_schedule() -> None:
    """Bit-identical to the reference's loop for a sample of (m, T) and both schedules
    (every m <= 1024 and T <= m under ``-m slow``); every position is decided, also at
    the last cosine step (cos(pi/2) is 6e-17 in float64, which left m - 1)."""
    rng = np.random.default_rng(0)
    pairs = [(12, 5), (12, 3), (1024, 16), (1024, 64), (1024, 256), (3, 3), (1, 1), (4, 10)]
    pairs += [(int(m), int(rng.integers(1, m + 1))) for m in rng.integers(1, 1025, 60)]
    for masked, steps in pairs:
        for schedule in ("linear", "cosine"):
            got = reference_reveals(masked, steps, schedule).dense()[:, 0].tolist()
            assert got == _reference_counts(masked, steps, schedule), (masked, steps, schedule)
            assert sum(got) == masked
    assert reference_reveals(12, 5, "cosine").dense()[:, 0].tolist() == [1, 1, 2, 4, 4]
    model = tiny_model("armd")
    out = lemma1_sample(model, N, 5, reveal="reference", batch=3, generator=torch.Generator())
    assert out.counts.T.tolist() == [_reference_counts(N, 5, "linear")] * 3
    assert out.forward_passes == 5
    with pytest.raises(Exception, match="reveal 'fixed' is unknown; use one of binomial"):
        lemma1_sample(model, N, 5, reveal="fixed")


@pytest.mark.slow
def test_reference_counts_for_every_length_and_step_count() -> None:
    """Every m in 1..1024 with every T in 1..m, both schedules (about a million sequences)."""
    for masked in range(1, 1025):
        for steps in range(1, masked + 1):
            for schedule in ("linear", "cosine"):
                got = reference_reveals(masked, steps, schedule).dense()[:, 0].tolist()
                assert got == _reference_counts(masked, steps, schedule), (masked, steps)


def test_cosine_schedule_reveals_few_tokens_first() -> None:
    """m(t) = cos((1 - t) pi / 2): at t = 1/2 about 71% of the tokens are still masked, so a
    two-step decode reveals about 29% first, and the binomial counts follow m."""
    assert masked_fraction(0.5, "cosine") == pytest.approx(math.cos(math.pi / 4))
    assert masked_fraction(1.0, "cosine") == 1.0 and masked_fraction(0.0, "cosine") < 1e-12
    steps, masked = 4, 40
    c = draw_reveals(masked, steps, 20000, "cosine", generator=torch.Generator().manual_seed(0))
    mean = c.dense().double().mean(1)
    # m(1 - i/T) = cos(i pi / 2T), written out here rather than through masked_fraction
    want = [
        masked * (math.cos(i * math.pi / (2 * steps)) - math.cos((i + 1) * math.pi / (2 * steps)))
        for i in range(steps)
    ]
    torch.testing.assert_close(mean, torch.tensor(want, dtype=torch.float64), atol=0.1, rtol=0)


def test_graphs_need_a_cuda_device() -> None:
    from anyorder.errors import SamplingError

    model = tiny_model("gpt")
    with pytest.raises(SamplingError, match="CUDA graphs need a CUDA device; the model is on cpu"):
        sequential_sample(model, N, graphs=True, generator=torch.Generator())


def test_reference_counts_and_cosine_through_the_cli_and_api(tmp_path, capsys) -> None:
    import json

    import anyorder
    from anyorder.cli import main
    from test_sample import _save_run

    _save_run(tmp_path / "aogpt", "aogpt")
    argv = ["sample", str(tmp_path / "aogpt"), "--steps", "5", "--length", "12", "--json"]
    assert main([*argv, "--reveal", "reference", "--num-samples", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["counts"] == [[2, 2, 3, 2, 3]] * 2 and res["forward_passes"] == 5
    assert main([*argv, "--schedule", "cosine", "--reveal", "reference"]) == 0
    counts = json.loads(capsys.readouterr().out)["counts"][0]
    assert counts == reference_reveals(12, 5, "cosine").dense()[:, 0].tolist()
    assert counts[0] < counts[-1]  # the cosine schedule reveals few tokens first
    model = anyorder.load(tmp_path / "aogpt")
    texts = model.generate(12, 2, steps=5, reveal="reference", schedule="cosine", seed=1)
    assert len(texts) == 2


@pytest.mark.parametrize("armd", [False, True])
def test_rows_alike_write_consecutive_slots(armd: bool) -> None:
    """The CPU path writes a pass whose rows are alike by slice copies at ``start``: its
    table must put entry j of every row at slot start + j (kept entries first)."""
    from anyorder.sampling.plan import A_SLOT, G_SLOT

    r = draw_reveals(60, 20, 1, generator=torch.Generator().manual_seed(0)).expand(3)
    blocks = strided(1, 64, 4).blocks[0].numpy() if armd else None
    for counts, steps, block_of, k in [
        (r.counts, r.step, None, 4),  # shared counts after a shared 4-token prompt
        (np.ones((60, 3), np.int64), np.arange(60), None, 4),  # sequential
        *([(np.bincount(blocks)[:, None].repeat(3, 1), np.arange(19), blocks, 0)] if armd else []),
    ]:
        plan = Plan(armd, 3, 64, k, counts, steps, block_of, prefill=k > 0, bucket=False)
        plan.ship(torch.stack([torch.randperm(64) for _ in range(3)]))
        checked = 0
        for p in plan.passes:
            if p.start is None or p.prefill:
                continue
            g = plan.groups[p.group]
            slots = g.table[p.index][:, A_SLOT if armd else G_SLOT]
            if armd:
                C = g.widths[0]
                assert torch.equal(slots[:, :C], p.start[0] + torch.arange(C).expand(3, C))
                G = slots.shape[1] - C
                assert torch.equal(slots[:, C:], p.start[1] + torch.arange(G).expand(3, G))
            else:
                assert torch.equal(
                    slots, p.start[0] + torch.arange(slots.shape[1]).expand_as(slots)
                )
            checked += 1
        assert checked > 0


def test_reference_counts_refuse_a_step_table_too_large() -> None:
    """The reference's float32 times are a table of T + 1 values: 10**9 steps would be 4 GB,
    so the reference reveal stops at 2**22 steps (the binomial one costs O(tokens) for any T)."""
    from anyorder.errors import SamplingError

    with pytest.raises(SamplingError, match="at most 4,194,304"):
        reference_reveals(12, 10**9)
    assert reference_reveals(3, 1 << 22).dense()[:4, 0].tolist() == [1, 1, 1, 0]
