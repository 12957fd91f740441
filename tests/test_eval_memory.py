"""Evaluation at the papers' scale fits in memory: every likelihood path reads the head
only at the slots it scores, a bounded chunk at a time.

Two kinds of check: on small models, each chunked path equals the full-logits computation
it replaced (fp32, atol 1e-5); at vocabulary 50257 and n = 1024 (2 layers x 64), each path
grows the peak resident set by less than 300 MB over the loaded model, measured in a process
of its own by ``benchmarks/eval_memory.py`` (before these paths, an ARMD ensemble of 8 grew
it by 1.3 GB, the any-order estimate by 1.2 GB and the encoder's left-to-right NLL by more
than 4 GB: docs/performance.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from anyorder.evaluation.corpus import block_generator, corpus_mdm_elbo
from anyorder.evaluation.estimators import member_logprobs
from anyorder.models.base import head_rows
from anyorder.orders import inverse, uniform

from conftest import REPO, tiny_model

V = 300  # more than d_model: the head's chunk is smaller than the trunk's


def full_nll(model, x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """The memory-hungry way: every slot's full logits, then the cross-entropy."""
    logits = model(x, order).float()  # (B, n, V)
    return F.cross_entropy(logits.transpose(1, 2), model.targets(x, order), reduction="none")


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd"])
def test_chunked_token_nll_equals_the_full_logits(kind: str, gen: torch.Generator) -> None:
    model = tiny_model(kind, vocab_size=V, seq_len=24)
    x = torch.randint(0, V, (3, 24), generator=gen)
    order = None if kind == "gpt" else uniform(3, 24, gen).order
    assert head_rows(model.cfg, 24) == 16  # 72 slots: 5 head calls
    want = full_nll(model, x, order)
    assert_close(model.token_nll(x, order, max_tokens=24), want, atol=1e-5, rtol=1e-5)
    assert_close(model.token_nll(x, order), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_ensemble_reads_the_head_at_the_target_only(kind: str, gen: torch.Generator) -> None:
    model = tiny_model(kind, vocab_size=V, seq_len=10)
    x = torch.randint(0, V, (2, 10), generator=gen)
    order = uniform(2, 10, gen).order
    keys = torch.rand(2, 2, 10, generator=gen, dtype=torch.float64)
    got, _ = member_logprobs(model, x, order, keys, max_tokens=24)
    # the full-logits way: each member's context order in a full forward, one slot read
    for b in range(2):
        for i in range(10):
            ctx = order[b, :i].tolist()
            for j in range(3):
                rho = ctx if j == 0 else sorted(ctx, key=lambda p, j=j: float(keys[b, j - 1, p]))
                rest = [p for p in order[b].tolist() if p not in rho]
                seq = torch.tensor([rho + rest])
                want = model(x[b : b + 1], seq).float().log_softmax(-1)[0, i, x[b, seq[0, i]]]
                assert_close(got[b, i, j], want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_mdm_left_to_right_and_elbo_read_the_head_at_masked_slots(gen: torch.Generator) -> None:
    model = tiny_model("mdm", vocab_size=V, seq_len=12)
    x = torch.randint(0, V, (2, 12), generator=gen)
    # left to right: slot t is the encoder on a copy with positions >= t masked
    want = torch.stack([
        torch.stack([
            -model.denoise(torch.where(torch.arange(12) < t, x[b], model.mask_id)[None])
            .float().log_softmax(-1)[0, t, x[b, t]]
            for t in range(12)
        ]) for b in range(2)
    ])  # fmt: skip
    assert_close(model.token_nll(x, max_tokens=24), want, atol=1e-5, rtol=1e-5)
    # a prefix of the order: the same slots' values
    prefix = torch.arange(5).expand(2, 5)
    assert_close(model.token_nll(x, prefix, max_tokens=24), want[:, :5], atol=1e-5, rtol=1e-5)
    # the ELBO: the head at the masked positions only, the full logits' value
    got = corpus_mdm_elbo(model, x, 2, seed=5, max_tokens=24, progress=False)
    for b in range(2):
        for k in range(2):
            o = uniform(1, 12, block_generator(5, b, 0, k)).order
            m = int(torch.randint(1, 13, (1,), generator=block_generator(5, b, 3, k)))
            masked = inverse(o)[0] >= 12 - m
            logits = model.denoise(torch.where(masked, model.mask_id, x[b])[None]).float()[0]
            nll = F.cross_entropy(logits, x[b], reduction="none")
            assert got[b, k].item() == pytest.approx(float(nll[masked].sum()) / m, abs=1e-5)


PATHS = ["armd-ensemble", "aogpt-ensemble", "mdm-l2r", "armd-any-order", "mdm-elbo"]


def test_paper_scale_paths_stay_under_300_mb(tmp_path) -> None:
    out = tmp_path / "mem.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "eval_memory.py"), "--only", ",".join(PATHS),
         "--targets", "2", "--mdm-slots", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "", "PYTHONPATH": str(REPO / "src")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["path"]: row for row in json.loads(out.read_text())}
    assert set(rows) == set(PATHS)
    for path, row in rows.items():
        assert 0 <= row["growth_mb"] < 300, (path, row)
