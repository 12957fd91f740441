"""The estimates drawn from a config's shapes (anyorder.memory, anyorder.flops) against the
models they describe: the exact parameter count for every trunk option, the activations a
step keeps (with and without recomputed blocks) and the FLOPs of a recomputing step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anyorder import build_model
from anyorder.config import ModelConfig, load_config
from anyorder.errors import ConfigError
from anyorder.flops import forward_flops_per_token, train_flops_per_token
from anyorder.memory import activation_bytes, param_estimate, training_bytes


@st.composite
def model_configs(draw) -> ModelConfig:
    """Any kind with any trunk option; inconsistent draws are rejected by the config."""
    n_head = draw(st.sampled_from([1, 2, 4]))
    values = dict(
        kind=draw(st.sampled_from(["gpt", "aogpt", "armd", "mdm"])),
        vocab_size=draw(st.integers(5, 40)),
        seq_len=draw(st.integers(4, 20)),
        n_layer=draw(st.integers(1, 3)),
        n_head=n_head,
        n_kv_head=draw(st.sampled_from([None, 1, n_head])),
        head_dim=draw(st.sampled_from([None, 8, 12])),
        d_model=draw(st.sampled_from([16, 24, 32])),
        mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        mlp_ratio=draw(st.sampled_from([2.0, 4.0])),
        intermediate_size=draw(st.sampled_from([None, 20])),
        pos_emb=draw(st.sampled_from(["auto", "learned", "rope"])),
        qk_norm=draw(st.booleans()),
        norm=draw(st.sampled_from(["rmsnorm", "layernorm"])),
        bias=draw(st.booleans()),
        qkv_bias=draw(st.sampled_from([None, True, False])),
        tie_embeddings=draw(st.booleans()),
        target_dim=draw(st.sampled_from([8, 16])),
        target_injection=draw(st.sampled_from(["adaln", "add"])),
        head_bias=draw(st.booleans()),
        padded_vocab=draw(st.sampled_from([None, 48])),
        bos_pos_row=draw(st.booleans()),
        l2s=draw(st.sampled_from([None, 1])),
    )
    try:
        return ModelConfig(**values)
    except ConfigError:
        values.update(kind="gpt", head_bias=False, padded_vocab=None, bos_pos_row=False)
        values.update(head_dim=None, d_model=32, pos_emb="learned")  # always consistent
        return ModelConfig(**values)


@settings(max_examples=25, deadline=None)
@given(model_configs())
def test_param_estimate_is_the_built_models_count(cfg: ModelConfig) -> None:
    model = build_model(cfg)
    assert param_estimate(cfg) == sum(p.numel() for p in model.parameters())


def test_param_estimate_of_qwen3_and_llama_shapes() -> None:
    """The published totals: Qwen3-0.6B 596,049,920 (tied); Llama-3.2-1B 1,235,814,400
    (tied). Ours adds the learned BOS vector (gpt: d_model) and nothing else."""
    qwen3 = ModelConfig(
        kind="gpt", vocab_size=151936, seq_len=2048, n_layer=28, n_head=16, n_kv_head=8,
        head_dim=128, d_model=1024, mlp="swiglu", intermediate_size=3072, pos_emb="rope",
        qk_norm=True, tie_embeddings=True,
    )  # fmt: skip
    assert param_estimate(qwen3) == 596_049_920 + 1024
    llama = dataclasses.replace(
        qwen3, vocab_size=128256, n_layer=16, n_head=32, n_kv_head=8, head_dim=None,
        d_model=2048, intermediate_size=8192, qk_norm=False,
    )  # fmt: skip
    assert param_estimate(llama) == 1_235_814_400 + 2048


def _saved_bytes(cfg: ModelConfig, checkpointing: bool, half: bool) -> tuple[int, int]:
    """(bytes autograd saves in one training forward of 2 x seq_len tokens, block count)."""
    torch.manual_seed(0)
    model = build_model(cfg).train()
    model.checkpoint_blocks = checkpointing
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    order = None if cfg.kind == "gpt" else torch.stack([torch.randperm(cfg.seq_len)] * 2)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        model.loss(tokens, order, generator=torch.Generator().manual_seed(0))
    return total, len(model.blocks)


def test_activation_bytes_are_a_lower_bound_and_follow_checkpointing() -> None:
    """Against what autograd saves, measured through saved-tensor hooks: the estimate never
    exceeds it, with or without bf16 and recomputed blocks (then one block's activations,
    those of the recomputation, are added to the measured ones)."""
    configs = [
        ModelConfig(kind="gpt", vocab_size=17, seq_len=8, n_layer=3, n_head=4, n_kv_head=2,
                    head_dim=12, d_model=32, mlp="swiglu", intermediate_size=40),
        ModelConfig(kind="aogpt", vocab_size=17, seq_len=8, n_layer=2, n_head=2, d_model=32),
        ModelConfig(kind="armd", vocab_size=17, seq_len=8, n_layer=3, n_head=2, n_kv_head=1,
                    d_model=32, l2s=2),
        ModelConfig(kind="mdm", vocab_size=17, seq_len=8, n_layer=2, n_head=2, d_model=32),
    ]  # fmt: skip
    for cfg in configs:
        for half in (False, True) if cfg.kind == "armd" else (False,):
            plain, layers = _saved_bytes(cfg, False, half)
            ckpt, _ = _saved_bytes(cfg, True, half)
            tokens = 2 * cfg.seq_len
            assert activation_bytes(cfg, tokens, half=half) <= plain, cfg.kind
            one_block = plain * (2 if cfg.kind == "armd" else 1) // layers
            est = activation_bytes(cfg, tokens, checkpointing=True, half=half)
            assert est <= ckpt + one_block, cfg.kind
    deep = ModelConfig(kind="gpt", vocab_size=256, seq_len=1024, n_layer=12, d_model=512)
    plain, ckpt = (activation_bytes(deep, 1024, checkpointing=c) for c in (False, True))
    assert 3 * ckpt < plain


def test_training_bytes_read_the_options_and_the_weights_vocabulary() -> None:
    """GQA and head_dim change the parameters counted; recomputed blocks lower the step;
    a model from train.init_from counts its own vocabulary (not the byte-level stand-in)."""
    base = ["model.kind=gpt", "model.n_layer=4", "model.d_model=64", "model.seq_len=128"]
    plain = training_bytes(load_config(None, base))
    gqa = training_bytes(load_config(None, [*base, "model.n_kv_head=1", "model.head_dim=8"]))
    assert gqa[1] < plain[1]
    ckpt = training_bytes(load_config(None, [*base, "train.activation_checkpointing=true"]))
    assert ckpt[0] < plain[0] and ckpt[1] == plain[1]
    wide = [*base, "model.vocab_size=50000"]
    assert training_bytes(load_config(None, wide))[1] == plain[1]  # stands in as 256 ids
    init = training_bytes(load_config(None, [*wide, "train.init_from=somewhere"]))
    assert init[1] == plain[1] + (50000 - 256) * 64


def test_recomputing_step_flops_add_the_blocks_forward() -> None:
    """With checkpointing a step costs one more forward of the blocks (not of the head, the
    adaLN or the query MLP): with and without a head, the difference is the same."""
    for kind in ("gpt", "aogpt", "armd", "mdm"):
        cfg = ModelConfig(kind=kind, vocab_size=1000, n_layer=4, n_head=4, n_kv_head=2,
                          d_model=64, mlp="swiglu")  # fmt: skip
        small = dataclasses.replace(cfg, vocab_size=10)
        for c in (cfg, small):
            assert train_flops_per_token(c, 64) == 3 * forward_flops_per_token(c, 64)
        extra = train_flops_per_token(cfg, 64, True) - train_flops_per_token(cfg, 64)
        assert extra == train_flops_per_token(small, 64, True) - train_flops_per_token(small, 64)
        assert 0 < extra < forward_flops_per_token(cfg, 64)
        if kind == "gpt":  # by hand: q/k/v and output projections, attention, SwiGLU (192)
            per_layer = 2 * 64 * (64 + 2 * 32) + 2 * 64 * 64 + 4 * 64 * 64 + 3 * 2 * 64 * 192
            assert extra == 4 * per_layer


def test_rope_tables_of_a_huge_context_are_refused_before_anything_is_built(monkeypatch):
    """A RoPE model's weights do not grow with seq_len, but its rotary tables (cos and sin,
    and the two joined, in fp32) do: a config.json claiming a context of 10**12 built the
    model and then tried to allocate terabytes at the first forward."""
    import anyorder.memory

    monkeypatch.setattr(anyorder.memory, "machine_memory", lambda device="cpu": 10**9)
    cfg = ModelConfig(kind="armd", vocab_size=257, n_layer=2, n_head=4, d_model=64)
    build_model(dataclasses.replace(cfg, seq_len=4096))  # 4 MB of tables: fine
    huge = dataclasses.replace(cfg, seq_len=10**12)
    with pytest.raises(ConfigError) as e:
        build_model(huge)
    params = param_estimate(huge)
    assert str(e.value) == (
        f"the model's config asks for at least {params:,} parameters and RoPE tables for "
        "1,000,000,000,000 positions (256.0 TB in fp32: 2 layers x 64, vocabulary 257, "
        "context 1,000,000,000,000), more than this machine's 1.0 GB; check model.seq_len, "
        "model.d_model, model.n_layer and model.vocab_size"
    )
