"""``train.activation_checkpointing``: each block recomputed in backward gives the plain
step's loss and gradients (dropout, bf16 autocast, torch.compile, a training run, FSDP2 and
DDP), keeps fewer activations, and the setting is checked."""

from __future__ import annotations

import json

import pytest
import torch

from anyorder.config import load_config
from anyorder.errors import ConfigError

from conftest import run_two_ranks, tiny_model

N = 12
KINDS = [("gpt", {}), ("aogpt", {}), ("armd", {"n_layer": 3, "l2s": 2}), ("mdm", {})]
"""armd: two two-stream layers (one that updates both streams, the last that returns the
query stream) and an ordinary one."""


def _batch(kind: str):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (3, N), generator=g)
    if kind == "gpt":
        return tokens, None
    return tokens, torch.stack([torch.randperm(N, generator=g) for _ in range(3)])


class _Saved:
    """Counts the elements autograd saves for backward (through saved-tensor hooks), and
    the calls of each block's first norm (every layer, ARMD's two-stream ones too, runs it
    once per forward)."""

    def __init__(self, model) -> None:
        self.elements, self.calls = 0, 0
        self.hooks = [b.norm1.register_forward_hook(self._call) for b in model.blocks]

    def _call(self, *_) -> None:
        self.calls += 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.elements += t.numel()
        return t

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def _step(model, kind: str, ckpt: bool, seed: int = 5, autocast: bool = False):
    """One loss and backward from a fixed RNG state: (loss, grads by name, _Saved)."""
    model.zero_grad(set_to_none=True)
    model.checkpoint_blocks = ckpt
    tokens, order = _batch(kind)
    saved = _Saved(model)
    torch.manual_seed(seed)  # the dropout masks
    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model.loss(tokens, order, generator=torch.Generator().manual_seed(1))
    calls_forward = saved.calls
    loss.backward()
    saved.calls -= calls_forward  # the blocks' forward calls during backward
    saved.close()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, saved


def _assert_same(a, b, exact: bool) -> None:
    (loss_a, grads_a, _), (loss_b, grads_b, _) = a, b
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 0
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 0, "atol": 1e-6}
    torch.testing.assert_close(loss_b, loss_a, **tol)
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], **tol, msg=k)


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["plain", "dropout"])
@pytest.mark.parametrize(("kind", "extra"), KINDS, ids=[k for k, _ in KINDS])
def test_recomputed_blocks_give_the_plain_gradients(kind: str, extra: dict, dropout: float):
    model = tiny_model(kind, dropout=dropout, **extra).train()
    plain = _step(model, kind, ckpt=False)
    ckpt = _step(model, kind, ckpt=True)
    _assert_same(plain, ckpt, exact=False)
    # it did recompute: every block ran again in backward, and far less was saved
    assert (plain[2].calls, ckpt[2].calls) == (0, len(model.blocks))
    assert ckpt[2].elements < 0.5 * plain[2].elements, (ckpt[2].elements, plain[2].elements)
    if dropout:  # the masks matter: another seed gives another loss
        other = _step(model, kind, ckpt=True, seed=6)
        assert not torch.equal(other[0], ckpt[0])


@pytest.mark.parametrize(("kind", "extra"), KINDS[1:3], ids=["aogpt", "armd"])
def test_recomputation_under_bf16_autocast_is_the_same_computation(kind: str, extra: dict):
    """The recomputation runs under the autocast state of the forward: the same bf16 ops,
    so the same numbers bit for bit."""
    model = tiny_model(kind, dropout=0.1, **extra).train()
    plain = _step(model, kind, ckpt=False, autocast=True)
    ckpt = _step(model, kind, ckpt=True, autocast=True)
    _assert_same(plain, ckpt, exact=True)


def test_no_recomputation_without_a_graph():
    """Validation and sampling (no_grad) run the blocks once, checkpointing or not."""
    model = tiny_model("armd", n_layer=3, l2s=2).train()
    model.checkpoint_blocks = True
    tokens, order = _batch("armd")
    with torch.no_grad():
        a = model(tokens, order)
    model.checkpoint_blocks = False
    with torch.no_grad():
        b = model(tokens, order)
    assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["aogpt", "armd"])
def test_compiled_recomputation_matches_eager(kind: str):
    """torch.compile (dynamo + AOT autograd, as training compiles) over checkpointed blocks."""
    model = tiny_model(kind, **({"n_layer": 3, "l2s": 2} if kind == "armd" else {})).train()
    plain = _step(model, kind, ckpt=False)
    model.compile(backend="aot_eager")
    compiled = _step(model, kind, ckpt=True)
    _assert_same(plain, compiled, exact=False)


# ----------------------------------------------------------------------------- training runs


def _run(tmp_path, name: str, **extra):
    from test_train import _overrides

    return _overrides(tmp_path / name, tmp_path / "cache", "armd", **{
        "model.n_layer": 3, "model.l2s": 2, "model.dropout": 0.1, "train.steps": 3,
        "train.ema": 0.0, **extra,
    })  # fmt: skip


def _weights(run) -> dict[str, torch.Tensor]:
    from anyorder import checkpoint as ck

    return ck.load_model(run, weights="raw").model.state_dict()


@pytest.mark.slow
def test_training_run_with_checkpointing_matches_the_plain_run(tmp_path, capsys):
    """Three optimizer steps (armd, dropout, grad accumulation) through the real loop (the
    fast variants: the steps above, and the recipes' dry runs in test_finetune_recipes.py)."""
    from anyorder.training.loop import train

    extra = {"train.grad_accum": 2}
    train(load_config(None, _run(tmp_path, "plain", **extra)), progress=False)
    on = {**extra, "train.activation_checkpointing": True}
    train(load_config(None, _run(tmp_path, "ckpt", **on)), progress=False)
    assert "(blocks recomputed in backward)" in capsys.readouterr().out
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "ckpt")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_two_processes_with_checkpointing_match_one_plain_process(tmp_path, fsdp: bool):
    """Two gloo ranks under DDP or FSDP2 (one unit per ordinary block, recomputed through
    its hooks) give the weights of one process without checkpointing."""
    from anyorder.training.loop import train
    from test_train import WORKER

    plain = {"model.dropout": 0.0}  # dropout differs between ranks
    train(load_config(None, _run(tmp_path, "single", **plain)), progress=False)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    on = {**plain, "train.fsdp": fsdp, "train.activation_checkpointing": True}
    overrides = json.dumps(_run(tmp_path, "dist", **on))
    outputs = run_two_ranks(script, overrides, tmp_path / "store", timeout=300)
    assert "(blocks recomputed in backward)" in outputs[0]
    a, b = _weights(tmp_path / "single"), _weights(tmp_path / "dist")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)


# ----------------------------------------------------------------------------- the setting


def test_the_setting_is_checked():
    from anyorder.config import RunConfig, TrainConfig
    from anyorder.training.setup import check_config

    assert load_config(None, []).train.activation_checkpointing is False
    assert load_config(None, ["train.activation_checkpointing=true"]).train.activation_checkpointing
    with pytest.raises(
        ConfigError,
        match=r"^config key 'train.activation_checkpointing' expects bool, got 'blocks' \(str\); "
        r"fix the value in the file or on the command line$",
    ):
        load_config(None, ["train.activation_checkpointing=blocks"])
    with pytest.raises(
        ConfigError,
        match=r"^train.activation_checkpointing='per-block': use true \(recompute each block in "
        r"backward\) or false$",
    ):
        check_config(RunConfig(train=TrainConfig(activation_checkpointing="per-block")))
