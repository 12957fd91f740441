"""Experiments: every experiment's whole code path at a minimal budget, and the paper-scale
torchrun command lines."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from anyorder.errors import ConfigError
from anyorder.experiments import (
    EXPERIMENTS,
    OURS,
    OURS_FIELDS,
    PUBLISHED,
    ROPE_TARGET,
    Context,
    context_order_spread,
    paper_commands,
    run_experiment,
    run_name,
    torchrun_command,
)

from conftest import tiny_model


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    # one folder for the module: the smoke runs are shared between experiments, as at scale
    return tmp_path_factory.mktemp("experiments")


def _ctx(root: Path, name: str, **kw) -> Context:
    return Context(out=root / name, runs=root / "runs", smoke=True, **kw)


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_smoke_run_writes_result_section_and_plot(root: Path, name: str) -> None:
    res = run_experiment(name, _ctx(root, name))
    out = root / name
    data = json.loads((out / "result.json").read_text())
    assert data["name"] == name and data["scale"] == "cpu"
    section = (out / "section.md").read_text()
    assert section.startswith(f"## {EXPERIMENTS[name][0]}")
    assert "|---|" in section  # a table
    if res.get("plot"):
        assert (out / "plot.png").stat().st_size > 0


def test_eq5_shows_progress_while_it_trains_and_enumerates(tmp_path: Path) -> None:
    """``anyorder experiment eq5`` ran 349 s at CPU scale without a word: it now reports its
    training steps and the enumeration as it goes (lines in a log, a bar on a terminal)."""
    out = subprocess.run(
        [sys.executable, "-m", "anyorder.cli", "experiment", "eq5", "--smoke", "--out",
         str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if x.startswith("eq5: ")]
    # smoke: one length (n = 4), 3 models x 5 steps and one enumeration = 16 units
    assert lines[-1] == "eq5: 16/16 steps (100%), " + lines[-1].split(", ", 1)[1]
    assert lines[-1].endswith("| n = 4: enumerating 24 orders")
    assert any("| n = 4: training mdm, aogpt and aogpt (ours)" in x for x in lines[:-1])
    quiet = subprocess.run(
        [sys.executable, "-m", "anyorder.cli", "experiment", "eq5", "--smoke", "--out",
         str(tmp_path / "q"), "--no-progress"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert quiet.returncode == 0 and "eq5: " not in quiet.stderr


def test_eq5_smoke_mdm_elbo_equals_order_average(root: Path) -> None:
    res = run_experiment("eq5", _ctx(root, "eq5"))
    (row,) = res["rows"]
    assert row["max_abs_diff"] < 1e-4
    assert math.isclose(row["mdm_elbo"], row["mdm_avg_orders"], rel_tol=1e-5)
    assert row["mdm_spread"][0] < 1e-5 < row["aogpt_spread"][0]


def test_equal_arms_share_one_run(root: Path) -> None:
    """finding3's 10% arms and finding5's models are the same run folders."""
    run_experiment("finding5", _ctx(root, "finding5"))
    run_experiment("finding3", _ctx(root, "finding3"))
    mix = ["order.kind=mix", "order.p_l2r=0.1"]
    for variant, tag in ((PUBLISHED, "published"), (OURS, "ours")):
        name = run_name("aogpt", [*variant, *mix])
        assert name == f"aogpt_{tag}_mix_0.1"
        assert (root / "runs" / f"{name}-s0" / "done.json").exists()
    assert run_name("aogpt", [*OURS, *mix, *ROPE_TARGET]) == "aogpt_ours_mix_0.1_rope_target"
    assert run_name("aogpt", mix) == "aogpt_mix_0.1"


def test_arms_spell_out_their_variant_whatever_the_defaults() -> None:
    """The published arm is the reference model and ours today's parameterization, field by
    field, so a changed default moves neither."""
    from anyorder.config import VARIANTS, ModelConfig, load_config

    pub = load_config(None, ["model.kind=aogpt", *PUBLISHED]).model
    assert all(getattr(pub, k) == v for k, v in VARIANTS["aogpt-ref"].items())
    ours = load_config(None, ["model.kind=aogpt", *OURS]).model
    names = {f for f in ModelConfig.__dataclass_fields__}
    sizes = {"kind", "vocab_size", "seq_len", "n_layer", "n_head", "d_model", "rope_base",
             "target_dim", "l2s"}  # fmt: skip
    assert set(OURS_FIELDS) == names - sizes  # every other field is spelled out
    assert ours.adaln_gate_offset and ours.adaln_init == "zero" and ours.gelu == "tanh"


def test_context_order_spread_zero_for_encoder_positive_for_decoder(gen) -> None:
    n = 5
    x = torch.randint(0, 5, (2, n), generator=gen)
    o = torch.stack([torch.randperm(n, generator=gen) for _ in range(2)])
    enc = context_order_spread(tiny_model("mdm", vocab_size=5, seq_len=n), x, o, 4, gen)
    dec = context_order_spread(tiny_model("aogpt", vocab_size=5, seq_len=n), x, o, 4, gen)
    assert enc[0] < 1e-5
    assert dec[0] > 1e-4


def test_unknown_experiment_and_scale(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown experiment 'nope'; use one of eq5"):
        run_experiment("nope", _ctx(tmp_path, "nope"))
    with pytest.raises(ConfigError, match="--scale 'tpu': use cpu or paper"):
        run_experiment("eq5", _ctx(tmp_path, "eq5", scale="tpu"))


def test_torchrun_command_line() -> None:
    cmd = torchrun_command("aogpt-small-owt.yaml", ["order.kind=uniform"], 8)
    assert cmd == [
        "torchrun", "--standalone", "--nproc_per_node=8", "-m", "anyorder.cli", "train",
        "configs/aogpt-small-owt.yaml", "--no-progress", "order.kind=uniform",
    ]  # fmt: skip


def test_paper_commands_per_arm_and_seed() -> None:
    arms = {"a": ("aogpt", ["order.kind=l2r"]), "b": ("aogpt", ["order.kind=uniform"])}
    cmds = paper_commands("aogpt-small-owt.yaml", arms, 4, 2, "out")
    assert len(cmds) == 4
    assert cmds[0][-4:] == ["model.kind=aogpt", "order.kind=l2r", "train.seed=0",
                            "train.out_dir=out/a-s0"]  # fmt: skip
    assert cmds[3][-2:] == ["train.seed=1", "train.out_dir=out/b-s1"]
    assert all(c[2] == "--nproc_per_node=4" for c in cmds)


# eq5 trains nothing; instruct (tiny models on a synthetic task) runs at CPU scale only
@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if n not in ("eq5", "instruct")])
def test_paper_scale_print_only_uses_existing_configs(tmp_path: Path, name: str, capsys) -> None:
    ctx = Context(out=tmp_path / name, runs=tmp_path / "runs", scale="paper", print_only=True)
    res = run_experiment(name, ctx)
    assert ctx.commands and res["commands"]
    repo = Path(__file__).resolve().parents[1]
    for c in ctx.commands:
        cfgs = [a for a in c if a.startswith("configs/")]
        assert all((repo / a).exists() for a in cfgs)
        if c[0] == "torchrun":
            assert cfgs
    assert "torchrun" in capsys.readouterr().out or name == "decode"


def test_paper_progressive_schedule_is_the_papers() -> None:
    ctx = Context(out=Path("x"), runs=Path("r"), scale="paper", print_only=True)
    res = run_experiment_dry(ctx, "progressive")
    assert any("order.i_ar=9000" in c and "order.i_perm=48000" in c for c in res["commands"])


def run_experiment_dry(ctx: Context, name: str) -> dict:
    return EXPERIMENTS[name][1](ctx)


def test_cli_experiment_print_only(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "anyorder.cli", "experiment", "four", "--scale", "paper",
         "--print-only", "--nproc", "2", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if "torchrun --standalone" in ln]
    assert len(lines) == 6 and all("--nproc_per_node=2" in ln for ln in lines)
    ours = [ln for ln in lines if "model.rope_query=target" in ln]  # our extension's arm
    assert len(ours) == 1 and "configs/aogpt-small-owt.yaml" in ours[0]
    bad = subprocess.run(
        [sys.executable, "-m", "anyorder.cli", "experiment", "nope", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown experiment 'nope'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_target_position_kl(gen) -> None:
    """Zero for a fresh aogpt of ours (adaLN-Zero: the target position enters through
    zero-initialised modulation), positive for models that see the target position from the
    start (the published aogpt's adaLN starts at N(0, 0.02))."""
    from anyorder.experiments import target_position_kl

    x = torch.randint(0, 11, (4, 16), generator=gen)
    assert target_position_kl(tiny_model("aogpt"), x) == pytest.approx(0.0, abs=1e-7)
    # small at N(0, 0.02) twice over (the table through SiLU, then the adaLN weights), not 0
    assert target_position_kl(tiny_model("aogpt", variant="aogpt-ref"), x) > 1e-8
    assert target_position_kl(tiny_model("armd"), x) > 1e-4
    assert target_position_kl(tiny_model("mdm"), x) > 1e-4


def test_a_finished_run_is_reused_across_new_default_off_fields() -> None:
    """A run saved before a config field existed still matches (the field takes its
    default); a changed value, or a key the config no longer has, does not."""
    from anyorder.config import load_config, to_dict
    from anyorder.experiments import _same_config

    cfg = to_dict(load_config(None, ["model.kind=aogpt"]))
    want = json.dumps(cfg, sort_keys=True)
    old = json.loads(want)
    del old["model"]["rope_query"]  # saved before the field existed
    assert _same_config(old, want)
    old["model"]["n_layer"] = 3
    assert not _same_config(old, want)
    assert not _same_config({**cfg, "model": {**cfg["model"], "retired": 1}}, want)
    assert not _same_config(None, want)


def test_arms_filter_runs_only_the_matching_arms(root: Path) -> None:
    res = run_experiment("four", _ctx(root, "four-published", only="published"))
    assert list(res["arms"]) == ["aogpt published, 10% l2r"]
    with pytest.raises(ConfigError, match="--arms 'nope' matches no arm; the arms are: gpt"):
        run_experiment("four", _ctx(root, "four-nope", only="nope"))


def test_instruct_scores_the_lora_arm_adapted_not_its_base(tmp_path: Path, monkeypatch) -> None:
    """The gpt-lora arm's step 0 is its base, and its last checkpoint is scored as the base
    with the adapters added by hand (W + alpha / r * B A, from the adapter file), not as the
    bare base."""
    from safetensors.torch import load_file

    from anyorder.checkpoint import list_checkpoints, load_model
    from anyorder.experiments import instruct

    scored = []
    real = instruct.score
    monkeypatch.setattr(instruct, "score", lambda m, *a, **k: scored.append(m) or real(m, *a, **k))
    res = run_experiment("instruct", _ctx(tmp_path, "i", only="gpt-lora"))
    assert list(res["scores"]) == ["gpt-lora"] and res["steps"] == [0, 4]
    first, last = scored
    runs = tmp_path / "runs"
    base = load_model(runs / "instruct-base-gpt-s0").model
    ckpt = list_checkpoints(runs / "instruct-gpt-lora-s0")[-1]
    adapters = load_file(str(ckpt / "model.safetensors"))
    lora = instruct.LORA
    scale = float(lora[1].split("=")[1]) / float(lora[0].split("=")[1])  # alpha / r
    merged = base.state_dict()
    names = {k.split(".lora_")[0] for k in adapters}
    assert names == {f"blocks.0.attn.{m}" for m in ("qkv", "proj")}  # the default targets
    for name in names:
        a, b = (adapters[f"{name}.lora_{x}.default.weight"] for x in "AB")
        merged[f"{name}.weight"] = merged[f"{name}.weight"] + scale * b @ a
    by_hand = load_model(runs / "instruct-base-gpt-s0").model
    by_hand.load_state_dict(merged)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {k: m(x) for k, m in (("first", first), ("last", last),
                  ("base", base), ("by_hand", by_hand))}  # fmt: skip
    torch.testing.assert_close(logits["first"], logits["base"], rtol=0, atol=0)
    torch.testing.assert_close(logits["last"], logits["by_hand"], rtol=1e-5, atol=1e-5)
    assert (logits["last"] - logits["base"]).abs().max() > 1e-3  # the adapters moved it


def test_instruct_arms_unknown(tmp_path: Path) -> None:
    arms = "gpt, aogpt, armd, gpt-full, gpt-lora, gpt-lora-lr2e-3, gpt-lora-attn\\+mlp, "
    arms += "gpt-lora-r64-attn\\+mlp, gpt-lora-r64-attn\\+mlp-lr2e-3"
    with pytest.raises(ConfigError, match=rf"^--arms 'lora' matches no arm; the arms are: {arms}$"):
        run_experiment("instruct", _ctx(tmp_path, "i", only="lora"))
    assert not (tmp_path / "runs").exists()  # nothing written


def test_instruct_fine_tuned_arms_configs() -> None:
    """The fine-tuned arms differ as their names say (the smoke run trains two of them)."""
    from anyorder.config import load_config
    from anyorder.experiments.instruct import ABLATIONS, FINE_TUNED

    got = {}
    for arm, overrides in FINE_TUNED.items():
        t = load_config(None, ["train.lr=2e-3", *overrides]).train  # the runs' lr, then the arm's
        got[arm] = (t.lr, t.lora.r, t.lora.alpha, t.lora.targets)
    assert got == {
        "gpt-full": (2e-3, 0, 16.0, ("attn",)),
        "gpt-lora": (2e-2, 8, 16.0, ("attn",)),
        "gpt-lora-lr2e-3": (2e-3, 8, 16.0, ("attn",)),
        "gpt-lora-attn+mlp": (2e-2, 8, 16.0, ("attn", "mlp")),
        "gpt-lora-r64-attn+mlp": (2e-2, 64, 128.0, ("attn", "mlp")),
        "gpt-lora-r64-attn+mlp-lr2e-3": (2e-3, 64, 128.0, ("attn", "mlp")),
    }
    assert set(ABLATIONS) == set(FINE_TUNED) - {"gpt-full", "gpt-lora"}  # smoke: not these
