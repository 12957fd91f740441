"""train.lora: peft's adapters on a frozen base; exact resume; merged and adapters-only export."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from test_train import _overrides  # the same tiny run as full training's tests

from conftest import run_two_ranks

pytest.importorskip("peft")

from anyorder import checkpoint as ck  # noqa: E402
from anyorder.cli import main  # noqa: E402
from anyorder.config import LoraConfig, ModelConfig, load_config  # noqa: E402
from anyorder.errors import CheckpointError, ConfigError  # noqa: E402
from anyorder.layers.linear import Linear  # noqa: E402
from anyorder.models import build_model  # noqa: E402
from anyorder.models.lora import add_adapters, merge_adapters  # noqa: E402
from anyorder.training.loop import train  # noqa: E402
from anyorder.training.metrics import read_metrics  # noqa: E402
from anyorder.training.setup import check_config, make_optimizer  # noqa: E402

KIND_TARGETS = {
    "gpt": ("attn", "mlp"),
    "aogpt": ("attn", "mlp", "adaln"),
    "armd": ("attn", "mlp", "query_mlp"),
    "mdm": ("attn", "mlp"),
}


def _tiny(kind: str) -> ModelConfig:
    return ModelConfig(kind=kind, n_layer=2, d_model=32, n_head=2, vocab_size=50, seq_len=16)


def _randomise_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """peft starts B at zero (the adapted model is the base): give B values, so the adapters
    change the logits and a path that skipped them would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _by_hand(base: torch.nn.Module, adapted: torch.nn.Module, scale: float) -> torch.nn.Module:
    """The base with W + scale * B @ A written into every adapted layer's weight, from the
    adapters' tensors, without peft: the independent reference."""
    ref = copy.deepcopy(base)
    params = dict(adapted.named_parameters())
    with torch.no_grad():
        for name, module in ref.named_modules():
            a = params.get(f"{name}.lora_A.default.weight")
            if a is not None:
                b = params[f"{name}.lora_B.default.weight"]
                module.weight += scale * (b @ a)
    return ref


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd", "mdm"])
def test_adapted_logits_are_w_plus_ba_and_the_merged_model_gives_them(kind: str) -> None:
    """Every path of the forward sees the adapters (ARMD's query-only projection and
    AO-GPT's joined adaLN read weights, not layers): the adapted model's logits equal a
    plain model holding W + (alpha / r) B A, and so do peft's merged model's."""
    torch.manual_seed(0)
    base = build_model(_tiny(kind)).eval()
    adapted = copy.deepcopy(base)
    lora = LoraConfig(r=4, alpha=8.0, targets=KIND_TARGETS[kind])
    tuner = add_adapters(adapted, lora)
    _randomise_adapters(adapted)
    ref = _by_hand(base, adapted, 8.0 / 4)
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    order = None if kind == "gpt" else torch.stack([torch.randperm(16) for _ in range(2)])
    with torch.no_grad():
        want = ref(tokens, order)
        got = adapted(tokens, order)
        assert not torch.allclose(want, base(tokens, order), atol=1e-3)  # the adapters matter
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        merged = merge_adapters(tuner)
        assert not any("lora" in k for k in merged.state_dict())
        assert type(merged.blocks[0].attn.qkv) is Linear  # the model's own layer again
        torch.testing.assert_close(merged(tokens, order), got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_only_the_adapters_are_trainable_and_optimized(optimizer: str) -> None:
    cfg = load_config(None, [f"train.optimizer={optimizer}", "train.lora.r=4"])
    model = build_model(_tiny("aogpt"))
    add_adapters(model, LoraConfig(r=4, targets=("attn", "mlp", "adaln")))
    adapters = {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == adapters and len(adapters) == 2 * (
        2 * 5 + 1
    )  # A, B of 5 layers a block, final adaLN
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    optimized = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(optimized) == sorted(adapters)


@pytest.mark.parametrize(
    ("targets", "named"),
    [(("attn", "mlp"), "Muon"), (("adaln",), "AdamW"), (("attn", "adaln"), "Muon + AdamW")],
)
def test_muon_takes_the_adapters_matrices_and_either_half_may_be_empty(targets, named):
    """Issue 40, item 2: under train.optimizer=muon the adapters of linear layers are
    matrices that Muon takes (docs/configs.md, train.optimizer), those of the adaLN linears
    take AdamW as the adaLN itself does; a run with adapters of one kind only has an empty
    half, and one step moves every adapter that has a gradient."""
    from anyorder.training.muon import describe

    cfg = load_config(None, ["train.optimizer=muon", "train.lora.r=4"])
    model = build_model(_tiny("aogpt"))
    add_adapters(model, LoraConfig(r=4, targets=targets))
    opt = make_optimizer(model, cfg, torch.device("cpu"))
    assert describe(opt) == named
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    in_muon = {id(p) for g in opt.param_groups if g.get("muon") for p in g["params"]}
    for n, p in adapters.items():
        assert (id(p) in in_muon) == ("ada" not in n.split(".")[-5]), n  # the adapted layer
    _randomise_adapters(model)  # B != 0: A has a gradient too
    before = {n: p.detach().clone() for n, p in adapters.items()}
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model.loss(tokens, torch.stack([torch.randperm(16) for _ in range(2)])).backward()
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in adapters.items())


# ----------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora_cache")


def _cfg(run: Path, cache: Path, kind: str, **extra):
    return load_config(None, _overrides(run, cache, kind, **extra))


@pytest.fixture(scope="module")
def bases(tmp_path_factory, cache) -> dict[str, Path]:
    """Per kind, an exported folder of a 2-step run: the base the LoRA runs start from
    (train.init_from an export, as a converted model is)."""
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for kind in ("armd", "aogpt"):
        run = root / f"{kind}-run"
        train(_cfg(run, cache, kind, **{"train.steps": 2}), resume=False, progress=False)
        out[kind] = ck.export(run, root / kind)
    return out


def _lora(base: Path, targets: str, **extra) -> dict:
    return {
        "train.init_from": str(base),
        "train.lora.r": 4,
        "train.lora.alpha": 8,
        "train.lora.targets": targets,
        **extra,
    }


LORA_RUNS = [
    ("armd", "[attn,mlp,query_mlp]", {"train.lora.dropout": 0.1}),
    ("aogpt", "[qkv,adaln,mlp_out]", {"train.optimizer": "muon"}),
    # adapters on linear layers only: every trainable tensor a matrix (issue 40, item 2)
    ("armd", "[attn,mlp]", {"train.optimizer": "muon", "train.grad_clip": 0.05}),
]


@pytest.mark.parametrize(
    ("kind", "targets", "extra"), LORA_RUNS, ids=["armd", "aogpt-muon", "armd-muon-matrices"]
)
def test_lora_resume_is_bit_exact(tmp_path, cache, bases, kind, targets, extra):
    """As test_train.test_resume_is_bit_exact for full training: 4 steps straight equal 2,
    a resume, and 2 more, bit for bit (raw and EMA weights, losses, validation)."""
    over = _lora(bases[kind], targets, **{"train.steps": 4, **extra})
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(_cfg(straight, cache, kind, **over), resume=False, progress=False)
    train(_cfg(split, cache, kind, **over), resume=False, progress=False, stop_at=2)
    torch.manual_seed(987)  # the resumed run must restore every RNG it uses
    second = train(_cfg(split, cache, kind, **over), resume=True, progress=False)
    assert second["step"] == 4 and second["steps_run"] == 2
    for which in ("raw", "ema"):
        a = ck.load_model(straight, weights=which).model.state_dict()
        b = ck.load_model(split, weights=which).model.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{which} {k} differs after resume"
    losses = [[(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r] for run in
              (straight, split)]  # fmt: skip
    assert [s for s, _ in losses[0]] == [1, 2, 3, 4] and losses[0] == losses[1]
    vals = [[r for r in read_metrics(run) if "val/l2r_bpb" in r][-1] for run in (straight, split)]
    assert vals[0] == vals[1] and math.isfinite(vals[0]["val/ao_bpb"])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cache, bases) -> Path:
    run = tmp_path_factory.mktemp("lora") / "run"
    over = _lora(bases["armd"], "[attn,mlp]", **{"train.steps": 4})
    train(_cfg(run, cache, "armd", **over), resume=False, progress=False)
    return run


def test_checkpoints_hold_the_adapters_and_name_the_base(lora_run, bases):
    from safetensors.torch import load_file

    latest = ck.latest_checkpoint(lora_run)
    for name in (ck.MODEL_FILE, ck.EMA_FILE):
        keys = set(load_file(str(latest / name)))
        assert keys and all(".lora_A.default." in k or ".lora_B.default." in k for k in keys)
        assert len(keys) == 2 * 2 * 4  # A and B of 4 layers in each of 2 blocks
    base = ck.read_manifest(latest)["base"]
    assert base["path"] == str(bases["armd"].resolve())
    assert base["sha256"] == ck.state_digest(ck.load_model(bases["armd"]).model)


def test_the_base_stays_frozen_and_only_adapted_layers_move(lora_run, bases):
    base = ck.load_model(bases["armd"]).model.state_dict()
    merged = ck.load_model(lora_run, weights="raw").model.state_dict()
    assert merged.keys() == base.keys()
    adapted = (".attn.qkv.weight", ".attn.proj.weight", ".mlp.fc.weight", ".mlp.proj.weight")
    for k in base:
        if k.endswith(adapted):
            assert not torch.equal(merged[k], base[k]), k
        else:
            assert torch.equal(merged[k], base[k]), k  # norms, tables, biases, head


def test_a_changed_base_is_refused_by_load_and_resume(tmp_path, cache, bases):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(bases["armd"], base)
    run = tmp_path / "run"
    over = _lora(base, "[attn]", **{"train.steps": 4})
    train(_cfg(run, cache, "armd", **over), resume=False, progress=False, stop_at=2)
    other = ck.load_model(base)
    with torch.no_grad():
        other.model.tok_emb.weight.add_(0.01)
    ck.save_pretrained(other.model, base, other.tokenizer)
    digest = ck.read_manifest(ck.latest_checkpoint(run))["base"]["sha256"]
    with pytest.raises(CheckpointError) as e:
        ck.load_model(run)
    step = ck.latest_checkpoint(run)
    assert str(e.value) == (
        f"the adapters in {step} were trained on the base {base.resolve()} (weights sha256 "
        f"{digest[:12]}), but {base.resolve()} now holds other weights (sha256 "
        f"{ck.state_digest(ck.load_model(base).model)[:12]}); restore that base, or start a "
        "new run on this one"
    )
    with pytest.raises(CheckpointError, match="now holds other weights"):
        train(_cfg(run, cache, "armd", **over), resume=True, progress=False)


def test_resuming_a_full_run_with_adapters_is_refused(tmp_path, cache, bases):
    run = bases["armd"].parent / "armd-run"
    step = ck.latest_checkpoint(run)
    with pytest.raises(CheckpointError) as e:
        train(_cfg(run, cache, "armd", **_lora(bases["armd"], "[attn]")), resume=True)
    assert str(e.value) == (
        f"{step} was trained without adapters (train.lora.r=0); continue it with "
        f"train.lora.r=0, or train adapters on it in a new run (train.init_from={step})"
    )


# ----------------------------------------------------------------------------- export


def test_export_merges_and_adapters_only_writes_peft_files(tmp_path, lora_run, bases, capsys):
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    merged_dir, apart = tmp_path / "merged", tmp_path / "adapters"
    assert main(["export", str(lora_run), "--out", str(merged_dir)]) == 0
    assert main(["export", str(lora_run), "--out", str(apart), "--adapters-only"]) == 0
    assert sorted(p.name for p in apart.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert f"LoRA adapters (ema weights): wrote {apart}" in capsys.readouterr().out
    merged = ck.load_model(merged_dir).model
    assert type(merged.blocks[0].attn.qkv) is Linear
    # peft alone puts the exported adapters on the base: the same logits as the merged export
    config = PeftLoraConfig.from_pretrained(str(apart))
    assert config.base_model_name_or_path == str(bases["armd"].resolve())
    adapted = ck.load_model(bases["armd"]).model
    inject_adapter_in_model(config, adapted)
    set_peft_model_state_dict(adapted, load_file(str(apart / "adapter_model.safetensors")))
    tokens = torch.randint(0, merged.cfg.vocab_size, (2, 32))
    order = torch.stack([torch.randperm(32) for _ in range(2)])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(tokens, order), adapted.eval()(tokens, order), rtol=1e-5, atol=1e-5
        )


def test_adapters_only_on_a_full_run_is_refused(tmp_path, bases, capsys):
    run = tmp_path / "nothing"
    full = next((bases["armd"].parent / "armd-run").glob("checkpoints/step_*"))
    assert main(["export", str(full), "--out", str(run), "--adapters-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"anyorder export: error: {full} trained every weight (train.lora.r=0): there are no "
        "adapters to write apart; export it without --adapters-only"
    ]
    assert not run.exists()


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.lora.r=-1"], "train.lora.r=-1 must be >= 0 (0: no adapters), e.g. 8"),
        (
            ["train.lora.r=8"],
            "train.lora.r=8 trains adapters on pretrained weights, and the run names none; set "
            "train.init_from to an exported folder, a hub id or a run folder",
        ),
        (
            ["train.lora.r=8", "train.init_from=x", "train.lora.targets=[attn,ffn]"],
            "train.lora.targets: 'ffn' is not a layer name; use some of qkv, attn_out, attn, "
            "mlp_in, mlp_out, mlp, adaln, query_mlp",
        ),
        (
            ["train.lora.r=8", "train.init_from=x", "train.lora.dropout=1"],
            "train.lora.dropout=1.0 must be in [0, 1), e.g. 0.05",
        ),
        (
            ["train.lora.r=8", "train.init_from=x", "train.lora.alpha=0"],
            "train.lora.alpha=0.0 must be a positive number, e.g. 16",
        ),
        (
            ["train.lora.r=8", "train.init_from=x", "train.lora.targets=[]"],
            "train.lora.targets is empty; name some of qkv, attn_out, attn, mlp_in, mlp_out, "
            "mlp, adaln, query_mlp",
        ),
    ],
)
def test_bad_lora_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        check_config(load_config(None, overrides))
    assert str(e.value) == message


def test_a_target_the_model_lacks_is_refused():
    with pytest.raises(ConfigError) as e:
        add_adapters(build_model(_tiny("gpt")), LoraConfig(r=2, targets=("attn", "adaln")))
    assert (
        str(e.value)
        == "train.lora.targets: adaln matches no layer of a gpt model; drop it from the list"
    )


# ----------------------------------------------------------------------------- distributed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "targets", "fsdp"),
    [("armd", "[attn,mlp]", False), ("armd", "[attn,mlp]", True), ("aogpt", "[qkv,adaln]", True)],
    ids=["armd-ddp", "armd-fsdp", "aogpt-fsdp"],
)
def test_two_lora_processes_match_one(tmp_path, cache, bases, kind, targets, fsdp):
    """Two gloo ranks (DDP, FSDP2) train the same adapters as one process (atol 1e-5); the
    aogpt's adaLN adapters sit in FSDP2's root unit with the adaLN they adapt."""
    over = _lora(bases[kind], targets, **{"train.steps": 3, "train.fsdp": fsdp})
    single, dist_run = tmp_path / "single", tmp_path / "dist"
    train(_cfg(single, cache, kind, **over), resume=False, progress=False)
    script = tmp_path / "worker.py"
    from test_train import WORKER  # a gloo rank of `anyorder.training.loop.train`

    script.write_text(WORKER)
    overrides = json.dumps(_overrides(dist_run, cache, kind, **over))
    run_two_ranks(script, overrides, tmp_path / "store", timeout=300)
    for which in ("raw", "ema"):
        a = ck.load_model(single, weights=which).model.state_dict()
        b = ck.load_model(dist_run, weights=which).model.state_dict()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)


def test_the_memory_check_counts_no_gradient_or_adamw_state_for_frozen_weights():
    """A LoRA run keeps 4 bytes per frozen parameter (the fp32 weight), not full training's
    16 (weight, gradient, AdamW's two moments) + 4 (EMA): the check that refuses runs too
    big for the machine must not refuse a LoRA run that fits."""
    from anyorder.memory import training_bytes

    over = ["model.n_layer=4", "model.d_model=256", "train.ema=0.9", "train.batch_size=1"]
    full, params, _ = training_bytes(load_config(None, over))
    lora, params2, _ = training_bytes(load_config(None, [*over, "train.lora.r=8"]))
    assert params == params2 and full - lora == params * (16 + 4 - 4)


# ----------------------------------------------------------------------------- issue 40


@pytest.mark.parametrize(("ema", "asked", "label"), [(0.0, "ema", "raw"), (0.9, "ema", "ema"),
                                                      (0.9, "raw", "raw")])  # fmt: skip
def test_both_exports_name_the_weights_they_write(tmp_path, cache, bases, capsys, ema, asked,
                                                  label):  # fmt: skip
    """Issue 40: a run without EMA has raw adapters only, which ``--adapters-only`` wrote
    while saying "(ema weights)" (the flag's default, not the file), and the merged export of
    the same run said "(raw weights)". Both now name the weights they write, and the
    adapters written are that file's, tensor for tensor."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    over = _lora(bases["armd"], "[attn]", **{"train.steps": 2, "train.ema": ema})
    train(_cfg(run, cache, "armd", **over), resume=False, progress=False)
    apart, merged = tmp_path / "adapters", tmp_path / "merged"
    capsys.readouterr()
    assert (
        main(["export", str(run), "--out", str(apart), "--adapters-only", "--weights", asked]) == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        f"LoRA adapters ({label} weights): wrote {apart}"
    ]
    assert main(["export", str(run), "--out", str(merged), "--weights", asked]) == 0
    assert f"step 2 ({label} weights): wrote {merged}" in capsys.readouterr().out
    step = ck.latest_checkpoint(run)
    want = load_file(str(step / (ck.EMA_FILE if label == "ema" else ck.MODEL_FILE)))
    written = load_file(str(apart / "adapter_model.safetensors"))
    named = {k.replace(".default.", "."): v for k, v in want.items()}  # peft's: no adapter name
    assert written.keys() == named.keys()
    for k in named:
        assert torch.equal(written[k], named[k]), k
    if ema:  # the two files differ, so the comparison above tells them apart
        other = load_file(str(step / (ck.MODEL_FILE if label == "ema" else ck.EMA_FILE)))
        assert any(not torch.equal(other[k], want[k]) for k in want)


def test_lora_on_the_tiny_armd_config_trains(tmp_path, cache, bases, capsys):
    """Issue 40, item 2: ``anyorder train configs/tiny-armd.yaml train.init_from=RUN
    train.lora.r=4`` (tiny-armd ships optimizer: muon; the default targets are the attention's
    linears, so every adapter is a matrix) exited 1 with AttributeError in muon.py. Now it
    trains, and its adapters move."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    small = [f"data.cache_dir={cache}", "data.max_documents=40", f"train.out_dir={run}",
             "train.steps=2", "train.batch_size=4", "train.eval_batches=1", "train.device=cpu",
             "train.warmup_steps=1"]  # fmt: skip
    rc = main(["train", "configs/tiny-armd.yaml", f"train.init_from={bases['armd']}",
               "train.lora.r=4", *small])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "LoRA r=4 alpha=16 on attn" in out.out and "; Muon at lr 0.005," in out.out
    adapters = load_file(str(ck.latest_checkpoint(run) / ck.MODEL_FILE))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapters.items())  # B left 0
