"""EleutherAI's evaluation harness on anyorder models, offline: the local tasks of
tests/fixtures/lm_eval run through the harness's own command line (``python -m
anyorder.harness``), and the numbers it receives are checked against computations written
out here: a plain forward pass of the model over the (permuted) sequence, its log-softmax
summed by hand, in the harness's own windows (``lm_eval.utils``)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.errors import AnyorderError, ConfigError
from anyorder.evaluation.conditional import _order, continuation_nll
from anyorder.evaluation.corpus import block_generator
from anyorder.evaluation.estimators import combine_members, member_logprobs

from conftest import REPO, tiny_model

pytest.importorskip("lm_eval", reason="the harness is the eval extra: pip install anyorder[eval]")

from anyorder.harness.run import main  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "lm_eval"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Byte vocabulary, context 64 (the perplexity texts span two windows)."""
    root = tmp_path_factory.mktemp("harness")
    return {
        kind: save_pretrained(
            tiny_model(kind, seed=3, vocab_size=257, seq_len=64), root / kind, ByteTokenizer()
        )
        for kind in ("gpt", "aogpt", "armd", "mdm")
    }


def harness(tmp_path, monkeypatch, model: Path, tasks: str, *extra: str, include=FIXTURES):
    """Run the harness's command line on the fixture tasks; per task, its logged samples,
    and its results under ``"results"``."""
    monkeypatch.chdir(REPO)  # the task YAML names its data files from the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for h in logging.getLogger("lm_eval").handlers:  # made once, on an earlier test's stderr
        if type(h) is logging.StreamHandler:  # not pytest's own capture handlers
            monkeypatch.setattr(h, "stream", sys.stderr)
    out = tmp_path / "out"
    main(
        ["run", "--model", "anyorder", "--model_args", f"pretrained={model}", *extra,
         "--tasks", *tasks.split(), "--include_path", str(include), "--device", "cpu",
         "--batch_size", "3", "--log_samples", "--output_path", str(out)]
    )  # fmt: skip
    found = {}
    for task in tasks.split():
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        found[task] = [json.loads(line) for line in path.read_text().splitlines()]
    (res,) = out.rglob("results_*.json")
    found["results"] = json.loads(res.read_text())["results"]
    return found


def _pairs(sample: dict) -> list[tuple[str, str, float, bool]]:
    """(context, continuation, log-likelihood, is_greedy) of each request of a sample."""
    out = []
    for args, resp in zip(sample["arguments"].values(), sample["resps"]):
        ll, greedy = resp[0]
        out.append((args["arg_0"], args["arg_1"], float(ll), greedy == "True"))
    return out


def _stock_wikitext(folder: Path) -> None:
    """The harness's own wikitext task (its detokenizer and metrics) on a local JSON file in
    its format (``page``): the YAML includes the stock one and changes only the data."""
    import lm_eval

    stock = Path(lm_eval.__file__).parent / "tasks" / "wikitext" / "wikitext.yaml"
    page = " = Loops = \n\n A for loop iterates over a sequence @-@ in order . \n"
    (folder / "wiki.jsonl").write_text(json.dumps({"page": page}) + "\n")
    (folder / "wikitext_local.yaml").write_text(
        f"include: {stock}\ntask: wikitext_local\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'wiki.jsonl'}\n"
        "training_split: null\nvalidation_split: null\n"
    )


@torch.no_grad()
def _by_hand(model, ctx: list[int], cont: list[int], order: torch.Tensor | None = None) -> float:
    """log p(cont | ctx) from one plain forward over ``ctx + cont`` (cut from the left to the
    window first): slot ``s`` predicts the token at ``order[s]`` (identity: left to right);
    the continuation's slots' log-softmax summed here. ``order``: of the cut sequence."""
    ids = (ctx + cont)[-model.cfg.seq_len :]
    k = len(ids) - min(len(cont), len(ids))
    x = torch.tensor([ids])
    o = torch.arange(len(ids)) if order is None else order
    logits = model(x) if model.kind == "gpt" else model(x, o[None])
    logp = torch.log_softmax(logits[0].double(), dim=-1)
    return sum(float(logp[s, ids[o[s]]]) for s in range(k, len(ids)))


def _any_order_by_hand(model, ctx: list[int], cont: list[int], seed: int, orders: int) -> float:
    """The mean over the ``orders`` drawn orders (the documented draw: the context left to
    right, then the continuation in ``randperm`` of the generator of block 0, stream 0,
    replicate k) of :func:`_by_hand`."""
    ids = (ctx + cont)[-model.cfg.seq_len :]
    k = len(ids) - min(len(cont), len(ids))
    total = 0.0
    for r in range(orders):
        tail = torch.randperm(len(ids) - k, generator=block_generator(seed, 0, 0, r))
        total += _by_hand(model, ctx, cont, torch.cat([torch.arange(k), k + tail]))
    return total / orders


def _windows(text: str, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """The harness's own rolling windows of a text (one token of context, disjoint); the
    prefix token it puts first is our BOS (slot 0 of every forward), so the first window's
    context is empty."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ids = ByteTokenizer().encode(text)
    eot = ByteTokenizer().eos_id
    windows = get_rolling_token_windows(ids, eot, seq_len, 1)
    out = [make_disjoint_window(w) for w in windows]
    return [([] if i == 0 else c, t) for i, (c, t) in enumerate(out)]


def _encoded(lm, ctx: str, cont: str) -> tuple[list[int], list[int]]:
    """The harness's tokenisation of a pair (its own ``_encode_pair``; an empty context is
    its prefix token, as ``TemplateLM.loglikelihood`` makes it)."""
    return ([lm.prefix_token_id], lm.tok_encode(cont)) if ctx == "" else lm._encode_pair(ctx, cont)


def test_left_to_right_is_a_plain_forward_in_the_harness_windows(
    tmp_path, monkeypatch, exports
) -> None:
    from anyorder.harness import AnyorderLM

    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES, tasks)
    _stock_wikitext(tasks)
    got = harness(
        tmp_path, monkeypatch, exports["gpt"], "anyorder_mc anyorder_ppl wikitext_local",
        include=tasks,
    )  # fmt: skip
    lm = AnyorderLM(str(exports["gpt"]), device="cpu")
    model = lm.model
    correct = []
    for sample in got["anyorder_mc"]:
        lls = []
        for ctx, cont, ll, greedy in _pairs(sample):
            assert ll == pytest.approx(_by_hand(model, *_encoded(lm, ctx, cont)), rel=1e-5)
            assert greedy is False  # an untrained model writes none of the choices greedily
            lls.append(ll)
        correct.append(float(max(range(len(lls)), key=lls.__getitem__) == sample["doc"]["label"]))
    assert got["results"]["anyorder_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    docs = got["anyorder_ppl"]
    assert any(len(d["doc"]["text"]) > 64 for d in docs)  # two windows at least once
    for d in docs:
        want = sum(_by_hand(model, c, t) for c, t in _windows(d["doc"]["text"], 64))
        assert float(d["resps"][0][0]) == pytest.approx(want, rel=1e-5)
    bits = sum(-float(d["resps"][0][0]) for d in docs) / math.log(2)
    size = sum(len(d["doc"]["text"].encode()) for d in docs)
    assert got["results"]["anyorder_ppl"]["bits_per_byte,none"] == pytest.approx(bits / size)
    (wiki,) = got["wikitext_local"]
    text = wiki["arguments"]["gen_args_0"]["arg_0"]
    assert "@-@" not in text and "sequence-in" in text  # the stock detokenizer ran
    want = sum(_by_hand(model, c, t) for c, t in _windows(text, 64))
    assert float(wiki["resps"][0][0]) == pytest.approx(want, rel=1e-5)


def test_rolling_from_scratch_is_an_option(exports) -> None:
    """``rolling=scratch``: every window of seq_len tokens from scratch, as Model.score."""
    from lm_eval.api.instance import Instance

    from anyorder.harness import AnyorderLM

    text = "A for loop iterates over a sequence, in order; a while loop tests first. " * 2
    ids = ByteTokenizer().encode(text)
    assert len(ids) > 2 * 64
    req = Instance("loglikelihood_rolling", {}, (text,), 0)
    got = {}
    for rolling in ("harness", "scratch"):
        lm = AnyorderLM(str(exports["gpt"]), device="cpu", rolling=rolling)
        (got[rolling],) = lm.loglikelihood_rolling([req])
    model = lm.model
    scratch = sum(_by_hand(model, [], ids[i : i + 64]) for i in range(0, len(ids), 64))
    assert got["scratch"] == pytest.approx(scratch, rel=1e-5)
    assert abs(got["harness"] - got["scratch"]) > 1e-3  # later windows see their past there


def test_any_order_is_a_plain_forward_over_the_drawn_orders(tmp_path, monkeypatch, exports) -> None:
    from anyorder.harness import AnyorderLM

    args = ("order=any", "num_orders=2", "seed=5")
    got = harness(tmp_path, monkeypatch, exports["armd"], "anyorder_mc anyorder_ppl", *args)
    lm = AnyorderLM(str(exports["armd"]), device="cpu")
    model = lm.model
    for sample in got["anyorder_mc"]:
        for ctx, cont, ll, _ in _pairs(sample):
            want = _any_order_by_hand(model, *_encoded(lm, ctx, cont), seed=5, orders=2)
            assert ll == pytest.approx(want, rel=1e-5)
    for d in got["anyorder_ppl"]:
        windows = _windows(d["doc"]["text"], 64)
        want = sum(_any_order_by_hand(model, c, t, seed=5, orders=2) for c, t in windows)
        assert float(d["resps"][0][0]) == pytest.approx(want, rel=1e-5)


def test_ensemble_is_eq7_over_the_member_orders(exports) -> None:
    """The harness's ensemble path (full mixtures, for is_greedy) against the chunked
    member_logprobs of the likelihood suite, on the same orders and keys."""
    model = anyorder.load(exports["aogpt"]).model
    ctx, cont = [5, 6, 7, 8], [9, 10, 11]
    res = continuation_nll(model, [(ctx, cont)], order="any", num_orders=2, ensemble=3, seed=3)
    for k in range(2):
        order = _order(4, 3, 7, "any", k, 3)
        keys = torch.rand(2, 7, generator=block_generator(3, 0, 1, k), dtype=torch.float64)
        slots = torch.tensor([[4, 5, 6]])
        lp, _ = member_logprobs(model, torch.tensor([ctx + cont]), order[None], keys[None], slots)
        assert float(res.nll[0, k]) == pytest.approx(float(-combine_members(lp).sum()), rel=1e-5)


@torch.no_grad()
def _greedy(model, ids: list[int], count: int) -> list[int]:
    """Greedy left-to-right decoding by full forward passes (no cache); slot ``s`` of the
    forward predicts the token at position ``s``, so a placeholder takes the new slot."""
    ids = list(ids)
    for _ in range(count):
        ids.append(int(model(torch.tensor([ids + [0]]))[0, -1].argmax()))
    return ids


def test_is_greedy_and_generate_until_follow_the_argmax(tmp_path) -> None:
    from lm_eval.api.instance import Instance

    from anyorder.harness import AnyorderLM

    # untied: an untrained tied model only repeats the last byte
    model = tiny_model("gpt", seed=3, vocab_size=257, seq_len=64, tie_embeddings=False)
    lm = AnyorderLM(str(save_pretrained(model, tmp_path / "gpt", ByteTokenizer())), batch_size=2)
    ctx = "The"
    ids = _greedy(lm.model, ByteTokenizer().encode(ctx), 6)
    best = ByteTokenizer().decode(ids[len(ctx) :])
    assert best.isascii()  # the decoded text encodes back to the same bytes
    other = best[:-1] + chr((ord(best[-1]) + 1) % 128)

    def req(kind, args):
        return Instance(kind, {}, args, 0)

    out = lm.loglikelihood([req("loglikelihood", (ctx, best)), req("loglikelihood", (ctx, other))])
    assert [g for _, g in out] == [True, False], best
    gen = lm.generate_until(
        [req("generate_until", (ctx, {"until": ["x", best[3:5]], "max_gen_toks": 6}))]
        + [req("generate_until", (ctx, {"max_gen_toks": 4, "do_sample": False}))]
    )
    assert gen == [best[: best.index(best[3:5])], best[:4]]


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(order="sideways"), "--model_args order='sideways': use one of l2r, any"),
        (dict(num_orders=0), "--model_args num_orders=0: give a whole number >= 1"),
        (dict(colour="red"), "--model_args colour: not an argument of the anyorder model; use "),
        (dict(order="ensemble:x"), "--model_args order='ensemble:x': write ensemble:M with M >= 1"),
        (dict(device="tpu"), "--device 'tpu': use cpu, cuda, cuda:N or auto"),
        (dict(steps=1.5), "--model_args steps=1.5: give a whole number >= 1"),
        (dict(order="ensemble:٣"), "--model_args order='ensemble:٣': write ensemble:M with M >= 1"),
        (dict(order="ensemble:0"), "--model_args order='ensemble:0': write ensemble:M with M >= 1"),
        (
            dict(order="ensemble:" + "9" * 5000),
            "--model_args order='ensemble:99999999999... (5000 digits)' must be at most 10,000 "
            "(each member costs about one pass per request and order); use e.g. order=ensemble:8",
        ),
        (dict(num_orders=10001), "--model_args num_orders=10001 must be at most 10,000 "),
        (dict(batch_size=10**9), "--batch_size 1000000000 must be at most 1024; use e.g. 8"),
        (dict(seed=2**63), "--model_args seed=9223372036854775808 must be a whole number in "),
        (dict(rolling="sometimes"), "--model_args rolling='sometimes': use one of harness, "),
    ],
)
def test_bad_model_arguments_name_the_argument(exports, args, message) -> None:
    from anyorder.harness.settings import parse_settings

    with pytest.raises(AnyorderError) as e:  # ConfigError; SamplingError for the seed
        parse_settings(str(exports["aogpt"]), args)
    assert str(e.value).startswith(message)


def test_a_bad_argument_on_the_harness_command_line_is_one_line(
    tmp_path, monkeypatch, capsys, exports
) -> None:
    with pytest.raises(SystemExit) as e:
        harness(tmp_path, monkeypatch, exports["aogpt"], "anyorder_mc", "order=sideways")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "anyorder harness: error: --model_args order='sideways': use one of l2r, any"
    assert not any("Traceback" in line for line in err), "\n".join(err)


def test_orders_the_model_has_no_meaning_for_are_refused(exports) -> None:
    from anyorder.harness import AnyorderLM

    with pytest.raises(ConfigError, match="gpt is a left-to-right model"):
        lm = AnyorderLM(str(exports["gpt"]), order="any", device="cpu")
        lm._loglikelihood_tokens([(("a", "b"), [97], [98])])
    lm = AnyorderLM(str(exports["mdm"]), order="ensemble:2", device="cpu")
    with pytest.raises(ConfigError, match="an encoder's conditionals depend on the context set"):
        lm._loglikelihood_tokens([(("a", "b"), [97], [98])])


def test_anyorder_eval_suite_lm_eval(tmp_path, monkeypatch, capsys, exports) -> None:
    """``anyorder eval --suite lm-eval``: the harness's table, the results file, one-line
    errors for a missing or unknown task."""
    from anyorder.cli import main as cli

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model = str(exports["gpt"])
    assert cli(["eval", model, "--suite", "lm-eval"]) == 2
    assert capsys.readouterr().err.strip() == (
        "anyorder eval: error: --suite lm-eval needs --tasks NAME[,NAME...]"
    )
    args = ["eval", model, "--suite", "lm-eval", "--include-path", str(FIXTURES)]
    assert cli([*args, "--tasks", "anyorder_nope"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith("anyorder eval: error: --tasks anyorder_nope: not a task the harness knows")
    )
    out = tmp_path / "out"
    assert cli([*args, "--tasks", "anyorder_ppl", "--device", "cpu", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    saved = json.loads((out / "lm_eval.json").read_text())["results"]["anyorder_ppl"]
    assert f"{saved['bits_per_byte,none']:.4f}" in table


# ----------------------------------------------------------------------------- batches


def _requests(kind: str, pairs) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(pairs)]


@pytest.mark.parametrize(
    "kind, order",
    [
        ("gpt", "l2r"),
        ("aogpt", "l2r"),
        ("aogpt", "any"),
        ("aogpt", "ensemble:3"),
        ("armd", "any"),
        ("armd", "ensemble:3"),
        ("mdm", "l2r"),
        ("mdm", "any"),
    ],
)
def test_a_requests_value_does_not_depend_on_its_batch(exports, kind, order) -> None:
    """Requests of different lengths in one batch against each alone: the same values
    (the ensemble's member orders were once drawn over the padded batch length)."""
    from anyorder.harness import AnyorderLM

    pairs = [
        ("The for statement", " iterates."),
        ("x", "yz"),
        ("To leave a loop early in a long program, use", " break and go on."),
    ]
    texts = [("short text.",), ("A longer text that needs a second window to fit. " * 2,)]
    args = dict(device="cpu", order=order, num_orders=2, seed=4)
    together = AnyorderLM(str(exports[kind]), batch_size=3, **args)
    alone = AnyorderLM(str(exports[kind]), batch_size=1, **args)
    batched = [ll for ll, _ in together.loglikelihood(_requests("loglikelihood", pairs))]
    for pair, ll in zip(pairs, batched):
        ((want, _),) = alone.loglikelihood(_requests("loglikelihood", [pair]))
        assert ll == pytest.approx(want, abs=1e-4)
    rolled = together.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    for text, ll in zip(texts, rolled):
        assert ll == pytest.approx(
            alone.loglikelihood_rolling(_requests("loglikelihood_rolling", [text]))[0], abs=1e-4
        )


def test_a_continuation_longer_than_the_context_is_cut_from_the_left(exports, caplog) -> None:
    """As the harness's hf model: the pair is cut from the left to the window (the
    continuation's first tokens go), said once in the log; the run goes on."""
    from anyorder.harness import AnyorderLM

    lm = AnyorderLM(str(exports["gpt"]), device="cpu")
    long = "0123456789" * 10
    ids = ByteTokenizer().encode(long)
    with caplog.at_level("WARNING"):
        out = lm.loglikelihood(_requests("loglikelihood", [("ab", long), ("cd", long)]))
    assert [ll for ll, _ in out] == pytest.approx([_by_hand(lm.model, [], ids[-64:])] * 2, rel=1e-5)
    said = [
        r.getMessage()
        for r in caplog.records
        if "longer than the model's context" in r.getMessage()
    ]
    assert said == [
        "a continuation of 100 tokens is longer than the model's context of 64: its first "
        "tokens are cut and its last 64 scored (as the harness's hf model cuts from the "
        "left); said once"
    ]


# ----------------------------------------------------------------------------- sampling


def test_sampled_repeats_are_independent_samples(tmp_path, monkeypatch, exports) -> None:
    """The harness's repeats (maj@k, pass@k): 6 copies of a question sampled (do_sample
    without a temperature: at 1.0, not greedily) come back as 6 different texts, at a batch
    size of 3 (each batch once re-seeded the one generator: 2 distinct texts)."""
    got = harness(tmp_path, monkeypatch, exports["gpt"], "anyorder_gen_repeats")
    for sample in got["anyorder_gen_repeats"]:
        (texts,) = sample["resps"]  # one request, its 6 repeats
        assert len(texts) == 6 and len(set(texts)) == 6, texts


def test_sampling_is_reproducible_at_any_batch_size(tmp_path) -> None:
    from anyorder.harness import AnyorderLM

    model = tiny_model("gpt", seed=3, vocab_size=257, seq_len=64, tie_embeddings=False)
    path = str(save_pretrained(model, tmp_path / "gpt", ByteTokenizer()))
    gen = {"until": ["never"], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0}
    reqs = _requests("generate_until", [("The", gen)] * 4 + [("A loop", gen)] * 3)

    def run(batch_size: int, seed: int = 0) -> list[str]:
        lm = AnyorderLM(path, device="cpu", batch_size=batch_size, seed=seed)
        return lm.generate_until(reqs)

    first = run(2)
    assert len(set(first[:4])) == 4 and len(set(first[4:])) == 3
    assert run(2) == first  # the same seed, the same texts
    assert run(1) == first and run(7) == first  # whatever the batch size
    assert run(2, seed=1) != first


@pytest.mark.parametrize(
    "kwargs, want",
    [
        (dict(do_sample=True), (1.0, None)),  # the harness's sampling without a temperature
        (dict(temperature=0.7), (0.7, None)),  # do_sample left out: temperature > 0 samples
        (dict(do_sample=True, temperature=0.5, top_k=5), (0.5, 5)),
        (dict(do_sample=True, temperature=0), (1.0, 1)),  # an explicit 0 is greedy
        (dict(do_sample=False, temperature=0.7), (1.0, 1)),
        (dict(), (1.0, 1)),
    ],
)
def test_generation_arguments_follow_the_harness(kwargs, want) -> None:
    from anyorder.harness.settings import gen_settings

    g = gen_settings(kwargs, "")
    assert (g.temperature, g.top_k) == want


# ----------------------------------------------------------------------------- bounds


@pytest.mark.parametrize(
    "args, message",
    [
        (
            "order=any,num_orders=1000000000",
            "--model_args num_orders=1000000000 must be at most 10,000 (each order is one pass "
            "over every request); use e.g. num_orders=16",
        ),
        (
            "order=ensemble:1000000000",
            "--model_args order='ensemble:1000000000' must be at most 10,000 (each member costs "
            "about one pass per request and order); use e.g. order=ensemble:8",
        ),
        ("order=ensemble:²", "--model_args order='ensemble:²': write ensemble:M with M >= 1"),
    ],
)
def test_unbounded_model_arguments_are_one_line(
    tmp_path, monkeypatch, capsys, exports, args, message
) -> None:
    """Through the harness's command line: refused before any request runs, exit 2."""
    import anyorder.evaluation.conditional as conditional

    def started(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(conditional, "continuation_nll", started)
    with pytest.raises(SystemExit) as e:
        harness(tmp_path, monkeypatch, exports["aogpt"], "anyorder_mc", args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "anyorder harness: error: " + message
    assert not any("Traceback" in line for line in err), "\n".join(err)


def test_an_ensemble_beyond_the_memory_is_refused(monkeypatch, exports) -> None:
    """The command line's estimate: 16 bytes per member, target and position."""
    import anyorder.memory
    from anyorder.harness import AnyorderLM

    monkeypatch.setattr(anyorder.memory, "machine_memory", lambda device="cpu": 10**6)
    with pytest.raises(ConfigError) as e:
        AnyorderLM(str(exports["aogpt"]), device="cpu", order="ensemble:64")
    assert str(e.value) == (
        "--model_args order='ensemble:64' needs at least 4.2 MB for the orders of a "
        "continuation of up to 64 tokens at once, more than this machine's 1.0 MB; use e.g. "
        "order=ensemble:8"
    )
    AnyorderLM(str(exports["aogpt"]), device="cpu", order="ensemble:8")  # 524 kB: fits


@pytest.mark.parametrize(
    "model_args, message",
    [
        (
            "pretrained=/etc",
            "--model-args pretrained: anyorder eval takes it as its first argument (the "
            "checkpoint); leave it out of --model-args",
        ),
        ("seed=3", "--model-args seed: anyorder eval takes it as --seed; leave it out of "),
        (
            "order=any,num_orders=1000000000",
            "--model_args num_orders=1000000000 must be at most 10,000 (each order is one pass "
            "over every request); use e.g. num_orders=16",
        ),
    ],
)
def test_anyorder_eval_model_args_are_one_line(
    monkeypatch, capsys, exports, model_args, message
) -> None:
    from anyorder.cli import main as cli

    monkeypatch.chdir(REPO)
    args = ["eval", str(exports["aogpt"]), "--suite", "lm-eval", "--tasks", "anyorder_mc"]
    assert cli([*args, "--include-path", str(FIXTURES), "--model-args", model_args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"anyorder eval: error: {message}")
    assert "Traceback" not in err
