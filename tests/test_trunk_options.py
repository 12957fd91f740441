"""The trunk options modern pretrained families need (issue 33, item 1): grouped-query
attention, an explicit head width, an explicit MLP width, query/key/value biases alone, RoPE
scaling (linear, Llama 3's), each checked against an independent computation:

* RoPE's inverse frequencies against the published formulas written out here in float64
  (and against transformers' own ``ROPE_INIT_FUNCTIONS`` when it is installed);
* grouped-query attention against plain multi-head attention whose key/value weights are
  each key/value head repeated over its query heads (the old code path, no GQA flag);
* an explicit head width and the biases against attention computed by hand from the
  weights (softmax of scaled dot products), for every kind;
* the configs: each inconsistent value refused in one line, the fields saved and read back.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from anyorder import build_model, orders, preset
from anyorder.cache import StaticKV
from anyorder.config import ModelConfig
from anyorder.errors import ConfigError
from anyorder.layers import inverse_frequencies, positions

KINDS = ("gpt", "aogpt", "armd", "mdm")

# every new option away from its default at once (Qwen3-like: head_dim * n_head != d_model)
MODERN = dict(
    n_head=4,
    n_kv_head=2,
    head_dim=12,
    intermediate_size=40,
    mlp="swiglu",
    qkv_bias=True,
    bias=False,
    qk_norm=True,
    pos_emb="rope",
    rope_base=5000.0,
    rope_scaling_type="llama3",
    rope_factor=4.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=2.0,
    rope_original_max_pos=16,
    norm_eps=1e-5,
    tie_embeddings=False,
)

# the trunks of the families issue 33 converts, at test sizes (d_model 32), for the other
# samplers' differential tests (tests/test_speculative.py, tests/test_confidence.py)
FAMILY_TRUNKS = {
    "llama3": dict(n_head=4, n_kv_head=1, mlp="swiglu", intermediate_size=24, qk_norm=False,
                   pos_emb="rope", rope_base=500000.0, rope_scaling_type="llama3", rope_factor=8.0,
                   rope_original_max_pos=16, tie_embeddings=False, norm_eps=1e-5),
    "qwen2": dict(n_head=4, n_kv_head=2, mlp="swiglu", intermediate_size=40, qkv_bias=True,
                  qk_norm=False, pos_emb="rope", rope_base=1e6, norm_eps=1e-6),
    "qwen3": dict(n_head=4, n_kv_head=2, head_dim=12, mlp="swiglu", intermediate_size=40,
                  qk_norm=True, pos_emb="rope", rope_base=1e6, tie_embeddings=False),
    "mistral": dict(n_head=4, n_kv_head=2, mlp="swiglu", intermediate_size=40, qk_norm=False,
                    pos_emb="rope", rope_scaling_type="linear", rope_factor=2.0),
}  # fmt: skip


def _model(kind: str, seed: int = 0, **over):
    torch.manual_seed(seed)
    shape = dict(vocab_size=13, seq_len=24, n_layer=2, d_model=32)
    model = build_model(preset("tiny", kind=kind, **{**shape, **MODERN, **over})).eval()
    with torch.no_grad():  # every weight (norm gains, biases) off its initialisation
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _forward(model, tokens: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if model.kind == "gpt":
            return model(tokens)
        if model.kind == "mdm":
            masked = tokens.clone()
            masked[:, ::3] = model.mask_id
            return model(masked)
        return model(tokens, order)


# ----------------------------------------------------------------------------- RoPE scaling


def _published_inv_freq(head_dim: int, base: float, scaling: dict | None) -> list[float]:
    """The inverse frequencies as the Llama 3.1 release and linear interpolation define them,
    in float64."""
    out = []
    for i in range(0, head_dim, 2):
        f = base ** (-i / head_dim)
        if scaling is None:
            pass
        elif scaling["type"] == "linear":
            f = f / scaling["factor"]
        else:
            factor, low, high = scaling["factor"], scaling["low"], scaling["high"]
            old = scaling["original"]
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                pass  # high frequencies: kept
            elif wavelen > old / low:
                f = f / factor  # low frequencies: scaled
            else:
                smooth = (old / wavelen - low) / (high - low)
                f = (1 - smooth) * f / factor + smooth * f
        out.append(f)
    return out


SCALINGS = [
    None,
    dict(type="linear", factor=2.0),
    dict(type="llama3", factor=8.0, low=1.0, high=4.0, original=8192),  # Llama 3.1's values
    dict(type="llama3", factor=4.0, low=1.0, high=2.0, original=64),  # a band at small sizes
    dict(type="llama3", factor=32.0, low=1.0, high=4.0, original=8192),  # Llama 3.2's
]


def _cfg_scaling(s: dict | None) -> dict:
    if s is None:
        return {}
    if s["type"] == "linear":
        return dict(rope_scaling_type="linear", rope_factor=s["factor"])
    return dict(
        rope_scaling_type="llama3",
        rope_factor=s["factor"],
        rope_low_freq_factor=s["low"],
        rope_high_freq_factor=s["high"],
        rope_original_max_pos=s["original"],
    )


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "none" if s is None else s["type"])
@pytest.mark.parametrize(("head_dim", "base"), [(64, 500000.0), (128, 10000.0), (12, 5000.0)])
def test_inverse_frequencies_follow_the_published_formulas(scaling, head_dim, base) -> None:
    cfg = ModelConfig(kind="armd", n_head=2, head_dim=head_dim, rope_base=base,
                      **_cfg_scaling(scaling))  # fmt: skip
    got = inverse_frequencies(cfg.d_head, cfg.rope_base, cfg.rope_scale).double()
    want = torch.tensor(_published_inv_freq(head_dim, base, scaling), dtype=torch.float64)
    assert_close(got, want, rtol=2e-6, atol=0)
    if scaling is not None and scaling["type"] == "llama3":  # the band is reached: all 3 cases
        unscaled = inverse_frequencies(head_dim, base)
        ratio = unscaled / got
        assert bool((ratio == 1).any()) or head_dim == 12
        assert bool((ratio > 1).any())


@pytest.mark.parametrize("scaling", SCALINGS[1:], ids=lambda s: s["type"])
def test_inverse_frequencies_match_transformers(scaling) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type=scaling["type"], rope_theta=500000.0, factor=scaling["factor"])
    if scaling["type"] == "llama3":
        params.update(
            low_freq_factor=scaling["low"],
            high_freq_factor=scaling["high"],
            original_max_position_embeddings=scaling["original"],
        )
    hf = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=params
    )
    want, attention_factor = ROPE_INIT_FUNCTIONS[scaling["type"]](hf, "cpu")
    cfg = ModelConfig(kind="gpt", pos_emb="rope", d_model=256, n_head=2, rope_base=500000.0,
                      **_cfg_scaling(scaling))  # fmt: skip
    assert attention_factor == 1.0  # these types scale frequencies only
    assert_close(inverse_frequencies(128, cfg.rope_base, cfg.rope_scale), want.float())


def test_models_rotate_by_the_scaled_frequencies() -> None:
    """The tables a model's layers read hold cos/sin of position x scaled frequency."""
    s = SCALINGS[3]
    cfg = ModelConfig(kind="armd", d_model=32, n_head=2, seq_len=40, **_cfg_scaling(s))
    pos = torch.tensor([[0, 7, 39, 3]])
    cos, sin = positions(cfg, pos)  # (1, 1, 4, D) each: [cos, cos] and [-sin, sin]
    freq = torch.tensor(_published_inv_freq(16, cfg.rope_base, s), dtype=torch.float64)
    angles = pos[0].double()[:, None] * freq  # (4, D/2)
    assert_close(cos[0, 0].double(), torch.cat([angles.cos()] * 2, -1), atol=1e-5, rtol=0)
    assert_close(sin[0, 0].double(), torch.cat([-angles.sin(), angles.sin()], -1), atol=1e-5,
                 rtol=0)  # fmt: skip


# ----------------------------------------------------------------------------- attention


def _expanded_to_mha(model):
    """The same model as plain multi-head attention: every key/value head's weights repeated
    over the query heads it serves (what grouped-query attention means)."""
    cfg = model.cfg
    over = {k: getattr(cfg, k) for k in MODERN} | dict(n_kv_head=None)
    mha = build_model(preset("tiny", kind=cfg.kind, vocab_size=cfg.vocab_size,
                             seq_len=cfg.seq_len, n_layer=cfg.n_layer, d_model=cfg.d_model,
                             **over)).eval()  # fmt: skip
    G, D, qw = cfg.n_head // cfg.kv_heads, cfg.d_head, cfg.n_head * cfg.d_head
    state = {}
    for name, t in model.state_dict().items():
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            q, kv = t[:qw], t[qw:]
            k, v = kv.chunk(2)
            k, v = (x.unflatten(0, (-1, D)).repeat_interleave(G, 0).flatten(0, 1) for x in (k, v))
            t = torch.cat([q, k, v])
        state[name] = t
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_query_attention_is_multi_head_attention_with_shared_heads(kind, gen) -> None:
    model = _model(kind)
    assert model.blocks[0].attn.qkv.weight.shape == (4 * 12 + 2 * 2 * 12, 32)
    mha = _expanded_to_mha(model)
    assert not mha.blocks[0].attn.gqa and model.blocks[0].attn.gqa
    tokens = torch.randint(0, 13, (3, 20), generator=gen)
    order = orders.uniform(3, 20, gen).order
    got, want = _forward(model, tokens, order), _forward(mha, tokens, order)
    assert_close(got, want, atol=1e-5, rtol=1e-5)


def _hand_attention(attn, x: torch.Tensor, pos: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Causal attention of one sequence (T, d) computed from the weights, head by head."""
    H, Hkv, D = cfg.n_head, cfg.kv_heads, cfg.d_head
    W, b = attn.qkv.weight, attn.qkv.bias
    q_all, kv_all = F.linear(x, W, b).split([H * D, 2 * Hkv * D], -1)
    k_all, v_all = kv_all.chunk(2, -1)
    freq = torch.tensor(_published_inv_freq(D, cfg.rope_base, None))
    if cfg.rope_scale is not None:
        kind, factor, low, high, old = cfg.rope_scale
        s = dict(type=kind, factor=factor, low=low, high=high, original=old)
        freq = torch.tensor(_published_inv_freq(D, cfg.rope_base, s))
    ang = pos.double()[:, None] * freq  # (T, D/2)
    cos, sin = ang.cos().float(), ang.sin().float()

    def rms(v, w):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope(v):  # the half-split layout: (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)
        a, c = v[:, : D // 2], v[:, D // 2 :]
        return torch.cat([a * cos - c * sin, a * sin + c * cos], -1)

    T = x.shape[0]
    heads = []
    for h in range(H):
        j = h // (H // Hkv)  # the key/value head query head h reads
        q, k = q_all[:, h * D : (h + 1) * D], k_all[:, j * D : (j + 1) * D]
        v = v_all[:, j * D : (j + 1) * D]
        if cfg.qk_norm:
            q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
        q, k = rope(q), rope(k)
        s = (q @ k.T) / math.sqrt(D)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(s, -1) @ v)
    return attn.proj(torch.cat(heads, -1))


@pytest.mark.parametrize(
    "over",
    [MODERN, dict(MODERN, rope_scaling_type="linear", rope_factor=3.0, rope_low_freq_factor=1.0,
                  rope_high_freq_factor=4.0, rope_original_max_pos=8192, qk_norm=False),
     dict(MODERN, n_kv_head=1, rope_scaling_type="none", rope_factor=1.0, rope_high_freq_factor=4.0,
          rope_original_max_pos=8192)],
    ids=["llama3", "linear-no-qknorm", "mqa"],
)  # fmt: skip
@pytest.mark.parametrize("native", [False, True], ids=["repeated", "enable_gqa"])
def test_attention_matches_attention_by_hand(over, native, gen, monkeypatch) -> None:
    """Both ways of serving the query groups: the heads repeated at attention time (the CPU's
    and every masked call's) and SDPA's ``enable_gqa`` (the flash kernel's; forced here)."""
    from anyorder.layers.attention import Attention

    monkeypatch.setattr(Attention, "native_gqa", lambda self, q, mask: native)
    cfg = ModelConfig(kind="gpt", vocab_size=13, seq_len=24, n_layer=1, d_model=32, **over)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    attn = model.blocks[0].attn
    assert attn.proj.bias is None and attn.qkv.bias is not None  # Qwen2's biases
    assert model.blocks[0].mlp.fc.weight.shape == (2 * 40, 32)  # intermediate_size, gate + up
    x = torch.randn(1, 10, 32, generator=gen)
    pos = torch.tensor([3, 0, 9, 1, 12, 5, 7, 2, 20, 4])
    causal = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want = _hand_attention(attn, x[0], pos, cfg)
        for mask in ("causal", causal):  # SDPA's causal kernel, and a mask tensor
            got = attn(x, positions(cfg, pos[None]), mask)[0]
            assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_queries_and_keys_rotated_together_are_rotated_apart(qk_norm, kv_heads, dtype) -> None:
    """``project`` rotates the queries' and keys' heads in one call where both sit at the
    same positions (normed by QK-norm, outside training only): the values and the gradients
    of rotating each apart (``qpos=pos`` takes that path), bit for bit, with or without
    QK-norm, grouped heads, bf16 autocast, with and without a gradient."""
    over = dict(n_head=4, n_kv_head=kv_heads, pos_emb="rope", qk_norm=qk_norm, qkv_bias=True)
    cfg = ModelConfig(kind="gpt", vocab_size=13, seq_len=24, n_layer=1, d_model=32, **over)
    g = torch.Generator().manual_seed(kv_heads)
    attn = build_model(cfg).blocks[0].attn
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    x = torch.randn(2, 9, 32, generator=g)
    pos = positions(cfg, torch.randperm(20, generator=g)[:9].repeat(2, 1))
    cast = torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16")
    outs, grads = [], []
    for qpos in (None, pos):
        attn.zero_grad()
        xi = x.clone().requires_grad_(True)
        with cast:
            q, k, v = attn.project(xi, pos, qpos=qpos)
            with torch.no_grad():  # decoding: the joined rotation whether normed or not
                outs.append(attn.project(x, pos, qpos=qpos))
        outs.append((q, k, v))
        (q.float().square().sum() + (k.float() * 1.5).sum() + v.float().sum()).backward()
        grads.append([xi.grad] + [p.grad for p in attn.parameters() if p.grad is not None])
    for a, b in zip(outs[0] + outs[1], outs[2] + outs[3], strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b)


def test_grouped_heads_are_repeated_where_no_fused_kernel_takes_them() -> None:
    """On the CPU (and in fp32, or with a mask tensor) ``enable_gqa`` would run SDPA's unfused
    math kernel: the heads are repeated instead."""
    attn = _model("gpt").blocks[0].attn
    q = torch.zeros(1, 4, 3, 12)
    assert not attn.native_gqa(q, None) and not attn.native_gqa(q, "causal")
    k = v = torch.randn(1, 2, 3, 12)
    k2, v2, flags = attn._grouped(q, k, v, None)
    assert flags == {} and torch.equal(k2[:, 1], k[:, 0]) and torch.equal(k2[:, 2], k[:, 1])


def test_static_cache_holds_key_value_heads_only() -> None:
    from anyorder.sampling.passes import GPTPasses, compute_dtype
    from anyorder.sampling.plan import Plan  # noqa: F401 - the class the passes take

    model = _model("aogpt")

    class _Plan:
        capacity = 9

    passes = GPTPasses(model, _Plan(), batch=3)
    assert isinstance(passes.cache, StaticKV) and compute_dtype(model) == torch.float32
    assert passes.cache.k[0].shape == (3, 2, 9, 12)  # (B, n_kv_head, capacity, head_dim)


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (dict(n_head=4, n_kv_head=3),
         "model.n_head=4 is not a multiple of model.n_kv_head=3; every key/value head serves "
         "the same number of query heads"),
        (dict(n_head=2, n_kv_head=4),
         "model.n_head=2 is not a multiple of model.n_kv_head=4; every key/value head serves "
         "the same number of query heads"),
        (dict(n_kv_head=0), "model.n_kv_head must be a positive integer"),
        (dict(head_dim=0), "model.head_dim must be a positive integer"),
        (dict(intermediate_size=0), "model.intermediate_size must be a positive integer"),
        (dict(rope_original_max_pos=0), "model.rope_original_max_pos must be a positive integer"),
        (dict(kind="armd", head_dim=7),
         "rope needs an even head dimension (model.head_dim, or d_model / n_head), not 7"),
        (dict(kind="armd", rope_scaling_type="yarn"),
         "model.rope_scaling_type='yarn' is not supported; use none, linear, llama3 (no other RoPE "
         "scaling is implemented)"),
        (dict(kind="aogpt", rope_scaling_type="linear", rope_factor=2.0),
         "model.rope_scaling_type=linear scales RoPE; it needs model.pos_emb=rope"),
        (dict(kind="armd", rope_factor=2.0),
         "model.rope_factor=2.0 does nothing without model.rope_scaling_type; set "
         "rope_scaling_type=linear or llama3, or leave rope_factor at 1"),
        (dict(kind="armd", rope_scaling_type="linear", rope_high_freq_factor=8.0),
         "model.rope_high_freq_factor is for model.rope_scaling_type=llama3; set that, or leave "
         "rope_high_freq_factor at its default"),
        (dict(kind="armd", rope_scaling_type="llama3", rope_low_freq_factor=4.0,
              rope_high_freq_factor=4.0),
         "model.rope_low_freq_factor=4.0 must be below model.rope_high_freq_factor=4.0"),
        (dict(kind="armd", rope_scaling_type="llama3", rope_factor=0.0),
         "model.rope_factor=0.0 must be a positive number"),
        # infinite: the hidden width overflows, the norms and rotations compute nothing useful
        (dict(mlp_ratio=math.inf), "model.mlp_ratio=inf must be a positive number"),
        (dict(kind="armd", norm_eps=math.inf), "model.norm_eps=inf must be a positive number"),
        (dict(kind="armd", rope_base=math.inf), "model.rope_base=inf must be a positive number"),
        (dict(init_std=math.inf), "model.init_std=inf must be a finite number >= 0"),
    ],
)  # fmt: skip
def test_inconsistent_trunk_options_are_refused(over, message) -> None:
    with pytest.raises(ConfigError) as e:
        ModelConfig(**over)
    assert str(e.value) == message


def test_explicit_head_dim_frees_d_model_from_n_head() -> None:
    cfg = ModelConfig(d_model=100, n_head=3, head_dim=16)
    assert (cfg.d_head, cfg.kv_heads) == (16, 3)
    with pytest.raises(ConfigError, match="or set model.head_dim"):
        ModelConfig(d_model=100, n_head=3)


def test_defaults_resolve_to_the_old_trunk() -> None:
    """Every new field at its default builds exactly the parameters the trunk had."""
    cfg = ModelConfig()
    assert (cfg.d_head, cfg.kv_heads, cfg.attn_bias, cfg.rope_scale) == (64, 4, False, None)
    assert cfg.mlp_hidden == 1024 and ModelConfig(mlp="swiglu").mlp_hidden == 704
    model = build_model(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if ".0." in n}
    assert shapes["blocks.0.attn.qkv.weight"] == (768, 256)
    assert shapes["blocks.0.attn.proj.weight"] == (256, 256)
    assert "blocks.0.attn.qkv.bias" not in shapes and not model.blocks[0].attn.gqa


@pytest.mark.parametrize("kind", ["gpt", "armd"])
def test_new_fields_survive_an_export(kind, tmp_path, gen) -> None:
    from anyorder.checkpoint.exported import load_exported, model_config_of
    from anyorder.checkpoint.exporting import save_pretrained

    model = _model(kind)
    save_pretrained(model, tmp_path / "exp")
    loaded = load_exported(tmp_path / "exp").model.eval()
    for name in MODERN:
        assert getattr(loaded.cfg, name) == getattr(model.cfg, name), name
    tokens = torch.randint(0, 13, (2, 16), generator=gen)
    order = orders.uniform(2, 16, gen).order
    assert torch.equal(_forward(loaded, tokens, order), _forward(model, tokens, order))
    # an export written before these fields existed loads with their defaults
    import json

    config = json.loads((tmp_path / "exp" / "config.json").read_text())
    old = {k: v for k, v in config.items() if k not in MODERN or k in ("n_head", "mlp")}
    cfg = model_config_of({**old, "pos_emb": "rope", "bias": False})
    assert (cfg.n_kv_head, cfg.head_dim, cfg.intermediate_size, cfg.qkv_bias) == (None,) * 4
    assert (cfg.rope_scaling_type, cfg.rope_factor) == ("none", 1.0)


def test_armd_decoding_adds_the_output_bias_where_a_query_sees_nothing(gen) -> None:
    """With ``model.bias`` the attention of a query that sees no key is the output projection's
    bias (what the training forward computes), not nothing: the CPU path of ARMD's decoding
    skipped the attention of an empty cache whole, bias included (found by the trunk draws
    of tests/test_decode_oracle.py)."""
    from anyorder.sample import sample
    from test_sample import slot_oracle

    model = _model("armd", n_head=2, n_kv_head=None, head_dim=None, bias=True, qkv_bias=None)
    out = sample(model, 6, batch=2, order="random", generator=gen, keep_logits=True)
    want = slot_oracle(model, out.tokens, out.order, out.step_of)
    assert_close(out.logits, want, atol=1e-5, rtol=0)


def test_new_fields_survive_a_training_checkpoints_config(tmp_path) -> None:
    """A run checkpoint keeps its config as YAML (``to_dict`` -> ``load_config``): the new
    fields come back as they were, and a config written before them loads with defaults."""
    import yaml

    from anyorder.config import RunConfig, load_config, to_dict

    for over in FAMILY_TRUNKS.values():
        cfg = RunConfig(model=ModelConfig(kind="armd", d_model=32, **over))
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        assert load_config(tmp_path / "config.yaml").model == cfg.model
    old = to_dict(RunConfig(model=ModelConfig(kind="armd", d_model=32)))
    for name in ("n_kv_head", "head_dim", "intermediate_size", "qkv_bias", "rope_scaling_type",
                 "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "rope_original_max_pos"):  # fmt: skip
        del old["model"][name]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert load_config(tmp_path / "config.yaml").model == ModelConfig(kind="armd", d_model=32)
