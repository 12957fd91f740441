"""Issue 41, item 1: CUDA graphs by default on CUDA (``graphs="auto"``) at every entry
point, eager on a CPU exactly as before, and the capture's cost reported."""

from __future__ import annotations

import inspect

import pytest
import torch

from anyorder.api import Model
from anyorder.cli.main import build_parser
from anyorder.cli.sample import graphs_line
from anyorder.errors import SamplingError
from anyorder.sampling import lemma1_sample, sample, sequential_sample, strided_sample
from anyorder.sampling.graphs import resolve_mode

from conftest import tiny_model


def test_auto_captures_on_cuda_and_is_eager_elsewhere():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode("auto", cpu) == "off"
    assert resolve_mode("auto", cuda) == "cuda"
    assert resolve_mode(False, cuda) == "off"
    assert resolve_mode("emulate", cpu) == "emulate"
    with pytest.raises(SamplingError, match="CUDA graphs need a CUDA device"):
        resolve_mode(True, cpu)
    with pytest.raises(SamplingError, match="graphs='yes': use True, False, or one of"):
        resolve_mode("yes", cpu)


@pytest.mark.parametrize(
    "fn, name",
    [(sample, "graphs"), (sequential_sample, "graphs"), (lemma1_sample, "graphs"),
     (strided_sample, "graphs"), (Model.generate, "cuda_graphs"), (Model._sample, "graphs")],
)  # fmt: skip
def test_every_entry_point_defaults_to_auto(fn, name):
    assert inspect.signature(fn).parameters[name].default == "auto"


def test_the_cli_defaults_to_auto_and_turns_it_off_or_on():
    parse = build_parser().parse_args
    assert parse(["sample", "run"]).cuda_graphs == "auto"
    assert parse(["sample", "run", "--no-cuda-graphs"]).cuda_graphs is False
    assert parse(["sample", "run", "--cuda-graphs"]).cuda_graphs is True


@pytest.mark.parametrize(
    "kind, kw", [("gpt", {}), ("aogpt", {"steps": 5}), ("armd", {"streams": 2})]
)
def test_on_a_cpu_the_default_is_the_eager_decode_bit_for_bit(kind, kw):
    model = tiny_model(kind)
    runs = []
    for graphs in ("auto", False):
        g = torch.Generator().manual_seed(3)
        runs.append(sample(model, 12, batch=2, generator=g, keep_logits=True, graphs=graphs, **kw))
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert torch.equal(runs[0].logits, runs[1].logits)
    assert "graphs" not in runs[0].extra  # nothing captured


def test_what_capturing_cost_is_reported():
    model = tiny_model("aogpt")
    g = torch.Generator().manual_seed(0)
    result = sample(model, 12, steps=4, generator=g, graphs="emulate")
    captured = result.extra["graphs"]
    assert captured["mode"] == "emulate" and 1 <= captured["shapes"] <= 8
    assert captured["capture_s"] >= 0
    assert graphs_line(captured) is None  # no graph was captured: nothing to report
    line = graphs_line({**captured, "mode": "cuda", "capture_s": 0.25})
    assert line == (
        f"CUDA graphs: {captured['shapes']} pass shapes captured in 0.25 s, in the time above "
        "(--no-cuda-graphs: eager)"
    )


def test_compiled_passes_are_reported_and_the_cli_compiles_them(tmp_path, capsys):
    """``--compile-passes BACKEND``: the decode goes through compiled runners (on a CPU
    without a graph), prints what compiling cost, and samples what the eager decode does."""
    import json

    from anyorder.checkpoint import save_checkpoint
    from anyorder.cli import main
    from anyorder.config import RunConfig
    from anyorder.data import ByteTokenizer

    line = graphs_line({"mode": "emulate", "shapes": 3, "capture_s": 1.5, "compiled": "inductor"})
    assert line == "compiled passes: 3 pass shapes compiled (inductor) in 1.50 s, in the time above"
    line = graphs_line({"mode": "cuda", "shapes": 2, "capture_s": 9.0, "compiled": "inductor"})
    assert line == (
        "CUDA graphs: 2 pass shapes compiled (inductor) and captured in 9.00 s, in the time "
        "above (--no-cuda-graphs: eager)"
    )
    model = tiny_model("aogpt", vocab_size=257, seq_len=16)
    save_checkpoint(tmp_path / "m", 1, model=model, config=RunConfig(model=model.cfg),
                    tokenizer=ByteTokenizer())  # fmt: skip
    argv = ["sample", str(tmp_path / "m"), "--length", "12", "--seed", "2", "--json",
            "--no-stop-at-eos", "--speculative", "3"]  # fmt: skip
    torch._dynamo.reset()
    try:
        assert main(argv) == 0
        eager = json.loads(capsys.readouterr().out)
        assert main([*argv[:-1], "3", "--compile-passes", "aot_eager"]) == 0
        out = capsys.readouterr()
        argv_text = [a for a in argv if a != "--json"]
        assert main([*argv_text, "--compile-passes", "aot_eager"]) == 0
        err = capsys.readouterr().err
    finally:
        torch._dynamo.reset()
    compiled = json.loads(out.out)
    assert compiled["samples"] == eager["samples"]
    assert "compiled passes: " in err and "pass shapes compiled (aot_eager) in" in err


def test_an_unknown_compile_backend_is_one_line_and_exit_2(tmp_path, capsys):
    from anyorder.checkpoint import save_checkpoint
    from anyorder.cli import main
    from anyorder.config import RunConfig
    from anyorder.data import ByteTokenizer

    model = tiny_model("aogpt", vocab_size=257, seq_len=16)
    save_checkpoint(tmp_path / "m", 1, model=model, config=RunConfig(model=model.cfg),
                    tokenizer=ByteTokenizer())  # fmt: skip
    code = main(["sample", str(tmp_path / "m"), "--length", "8", "--compile-passes", "nope"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("anyorder sample: error: compiled passes: backend 'nope' is not one of")
    assert "use inductor (the default) or aot_eager" in err
