"""A linear layer's weight and bias as its forward applies them, LoRA adapters included.

Some paths read a layer's weight instead of calling it (ARMD's query-only and key/value-only
projections slice the fused ``qkv`` weight; AO-GPT joins every adaLN linear into one
matmul). Under peft's LoRA (``train.lora``) the layer is a wrapper whose ``weight`` is the
frozen base alone, so those paths would skip the adapters silently. :func:`weight_and_bias`
adds each active, unmerged adapter's delta (peft's own ``get_delta_weight``, which keeps
the gradient to the adapters); a plain ``nn.Linear`` returns its own tensors, untouched.
peft is never imported here: the wrapper is recognised by its ``base_layer``.
"""

from __future__ import annotations

from torch import Tensor, nn


def weight_and_bias(linear: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W, b)`` with ``linear(x) == F.linear(x, W, b)`` (up to the adapters' dropout)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight, linear.bias
    weight = base.weight
    if not (linear.disable_adapters or linear.merged):
        for name in linear.active_adapters:
            if name in linear.lora_A:
                weight = weight + linear.get_delta_weight(name)
    return weight, base.bias
