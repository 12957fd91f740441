"""Config loading (strict, layered) and the console script's basics."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from anyorder.config import ModelConfig, describe, field_docs, load_config, parse_override
from anyorder.errors import ConfigError

from conftest import run_cli


def test_layers_defaults_file_overrides(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("model: {preset: tiny, kind: armd, n_layer: 6}\ntrain: {steps: 7}\n")
    cfg = load_config(f, ["train.steps=9", "model.l2s=2", "order.sbp_streams=[1,2]"])
    assert cfg.model.kind == "armd" and cfg.model.n_layer == 6 and cfg.model.d_model == 256
    assert cfg.train.steps == 9 and cfg.model.l2s == 2 and cfg.order.sbp_streams == (1, 2)
    assert load_config(None).train.lr == 1e-3
    assert load_config(None, ["train.lr=3"]).train.lr == 3.0  # int widened to float
    assert load_config(None, ["train.lr=2e-3"]).train.lr == 2e-3  # YAML 1.1 gives a string


def test_unknown_and_ill_typed_keys_are_named(tmp_path) -> None:
    # a typo: the closest key of its section (or the closest section), not all 27 keys
    typo = "(anyorder info --config-keys lists every key)"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.stpes=3"])
    assert str(e.value) == f"unknown config key 'train.stpes'; did you mean train.steps? {typo}"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["modle.n_layer=3"])
    assert str(e.value) == f"unknown config key 'modle'; did you mean model? {typo}"
    (tmp_path / "t.yaml").write_text("train: {batchsize: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "t.yaml")
    assert (
        str(e.value)
        == f"unknown config key 'train.batchsize'; did you mean train.batch_size? {typo}"
    )
    # close to none: every key of the section, in order
    from anyorder.config import TrainConfig

    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.zzzz=3"])
    keys = ", ".join(f.name for f in dataclasses.fields(TrainConfig))
    assert str(e.value) == f"unknown config key 'train.zzzz'; known keys in train: {keys}"
    with pytest.raises(ConfigError, match="config key 'train.steps' expects int, got 'many'"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(ConfigError, match="config file '.*nope.yaml' does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="override 'steps' is not key=value"):
        parse_override("steps")


def test_an_unknown_option_among_overrides_suggests_the_closest_option(tmp_path, capsys) -> None:
    """``train`` collects key=value words after its options; a mistyped option there is
    answered by train's own parser, with the closest option."""
    from anyorder.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", str(tmp_path / "c.yaml"), "--dryrun", "train.steps=1"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "anyorder train: error: unrecognized arguments: --dryrun (did you mean --dry-run?); "
        "see anyorder train --help\n"
    )


def test_a_huge_config_file_is_refused_before_it_is_read(tmp_path) -> None:
    """A sparse config file of a terabyte (a checkpoint's config.yaml, an export's
    training_config.yaml) was read whole: a MemoryError traceback."""
    import os

    path = tmp_path / "cfg.yaml"
    path.write_text("train: {steps: 3}\n")
    os.truncate(path, 1 << 40)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        f"config file {str(path)!r} is 1,099,511,627,776 bytes, more than a run config holds "
        "(a few KB); give the YAML file of the run"
    )


def test_help_comes_from_field_docstrings() -> None:
    docs = field_docs(ModelConfig)
    assert docs["target_dim"].startswith("aogpt: width of the target-position embedding")
    keys = {k for k, _, _ in describe()}
    assert {"model.kind", "train.lr", "order.rho", "data.source"} <= keys
    assert all(h for _, _, h in describe())  # every field documented


def test_import_is_light_and_cpu_only() -> None:
    code = (
        "import sys, anyorder; "
        "assert 'transformers' not in sys.modules and 'datasets' not in sys.modules; "
        "print(anyorder.__version__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.1.0"


def test_help_lists_subcommands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    assert "info" in out.stdout


def test_info_prints_parameter_counts() -> None:
    out = run_cli("info", "--preset", "tiny")
    assert out.returncode == 0, out.stderr
    assert "tiny" in out.stdout and "M" in out.stdout


def test_a_variant_on_the_command_line_replaces_the_files_variant_keys(tmp_path, capsys) -> None:
    """tiny-aogpt.yaml sets pos_emb: rope and rope_query: target; model.variant=aogpt-ref on
    top of it used to keep both (a hybrid trained under the published model's name)."""
    from anyorder.cli import main
    from anyorder.config import VARIANTS, ModelConfig

    from conftest import REPO

    cfg_file = str(REPO / "configs" / "tiny-aogpt.yaml")
    cfg = load_config(cfg_file, ["model.variant=aogpt-ref"])
    for key, value in VARIANTS["aogpt-ref"].items():
        assert getattr(cfg.model, key) == value, key
    assert cfg.model.n_layer == 4 and cfg.model.seq_len == 256  # sizes stay the file's
    # keys given beside the variant on the command line still win, before it or after it
    for argv in (["model.pos_emb=rope", "model.variant=aogpt-ref"],
                 ["model.variant=aogpt-ref", "model.pos_emb=rope"]):  # fmt: skip
        ours = load_config(cfg_file, argv).model
        assert (ours.pos_emb, ours.rope_query, ours.adaln_init) == ("rope", "input", "normal")
    base = ModelConfig(kind="aogpt", pos_emb="rope", rope_query="target", adaln_init="zero")
    assert base.positions == "rope (queries at their targets), target by adaln"
    # the start-up line says which positional scheme is trained
    for extra, positions in (
        ([], "learned positions, BOS at row 0, target by adaln"),
        (["model.pos_emb=rope"], "rope (queries at their inputs), target by adaln"),
    ):
        argv = ["train", cfg_file, "--dry-run", "model.variant=aogpt-ref", *extra,
                "model.n_layer=1", "model.d_model=64", "model.seq_len=32",
                f"train.out_dir={tmp_path / 'run'}", "data.source=builtin:synthetic",
                f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
        assert main(argv) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert f"1 layers x 64, seq_len 32, {positions}; order" in head, head


def test_a_model_too_big_for_memory_is_refused_before_anything_is_allocated() -> None:
    """A context of 10**15 (say, a hand-edited config.json) on a model with a position table
    is refused by build_model with the estimate, at once; count_params, which builds on the
    meta device, still counts. (With RoPE the weights do not grow with the context: such a
    model builds, and what would be too long is refused where a length is asked for.)"""
    from anyorder import build_model
    from anyorder.models import count_params

    cfg = ModelConfig(kind="gpt", n_layer=2, n_head=2, d_model=32, seq_len=10**15)
    with pytest.raises(ConfigError, match=r"context 1,000,000,000,000,000\), more than this"):
        build_model(cfg)  # 512,000 TB: had it allocated, this would fail otherwise
    small = ModelConfig(kind="armd", n_layer=2, n_head=2, d_model=32, seq_len=64)
    assert build_model(small).num_params() == count_params(small)
    huge = ModelConfig(kind="gpt", n_layer=2, n_head=2, d_model=32, seq_len=2**40)
    assert count_params(huge) > 2**40 * 32  # its position table, counted on meta


LONG = "x" * 100_000
"""A value of 100,000 characters (an argument may hold 128 KiB): quoted whole, it made an
error line of 100 KB."""
SHORT = "'" + "x" * 27 + "..." + "x" * 28 + "'"  # anyorder.errors.preview: 60 characters


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from anyorder.checkpoint.exporting import save_pretrained
    from anyorder.data import ByteTokenizer

    from conftest import tiny_model

    folder = tmp_path_factory.mktemp("long") / "armd"
    return save_pretrained(tiny_model("armd", vocab_size=257, seq_len=32), folder, ByteTokenizer())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sample", "EXPORT", "--order", LONG], f"anyorder sample: error: argument --order: "
         f"invalid choice: {SHORT} (choose from 'l2r', 'random', 'strided', 'confidence'); see "
         "anyorder sample --help"),
        (["sample", "EXPORT", "--order", "rnadom" + LONG], "anyorder sample: error: argument "
         f"--order: invalid choice: 'rnadom{'x' * 21}...{'x' * 28}' (choose from 'l2r', "
         "'random', 'strided', 'confidence'); see anyorder sample --help"),
        (["sample", "EXPORT", "--top-p", LONG], "anyorder sample: error: argument --top-p: "
         f"invalid float value: {SHORT}; see anyorder sample --help"),
        (["sample", "EXPORT", LONG[:200]], f"anyorder sample: error: unrecognized arguments: "
         f"'{'x' * 27}...{'x' * 28}'; see anyorder sample --help"),
        (["sample", "EXPORT", "--device", LONG], f"anyorder sample: error: --device={SHORT} is "
         "not a device; use auto, cpu, cuda or cuda:N"),
        (["sample", "EXPORT", "--device", "cpu", "--compile-passes", LONG], "anyorder sample: "
         f"error: compiled passes: backend {SHORT} is not one of torch.compile's ("),
        (["sample", "/" + "d" * 200 + "/" + "e" * 200], "anyorder sample: error: checkpoint "
         f"path '/{'d' * 69}...(402 characters)...{'e' * 20}' does not exist; give a run folder "
         "or a checkpoint folder"),
        (["eval", "EXPORT", "--device", LONG], f"anyorder eval: error: --device {SHORT} is not "
         "available here; use auto or cpu"),
        (["eval", "EXPORT", "--targets", LONG], f"anyorder eval: error: --targets {SHORT}: give "
         "a number of target slots, or all"),
        (["eval", "EXPORT", "--suite", "gen", "--steps", LONG], "anyorder eval: error: --steps "
         f"{SHORT}: give comma-separated numbers"),
        (["serve", "EXPORT", "--device", "cpu", "--host", LONG], "anyorder serve: error: cannot "
         f"listen on {'x' * 80}... (100000 characters):8000 ("),
        (["train", "CONFIG", "--dry-run", f"train.device={LONG}"], "anyorder train: error: "
         f"train.device={SHORT} is not a device; use auto, cpu, cuda or cuda:N"),
    ],
)  # fmt: skip
def test_long_values_are_quoted_short(argv, message, export, capsys) -> None:
    """A user's value in a CLI error is quoted as anyorder.errors.preview cuts it (a path as
    anyorder.atomic.short_path does): one short line, whatever was passed."""
    from anyorder.cli import main

    from conftest import REPO

    paths = {"EXPORT": str(export), "CONFIG": str(REPO / "configs" / "tiny-armd.yaml")}
    try:
        code = main([paths.get(a, a) for a in argv])
    except SystemExit as e:  # argparse's errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err[:300]
    assert err.startswith(message), err[:600]
    assert "x" * 81 not in err and len(err) < 1000, err[:600]  # (a list of backends: 600)
