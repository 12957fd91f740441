"""The synthetic instruction task: right answers, disjoint splits, fixed seeds, the CLI."""

from __future__ import annotations

import json

import pytest

from anyorder.data.instruct import (
    TASKS,
    WORDS,
    accuracy,
    exact_match,
    is_heldout,
    make_examples,
    write_instruct,
)
from anyorder.errors import ConfigError


def _solve(prompt: str) -> str:
    """The answer, worked out from the prompt's text alone."""
    verb, _, rest = prompt.partition(": ")
    if verb == "add":
        a, b = rest.split("+")
        return str(int(a) + int(b))
    items = rest.split(" ")
    return " ".join(sorted(items) if verb == "sort" else items[::-1])


def test_answers_are_right_and_vary_in_length() -> None:
    records = make_examples(600, seed=3)
    assert {r["task"] for r in records} == set(TASKS)
    for r in records:
        assert r["response"] == _solve(r["prompt"]), r
        assert r["prompt"].startswith(r["task"] + ": ")
    for task in TASKS:
        lengths = {len(r["response"]) for r in records if r["task"] == task}
        assert len(lengths) >= 3, (task, lengths)
    words = {w for r in records if r["task"] == "reverse" for w in r["response"].split()}
    assert words <= set(WORDS)


def test_splits_are_disjoint_distinct_and_seeded() -> None:
    train = make_examples(3000, seed=0)
    held = make_examples(400, seed=0, split="heldout")
    tp, hp = [r["prompt"] for r in train], [r["prompt"] for r in held]
    assert len(set(tp)) == len(tp) and len(set(hp)) == len(hp)
    assert not set(tp) & set(hp)
    # the held-out prompts are those of one hash bucket of 8, whatever the seed and n
    assert not set(tp) & {r["prompt"] for r in make_examples(400, seed=7, split="heldout")}
    assert all(is_heldout(p) for p in hp) and not any(is_heldout(p) for p in tp)
    assert make_examples(50, seed=0) == train[:50]
    assert make_examples(50, seed=1) != train[:50]
    assert {r["task"] for r in make_examples(30, tasks=("sort",))} == {"sort"}


def test_exact_match_and_accuracy() -> None:
    assert exact_match(" 151\n", "151")
    assert not exact_match("1 51", "151") and not exact_match("15", "151")
    assert accuracy(["a b", "x", "3"], ["a b", "y", "3 "]) == pytest.approx(2 / 3)
    with pytest.raises(ConfigError, match=r"^2 predictions for 3 references; give one"):
        accuracy(["a", "b"], ["a", "b", "c"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), r"^n=0 examples must lie in 1\.\.1000000$"),
        (dict(n=5, split="test"), r"^split='test': use train or heldout$"),
        (dict(n=5, tasks=("mul",)), r"^tasks=\['mul'\]: choose among sort, reverse, add$"),
    ],
)
def test_bad_requests(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        make_examples(**kwargs)


def test_cli_writes_both_files(tmp_path, capsys) -> None:
    from anyorder.cli import main

    out = tmp_path / "task"
    assert main(["data", "--instruct", str(out), "--n", "40", "--heldout", "8", "--seed", "2"]) == 0
    assert "train.jsonl (40 examples)" in capsys.readouterr().out
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert train == make_examples(40, seed=2)
    assert held == make_examples(8, seed=2, split="heldout")
    assert sorted(p.name for p in out.iterdir()) == ["heldout.jsonl", "train.jsonl"]
    assert write_instruct(out, n=3, heldout=1)["train"] == out / "train.jsonl"


def test_cli_refuses_a_config_beside_instruct_and_no_config(tmp_path, capsys) -> None:
    from anyorder.cli import main

    assert main(["data", "cfg.yaml", "--instruct", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err == (
        "anyorder data: error: --instruct writes a task and reads no config; leave out the config\n"
    )
    assert main(["data"]) == 2
    assert capsys.readouterr().err == (
        "anyorder data: error: anyorder data needs a config (or --instruct DIR); see --help\n"
    )
    assert not (tmp_path / "t").exists()
