"""The training loop: exact resume, distributed == one process, config errors, dry runs."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from anyorder import checkpoint as ck
from anyorder.config import load_config
from anyorder.errors import ConfigError
from anyorder.training.loop import train
from anyorder.training.metrics import read_metrics
from anyorder.training.setup import check_config
from anyorder.training.state import EMA, lr_at

from conftest import gloo_worker, run_cli, run_two_ranks

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
PAPER_CONFIGS = {
    # name: (n_layer, d_model, n_head, seq_len, hub dataset, tokenizer)
    "aogpt-small-owt": (12, 768, 12, 1024, "hf:Skylion007/openwebtext", "gpt2"),
    "aogpt-medium-owt": (24, 1024, 16, 1024, "hf:Skylion007/openwebtext", "gpt2"),
    "armd-small-owt": (12, 768, 12, 1024, "hf:Skylion007/openwebtext", "gpt2"),
    "armd-medium-owt": (24, 1024, 16, 1024, "hf:Skylion007/openwebtext", "gpt2"),
    "armd-small-lm1b": (12, 768, 12, 128, "hf:lm1b", "bert-base-uncased"),
    "gpt-small-owt": (12, 768, 12, 1024, "hf:Skylion007/openwebtext", "gpt2"),
    "mdm-small-owt": (12, 768, 12, 1024, "hf:Skylion007/openwebtext", "gpt2"),
}
TINY_CONFIGS = ["tiny-armd", "tiny-aogpt", "tiny-gpt", "tiny-mdm"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A data cache shared by the module's runs (prepared by the first one)."""
    return tmp_path_factory.mktemp("data_cache")


def _overrides(run: Path, cache: Path, kind: str = "armd", **extra) -> list[str]:
    values = {
        "model.kind": kind,
        "model.n_layer": 2,
        "model.n_head": 2,
        "model.d_model": 32,
        "model.seq_len": 32,
        "data.source": "builtin:pydoc",
        "data.max_documents": 40,
        "data.cache_dir": str(cache),
        "train.out_dir": str(run),
        "train.steps": 6,
        "train.batch_size": 8,
        "train.lr": 0.01,
        "train.warmup_steps": 2,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "train.ckpt_every": 0,
        "train.log_every": 1,
        "train.ema": 0.9,
        "train.device": "cpu",
        "order.kind": "uniform",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def _cfg(run: Path, cache: Path, kind: str = "armd", **extra):
    return load_config(None, _overrides(run, cache, kind, **extra))


def _weights(run: Path, which: str) -> dict[str, torch.Tensor]:
    return ck.load_model(run, weights=which).model.state_dict()


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run) if "loss" in r]


def _scramble_global_rngs() -> None:
    torch.manual_seed(987)
    random.seed(987)
    np.random.seed(987)


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize(
    ("kind", "order"),
    [
        ("armd", {"order.kind": "progressive", "order.i_ar": 2, "order.i_perm": 5, "order.rho": 4}),
        ("mdm", {"order.kind": "uniform"}),
        ("aogpt", {"order.kind": "uniform", "train.optimizer": "muon"}),
    ],
)
def test_resume_is_bit_exact(tmp_path, cache, kind, order):
    straight = tmp_path / "straight"
    split = tmp_path / "split"
    s = train(_cfg(straight, cache, kind, **order), resume=False, progress=False)
    assert s["step"] == 6 and s["steps_run"] == 6

    first = train(_cfg(split, cache, kind, **order), resume=False, progress=False, stop_at=3)
    assert first["step"] == 3
    assert [p.name for p in ck.list_checkpoints(split)] == ["step_0000003"]
    _scramble_global_rngs()  # the resumed run must restore every RNG it uses
    second = train(_cfg(split, cache, kind, **order), resume=True, progress=False)
    assert second["step"] == 6 and second["steps_run"] == 3

    for which in ("raw", "ema"):
        a, b = _weights(straight, which), _weights(split, which)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{which} {k} differs after resume"
    la, lb = _losses(straight), _losses(split)
    assert [s for s, _ in la] == [1, 2, 3, 4, 5, 6]
    assert la == lb  # the same floats, step by step
    # both runs validated at the end on the same blocks with the same orders
    va = [r for r in read_metrics(straight) if "val/l2r_bpb" in r][-1]
    vb = [r for r in read_metrics(split) if "val/l2r_bpb" in r][-1]
    assert va == vb
    assert math.isfinite(va["val/ao_bpb"]) and va["val/ao_bpb_se"] >= 0


def test_auto_resume_and_refusals(tmp_path, cache):
    run = tmp_path / "run"
    train(_cfg(run, cache, "aogpt", **{"order.kind": "mix"}), progress=False, stop_at=2)
    # the same config (bookkeeping keys may change) resumes by itself
    s = train(
        _cfg(run, cache, "aogpt", **{"order.kind": "mix", "train.log_every": 2}),
        progress=False,
    )
    assert s["step"] == 6 and s["steps_run"] == 4
    # a different model does not resume into this folder, and nothing is written
    before = sorted(p.name for p in ck.list_checkpoints(run))
    with pytest.raises(ConfigError, match=r"another config \(differs in model\.n_layer\)"):
        train(_cfg(run, cache, "aogpt", **{"order.kind": "mix", "model.n_layer": 3}))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        train(_cfg(run, cache, "aogpt", **{"order.kind": "mix"}), resume=False)
    # not even a forced resume takes another optimizer: the saved state is AdamW's
    muon = {"order.kind": "mix", "train.optimizer": "muon", "train.steps": 8}
    with pytest.raises(
        ConfigError,
        match=r"trained with train.optimizer=adamw, not muon, .*"
        r"resume with train.optimizer=adamw, or start a new run from its weights "
        r"\(train.init_from=.*step_0000006 with another train.out_dir\)",
    ):
        train(_cfg(run, cache, "aogpt", **muon), resume=True, progress=False)
    assert sorted(p.name for p in ck.list_checkpoints(run)) == before


def test_grad_accumulation_matches_one_batch(tmp_path, cache):
    one = train(_cfg(tmp_path / "a", cache, "aogpt", **{"train.steps": 3}), progress=False)
    acc = train(
        _cfg(tmp_path / "b", cache, "aogpt", **{"train.steps": 3, "train.grad_accum": 4}),
        progress=False,
    )
    assert one["step"] == acc["step"] == 3
    a, b = _weights(tmp_path / "a", "raw"), _weights(tmp_path / "b", "raw")
    # Summing four micro-batch gradients reorders fp32 additions; Adam divides by sqrt(v),
    # which amplifies that round-off for near-zero gradients (seen: 1.1e-5 on one element).
    # 1e-4 is still 60x below the 3 steps' update (~lr = 2e-3 per step).
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-4)


# ----------------------------------------------------------------------------- distributed

WORKER = gloo_worker(  # a gloo rank of `anyorder.training.loop.train`
    "overrides",
    "from anyorder.config import load_config\nfrom anyorder.training.loop import train\n",
    "train(load_config(None, overrides), resume=False, progress=False)\n",
)


DIST_EXTRA = {"train.steps": 3, "train.batch_size": 8}


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory, cache):
    """The one-process reference of the distributed tests, one per model kind (made once)."""
    runs: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in runs:
            run = tmp_path_factory.mktemp(f"single-{kind}") / "run"
            train(_cfg(run, cache, kind, **DIST_EXTRA), progress=False)  # prepares the data
            runs[kind] = run
        return runs[kind]

    return get


@pytest.mark.parametrize(
    ("kind", "fsdp"),
    [("armd", False), ("armd", True), ("aogpt", True)],
    ids=["armd-ddp", "armd-fsdp", "aogpt-fsdp"],
)
def test_two_processes_match_one(tmp_path, cache, single_runs, kind, fsdp):
    """Two gloo ranks with the same global batch give one process's weights (atol 1e-5),
    with DDP and with FSDP2 (both run on the CPU). AO-GPT's joined adaLN reads every block's
    adaLN weights before the blocks run: under FSDP2 they must be whole there."""
    single = single_runs(kind)
    dist_run = tmp_path / "dist"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    extra = {**DIST_EXTRA, "train.fsdp": fsdp}
    overrides = json.dumps(_overrides(dist_run, cache, kind, **extra))
    store = tmp_path / "store"
    run_two_ranks(script, overrides, store, timeout=180)

    # Two ranks sum their halves' gradients in another order than one process does. AO-GPT's
    # adaLN starts at zero, where Adam's first steps move each weight by about lr whatever
    # its gradient's size: the round-off of a tiny gradient reaches the weight magnified
    # (1.7e-5 measured on one of 24,576 adaLN weights after 3 steps at lr 0.01, 0.2% of a step)
    atol = 5e-5 if kind == "aogpt" else 1e-5
    for which in ("raw", "ema"):
        a, b = _weights(single, which), _weights(dist_run, which)
        for k in a:
            torch.testing.assert_close(
                a[k], b[k], rtol=0, atol=atol, msg=lambda m, k=k, w=which: f"{w} {k}: {m}"
            )
    la, lb = _losses(single), _losses(dist_run)
    assert [s for s, _ in la] == [s for s, _ in lb] == [1, 2, 3]
    for (_, x), (_, y) in zip(la, lb):
        assert abs(x - y) < 1e-5
    summary = json.loads((dist_run / "summary.json").read_text())
    assert summary["world_size"] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_cli(tmp_path, cache):
    """The real entry point under torchrun: two workers, gloo, a clean exit (rc 0)."""
    run = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model: {preset: tiny, kind: armd}\n")
    args = _overrides(run, cache, "armd", **{"train.steps": 2})
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        "-m",
        "anyorder.cli",
        "train",
        str(cfg),
        "--no-progress",
        *args,
    ]
    # TMPDIR: torchrun leaves /tmp/torchelastic_* folders behind; keep them in tmp_path
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ck.latest_checkpoint(run).name == "step_0000002"


# ----------------------------------------------------------------------------- CLI errors


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.n_layr=2", "anyorder train: error: unknown config key 'model.n_layr'; did you"),
        ("train.steps=many", "anyorder train: error: config key 'train.steps' expects int, got"),
        ("data.source=missing/corpus.txt", "anyorder train: error: "),
    ],
)
def test_cli_config_errors(tmp_path, override, message):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "model: {preset: tiny, kind: armd}\n"
        f"data: {{cache_dir: {tmp_path / 'cache'}}}\n"
        f"train: {{out_dir: {tmp_path / 'run'}}}\n"
    )
    out = _cli(["train", str(cfg), override, "--no-progress"], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr
    assert "Traceback" not in out.stderr
    if override.startswith("data.source"):
        assert "missing/corpus.txt" in lines[0]
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "cache").exists()


def test_check_config_errors():
    cfg = load_config(None, ["train.batch_size=6", "train.grad_accum=4"])
    with pytest.raises(ConfigError, match="does not split over 1 process"):
        check_config(cfg)
    cfg = load_config(None, ["model.kind=aogpt", "order.kind=strided", "order.streams=4"])
    with pytest.raises(ConfigError, match="only armd and mdm take"):
        check_config(cfg)
    with pytest.raises(ConfigError, match="order.kind='sideways' is unknown"):
        check_config(load_config(None, ["order.kind=sideways"]))
    check_config(load_config(None, ["model.kind=armd", "order.kind=strided", "order.streams=4"]))
    with pytest.raises(ConfigError, match=r"train.optimizer='sgd': use adamw or muon"):
        check_config(load_config(None, ["train.optimizer=sgd"]))
    with pytest.raises(ConfigError, match=r"train.muon_momentum=1.0 must be in \[0, 1\)"):
        check_config(load_config(None, ["train.optimizer=muon", "train.muon_momentum=1.0"]))
    with pytest.raises(ConfigError, match="which FSDP shards over the ranks; use DDP"):
        check_config(load_config(None, ["train.optimizer=muon", "train.fsdp=true"]))


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path, cache):
    with pytest.raises(ConfigError, match=r"model.vocab_size=100 is smaller .* 257 ids"):
        train(_cfg(tmp_path / "run", cache, "gpt", **{"model.vocab_size": 100}), progress=False)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- schedule, EMA


def test_learning_rate_schedule():
    cfg = load_config(
        None, ["train.lr=1.0", "train.warmup_steps=4", "train.steps=14", "train.min_lr_ratio=0.1"]
    )
    lrs = [lr_at(s, cfg) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0)
    assert lrs[9] == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_ema_warmup_and_swap():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([p], decay=0.99, warmup=True)
    assert ema.decay_at(0) == pytest.approx(2 / 11) and ema.decay_at(10_000) == 0.99
    with torch.no_grad():
        p.fill_(1.0)
    ema.update(0)  # 2/11 * 0 + 9/11 * 1
    torch.testing.assert_close(ema.shadow[0], torch.full((3,), 9 / 11))
    with ema.swapped():
        torch.testing.assert_close(p.detach(), torch.full((3,), 9 / 11))
    assert torch.equal(p.detach(), torch.ones(3))


def test_ema_follows_the_reference_formula_step_by_step():
    """The AO-GPT reference's ema.py, written out in float64: a counter of updates ``u``
    raised before each one, decay ``min(d, (1 + u) / (10 + u))``, ``s -= (1 - decay)(s - p)``."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, generator=g))
    ema = EMA([p], decay=0.8, warmup=True)
    shadow = p.detach().double().clone()
    for updates in range(1, 41):  # their counter, raised before each update
        with torch.no_grad():
            p.add_(torch.randn(5, generator=g))
        ema.update(updates - 1)  # ours takes the 0-based step
        decay = min(0.8, (1 + updates) / (10 + updates))
        shadow -= (1 - decay) * (shadow - p.detach().double())
        torch.testing.assert_close(ema.shadow[0].double(), shadow, atol=1e-6, rtol=1e-6)
    assert decay == 0.8  # the cap was reached (from the 35th update on)


# ----------------------------------------------------------------------------- configs


def _corpus(tmp_path: Path) -> Path:
    from pydoc_data.topics import topics

    path = tmp_path / "corpus.jsonl"
    docs = [{"text": t} for t in list(topics.values())[:60]]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


@pytest.mark.parametrize("name", sorted(PAPER_CONFIGS))
def test_paper_configs_have_paper_sizes(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    n_layer, d_model, n_head, seq_len, source, tokenizer = PAPER_CONFIGS[name]
    m = cfg.model
    assert (m.n_layer, m.d_model, m.n_head, m.seq_len) == (n_layer, d_model, n_head, seq_len)
    assert m.kind == name.split("-")[0] and m.d_head == 64
    assert cfg.data.source == source and cfg.data.tokenizer == tokenizer
    # ~0.5M tokens per step (SEDD/ARMD); the AO-GPT authors' ~1M (16 x 64 x 1024)
    assert cfg.train.batch_size == (1024 if m.kind == "aogpt" else 512)
    check_config(cfg)
    if m.kind == "armd":
        assert cfg.order.kind == "progressive"
        want = (100_000, 300_000, 8) if name.endswith("lm1b") else (9000, 48000, 32)
        assert (cfg.order.i_ar, cfg.order.i_perm, cfg.order.rho) == want
    if m.kind == "aogpt":
        assert (cfg.order.kind, cfg.order.p_l2r, cfg.train.ema) == ("mix", 0.1, 0.9999)
        # the authors' model and recipe (train_AOGPT_CL.py, submit_124M_train.sh)
        from anyorder.config import VARIANTS

        assert all(getattr(m, k) == v for k, v in VARIANTS["aogpt-ref"].items())
        assert m.padded_vocab == 50304 and not m.tie_embeddings and m.head_bias
        t = cfg.train
        assert (t.weight_decay, t.beta2, t.warmup_steps) == (0.03, 0.95, 2000)
        assert t.lr == (6e-4 if "small" in name else 3e-4)
        assert math.isclose(t.lr * t.min_lr_ratio, 6e-5)


@pytest.mark.parametrize("name", sorted(PAPER_CONFIGS) + TINY_CONFIGS)
def test_dry_run_every_config(tmp_path, name):
    corpus = _corpus(tmp_path)
    # the paper sizes are checked above; a 2-layer trunk keeps the dry run fast
    small = (
        ["model.n_layer=2", "model.d_model=64", "model.n_head=2"] if name in PAPER_CONFIGS else []
    )
    cfg = load_config(
        CONFIGS / f"{name}.yaml",
        [
            f"data.source={corpus}",
            "data.tokenizer=bytes",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"train.out_dir={tmp_path / 'run'}",
            "train.device=cpu",
            "model.seq_len=64",
            *small,
        ],
    )
    s = train(cfg, dry_run=True, progress=False)
    assert s["dry_run"] and math.isfinite(s["loss"]) and s["vocab_size"] == 257
    assert math.isfinite(s["val"]["val/l2r_bpb"])
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_dry_run_through_the_cli(tmp_path):
    corpus = _corpus(tmp_path)
    out = _cli(
        [
            "train",
            str(CONFIGS / "armd-small-owt.yaml"),
            "--dry-run",
            f"data.source={corpus}",
            "data.tokenizer=bytes",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"train.out_dir={tmp_path / 'run'}",
            "model.n_layer=2",
            "model.d_model=64",
            "model.n_head=2",
            "model.seq_len=64",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "dry run: one step done" in out.stdout
    assert "model.vocab_size 50257 -> 257" in out.stdout
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_data_command(tmp_path):
    corpus = _corpus(tmp_path)
    out = _cli(
        [
            "data",
            str(CONFIGS / "tiny-armd.yaml"),
            f"data.source={corpus}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "unigram baseline" in out.stdout and (tmp_path / "cache").is_dir()
