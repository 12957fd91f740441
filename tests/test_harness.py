"""EleutherAI's evaluation harness on anyorder models, offline: the local tasks of
tests/fixtures/lm_eval run through the harness's own command line (``python -m
anyorder.harness``), and the numbers it receives are checked against ``Model.score`` and
against computations written out here."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.errors import ConfigError
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


def test_left_to_right_equals_score_and_the_chain_rule(tmp_path, monkeypatch, exports) -> None:
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURES, tasks)
    _stock_wikitext(tasks)
    got = harness(
        tmp_path, monkeypatch, exports["aogpt"], "anyorder_mc anyorder_ppl wikitext_local",
        include=tasks,
    )  # fmt: skip
    model = anyorder.load(exports["aogpt"])
    correct = []
    for sample in got["anyorder_mc"]:
        lls = []
        for ctx, cont, ll, greedy in _pairs(sample):
            assert ll == pytest.approx(-model.score(cont, context=ctx)["nats"], rel=1e-6)
            # independent: log p(cont | ctx) = log p(ctx + cont) - log p(ctx), left to right
            chain = model.score(ctx + cont)["nats"] - model.score(ctx)["nats"]
            assert ll == pytest.approx(-chain, rel=1e-5)
            assert greedy is False  # an untrained model writes none of the choices greedily
            lls.append(ll)
        correct.append(float(max(range(len(lls)), key=lls.__getitem__) == sample["doc"]["label"]))
    assert got["results"]["anyorder_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    docs = got["anyorder_ppl"]
    assert any(len(d["doc"]["text"]) > 64 for d in docs)  # two windows at least once
    for d in docs:
        assert float(d["resps"][0][0]) == pytest.approx(
            -model.score(d["doc"]["text"])["nats"], rel=1e-6
        )
    bits = sum(-float(d["resps"][0][0]) for d in docs) / math.log(2)
    size = sum(len(d["doc"]["text"].encode()) for d in docs)
    assert got["results"]["anyorder_ppl"]["bits_per_byte,none"] == pytest.approx(bits / size)
    (wiki,) = got["wikitext_local"]
    text = wiki["arguments"]["gen_args_0"]["arg_0"]
    assert "@-@" not in text and "sequence-in" in text  # the stock detokenizer ran
    assert float(wiki["resps"][0][0]) == pytest.approx(-model.score(text)["nats"], rel=1e-6)


def test_any_order_equals_score(tmp_path, monkeypatch, exports) -> None:
    args = ("order=any", "num_orders=2", "seed=5")
    got = harness(tmp_path, monkeypatch, exports["armd"], "anyorder_mc anyorder_ppl", *args)
    model = anyorder.load(exports["armd"])
    kw = dict(order="any", num_orders=2, seed=5)
    for sample in got["anyorder_mc"]:
        for ctx, cont, ll, _ in _pairs(sample):
            assert ll == pytest.approx(-model.score(cont, context=ctx, **kw)["nats"], rel=1e-6)
    for d in got["anyorder_ppl"]:
        want = -model.score(d["doc"]["text"], **kw)["nats"]
        assert float(d["resps"][0][0]) == pytest.approx(want, rel=1e-6)


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
    ],
)
def test_bad_model_arguments_name_the_argument(exports, args, message) -> None:
    from anyorder.harness.settings import parse_settings

    with pytest.raises(ConfigError) as e:
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
    assert not any("Traceback" in line for line in err)


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
