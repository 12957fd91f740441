"""Multi-head self-attention over a permuted sequence, with QK-norm and RoPE on given
positions.

Design choices:

* Grouped-query attention (``model.n_kv_head`` below ``n_head``) keeps ``n_kv_head`` key and
  value heads everywhere they are stored (the KV caches are sized by them). At attention
  time SDPA's ``enable_gqa`` serves each head's group where a fused kernel takes it
  (FlexAttention; flash: CUDA, half precision, no mask tensor); elsewhere that flag falls
  back to the unfused math kernel, so the heads are repeated for the call instead
  (:meth:`Attention.native_gqa`). With as many key/value heads as query heads nothing
  changes: the same kernels as before.

* Attention is split into :meth:`Attention.project` and :meth:`Attention.attend` so that
  the two streams of ARMD and the KV cache reuse the same weights and code.
* Queries and keys at the same positions are rotated in one call over their heads side by
  side (decoding is bound by kernel launches; the numbers are those of two calls).
* A row with nothing to attend to (the first block under a strict mask) gives a zero output
  on every backend: we let it attend to key 0 and multiply the result by zero, instead of
  relying on how a kernel treats a fully masked row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from anyorder.config import ModelConfig
from anyorder.errors import ConfigError
from anyorder.layers import casts
from anyorder.layers.flex import _load_flex
from anyorder.layers.linear import Linear, linear, weight_and_bias
from anyorder.layers.masks import Mask, Packing, PreparedMask
from anyorder.layers.norm import RMSNorm
from anyorder.layers.rope import Positions, rotary, rotate

KVHook = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]  # see anyorder.cache


class Attention(nn.Module):
    """Multi-head self-attention with QK-norm and RoPE on given positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.kv_heads
        self.head_dim = cfg.d_head
        self.rope = cfg.positional == "rope"
        self.rope_base, self.rope_scale = cfg.rope_base, cfg.rope_scale
        self.q_width = cfg.n_head * cfg.d_head
        self.kv_width = cfg.kv_heads * cfg.d_head
        # grouped-query attention: SDPA repeats each key/value head over its query heads
        # (no copy in the cache); plain multi-head attention passes no flag (same kernels)
        self.gqa = {"enable_gqa": True} if self.n_kv_head != self.n_head else {}
        width = self.q_width + 2 * self.kv_width
        self.qkv = Linear(cfg.d_model, width, bias=cfg.attn_bias)
        self.proj = Linear(self.q_width, cfg.d_model, bias=cfg.bias)
        self.proj.residual = True  # scaled init
        self.q_norm = RMSNorm(cfg.d_head, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.d_head, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.dropout = cfg.dropout

    def _heads(self, x: Tensor, heads: int, norm: nn.Module | None = None) -> Tensor:
        """(B, T, h * D) -> (B, h, T, D), normed per head first when ``norm`` is given (on
        the (B, T, h, D) view: a norm of the transposed view would copy its output back)."""
        B, T, _ = x.shape
        x = x.view(B, T, heads, self.head_dim)
        return (x if norm is None else norm(x)).transpose(1, 2)

    def _rotate(self, x: Tensor, pos: Positions) -> Tensor:
        if not self.rope:
            return x
        if isinstance(pos, Tensor):
            pos = rotary(pos, self.head_dim, self.rope_base, self.rope_scale)
        return rotate(x, pos)

    def project(
        self,
        x: Tensor,
        pos: Positions,
        packing: Packing | None = None,
        qpos: Positions = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (each (B, Hkv, T, D)), normed and rotated to
        ``pos`` (the queries to ``qpos`` where given; with a ``packing``: ``x`` is packed, the
        outputs are not)."""
        qkv = self.qkv(x)
        if packing is not None:
            qkv = packing.unpack(qkv)
        q, k, v = qkv.split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        H, Hkv = self.n_head, self.n_kv_head
        normed = not isinstance(self.q_norm, nn.Identity)
        if not self.rope or qpos is not None or (normed and torch.is_grad_enabled()):
            q = self._rotate(self._heads(q, H, self.q_norm), pos if qpos is None else qpos)
            k = self._rotate(self._heads(k, Hkv, self.k_norm), pos)
            return q, k, self._heads(v, Hkv)
        # queries and keys at the same positions: their heads side by side, (B, H + Hkv, T,
        # D), rotated at once: the same numbers, half the rotation's kernels (three, and two
        # casts under autocast). Normed, the heads are joined first (one copy): worth it
        # where launches bound the pass (decoding), not in training (a copy of q and k, and
        # the gains' gradients summed in another order)
        if normed:
            qk = torch.cat([self._heads(q, H, self.q_norm), self._heads(k, Hkv, self.k_norm)], 1)
        else:
            qk = self._heads(qkv[..., : self.q_width + self.kv_width], H + Hkv)
        q, k = self._rotate(qk, pos).split((H, Hkv), dim=1)
        return q, k, self._heads(v, Hkv)

    def project_q(self, x: Tensor, pos: Positions, packing: Packing | None = None) -> Tensor:
        """Queries only (the ARMD query stream reads the content stream's keys and values)."""
        d = self.q_width
        weight, bias = map(casts.cast, weight_and_bias(self.qkv))  # LoRA's adapters included
        q = linear(x, weight[:d], None if bias is None else bias[:d])
        q = q if packing is None else packing.unpack(q)
        return self._rotate(self._heads(q, self.n_head, self.q_norm), pos)

    def project_kv(
        self, x: Tensor, pos: Positions, packing: Packing | None = None
    ) -> tuple[Tensor, Tensor]:
        """Keys and values only (the rows whose queries nobody reads)."""
        d = self.q_width
        weight, bias = map(casts.cast, weight_and_bias(self.qkv))
        kv = linear(x, weight[d:], None if bias is None else bias[d:])
        k, v = (kv if packing is None else packing.unpack(kv)).split(self.kv_width, dim=-1)
        return self._rotate(self._heads(k, self.n_kv_head, self.k_norm), pos), self._heads(
            v, self.n_kv_head
        )

    def native_gqa(self, q: Tensor, mask: Mask) -> bool:
        """Whether SDPA serves the query groups itself (``enable_gqa``): FlexAttention, or
        the flash kernel (CUDA, half precision, no mask tensor). Every other backend falls
        back to the unfused math kernel under ``enable_gqa`` (scores materialised in fp32),
        so there the keys and values are repeated instead, at attention time only."""
        if isinstance(mask, PreparedMask):
            return mask.flex is not None
        unmasked = mask is None or isinstance(mask, str)
        return unmasked and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)

    def _grouped(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> tuple[Tensor, Tensor, dict]:
        """Keys and values (B, Hkv, Tk, D) as SDPA takes them for ``q`` (B, H, Tq, D) and the
        flags to pass: as they are with ``enable_gqa``, or each head repeated over its group
        (query head h reads key/value head h // (H / Hkv) either way)."""
        if self.native_gqa(q, mask):
            return k, v, self.gqa
        G = self.n_head // self.n_kv_head
        return k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), {}

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask,
        *,
        empty: Tensor | bool | None = None,
        packing: Packing | None = None,
        project: bool = True,
    ) -> Tensor:
        """SDPA of (B, H, Tq, D) queries over (B, Hkv, Tk, D) keys/values (each key/value head
        serving H / Hkv consecutive query heads), merged and projected
        (``project=False``: merged only, (B, Tq, d), for a caller that projects several at once).

        ``mask`` is ``"causal"`` or ``"strict"`` (key < query; square only), ``None`` (all
        visible), a boolean (B|1, 1, Tq, Tk) tensor or a :class:`PreparedMask`; rows with no
        visible key give zeros. ``empty`` spares the host-device sync of looking for such rows
        in a boolean mask (the KV-cache decoders know): ``False`` promises there are none, a
        (B, 1, Tq, 1) tensor names them; ``None`` checks. A :class:`PreparedMask` names them.
        With a ``packing`` the output is packed (1, N, d).
        """
        p, g = (self.dropout if self.training else 0.0), {}
        if self.gqa:
            k, v, g = self._grouped(q, k, v, mask)
        if isinstance(mask, PreparedMask):
            if mask.flex is not None:
                if p > 0:
                    raise ConfigError(
                        "the FlexAttention path has no attention dropout; set model.dropout=0 "
                        "or use the sdpa attention backend"
                    )
                plain, compiled, _ = _load_flex()
                flex = plain if torch.compiler.is_compiling() else compiled
                y = flex(q, k, v, block_mask=mask.flex, **g)
            else:
                m = mask.sdpa_mask(q.dtype)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, **g)
            if mask.empty is not None:
                y = y.masked_fill(mask.empty, 0.0)
        elif isinstance(mask, str) and mask == "strict":
            # key < query is causal attention of queries 1.. over keys ..n-2 (the same
            # softmax sets), so SDPA's causal kernel skips the masked half here too; query 0
            # sees nothing and gets zeros
            if q.shape[2] > 1:
                y = F.scaled_dot_product_attention(
                    q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], is_causal=True, dropout_p=p, **g
                )
                y = F.pad(y, (0, 0, 1, 0))
            else:
                y = torch.zeros_like(q)
        elif isinstance(mask, str):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, **g)
        elif mask is None or empty is False:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, **g)
        else:
            if empty is None:
                empty = ~mask.any(dim=-1, keepdim=True)  # (B, 1, Tq, 1)
                fix = bool(empty.any())
            else:
                fix = True  # named by the caller: fix up without looking (no sync)
            if fix:
                first = torch.zeros_like(mask)
                first[..., 0] = True
                mask = mask | (empty & first)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, **g)
                y = y.masked_fill(empty, 0.0)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, **g)
        B, H, T, D = y.shape
        y = y.transpose(1, 2).reshape(B, T, H * D)
        if not project:
            return y
        return self.proj(y if packing is None else packing.pack(y))

    def forward(
        self,
        x: Tensor,
        pos: Positions,
        mask: Mask,
        kv: KVHook | None = None,
        packing: Packing | None = None,
        qpos: Positions = None,
    ) -> Tensor:
        """Self-attention; ``kv`` (a KV-cache hook) swaps the new keys/values for the cached
        ones plus the new, and then every query must see at least itself in ``mask``.
        ``packing`` (decoding only): ``x`` and the output hold the real slots only.
        ``qpos``: the queries' positions where they differ from the keys' (``pos``)."""
        q, k, v = self.project(x, pos, packing, qpos)
        if kv is None:
            return self.attend(q, k, v, mask, packing=packing)
        k, v = kv(k, v)
        return self.attend(q, k, v, mask, empty=False, packing=packing)
