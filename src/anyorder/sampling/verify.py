"""The speculative acceptance rule on the device: drafts, the ratio test, the residual.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), in the any-order form of
Guo & Ermon (ICLR 2026): a draft ``y ~ p`` of one slot is accepted with probability
``min(1, q(y) / p(y))``, where ``q`` is the slot's exact sequential conditional; at the first
rejection the slot is drawn from the normalised ``(q - p)+`` instead and the round stops.
Whatever ``p`` is, the slot's token then follows ``q`` exactly.

Design choices:

* Everything is float64 (as every draw of :mod:`anyorder.sampling.draws`) and goes through
  the explicit generator, in a fixed sequence per pass: the uniforms of the ratio tests,
  the residual or bonus draw, then the next drafts.
* The randoms of a pass come from :class:`Randoms`: drawn as they are needed
  (:class:`LiveRandoms`, ``torch.multinomial``), or all drawn ahead into static buffers
  (:class:`AheadRandoms`) so that the rest of the pass can be captured as a CUDA graph
  with no generator inside. ``torch.multinomial`` of one sample is the exponential race
  ``argmax(p / E)``, ``E`` exponentials drawn by ``exponential_`` from the generator; drawn
  ahead in the same sequence they give the same tokens, bit for bit (tested).
* Temperature, top-k and top-p filter both ``p`` and ``q`` (:func:`probabilities`), so the
  output is exact with respect to the filtered sequential sampler.
* Rows of a batch are independent: each row accepts its own number of drafts; rows without
  a real draw are drawn all the same (every row passed is a distribution) and their draws
  are zeroed.
* Few kernels a pass: a GPU pass of a small model is bound by launches, so constants are
  kept on the device and masks multiply instead of selecting where they can.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from anyorder.sampling.draws import filter_logits


def probabilities(
    logits: Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    rule: str | None = None,
) -> Tensor:
    """The sampling distribution (..., V) float64 of logits (..., V) under the controls: the
    very distribution :func:`anyorder.sampling.draws.sample_logits` draws from (``rule``:
    the top-p rule, read once by the sampler; None: the rule in force)."""
    x = logits.double()
    if temperature != 1.0:  # a kernel saved at the default (x / 1 is x)
        x = x / temperature
    return filter_logits(x, top_k, top_p, rule).softmax(dim=-1)


def draw(probs: Tensor, valid: Tensor | None, generator: torch.Generator | None) -> Tensor:
    """One token per row of ``probs`` (..., V), every row a distribution, kept where ``valid``
    (...) is True (0 elsewhere; None: every row). Every row is drawn: one multinomial draw
    per row takes the same randoms whatever the row holds (an exponential per entry), so
    the kept rows get what they would get alone, and no stand-in row is built."""
    V = probs.shape[-1]
    flat = probs.reshape(-1, V)
    if generator is not None and generator.device != flat.device:
        flat = flat.to(generator.device)
    out = torch.multinomial(flat, 1, generator=generator).to(probs.device)
    out = out.view(probs.shape[:-1])
    return out if valid is None else out * valid


def uniform(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    """U[0, 1) float64 draws of ``shape`` on ``like``'s device (from the generator's)."""
    device = generator.device if generator is not None else like.device
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=device).to(
        like.device
    )


class Randoms:
    """Where the randoms of a pass come from: the uniforms of the ratio tests, then one
    categorical draw per row of each :meth:`pick`, in that sequence."""

    def begin(self) -> None:
        """A pass starts (its picks come in their sequence again)."""

    def uniform(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        raise NotImplementedError

    def pick(self, probs: Tensor, out: Tensor | None = None) -> Tensor:
        """One token per row of ``probs`` (..., V) (unnormalised rows are weighed as they
        are); every row is drawn (into ``out`` where given)."""
        raise NotImplementedError


class LiveRandoms(Randoms):
    """Drawn from the generator as they are needed (the eager path)."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    def uniform(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return uniform(shape, like, self.generator)

    def pick(self, probs: Tensor, out: Tensor | None = None) -> Tensor:
        y = draw(probs, None, self.generator)
        return y if out is None else out.copy_(y)


class AheadRandoms(Randoms):
    """Drawn ahead of a pass into static buffers (:meth:`fill`, eagerly), in the sequence
    :class:`LiveRandoms` draws them (uniforms by ``torch.rand``, each pick's exponentials by
    ``exponential_``). The pass itself then holds no generator (it can be captured), and
    its tokens are those of the live draws.

    Args:
        draws: ``("uniform", shape)`` or ``("pick", shape)`` (the probabilities' shape), in
            the order the pass asks for them.
        device: where the pass runs.
        generator: the generator (on any device).
    """

    def __init__(
        self,
        draws: list[tuple[str, tuple[int, ...]]],
        device: torch.device,
        generator: torch.Generator | None,
    ) -> None:
        self.generator = generator
        self.kinds = [kind for kind, _ in draws]
        self.buffers = [torch.ones(shape, dtype=torch.float64, device=device) for _, shape in draws]
        self.next = 0

    def fill(self) -> None:
        """Draw the next pass's randoms (eagerly, outside any graph)."""
        g = self.generator
        for kind, buf in zip(self.kinds, self.buffers):
            if not buf.numel():  # (an empty draw takes nothing from the generator)
                continue
            gdev = g.device if g is not None else buf.device
            if gdev == buf.device:
                target = buf
            else:
                target = torch.empty(buf.shape, dtype=buf.dtype, device=gdev)
            if kind == "uniform":
                torch.rand(buf.shape, generator=g, dtype=buf.dtype, device=gdev, out=target)
            else:
                target.exponential_(generator=g)
            if target is not buf:
                buf.copy_(target)

    def begin(self) -> None:
        self.next = 0

    def _take(self, kind: str, shape: tuple[int, ...]) -> Tensor:
        i = self.next
        ok = i < len(self.kinds) and self.kinds[i] == kind
        if not ok or self.buffers[i].numel() != math.prod(shape):
            drawn = list(zip(self.kinds, (tuple(b.shape) for b in self.buffers)))
            raise RuntimeError(f"draw {i} asked as {kind} {tuple(shape)}; drawn ahead: {drawn}")
        self.next += 1
        return self.buffers[i]

    def uniform(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        return self._take("uniform", shape).view(shape)

    def pick(self, probs: Tensor, out: Tensor | None = None) -> Tensor:
        e = self._take("pick", tuple(probs.shape))
        return torch.argmax(probs / e.view(probs.shape), dim=-1, out=out)  # exponential race


def accept(
    q: Tensor,
    p: Tensor,
    drafts: Tensor,
    num_drafts: Tensor,
    randoms: Randoms | torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """The ratio tests of a round and the token that closes it.

    Args:
        q: (B, J, V) the target conditionals of the round's slots (``J`` >= drafts + 1; column
            ``j`` given the committed prefix and drafts ``< j``).
        p: (B, Kd, V) the draft distributions of the drafts (``Kd`` columns, padding after
            ``num_drafts``).
        drafts: (B, Kd) the drafted tokens.
        num_drafts: (B,) how many drafts each row verifies (0 for none).
        randoms: a :class:`Randoms`, or a generator (drawn live).

    Returns:
        ``(m, token)``: (B,) the accepted drafts per row (a leading run), and (B,) the token
        of slot ``m``: from the normalised ``(q_m - p_m)+`` after a rejection, from ``q_m``
        when every draft was accepted (the bonus).
    """
    rnd = randoms if isinstance(randoms, Randoms) else LiveRandoms(randoms)
    m, q = ratio_tests(q, p, drafts, num_drafts, rnd)
    Kd = drafts.shape[1]
    if not Kd:
        return m, rnd.pick(q[:, 0])
    V = q.shape[-1]
    p_m = p.gather(1, m.clamp(max=Kd - 1)[:, None, None].expand(-1, 1, V))[:, 0]
    return m, close(q, m, p_m * (m < num_drafts)[:, None], rnd)  # (q - p)+, or q: bonus


def ratio_tests(
    q: Tensor, p: Tensor, drafts: Tensor, num_drafts: Tensor | None, rnd: Randoms
) -> tuple[Tensor, Tensor]:
    """The ratio tests of :func:`accept` (its arguments; ``rnd`` a :class:`Randoms`): ``m``
    (B,), the accepted drafts per row, and ``q`` with at least ``Kd + 1`` columns.
    ``num_drafts`` None: ``m`` is the leading run of passed tests, padding included (the
    caller takes its minimum with the drafts' count)."""
    B, Kd = drafts.shape
    if q.shape[1] <= Kd:  # near the end a pass has fewer columns than drafts (padding)
        q = torch.cat([q, q[:, -1:].expand(B, Kd + 1 - q.shape[1], -1)], dim=1)
    u = rnd.uniform((B, Kd), q)
    if not Kd:
        return torch.zeros(B, dtype=torch.long, device=q.device), q
    py = p.gather(2, drafts[..., None])[..., 0]
    qy = q[:, :Kd].gather(2, drafts[..., None])[..., 0]
    # accept with probability min(1, q/p); a row's drafts past num_drafts are padding, and
    # the leading run of accepted ones stops at the first that is not accepted
    run = (u * py <= qy).cumprod(dim=1).sum(dim=1)  # bool: cumprod is long
    return (run if num_drafts is None else run.minimum(num_drafts)), q


def close(q: Tensor, m: Tensor, p_m: Tensor, rnd: Randoms) -> Tensor:
    """The token (B,) of slot ``m`` (B,) from the normalised ``(q_m - p_m)+``: ``p_m`` (B, V)
    is the law of draft ``m`` after a rejection, zeros when every draft was accepted (then
    the token follows ``q_m``, the bonus). ``q``, ``rnd``: as :func:`ratio_tests`'s."""
    V = q.shape[-1]
    q_m = q.gather(1, m[:, None, None].expand(-1, 1, V))[:, 0]
    residual = (q_m - p_m).clamp(min=0)
    # a rejection has probability 0 where q <= p nowhere; rounding may still leave no mass.
    # Not normalised: a draw weighs its row as it is
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, q_m)
    return rnd.pick(residual)
