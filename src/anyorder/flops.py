"""FLOP counts from the architecture, as ARMD App. B.2 counts them.

A multiply-add is 2 FLOPs; attention scores and values cost ``4 * n_ctx * d`` per query
token (``4 N^2 d`` per sequence, the causal half not subtracted, as in the paper). A
training step is three forward passes' worth (forward + backward), and one more of the
blocks when they are recomputed in backward. Biases, norms, softmax and embeddings lookups
are left out: they are small and the same on both sides of every ratio we report.
"""

from __future__ import annotations

from anyorder.config import ModelConfig


def _mlp_hidden(cfg: ModelConfig) -> tuple[int, int]:
    """(hidden width, number of d x hidden matrices) of the MLP."""
    return cfg.mlp_hidden, 3 if cfg.mlp == "swiglu" else 2


def _widths(cfg: ModelConfig) -> tuple[int, int]:
    """(query width, key/value width): ``n_head * head_dim`` and ``n_kv_head * head_dim``
    (both d_model without grouped-query attention or an explicit head_dim)."""
    return cfg.n_head * cfg.d_head, cfg.kv_heads * cfg.d_head


def layer_flops(cfg: ModelConfig, n_ctx: int) -> int:
    """Forward FLOPs of one ordinary layer, per query token attending over ``n_ctx`` keys."""
    d = cfg.d_model
    hidden, mats = _mlp_hidden(cfg)
    q, kv = _widths(cfg)
    return 2 * 2 * d * (q + kv) + 4 * n_ctx * q + 2 * mats * d * hidden


def forward_flops_per_token(cfg: ModelConfig, n: int) -> int:
    """Forward FLOPs per token of a length-``n`` training sequence, head included."""
    d, L = cfg.d_model, cfg.n_layer
    base = blocks_flops_per_token(cfg, n) + 2 * d * cfg.vocab_size  # the blocks, the head
    if cfg.kind == "aogpt" and cfg.target_injection == "adaln":
        base += L * 2 * cfg.target_dim * 6 * d + 2 * cfg.target_dim * 2 * d
    elif cfg.kind == "armd":
        base += 2 * 2 * d * (d // 4)  # the query MLP of prefix aggregation
    return base


def blocks_flops_per_token(cfg: ModelConfig, n: int) -> int:
    """The transformer blocks' share of :func:`forward_flops_per_token` (ARMD's two streams
    included): what activation checkpointing computes twice."""
    d, L = cfg.d_model, cfg.n_layer
    hidden, mats = _mlp_hidden(cfg)
    base = L * layer_flops(cfg, n)
    if cfg.kind == "armd":
        l2s = cfg.two_stream_layers
        q, _ = _widths(cfg)
        # query stream per two-stream layer: its own Q and O projections, attention, MLP
        query = 2 * 2 * d * q + 4 * n * q + 2 * mats * d * hidden
        # the last two-stream layer needs only K and V of the content stream
        skipped = 2 * d * q + 2 * d * q + 2 * n * q + 2 * mats * d * hidden
        base += l2s * query - skipped
    return base


def train_flops_per_token(cfg: ModelConfig, n: int, checkpointing: bool = False) -> int:
    """Training FLOPs per token: forward + backward = 3 forwards; with ``checkpointing``
    (``train.activation_checkpointing``) the blocks' forward once more, in backward."""
    again = blocks_flops_per_token(cfg, n) if checkpointing else 0
    return 3 * forward_flops_per_token(cfg, n) + again


def decode_flops_per_token(cfg: ModelConfig, n_ctx: int) -> int:
    """FLOPs to decode one token with a KV cache holding ``n_ctx`` entries.

    gpt/aogpt: one pass of one slot through all layers (aogpt: plus its adaLN, counted per
    token as the architecture has it, though our decoder looks it up in a per-position
    table). armd: the query slot through all layers (Q and O only in the two-stream layers,
    whose K and V come from the content stream) plus the decided token's content slot
    through the two-stream layers (K and V only in the last one), plus the query MLP.
    mdm: a full bidirectional pass over ``n_ctx`` tokens per step.
    """
    d, L = cfg.d_model, cfg.n_layer
    per_layer = layer_flops(cfg, n_ctx)
    head = 2 * d * cfg.vocab_size
    if cfg.kind == "armd":
        l2s = cfg.two_stream_layers
        kv = 2 * 2 * d * _widths(cfg)[1]  # the K and V projections
        query = l2s * (per_layer - kv) + (L - l2s) * per_layer
        content = (l2s - 1) * per_layer + kv
        return query + content + 2 * 2 * d * (d // 4) + head
    if cfg.kind == "mdm":
        return n_ctx * L * per_layer + n_ctx * head
    base = L * per_layer + head
    if cfg.kind == "aogpt" and cfg.target_injection == "adaln":
        base += L * 2 * cfg.target_dim * 6 * d + 2 * cfg.target_dim * 2 * d
    return base


def decode_flops_per_sequence(cfg: ModelConfig, n: int) -> int:
    """FLOPs to decode ``n`` tokens one at a time (the cache grows from 1 to ``n`` entries)."""
    return sum(decode_flops_per_token(cfg, t) for t in range(1, n + 1))
