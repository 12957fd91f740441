"""Muon for the hidden matrices, AdamW for everything else, in one optimizer.

Muon (Jordan et al., 2024) keeps a momentum of each matrix's gradient and steps along its
nearest semi-orthogonal matrix, found by a few Newton-Schulz iterations. It is used for the
2-D weights of linear layers inside the network; token and position tables, the head, norms
and biases keep AdamW, as Muon's authors recommend.

Design choices:

* The arithmetic is torch's: ``torch.optim.Muon`` (Nesterov momentum, the quintic
  Newton-Schulz iteration in bf16, decoupled weight decay) with ``adjust_lr_fn=
  "match_rms_adamw"``, which scales the step of an ``m x n`` matrix by ``0.2 sqrt(max(m,
  n))``: AdamW's typical RMS (Liu et al., 2025), so ``train.lr`` means about the same for
  both optimizers and one schedule serves both. The other groups step by
  ``torch.optim.AdamW``. :class:`MuonAdamW` only holds the groups and hands each kind to
  its torch optimizer, sharing the group dicts and the state.
* One :class:`torch.optim.Optimizer` with two kinds of parameter group (``"muon": True`` or
  not), so the learning-rate schedule (which sets ``group["lr"]``), checkpoints
  (``state_dict``) and exact resume work as they do for AdamW.
* Checkpoints written before torch's Muon took over (``muon_momentum`` absent from a Muon
  group) kept the momentum as a plain sum ``B = mu B + g``; torch keeps ``(1 - mu) B``, an
  average. :meth:`MuonAdamW.load_state_dict` rescales such buffers once, so those runs resume
  with the same updates (up to bf16 round-off in the iteration).
* The Newton-Schulz iteration runs in a dtype the machine computes fast. torch's is fixed
  to bf16 (there is no hook for it in torch 2.13), and a CPU without bf16 units (AVX2
  only: most laptops) takes 7-13x fp32's time for it: one step of tiny-armd's optimizer
  costs more than its forward and backward. There (``ns_dtype=torch.float32``, chosen by
  :func:`anyorder.precision.bf16_is_fast` in ``make_optimizer``) the Muon groups step by
  :meth:`MuonAdamW._fp32_muon`: torch's update written out with the iteration in fp32
  (equal to torch's up to bf16's round-off, tests/test_muon.py); elsewhere torch's Muon
  steps them. The choice is the machine's, not the run's, so checkpoints do not record it:
  a run resumed on the same CPU continues exactly, one resumed on another kind of CPU
  continues up to bf16 round-off in the iteration.
* LoRA adapters (``train.lora``) of linear layers are matrices too, ``r x d_in`` (A) and
  ``d_out x r`` (B), and Muon takes them; those of the adaLN linears keep AdamW, as the
  adaLN does. Newton-Schulz on a rank-``r`` factor sets its ``r`` singular values to about
  1, and the ``match_rms_adamw`` scale still gives the step AdamW's RMS (``0.2 lr``). B
  starts at zero, so A's first gradient is zero and so is its first step, as with AdamW.
  Measured (issue 40; a 2 x 128 gpt trained 300 steps on builtin:pydoc, then r=8 adapters
  on attn and mlp 150 steps on builtin:stdlib, batch 16 x 128 bytes, validation bits/byte
  on 128 blocks), at lr 1e-3 / 3e-3 / 1e-2 / 3e-2: AdamW 4.030 / 3.964 / 3.916 / 3.983,
  Muon 4.078 / 4.002 / **3.896** / 3.960: as good at each one's best lr, so Muon stays.
  Under LoRA the AdamW half is often empty (no adapter on an adaLN), so either half may
  hold no parameter (see ``__init__``); adapters on the adaLN alone leave Muon nothing,
  and the run steps by plain AdamW (the start-up line names it: :func:`describe`).
* ``torch.optim.Muon`` is in torch 2.9 and later, the package's floor (``make test-lowest``);
  an older torch installed by hand gets ``train.optimizer=muon`` refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from anyorder.errors import CheckpointError, ConfigError

MOMENTUM_KIND = "average"
"""The ``muon_momentum`` of a Muon group: torch's ``(1 - mu)``-weighted momentum buffer."""
_OURS = ("lr", "weight_decay", "momentum", "betas", "muon", "params")
"""Group keys this optimizer sets; the torch optimizers' other defaults fill the rest."""


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The weights Muon takes: those of ``nn.Linear`` layers, except the output head (whose
    rows are tokens, like the embedding's): a :class:`~anyorder.layers.blocks.Head`, or the
    model's ``head`` attribute (the encoder's plain ``Linear``); and except the adaLN
    linears (:class:`~anyorder.layers.adaln.AdaLN`), which start at zero, where Muon's first
    step moves them at full size whatever the gradient. AdamW on them ended tiny-aogpt 5.3%
    above the known floor any order against 7.7% with Muon (docs/results.md)."""
    from anyorder.layers.adaln import AdaLN
    from anyorder.layers.blocks import Head

    head = getattr(model, "head", None)
    adaln = {id(p) for m in model.modules() if isinstance(m, AdaLN) for p in m.parameters()}
    out: list[nn.Parameter] = []
    for m in model.modules():
        if not isinstance(m, nn.Linear) or isinstance(m, Head) or m is head:
            continue
        if m.weight.requires_grad and id(m.weight) not in adaln:
            out.append(m.weight)
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon (``torch.optim.Muon``) on the groups marked ``muon=True``, AdamW
    (``torch.optim.AdamW``) on the others."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.95,
        eps: float = 1e-8,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "momentum": momentum,
            "eps": eps,
            "muon": False,
            "weight_decay": 0.0,
        }
        super().__init__(list(groups), defaults)
        for g in self.param_groups:
            if g["muon"] and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon takes matrices only (2-D parameters)")
        muon = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        adamw = [p for g in self.param_groups if not g["muon"] for p in g["params"]]
        if ns_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"ns_dtype={ns_dtype}: use torch.bfloat16 or torch.float32")
        self.ns_dtype = ns_dtype
        # torch refuses an optimizer without parameters, and either half may hold none (a
        # LoRA run's adapters are all matrices): a placeholder then gives that optimizer's
        # defaults, and step() hands each one this optimizer's groups, never the placeholder
        self._muon = _torch_muon(muon or [_placeholder()], lr)
        self._adamw = torch.optim.AdamW(adamw or [_placeholder()], lr=lr)
        self._fill_groups()

    def _fill_groups(self) -> None:
        """Give every group the keys its torch optimizer reads (Muon's ``eps`` is its
        Newton-Schulz guard, not AdamW's)."""
        for g in self.param_groups:
            opt = self._muon if g["muon"] else self._adamw
            for k, v in opt.defaults.items():
                if k not in _OURS and (k != "eps" or g["muon"]):
                    g[k] = v
            if g["muon"]:
                g["muon_momentum"] = MOMENTUM_KIND

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102 (torch's signature)
        assert closure is None, "MuonAdamW takes no closure"
        # the torch optimizers step over this optimizer's own group dicts and state, which
        # the schedule and load_state_dict may have replaced since the last step
        for opt, muon in ((self._muon, True), (self._adamw, False)):
            groups = [g for g in self.param_groups if g["muon"] is muon]
            if not any(g["params"] for g in groups):  # this half holds no parameter
                continue
            if muon and self.ns_dtype == torch.float32:
                self._fp32_muon(groups)
                continue
            opt.param_groups = groups
            opt.state = self.state
            opt.step()

    def _fp32_muon(self, groups: list[dict[str, Any]]) -> None:
        """torch.optim.Muon's update (its momentum buffer, Nesterov step, decoupled weight
        decay and ``match_rms_adamw`` scale) with the Newton-Schulz iteration in fp32."""
        for g in groups:
            assert g["adjust_lr_fn"] == "match_rms_adamw", g["adjust_lr_fn"]
            mu, lr = g["momentum"], g["lr"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)  # torch's (1 - mu)-weighted average
                update = p.grad.lerp(buf, mu) if g["nesterov"] else buf
                update = orthogonalise(update, g["ns_coefficients"], g["ns_steps"], g["eps"])
                p.mul_(1 - lr * g["weight_decay"])
                p.add_(update, alpha=-lr * 0.2 * max(p.shape) ** 0.5)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, this version's or an earlier one (see the module notes)."""
        saved = [len(g["params"]) for g in state_dict["param_groups"] if g.get("muon")]
        ours = [len(g["params"]) for g in self.param_groups if g["muon"]]
        if saved != ours:
            raise CheckpointError(
                f"this Muon checkpoint steps {sum(saved)} matrices by Muon, this anyorder "
                f"{sum(ours)}: it was written before the adaLN linears moved to AdamW; resume "
                "it with the anyorder that wrote it, or start anew from its weights "
                "(train.init_from=CHECKPOINT)"
            )
        super().load_state_dict(state_dict)
        old = [g for g in self.param_groups if g["muon"] and g.get("muon_momentum") is None]
        self._fill_groups()
        for g in old:  # a summed momentum: torch's buffer is its (1 - mu) average
            for p in g["params"]:
                buf = self.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    buf.mul_(1 - g["momentum"])


def describe(opt: torch.optim.Optimizer) -> str:
    """The optimizer as the start-up line names it: ``Muon + AdamW``, ``Muon`` (a LoRA run
    whose adapters are all matrices) or ``AdamW`` (also under ``train.optimizer=muon`` when
    no trainable matrix takes Muon, e.g. adapters on the adaLN linears alone)."""
    if not isinstance(opt, MuonAdamW):
        return "AdamW"
    halves = [any(g["params"] for g in opt.param_groups if g["muon"] is m) for m in (True, False)]
    return " + ".join(name for name, has in zip(("Muon", "AdamW"), halves) if has)


def orthogonalise(
    m: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to ``m``, roughly: ``steps`` quintic Newton-Schulz
    iterations ``X <- a X + (b S + c S^2) X``, ``S = X X^T``, from ``m`` over its Frobenius
    norm, in fp32 and on the wide orientation (so that ``S`` is the smaller Gram matrix)."""
    a, b, c = coefficients
    tall = m.size(0) > m.size(1)
    x = m.float().T if tall else m.float()  # (short, long)
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        s = x @ x.T
        x = torch.addmm(x, torch.addmm(s, s, s, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _placeholder() -> nn.Parameter:
    """A 1 x 1 matrix for an optimizer half without parameters (see ``MuonAdamW.__init__``)."""
    return nn.Parameter(torch.zeros(1, 1))


def _torch_muon(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if not hasattr(torch.optim, "Muon"):
        raise ConfigError(
            f"train.optimizer=muon needs torch.optim.Muon (torch 2.9 or later; this is "
            f"{torch.__version__}); upgrade torch or use train.optimizer=adamw"
        )
    return torch.optim.Muon(params, lr=lr, adjust_lr_fn="match_rms_adamw")
