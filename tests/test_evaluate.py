"""The evaluation suite: corpus likelihoods with error bars, context-order ensembles, the
zero-shot protocol, generative perplexity, plots and the ``anyorder eval`` command."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.testing import assert_close

from anyorder.config import ModelConfig, RunConfig
from anyorder.data import ByteTokenizer
from anyorder.errors import ConfigError, DataError, SamplingError
from anyorder.evaluation.corpus import corpus_any_order, corpus_ensemble, corpus_left_to_right
from anyorder.evaluation.estimators import (
    combine_members,
    ensemble_cost,
    exact_any_order_nll,
    member_logprobs,
    sequence_nll,
)
from anyorder.evaluation.suite import likelihood_suite, pooled_estimate
from anyorder.evaluation.zeroshot import (
    ZeroShotSet,
    dataset,
    lambada_detokenize,
    lm1b_detokenize,
    load_corpus,
    load_texts,
    pack_examples,
    ptb_detokenize,
    wikitext_detokenize,
)
from anyorder.evaluation.zeroshot_table import table_markdown, write_table, zero_shot
from anyorder.models.base import AnyOrderLM

from conftest import GPT2_TOKENIZER_DIR, REPO, has_gpt2_tokenizer, tiny_model
from conftest import run_cli as conftest_run_cli

# ----------------------------------------------------------------------------- a known model


class MarkovChainLM(AnyOrderLM):
    """A real model of a known distribution: a stationary first-order Markov chain over a
    tiny vocabulary, whose any-order conditionals are computed analytically.

    ``p(x_q | x_S)`` depends only on the nearest observed positions ``l < q < r`` of the
    context: ``∝ P^(q-l)[x_l, v] · P^(r-q)[v, x_r]`` (the initial marginal ``pi0 P^q`` when
    nothing is observed to the left). It takes the aogpt slot of the interface: any order,
    one token per slot, orders shorter than ``n`` allowed.
    """

    kind = "aogpt"

    def __init__(self, pi0: Tensor, P: Tensor, n: int) -> None:
        super().__init__(ModelConfig(kind="aogpt", vocab_size=len(pi0), seq_len=n, n_head=1))
        self.register_buffer("pi0", pi0.double())
        self.register_buffer("P", P.double())
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # gives the model a device

    def log_prob(self, x: Tensor) -> Tensor:
        """The exact log-likelihood (B,) of whole sequences."""
        lp = self.pi0.log()[x[:, 0]]
        return lp + self.P.log()[x[:, :-1], x[:, 1:]].sum(dim=1)

    def forward(self, tokens: Tensor, order: Tensor | None = None, blocks=None) -> Tensor:
        order = self.resolve_order(tokens, order)
        B, T = order.shape
        out = torch.empty(B, T, len(self.pi0), dtype=torch.float64)
        for b in range(B):
            for t in range(T):
                q = int(order[b, t])
                ctx = order[b, :t].tolist()
                left = [p for p in ctx if p < q]
                right = [p for p in ctx if p > q]
                if left:
                    lft = max(left)
                    p = torch.linalg.matrix_power(self.P, q - lft)[tokens[b, lft]]
                else:
                    p = self.pi0 @ torch.linalg.matrix_power(self.P, q)
                if right:
                    r = min(right)
                    p = p * torch.linalg.matrix_power(self.P, r - q)[:, tokens[b, r]]
                out[b, t] = (p / p.sum()).log()
        return out.float()


def markov(n: int = 5, V: int = 3, seed: int = 0) -> MarkovChainLM:
    g = torch.Generator().manual_seed(seed)
    pi0 = torch.rand(V, generator=g, dtype=torch.float64) + 0.2
    P = torch.rand(V, V, generator=g, dtype=torch.float64) + 0.2
    return MarkovChainLM(pi0 / pi0.sum(), P / P.sum(1, keepdim=True), n)


def perturbed(kind: str, seed: int = 0, **kw) -> AnyOrderLM:
    """A tiny real model with every weight moved off its initialisation (adaLN included,
    which starts at zero), so that target positions and context orders matter."""
    model = tiny_model(kind, seed, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


# ----------------------------------------------------------------------------- likelihoods


def test_exact_model_gets_the_true_likelihood_in_every_order(gen: torch.Generator) -> None:
    n = 5
    model = markov(n)
    x = torch.randint(0, 3, (6, n), generator=gen)
    truth = -model.log_prob(x).float()
    assert_close(sequence_nll(model, x), truth, atol=1e-5, rtol=1e-5)
    for _ in range(3):
        order = torch.rand(6, n, generator=gen).argsort(-1)
        assert_close(sequence_nll(model, x, order), truth, atol=1e-5, rtol=1e-5)
    assert_close(exact_any_order_nll(model, x).float(), truth, atol=1e-5, rtol=1e-5)
    # corpus level: every order gives the truth, so the order draw's error bar is zero, and
    # the headline one is the spread of the blocks' true likelihoods (the text sample)
    res = likelihood_suite(model, x, bytes_per_token=2.0, orders=4, ensemble=3, progress=False)
    per_token = float(truth.mean()) / n
    for key in ("l2r", "any_order", "ensemble"):
        m = res[key]
        assert m["nats_per_token"] == pytest.approx(per_token, abs=1e-6)
        assert m["ppl"] == pytest.approx(math.exp(per_token), rel=1e-6)
        assert m["bits_per_byte"] == pytest.approx(per_token / math.log(2) / 2.0, rel=1e-6)
        assert m["ppl_ci95"][0] <= math.exp(per_token) + 1e-6 <= m["ppl_ci95"][1] + 2e-6
        block_se = float((truth.double() / n).std() / math.sqrt(len(x)))
        assert m["stderr"] == pytest.approx(block_se, rel=1e-4)
    assert res["any_order"]["stderr_orders"] < 1e-6 and res["l2r"]["stderr_orders"] is None
    per_block = torch.tensor(res["per_block"]["l2r"]).double()
    assert_close(per_block, truth.double() / n, atol=1e-5, rtol=0)
    assert torch.tensor(res["per_block"]["any_order"]).shape == (6, 4)


def test_monte_carlo_ci_covers_the_exact_any_order_nll(gen: torch.Generator) -> None:
    """An imperfect model (its conditionals disagree between orders): the estimate over 6
    random orders per block, with its 95% interval, against the average over all n!."""
    n = 5
    model = perturbed("aogpt", vocab_size=5, seq_len=n)
    x = torch.randint(0, 5, (8, n), generator=gen)
    exact = float(exact_any_order_nll(model, x).mean()) / n
    values = corpus_any_order(model, x, 6, seed=3, batch_size=3, progress=False)
    assert values.shape == (8, 6)
    est = pooled_estimate(values)
    lo, hi = est.ci95()
    assert est.stderr > 1e-4 and lo <= exact <= hi
    # the draws are per block: the batch size does not change them (different draws would
    # move a value by ~0.1; a different batch only reorders float sums, ~1e-7)
    rebatched = corpus_any_order(model, x, 6, seed=3, batch_size=8, progress=False)
    assert_close(values, rebatched, rtol=1e-5, atol=1e-5)


def test_pooled_estimate() -> None:
    v = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 4.0]])
    est = pooled_estimate(v)
    assert est.mean == pytest.approx(2.0)
    # within-block variances 2, 0, 8 -> se = sqrt(10 / 2) / 3
    assert est.stderr == pytest.approx(math.sqrt(5) / 3)
    assert pooled_estimate(v[:, 0]).stderr == 0.0
    assert math.isnan(pooled_estimate(v[:, :1]).stderr)


# ----------------------------------------------------------------------------- ensembles


def test_ensemble_of_one_is_the_plain_any_order_nll(gen: torch.Generator) -> None:
    model = perturbed("aogpt", vocab_size=7, seq_len=8)
    x = torch.randint(0, 7, (5, 8), generator=gen)
    plain = corpus_any_order(model, x, 3, seed=1, progress=False)
    one = corpus_ensemble(model, x, 3, 1, seed=1, progress=False)
    assert one.sizes == [1]
    assert_close(one.values[..., 0], plain)
    four = corpus_ensemble(model, x, 3, 4, seed=1, progress=False)
    assert four.sizes == [1, 2, 4]
    assert_close(four.values[..., 0], plain)  # identity member = the plain pass
    assert not torch.allclose(four.values[..., 2], plain, atol=1e-4)


def test_members_combine_in_probability_space(gen: torch.Generator) -> None:
    # constructed: two members give 0.9 and 0.1 -> the ensemble gives 0.5
    logp = torch.tensor([math.log(0.9), math.log(0.1)])
    assert combine_members(logp).item() == pytest.approx(math.log(0.5))
    assert combine_members(logp).item() != pytest.approx(float(logp.mean()), abs=0.1)
    assert combine_members(logp, 1).item() == pytest.approx(math.log(0.9))
    # on a real model: the corpus value is -mean log(mean_j p_j), not -mean mean_j log p_j
    model = perturbed("aogpt", vocab_size=7, seq_len=8)
    x = torch.randint(0, 7, (2, 8), generator=gen)
    order = torch.rand(2, 8, generator=gen).argsort(-1)
    keys = torch.rand(2, 3, 8, generator=gen, dtype=torch.float64)
    lp, _ = member_logprobs(model, x, order, keys)
    prob_space = -lp.double().exp().mean(-1).log().mean(1)
    log_space = -lp.double().mean(-1).mean(1)
    assert_close(-combine_members(lp).mean(1), prob_space)
    assert (log_space - prob_space).min() > 1e-4  # Jensen: log-space is worse, and differs


def reference_member_logprobs(model, x, order, keys, slots) -> Tensor:
    """The slow reference: one full forward pass per (sequence, target, member)."""
    B, n = x.shape
    M = keys.shape[1] + 1
    out = torch.zeros(B, slots.shape[1], M)
    full = model(x, order).log_softmax(-1)
    for b, c in itertools.product(range(B), range(slots.shape[1])):
        i = int(slots[b, c])
        target = int(order[b, i])
        out[b, c, 0] = full[b, i, x[b, target]]
        ctx = order[b, :i].tolist()
        for j in range(M - 1):
            rho = sorted(ctx, key=lambda p, j=j: float(keys[b, j, p]))  # noqa: B023
            rest = [p for p in order[b].tolist() if p not in ctx and p != target]
            seq = torch.tensor([rho + [target] + rest])
            out[b, c, j + 1] = model(x[b : b + 1], seq).log_softmax(-1)[0, i, x[b, target]]
    return out


@pytest.mark.parametrize("kind", ["aogpt", "armd", "aogpt-rope-target"])
def test_batched_ensemble_equals_one_pass_per_context(kind: str, gen: torch.Generator) -> None:
    n, M = 9, 4
    extra = {"pos_emb": "rope", "rope_query": "target"} if kind == "aogpt-rope-target" else {}
    model = perturbed(kind.split("-")[0], vocab_size=7, seq_len=n, **extra)
    x = torch.randint(0, 7, (2, n), generator=gen)
    order = torch.rand(2, n, generator=gen).argsort(-1)
    keys = torch.rand(2, M - 1, n, generator=gen, dtype=torch.float64)
    slots = torch.arange(n).expand(2, n)
    ref = reference_member_logprobs(model, x, order, keys, slots)
    for max_tokens in (1 << 15, 24):  # one chunk; many small chunks
        got, evaluated = member_logprobs(model, x, order, keys, max_tokens=max_tokens)
        assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert evaluated >= 2 * n + 2 * (M - 1) * n * (n + 1) // 2
    sub = torch.tensor([[0, 4, 8], [2, 3, 7]])
    got, _ = member_logprobs(model, x, order, keys, sub, max_tokens=30)
    assert_close(got, reference_member_logprobs(model, x, order, keys, sub), atol=1e-5, rtol=1e-5)


def test_ensemble_cost_and_kinds_it_does_not_apply_to() -> None:
    assert ensemble_cost(1024, 8) == pytest.approx(1 + 7 * 1025 / 2)
    assert ensemble_cost(1024, 1) == 1.0
    assert ensemble_cost(100, 3, targets=10) == pytest.approx(1 + 2 * 10 * 101 / 200)
    x = torch.randint(0, 11, (2, 6))
    for kind in ("gpt", "mdm"):
        with pytest.raises(ConfigError, match=f"ensembles do not apply to {kind}"):
            corpus_ensemble(tiny_model(kind), x, 2, 4, progress=False)
    gpt = likelihood_suite(tiny_model("gpt"), x, orders=2, ensemble=4, progress=False)
    assert gpt["any_order"] is None and gpt["ensemble"] is None and gpt["l2r"] is not None
    mdm = likelihood_suite(tiny_model("mdm"), x, orders=2, ensemble=4, progress=False)
    assert mdm["any_order"]["kind"] == "elbo" and mdm["ensemble"]["noop"]
    assert any("no-op" in note for note in mdm["notes"])


def test_ensemble_on_sampled_targets_runs_the_plain_estimate_on_all(gen) -> None:
    model = perturbed("armd", vocab_size=7, seq_len=12)
    x = torch.randint(0, 7, (3, 12), generator=gen)
    res = likelihood_suite(
        model, x, orders=2, ensemble=4, targets=5, left_to_right=False, progress=False
    )
    plain = pooled_estimate(corpus_any_order(model, x, 2, progress=False))
    assert res["any_order"]["nats_per_token"] == pytest.approx(plain.mean)
    assert res["l2r"] is None and res["ensemble"]["targets"] == 5
    ens = res["ensemble"]
    assert set(ens["by_size"]) == set(ens["gain_by_size"]) == {1, 2, 4}
    assert ens["gain_by_size"][1]["nats"] == ens["gain_by_size"][1]["stderr"] == 0.0
    assert ens["baseline"] == ens["by_size"][1]  # the same-targets baseline it is paired with
    assert ens["gain_by_size"][4]["nats"] == ens["gain_nats"]
    # paired: the gain is the difference of the two sizes' means on the same targets
    by = ens["by_size"]
    assert ens["gain_by_size"][2]["nats"] == pytest.approx(
        by[1]["nats_per_token"] - by[2]["nats_per_token"], abs=1e-9
    )
    assert ens["passes_per_block"] > 1.0


def test_left_to_right_is_exact(gen: torch.Generator) -> None:
    model = tiny_model("gpt")
    x = torch.randint(0, 11, (3, 8), generator=gen)
    expected = -model(x).log_softmax(-1).gather(2, x[..., None])[..., 0].double().mean(1)
    assert_close(corpus_left_to_right(model, x.numpy(), batch_size=2, progress=False), expected)


# ----------------------------------------------------------------------------- zero-shot


def test_wikitext_detokenizer() -> None:
    raw = ' The game @-@ play ( sold 1 @,@ 000 copies ) , was " good " . It \'s 3 @.@ 5 km . \n'
    assert wikitext_detokenize(raw) == (
        ' The game-play (sold 1,000 copies), was "good". It\'s 3.5 km.\n'
    )
    assert wikitext_detokenize(" = = Gameplay = = \n") == " == Gameplay ==\n"
    assert wikitext_detokenize(" = = = Plot = = = \n") == " === Plot ===\n"
    assert wikitext_detokenize("the players ' team") == "the players' team"


def test_ptb_lm1b_lambada_detokenizers() -> None:
    assert ptb_detokenize("the company 's N N shares did n't rise <unk> to $ N a share") == (
        "the company's 1 1 shares didn't rise ? to $1 a share"
    )
    assert ptb_detokenize("the buyers ' share \\/ price") == "the buyers' share / price"
    assert lm1b_detokenize('He said : " It \'s fine , really . " Cost $ 5 ( about £ 3 ) !') == (
        'He said: "It\'s fine, really." Cost $5 (about £3)!'
    )
    assert lm1b_detokenize("see http : / / example.com now ?") == "see http://example.com now?"
    assert lambada_detokenize("  \u201cHello,\u201d he said.  ") == '\n"Hello," he said.'


def test_pack_examples_eos_after_every_example_and_remainder_dropped() -> None:
    tok = ByteTokenizer()
    c = pack_examples(["ab", "", "cde"], tok, seq_len=3, name="toy")
    # a b EOS | EOS c d | e EOS (dropped)
    assert c.blocks.tolist() == [[97, 98, 256], [256, 99, 100]]
    assert (c.examples, c.tokens, c.bytes) == (3, 8, 5)
    assert c.bytes_per_token == pytest.approx(5 / 8)
    with pytest.raises(DataError, match="toy: 3 tokens do not fill one block of 4"):
        pack_examples(["ab"], tok, seq_len=4, name="toy")


def test_reference_protocol_cuts_blocks_per_group_as_datasets_map_does() -> None:
    """The reference code maps ``group_texts`` over the tokenized rows with ``batched=True``
    and ``num_proc=8``: each contiguous shard, in batches of 1000 rows, is concatenated and
    cut on its own. Checked against ``datasets`` itself (3 shards, batches of 4 rows, so
    29 rows make shards of 10, 10, 9 and batches 4, 4, 2 | 4, 4, 2 | 4, 4, 1)."""
    datasets = pytest.importorskip("datasets")
    from itertools import chain

    from anyorder.evaluation.zeroshot import reference_groups

    tok = ByteTokenizer()
    texts = [("xyz" * (i % 7))[: (i * 5) % 11] for i in range(29)]
    seq_len = 4

    def group_texts(batch):  # the reference's rule, on the column of ids
        ids = list(chain(*batch["input_ids"]))
        usable = len(ids) // seq_len * seq_len
        return {"input_ids": [ids[i : i + seq_len] for i in range(0, usable, seq_len)]}

    rows = datasets.Dataset.from_dict({"input_ids": [tok.encode(t) + [tok.eos_id] for t in texts]})
    want = rows.map(group_texts, batched=True, batch_size=4, num_proc=3)["input_ids"]
    assert reference_groups(29, num_proc=3, batch=4) == [4, 4, 2, 4, 4, 2, 4, 4, 1]
    got = pack_examples(texts, tok, seq_len, groups=reference_groups(29, 3, 4)).blocks
    assert got.tolist() == want
    whole = pack_examples(texts, tok, seq_len).blocks
    assert len(whole) > len(got)  # one cut over the whole set keeps more blocks
    assert reference_groups(5) == [1] * 5  # datasets never runs more shards than rows
    assert reference_groups(8001) == [1000, 1] + [1000] * 7


def write_layout(root: Path) -> Path:
    """A --data-dir with a few lines of each dataset's format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "wikitext2").mkdir(parents=True)
    (root / "wikitext2" / "wiki.test.raw.txt").write_text(
        " \n = Robert Boulter = \n \n Robert Boulter is an English film @-@ actor . \n"
    )
    (root / "ptb").mkdir()
    pq.write_table(
        pa.table({"sentence": ["no it was n't black monday", "the N stocks fell <unk>"]}),
        root / "ptb" / "test.parquet",
    )
    (root / "lambada").mkdir()
    rows = [{"text": "\u201cHi,\u201d she said to her friend"}, {"text": "the end of the story"}]
    (root / "lambada" / "lambada_test.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    return root


def test_local_layout_through_the_protocol(tmp_path: Path) -> None:
    root = write_layout(tmp_path / "zs")
    tok = ByteTokenizer()
    wiki = load_texts(dataset("wikitext2"), root)
    actor = " Robert Boulter is an English film @-@ actor . \n"
    assert wiki == ["", " = Robert Boulter = \n", "", actor]
    c = load_corpus("wikitext2", tok, 8, root)
    ids: list[int] = []
    for t in wiki:  # detokenized bytes, one EOS after every row (the empty ones too)
        ids += list(wikitext_detokenize(t).encode()) + [256]
    assert c.blocks.ravel().tolist() == ids[: len(ids) // 8 * 8]
    assert c.tokens == len(ids) and c.examples == 4
    assert c.bytes == sum(len(wikitext_detokenize(t).encode()) for t in wiki)
    ptb = load_corpus("ptb", tok, 8, root)
    assert bytes(v for v in ptb.blocks.ravel() if v < 256).decode().startswith("no it wasn't")
    lam = load_corpus("lambada", tok, 4, root)
    assert lam.blocks.ravel()[:4].tolist() == list(b'\n"Hi')
    with pytest.raises(DataError, match="no folder .*lm1b for lm1b"):
        load_corpus("lm1b", tok, 8, root)
    with pytest.raises(DataError, match="unknown zero-shot dataset 'wt2'"):
        load_corpus("wt2", tok, 8, root)


@pytest.mark.parametrize(
    "line, problem",
    [
        ('["x"]', "line 2 holds list, not an object with field 'text'"),
        ('"hello"', "line 2 holds str, not an object with field 'text'"),
        ('{"text": 5}', "line 2: field 'text' holds int, not text"),
        ('{"text": null}', "line 2: field 'text' holds NoneType, not text"),
        ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}",
         "line 2 nests too deep for a JSON reader"),
    ],
)  # fmt: skip
def test_a_local_test_set_record_of_the_wrong_shape_is_one_error(tmp_path, line, problem):
    """Each of these crashed with a traceback (TypeError, AttributeError, RecursionError)."""
    root = write_layout(tmp_path / "zs")
    path = root / "lambada" / "lambada_test.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        load_texts(dataset("lambada"), root)
    assert str(e.value) == (
        f"{path} could not be read as jsonl with field 'text' ({problem}); fix the file or "
        "the layout"
    )


def test_a_named_pipe_in_a_local_test_set_is_refused_not_opened(tmp_path):
    """Reading it blocked the evaluation for ever."""
    root = write_layout(tmp_path / "zs")
    pipe = root / "wikitext2" / "wiki.test.raw.txt"
    pipe.unlink()
    os.mkfifo(pipe)
    with pytest.raises(DataError) as e:
        load_texts(dataset("wikitext2"), root)
    assert (
        str(e.value)
        == f"{pipe} is a named pipe (FIFO), not a file; replace it with the file itself"
    )


def test_hub_path_reads_a_local_folder_offline(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "ptb_like"
    folder.mkdir()
    rows = [{"sentence": "a b c"}, {"sentence": "it 's N"}]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = ZeroShotSet("ptb", str(folder), None, "test", "sentence", ptb_detokenize)
    assert load_texts(spec) == ["a b c", "it 's N"]
    bad = ZeroShotSet("ptb", str(tmp_path / "missing"), None, "test", "sentence", ptb_detokenize)
    with pytest.raises(DataError, match="could not load ptb .*pass --data-dir"):
        load_texts(bad)


def test_zero_shot_table(tmp_path: Path) -> None:
    root = write_layout(tmp_path / "zs")
    model = perturbed("aogpt", vocab_size=257, seq_len=16)
    table = zero_shot(
        model, ByteTokenizer(), ["wikitext2", "ptb"], data_dir=root, max_blocks=2,
        progress=False, orders=2, ensemble=2, targets=4,
    )  # fmt: skip
    md = table_markdown(table)
    head = [c.strip() for c in md.splitlines()[0].split("|")[1:-1]]
    # one unit (bits per byte: a byte-level model), the ensemble beside its same-targets x1
    assert head == [
        "dataset", "split (ours protocol)", "blocks", "bits/byte l2r", "bits/byte any order",
        "bits/byte any order, x1 on 4 targets", "bits/byte ens x2 on 4 targets",
    ]  # fmt: skip
    for name in ("wikitext2", "ptb"):
        r = table["datasets"][name]
        assert r["blocks"] == 2 and r["l2r"]["ppl"] > 1 and r["ensemble"]["members"] == 2
        assert r["split"] == "test" and f"| {name}" in md
    assert "Protocol: ours (every set on its test split" in md
    js, mdf = write_table(table, tmp_path / "out")
    assert json.loads(js.read_text())["datasets"]["ptb"]["seq_len"] == 16
    assert mdf.read_text() == md
    # no ensemble: no ensemble column (no "ens x1 ... n/a")
    plain = zero_shot(model, ByteTokenizer(), ["ptb"], data_dir=root, max_blocks=2,
                      progress=False, echo=False, orders=2)  # fmt: skip
    assert "ens" not in table_markdown(plain).splitlines()[0]


def test_zero_shot_splits_and_the_reference_protocol(tmp_path: Path) -> None:
    from anyorder.evaluation.zeroshot import parse_splits, resolve_splits

    names = ["lambada", "wikitext2", "ptb", "wikitext103", "lm1b"]
    # the AO-GPT reference code: WikiText-2 on its train split, every other set on test
    assert resolve_splits(names, "reference") == dict.fromkeys(names, "test") | {
        "wikitext2": "train"
    }
    assert set(resolve_splits(names).values()) == {"test"}
    over = parse_splits("wikitext2=test, lm1b=train")
    assert resolve_splits(names, "reference", over)["wikitext2"] == "test"
    with pytest.raises(DataError, match="lambada has no 'train' split; use one of test"):
        resolve_splits(["lambada"], "ours", {"lambada": "train"})
    with pytest.raises(DataError, match="--splits entry 'wikitext2': give NAME=SPLIT"):
        parse_splits("wikitext2")
    with pytest.raises(DataError, match="unknown zero-shot dataset 'wt2'"):
        resolve_splits(names, "ours", {"wt2": "test"})
    # the local layout: another split in a subfolder named after it
    root = write_layout(tmp_path / "zs")
    with pytest.raises(DataError, match="no folder .*wikitext2/train for the train split"):
        load_texts(dataset("wikitext2"), root, "train")
    (root / "wikitext2" / "train").mkdir()
    (root / "wikitext2" / "train" / "wiki.train.raw.txt").write_text(" = Train text = \n")
    assert load_texts(dataset("wikitext2"), root, "train") == [" = Train text = \n"]
    assert load_texts(dataset("wikitext2"), root)[1] == " = Robert Boulter = \n"


# ----------------------------------------------------------------------------- gen ppl


def make_judge_folder(path: Path) -> Path:
    """A tiny random-weight GPT-2 and a tokenizer, saved as a transformers folder."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    if has_gpt2_tokenizer():
        tok = GPT2TokenizerFast.from_pretrained(str(GPT2_TOKENIZER_DIR))
    else:  # no GPT-2 tokenizer files (ANYORDER_GPT2_TOKENIZER): a tiny byte-level BPE
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        raw = Tokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        raw.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer=trainer)
        tok = PreTrainedTokenizerFast(
            tokenizer_object=raw, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
        )
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def test_generative_perplexity_matches_the_hf_model(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from anyorder.evaluation.genppl import HFJudge, generative_perplexity, unigram_entropy

    folder = make_judge_folder(tmp_path / "judge")
    judge = HFJudge(str(folder))
    ours = ByteTokenizer()
    texts = [b"hello world the fox", b"quick brown"]
    samples = torch.tensor(
        [list(texts[0][:13]), list(texts[1]) + [256] + list(b"x")]  # sample 2 ends at its EOS
    )
    score = generative_perplexity(samples, ours, judge, batch_size=1)
    # direct: the HF model on [EOS] + tokens (+ EOS where the sample had one)
    hf = GPT2LMHeadModel.from_pretrained(str(folder)).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    eos = tok.eos_token_id
    total, count = 0.0, 0
    for text, ended in ((texts[0][:13].decode(), False), (texts[1].decode(), True)):
        ids = [eos] + tok.encode(text) + ([eos] if ended else [])
        x = torch.tensor([ids])
        with torch.no_grad():
            logp = hf(x).logits[0, :-1].log_softmax(-1)
        total -= float(logp.gather(1, x[0, 1:, None]).sum())
        count += len(ids) - 1
    assert score.scored_tokens == count and score.with_eos == 1 and score.truncated == 0
    assert score.nll_per_token == pytest.approx(total / count, rel=1e-5)
    assert score.gen_ppl == pytest.approx(math.exp(total / count), rel=1e-5)
    ent = unigram_entropy(samples)
    row = samples[0].tolist()
    p = np.array([row.count(v) for v in set(row)]) / len(row)
    assert float(ent[0]) == pytest.approx(float(-(p * np.log(p)).sum()))
    assert score.entropy == pytest.approx(float(ent.mean()))


def test_an_exported_gpt_judge_cuts_text_to_its_own_context(tmp_path: Path) -> None:
    """An anyorder export given as --judge loads through transformers, whose config names
    its context seq_len: the judge took 1024 for it, cut nothing, and eval --suite gen
    failed after all its sampling with "sequence of 111 tokens is longer than the model's
    context (model.seq_len=64); shorten it" (bytes re-encoded as U+FFFD grow threefold)."""
    from anyorder.checkpoint.exporting import save_pretrained
    from anyorder.evaluation.genppl import HFJudge, generative_perplexity

    folder = save_pretrained(tiny_model("gpt", vocab_size=257, seq_len=16), tmp_path / "judge",
                             ByteTokenizer())  # fmt: skip
    judge = HFJudge(str(folder))
    assert judge.max_len == 16
    samples = torch.full((2, 16), 0xFF)  # each byte decodes to U+FFFD: 48 bytes for the judge
    score = generative_perplexity(samples, ByteTokenizer(), judge)
    assert score.truncated == 2 and score.scored_tokens == 2 * 15


def test_reference_gen_protocol_is_the_mean_per_sample_ppl_of_the_ids_as_generated(
    tmp_path: Path,
) -> None:
    from anyorder.evaluation.genppl import ModelJudge, generate_samples, generative_perplexity

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text to model. " * 10)
    save_tiny_run(tmp_path / "judge", "gpt", corpus, seed=1)
    judge = ModelJudge(tmp_path / "judge")
    tok = ByteTokenizer()
    model = perturbed("aogpt", vocab_size=257, seq_len=16)
    samples = generate_samples(model, 16, 6, seed=3, batch_size=3, progress=False)
    samples[0, 5] = samples[2, 9] = tok.eos_id  # EOS mid-sample: the reference keeps going
    ref = generative_perplexity(samples, tok, judge, batch_size=4, protocol="reference")
    # direct: the judge on the unmodified ids, tokens 2..n each from the ids before it
    with torch.no_grad():
        nll = judge.model.token_nll(samples)[:, 1:].double()
    per_sample = nll.mean(dim=1).exp()
    assert ref.gen_ppl == pytest.approx(float(per_sample.mean()), rel=1e-5)
    assert ref.ppl_per_sample == pytest.approx(per_sample.tolist(), rel=1e-4)
    # the reference prints np.std: the population deviation (ddof 0)
    assert ref.ppl_per_sample_std == pytest.approx(float(np.std(per_sample.numpy())), rel=1e-4)
    assert ref.scored_tokens == 6 * 15 and ref.with_eos >= 2 and ref.protocol == "reference"
    assert ref.gen_ppl >= math.exp(ref.nll_per_token) - 1e-9  # Jensen: mean of exps
    ours = generative_perplexity(samples, tok, judge, batch_size=4)
    assert ours.protocol == "ours" and ours.scored_tokens != ref.scored_tokens  # cut at EOS
    with pytest.raises(ConfigError, match="unknown protocol 'paper'; use one of ours, reference"):
        generative_perplexity(samples, tok, judge, protocol="paper")


def test_reference_gen_protocol_needs_the_models_vocabulary(tmp_path: Path) -> None:
    from anyorder.evaluation.genppl import HFJudge, generative_perplexity

    judge = HFJudge(str(make_judge_folder(tmp_path / "judge")))  # a BPE judge, byte model
    samples = torch.randint(0, 256, (2, 8))
    with pytest.raises(ConfigError, match="reference protocol scores the generated ids as they"):
        generative_perplexity(samples, ByteTokenizer(), judge, protocol="reference")


def test_generate_samples(gen: torch.Generator) -> None:
    from anyorder.evaluation.genppl import generate_samples

    model = tiny_model("aogpt")
    a = generate_samples(model, 6, 3, seed=4, batch_size=2, progress=False)
    assert a.shape == (3, 6) and int(a.max()) < 11
    assert torch.equal(a, generate_samples(model, 6, 3, seed=4, batch_size=2, progress=False))
    with pytest.raises(SamplingError, match="steps=9 must lie in 1..n=6"):
        generate_samples(model, 6, 1, steps=9, progress=False)
    fewer = generate_samples(model, 6, 3, steps=2, temperature=0.7, top_p=0.9, progress=False)
    assert fewer.shape == (3, 6)
    with pytest.raises(SamplingError, match="gpt cannot predict several positions per pass"):
        generate_samples(tiny_model("gpt"), 6, 1, steps=2, progress=False)


# ----------------------------------------------------------------------------- plots


def test_plots_write_pngs(tmp_path: Path) -> None:
    from anyorder.plots import plot_ensemble_curve, plot_gen_sweep

    model = perturbed("aogpt", vocab_size=7, seq_len=8)
    x = torch.randint(0, 7, (3, 8))
    res = likelihood_suite(model, x, bytes_per_token=1.0, orders=2, ensemble=4, progress=False)
    res = json.loads(json.dumps(res))  # as read back from the JSON file: string keys
    png = plot_ensemble_curve({"toy": res}, tmp_path / "ens.png")  # bits per byte
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png = plot_ensemble_curve({"toy": res}, tmp_path / "ens_ppl.png", unit="ppl")
    assert png.read_bytes()[:4] == b"\x89PNG"
    res["bytes_per_token"] = None
    with pytest.raises(ConfigError, match="no bytes per token: plot them with unit='ppl'"):
        plot_ensemble_curve({"toy": res}, tmp_path / "none.png")
    rows = [
        {"steps": s, "temperature": t, "gen_ppl": 10.0 / s + t, "entropy": 4.0 + t}
        for s in (8, 16, 32)
        for t in (0.7, 1.0)
    ]
    for axis in ("steps", "temperature"):
        png = plot_gen_sweep(rows, tmp_path / f"{axis}.png", x=axis)
        assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ConfigError, match="no ensemble results to plot"):
        plot_ensemble_curve({"toy": {"ensemble": None}}, tmp_path / "none.png")


# ----------------------------------------------------------------------------- the CLI


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return conftest_run_cli(
        *args,
        cwd=cwd,
        env={"OMP_NUM_THREADS": "1", "PATH": "", "PYTHONPATH": str(REPO / "src")},
    )


def save_tiny_run(run: Path, kind: str, source: Path, seed: int = 0) -> None:
    from anyorder.checkpoint import save_checkpoint

    model = perturbed(kind, seed, vocab_size=257, seq_len=16)
    cfg = RunConfig(model=model.cfg)
    cfg.data.source = str(source)
    cfg.data.tokenizer = "bytes"
    cfg.data.val_fraction = 0.5
    cfg.data.cache_dir = str(run.parent / "cache")
    save_checkpoint(run, 1, model=model, config=cfg, tokenizer=ByteTokenizer())


def test_cli_eval_end_to_end(tmp_path: Path, capsys, monkeypatch) -> None:
    from anyorder.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "some text to model. " * 6)
    save_tiny_run(tmp_path / "run", "aogpt", corpus)
    save_tiny_run(tmp_path / "judge", "gpt", corpus, seed=1)
    out = tmp_path / "out"
    common = ["--orders", "2", "--max-blocks", "3", "--no-progress", "--out", str(out)]
    # the console script, in a process of its own, its stderr a pipe (not a terminal): the
    # estimate comes first, then progress lines, not \r updates
    args = ["--orders", "2", "--max-blocks", "3", "--out", str(out), "--targets", "4"]
    r = run_cli("eval", str(tmp_path / "run"), "--ensemble", "2", *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    # after the data preparation's own lines (the corpus is tokenized on first use)
    err = [line for line in r.stderr.splitlines() if not line.startswith("tokenizing ")]
    assert (
        err[0].startswith("aogpt likelihoods of 3 blocks: about ")
        and "passes of 16 tokens x" in err[0]
    )
    assert any(line.startswith("ensemble x2: ") and "passes of 16 tokens (100%)" in line
               for line in err)  # fmt: skip
    assert any(line.startswith("left to right: 3/3 blocks (100%)") for line in err)
    assert "\r" not in r.stderr
    text = r.stdout
    assert "this run kept no EMA of its weights (train.ema: 0)" in text  # said once
    assert text.count("no EMA") == 1
    assert "± = standard error over the 3 blocks" in text and "bits/byte, lower is better" in text
    assert "left to right (exact)" in text and "any order (K=2 orders)" in text
    assert "on 4 random target slots per block and order" in text
    assert "x1 = plain any order" in text and "gain x1 - x2 = " in text
    assert "forward passes of n=16 tokens" in text and "every target: --targets all" in text
    assert "nats/token" not in text and "ppl" not in text  # one unit
    res = json.loads((out / "likelihood.json").read_text())
    assert res["blocks"] == 3 and res["ensemble"]["members"] == 2
    assert res["l2r"]["bits_per_byte"] > 0 and (out / "ensemble.png").is_file()
    # block-level error bars, the order draw's part beside them, the values behind them
    per = res["per_block"]
    assert len(per["l2r"]) == 3 and np.array(per["any_order"]).shape == (3, 2)
    l2r = np.array(per["l2r"])
    assert res["l2r"]["stderr"] == pytest.approx(l2r.std(ddof=1) / math.sqrt(3), rel=1e-4)
    assert res["l2r"]["stderr_orders"] is None and res["any_order"]["stderr_orders"] > 0
    assert res["ensemble"]["targets"] == 4 and set(per["ensemble"]) == {"1", "2"}

    monkeypatch.chdir(tmp_path)  # the rest in this process (faster)
    # an ensemble scores a few random target slots unless told otherwise (all: --targets all)
    assert main(["eval", str(tmp_path / "run"), "--ensemble", "2", *common]) == 0
    assert "on 8 random target slots per block and order" in capsys.readouterr().out
    assert (
        main(["eval", str(tmp_path / "run"), "--ensemble", "2", "--targets", "all", *common]) == 0
    )
    assert "on every target slot" in capsys.readouterr().out
    zs = write_layout(tmp_path / "zs")
    argv = ["eval", str(tmp_path / "run"), "--suite", "zero-shot", "--data-dir", str(zs)]
    assert main([*argv, "--datasets", "ptb,lambada", *common]) == 0
    assert "| ptb" in capsys.readouterr().out and (out / "zero_shot.md").is_file()
    # the reference protocol: WikiText-2 on its train split, named in the table
    (zs / "wikitext2" / "train").mkdir()
    (zs / "wikitext2" / "train" / "wiki.train.raw.txt").write_text(
        " = Valkyria Chronicles = \n The game @-@ play began in 2011 . \n" * 3
    )
    ref = [*argv, "--datasets", "wikitext2,ptb", "--protocol", "reference", *common]
    assert main(ref) == 0
    md = capsys.readouterr().out
    assert "| split (reference protocol) |" in md
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in md.splitlines() if line.startswith("| ")}  # fmt: skip
    assert rows["wikitext2"] == "train" and rows["ptb"] == "test"
    assert "Protocol: reference (the AO-GPT reference code's splits" in md
    saved = json.loads((out / "zero_shot.json").read_text())
    assert saved["protocol"] == "reference" and saved["splits"]["wikitext2"] == "train"
    assert main([*argv, "--datasets", "ptb", "--splits", "ptb=train", *common]) == 2
    assert "no folder" in capsys.readouterr().err

    argv = ["eval", str(tmp_path / "run"), "--suite", "gen", "--judge", str(tmp_path / "judge")]
    argv += ["--num-samples", "2", "--length", "8", "--temperature", "0.8,1.0"]
    assert main([*argv, *common]) == 0
    rows = json.loads((out / "gen.json").read_text())["rows"]
    assert [row["temperature"] for row in rows] == [0.8, 1.0]
    assert all(row["gen_ppl"] > 1 and row["entropy"] > 0 for row in rows)
    assert (out / "gen_temperature.png").is_file()
    assert "gen PPL (ours protocol: pooled)" in capsys.readouterr().out
    assert main([*argv, "--protocol", "reference", *common]) == 0
    assert "gen PPL (reference protocol: mean per sample)" in capsys.readouterr().out
    assert json.loads((out / "gen.json").read_text())["rows"][0]["protocol"] == "reference"

    assert main(["eval", str(tmp_path / "nowhere"), *common]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint path" in err and "does not exist" in err
    argv = ["eval", str(tmp_path / "run"), "--suite", "gen", "--judge", str(tmp_path / "run")]
    assert main([*argv, *common]) == 2
    assert "a judge must be a left-to-right gpt" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "run"), "--ensemble", "0", *common]) == 2
    assert "--ensemble must be at least 1" in capsys.readouterr().err
    bad = {
        ("--ensemble", "2", "--targets", "x"): "--targets 'x': give a number of target slots, or",
        ("--protocol", "reference"): "--protocol reference applies to --suite zero-shot and gen",
        ("--splits", "ptb=test"): "--splits applies to --suite zero-shot; use --split",
        ("--max-tokens", "0"): "--max-tokens must be at least 1",
    }
    for flags, message in bad.items():
        assert main(["eval", str(tmp_path / "run"), *flags, *common]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_cli_eval_prints_its_estimate_even_without_progress(tmp_path, capsys, monkeypatch) -> None:
    """--no-progress drops the bars, not the estimate: a long MDM evaluation never runs
    silent, and the estimate says what dominates it."""
    from anyorder.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "some text to model. " * 6)
    save_tiny_run(tmp_path / "run", "mdm", corpus)
    monkeypatch.chdir(tmp_path)
    argv = ["eval", "run", "--orders", "2", "--max-blocks", "3", "--no-progress"]
    assert main(argv) == 0
    err = [e for e in capsys.readouterr().err.splitlines() if not e.startswith("tokenizing ")]
    assert len(err) == 1, err  # the estimate, and no progress line
    head = "mdm likelihoods of 3 blocks (left to right: 16 encoder passes a block, the ELBO 2): "
    assert err[0].startswith(head + "about ") and "54 passes of 16 tokens x" in err[0], err
    res = json.loads((tmp_path / "run" / "eval" / "likelihood.json").read_text())
    assert res["any_order"]["kind"] == "elbo" and res["blocks"] == 3
