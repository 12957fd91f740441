"""The training step's speed paths: bf16 norms on the fused kernel's dtype, the masks each
model's attention gets, AO-GPT's adaLN in one matmul, ARMD's streams batched, compiled
training against eager."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from anyorder.layers import RMSNorm
from anyorder.orders import strided

from conftest import run_two_ranks, tiny_model

N = 12


def _batch(kind: str, blocks: int | None = None, batch: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (batch, N), generator=g)
    if kind == "gpt":
        return tokens, None, None
    if blocks:
        o = strided(batch, N, blocks)
        return tokens, o.order, o.model_blocks
    return tokens, torch.stack([torch.randperm(N, generator=g) for _ in range(batch)]), None


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("gpt", {}), ("aogpt", {}), ("armd", {}), ("mdm", {}), ("gpt", {"norm": "layernorm"})],
)
def test_bf16_autocast_training_and_eval_raise_no_warning(kind: str, extra: dict) -> None:
    """F.rms_norm warns ("Mismatch dtype ... Cannot dispatch to fused implementation") on
    every call whose weight dtype is not the input's: none may reach a bf16 run."""
    model = tiny_model(kind, **extra).train()
    tokens, order, blocks = _batch(kind if kind != "mdm" else "aogpt")
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # the warning is a TORCH_WARN_ONCE: else once per process
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(tokens, order, blocks, generator=torch.Generator().manual_seed(0))
            loss.backward()
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens, order) if kind != "mdm" else model(tokens)
    finally:
        torch.set_warn_always(always)
    assert torch.isfinite(loss) and bool(torch.isfinite(logits).all())
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def test_rms_norm_is_unchanged_in_fp32_and_close_in_bf16() -> None:
    norm = RMSNorm(16, eps=1e-6)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    x = torch.randn(3, 5, 16, generator=g)
    ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.equal(norm(x), F.rms_norm(x, (16,), norm.weight, 1e-6))
    torch.testing.assert_close(norm(x), ref, atol=1e-6, rtol=0)
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)
    assert norm.weight.dtype == torch.float32  # the parameter itself stays fp32


# ----------------------------------------------------------------------------- compiled training


def _compiled_vs_eager(tmp_path, kind: str, backend: str | None, **extra) -> None:
    """Train eager, then compiled (same seed), then resume the compiled run eagerly and
    compiled: the losses agree step by step, checkpoints carry the plain keys."""
    from torch._dynamo.utils import counters

    from anyorder import checkpoint as ck
    from anyorder.training import loop as train_loop
    from anyorder.training import setup as train_setup
    from test_train import _cfg, _losses

    cache = tmp_path / "cache"
    on = {"train.grad_accum": 2, "train.ckpt_every": 3, "train.eval_every": 3, **extra}
    eager = train_loop.train(
        _cfg(tmp_path / "eager", cache, kind, **on, **{"train.compile": False}), progress=False
    )
    kwargs = {} if backend is None else {"backend": backend}
    saved = dict(train_setup.COMPILE_KWARGS)
    train_setup.COMPILE_KWARGS.update(kwargs)
    counters["stats"].clear()
    try:
        run = tmp_path / "compiled"
        cfg = _cfg(run, cache, kind, **on, **{"train.compile": True})
        compiled = train_loop.train(cfg, progress=False, stop_at=3)
        keys = ck.load_model(run, weights="raw").model.state_dict().keys()
        assert not [k for k in keys if "_orig_mod" in k]
        compiled = train_loop.train(cfg, resume=True, progress=False)  # compiled again
    finally:
        train_setup.COMPILE_KWARGS.clear()
        train_setup.COMPILE_KWARGS.update(saved)
    assert counters["stats"]["unique_graphs"] >= 2  # the loss and validation were compiled
    assert compiled["step"] == eager["step"] == 6
    la, lb = _losses(tmp_path / "eager"), _losses(run)
    assert [s for s, _ in la] == [s for s, _ in lb] == [1, 2, 3, 4, 5, 6]
    for (_, a), (_, b) in zip(la, lb):
        assert b == pytest.approx(a, rel=2e-4, abs=2e-4)
    for which in ("raw", "ema"):
        a = ck.load_model(tmp_path / "eager", weights=which).model.state_dict()
        b = ck.load_model(run, weights=which).model.state_dict()
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], atol=2e-4, rtol=2e-3)


@pytest.mark.parametrize("kind", ["aogpt", pytest.param("armd", marks=pytest.mark.slow)])
def test_compiled_training_follows_eager_through_dynamo(tmp_path, kind: str, capsys) -> None:
    """Dynamo and AOT autograd (backend aot_eager: the graphs, not inductor's kernels) with
    grad accumulation, EMA, validation, checkpoints and a resume; the first compiled step
    says what it paid for."""
    _compiled_vs_eager(tmp_path, kind, "aot_eager")
    said = [line for line in capsys.readouterr().out.splitlines() if "compiling" in line]
    assert len(said) == 2  # the run and its resume, once each
    assert re.fullmatch(r"step [14]: \d+\.\d s, compiling the loss and its backward", said[0])


@pytest.mark.slow
def test_compiled_training_follows_eager_with_inductor(tmp_path) -> None:
    """The real compiler (inductor's CPU kernels), as ``train.compile=true`` runs it."""
    _compiled_vs_eager(tmp_path, "aogpt", None)


def test_compile_setting_is_checked_and_auto_compiles_on_cuda(monkeypatch) -> None:
    from anyorder.config import load_config
    from anyorder.errors import ConfigError
    from anyorder.training import setup
    from anyorder.training.setup import check_config, use_compile

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = load_config(None, [])
    assert auto.train.compile == "auto"
    monkeypatch.setattr(setup, "_has_triton", lambda: True)
    assert not use_compile(auto, cpu) and use_compile(auto, cuda)
    monkeypatch.setattr(setup, "_has_triton", lambda: False)  # inductor has no GPU kernels
    assert not use_compile(auto, cuda)
    assert use_compile(load_config(None, ["train.compile=true"]), cpu)
    assert not use_compile(load_config(None, ["train.compile=false"]), cuda)
    with pytest.raises(ConfigError, match=r"^train.compile='fast': use true, false or auto$"):
        check_config(load_config(None, ["train.compile=fast"]))


# ----------------------------------------------------------------------------- attention


class _Attention(TorchDispatchMode):
    """Records the SDPA calls (is_causal, the mask's storage) and every (n, n)-shaped tensor
    an op makes: masks are the only such tensors outside SDPA."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.calls, self.square = n, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product") and "backward" not in name:
            bound = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
            mask = bound.get("attn_mask")
            ptr = None if mask is None else mask.untyped_storage().data_ptr()
            self.calls.append((bool(bound.get("is_causal", False)), ptr))
        elif isinstance(out, torch.Tensor) and tuple(out.shape[-2:]) == (self.n, self.n):
            self.square += 1
        return out


def _forward_attention(kind: str, n_layer: int, blocks: int | None) -> _Attention:
    model = tiny_model(kind, n_layer=n_layer, **({"l2s": 1} if kind == "armd" else {}))
    tokens, order, model_blocks = _batch(kind, blocks)
    spy = _Attention(N)
    with spy:
        model.train().loss(tokens, order, model_blocks).backward()
    return spy


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd"])
def test_token_level_attention_is_the_causal_kernel_without_a_mask(kind: str) -> None:
    spy = _forward_attention(kind, 3, None)
    assert len(spy.calls) == 3  # one per layer (ARMD, l2s = 1: the query stream only)
    assert all(causal and mask is None for causal, mask in spy.calls)
    assert spy.square == 0  # no dense (n, n) mask is built


def test_block_masks_are_prepared_once_per_forward_not_per_layer() -> None:
    shallow, deep = _forward_attention("armd", 2, 3), _forward_attention("armd", 5, 3)
    assert len(deep.calls) == len(shallow.calls) + 3
    assert deep.square == shallow.square > 0  # the (n, n) masks: as many at any depth
    # every layer reads one of the two prepared masks (content and query stream)
    assert len({mask for _, mask in deep.calls}) == 2 and None not in {m for _, m in deep.calls}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_compiled_two_processes_match_one_eager_process(tmp_path, fsdp: bool) -> None:
    """``train.compile=true`` under DDP and FSDP2 (two gloo ranks; dynamo + AOT autograd)
    gives the weights and losses of one eager process."""
    import json

    from anyorder.training.loop import train
    from test_train import DIST_EXTRA, WORKER, _cfg, _losses, _overrides, _weights

    cache = tmp_path / "cache"
    single = tmp_path / "single"
    train(_cfg(single, cache, "armd", **DIST_EXTRA), progress=False)
    run = tmp_path / "dist"
    script = tmp_path / "worker.py"
    backend = (
        "import anyorder.training.setup as S; import anyorder.training.loop as T; "
        'S.COMPILE_KWARGS["backend"] = "aot_eager"\n'
    )
    script.write_text(
        WORKER.replace("from anyorder.training.loop import train\n", backend + "train = T.train\n")
    )
    extra = {**DIST_EXTRA, "train.fsdp": fsdp, "train.compile": True}
    overrides = json.dumps(_overrides(run, cache, "armd", **extra))
    outputs = run_two_ranks(script, overrides, tmp_path / "store", timeout=600)
    assert "(compiled)" in outputs[0]
    for which in ("raw", "ema"):
        a, b = _weights(single, which), _weights(run, which)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4)
    for (_, x), (_, y) in zip(_losses(single), _losses(run)):
        assert abs(x - y) < 1e-4


def test_compile_leaves_the_encoders_features_eager() -> None:
    """``compile_modules`` compiles validation's ``features`` where it traces whole; the
    encoder's groups its masked copies by values read on the host (a graph break at every
    call, and dynamo's warnings on every validation), so its ``features`` stay eager."""
    from anyorder.training.setup import LossModule, compile_modules

    for kind, compiled in (("aogpt", True), ("mdm", False)):
        model = tiny_model(kind)
        compile_modules(model, LossModule(model), fullgraph=True)
        assert ("features" in vars(model)) is compiled  # the compiled instance attribute
