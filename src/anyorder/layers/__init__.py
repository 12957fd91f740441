"""The trunk every model shares: norms, RoPE, attention over a permuted sequence, MLPs, adaLN.

Design choices:

* Every sequence the models see is *permuted*: slot ``t`` holds the token at original
  position ``pos[t]``. RoPE and learned position tables are therefore indexed by the given
  positions, never by ``arange`` (that is what makes the models permutation-equivariant).
* Masks are boolean, ``True`` = may attend, shaped ``(B, 1, Tq, Tk)``; the plain causal case
  is passed as the string ``"causal"`` so that SDPA takes its ``is_causal`` fast path (it
  skips the masked half), the strictly causal one as ``"strict"`` (the same kernel on
  shifted queries and keys), and ``None`` means bidirectional. :func:`block_mask` builds the
  block-causal and block-strict masks from block ids; :func:`block_visibility` prepares a
  model's masks once per forward (:class:`PreparedMask`), for every layer.
* A row with nothing to attend to (the first block under a strict mask) gives a zero output
  on every backend: we let it attend to key 0 and multiply the result by zero, instead of
  relying on how a kernel treats a fully masked row.
* Attention is split into :meth:`Attention.project` and :meth:`Attention.attend` so that
  the two streams of ARMD and the KV cache reuse the same weights and code.

Modules: :mod:`~anyorder.layers.norm` (RMSNorm, LayerNorm), :mod:`~anyorder.layers.rope`
(positions: RoPE, sinusoidal), :mod:`~anyorder.layers.masks` (block masks, prepared masks,
packings), :mod:`~anyorder.layers.flex` (the optional FlexAttention backend),
:mod:`~anyorder.layers.attention` (:class:`Attention`), :mod:`~anyorder.layers.adaln`
(adaLN and its joined forms), :mod:`~anyorder.layers.blocks` (MLP, Block, Head, init),
:mod:`~anyorder.layers.head_loss` (the head's cross-entropy in chunks),
:mod:`~anyorder.layers.casts` (the weights a decode casts once under autocast).
"""

from anyorder.layers.adaln import (
    AdaLN,
    Modulation,
    TargetCondition,
    adaln_offset,
    adaln_rows,
    adaln_stack,
    adaln_table,
)
from anyorder.layers.attention import (
    Attention,
    KVHook,
)
from anyorder.layers.blocks import (
    MLP,
    Block,
    Head,
    init_normal,
    init_weights,
)
from anyorder.layers.flex import (  # noqa: F401 (tests)
    ATTENTION_BACKENDS,
    _flex_block_mask,
    _load_flex,
    flex_enabled,
    set_attention_backend,
)
from anyorder.layers.head_loss import head_cross_entropy
from anyorder.layers.masks import (
    Mask,
    Packing,
    PreparedMask,
    StreamPacking,
    block_mask,
    block_visibility,
    prepare_mask,
    strict_causal_mask,
)
from anyorder.layers.norm import (
    RMSNorm,
    make_norm,
)
from anyorder.layers.rope import (
    Positions,
    Rotary,
    apply_rope,
    inverse_frequencies,
    positions,
    rope_angles,
    rotary,
    rotary_table,
    rotate,
    sinusoidal,
    slice_positions,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AdaLN",
    "Attention",
    "Block",
    "Head",
    "KVHook",
    "MLP",
    "Mask",
    "Modulation",
    "Packing",
    "Positions",
    "PreparedMask",
    "RMSNorm",
    "Rotary",
    "StreamPacking",
    "TargetCondition",
    "adaln_offset",
    "adaln_rows",
    "adaln_stack",
    "adaln_table",
    "apply_rope",
    "block_mask",
    "block_visibility",
    "flex_enabled",
    "head_cross_entropy",
    "init_normal",
    "init_weights",
    "make_norm",
    "positions",
    "prepare_mask",
    "inverse_frequencies",
    "rope_angles",
    "rotary",
    "rotary_table",
    "rotate",
    "set_attention_backend",
    "sinusoidal",
    "slice_positions",
    "strict_causal_mask",
]
