"""The ``anyorder`` harness model's arguments (``--model_args``) and a request's generation
arguments, checked like every other input: a bad one is one line naming it.

The harness hands ``--model_args`` over parsed (``"4"`` is already 4, ``"true"`` True) and
adds ``batch_size``, ``max_batch_size`` and ``device`` from its own flags.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from anyorder.errors import ConfigError

ARGS = {
    "pretrained": "a run folder, checkpoint, export or hub id (required)",
    "order": "l2r (default), any or ensemble:M",
    "num_orders": "random orders per request for any and ensemble:M (default 4)",
    "seed": "seed of the orders, ensemble keys and sampling (default 0)",
    "weights": "ema (default) or raw, for training checkpoints",
    "tokenizer": "a tokenizer spec for a model saved without one",
    "gen_order": "generate_until: l2r (default) or random",
    "steps": "generate_until: decode in this many Lemma-1 steps (aogpt, armd, mdm)",
    "schedule": "generate_until with steps: linear (default) or cosine",
    "batch_size": "requests per forward pass (the harness's --batch_size; auto: 8)",
    "max_batch_size": "(the harness's; unused)",
    "device": "cpu, cuda, cuda:N or auto (the harness's --device)",
}


@dataclass(frozen=True)
class Settings:
    """The checked model arguments."""

    pretrained: str
    order: str = "l2r"
    ensemble: int = 1
    num_orders: int = 4
    seed: int = 0
    weights: str = "ema"
    tokenizer: str | None = None
    gen_order: str = "l2r"
    steps: int | None = None
    schedule: str = "linear"
    batch_size: int = 8
    device: str = "cpu"

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def _int(name: str, value: Any, least: int, where: str = "--model_args") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where} {name}={value!r}: give a whole number >= {least}")
    return value


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"--model_args {name}={value!r}: use one of {', '.join(choices)}")
    return value


def _order(value: Any) -> tuple[str, int]:
    """``l2r``, ``any`` or ``ensemble:M`` -> (order, M)."""
    if isinstance(value, str) and value.startswith("ensemble:"):
        m = value.split(":", 1)[1]
        if not m.isdigit() or int(m) < 1:
            raise ConfigError(f"--model_args order={value!r}: write ensemble:M with M >= 1")
        return "any", int(m)
    return _choice("order", value, ("l2r", "any")), 1


def _device(spec: Any) -> str:
    """The harness's ``--device`` (its default is ``cuda:0``): CUDA where there is none
    falls back to the CPU with a warning, as the harness's own ``hf`` model does."""
    import logging

    import torch

    device = str(spec or "cpu")
    if not (device in ("cpu", "auto", "cuda") or device.startswith("cuda:")):
        raise ConfigError(f"--device {device!r}: use cpu, cuda, cuda:N or auto")
    if device.startswith("cuda") and not torch.cuda.is_available():
        logging.getLogger(__name__).warning("--device %s: no CUDA device here; using cpu", device)
        return "cpu"
    return device


def parse_settings(pretrained: Any, kwargs: dict[str, Any]) -> Settings:
    """Check the backend's arguments; the first bad one is a :class:`ConfigError`."""
    unknown = sorted(set(kwargs) - set(ARGS))
    if unknown:
        raise ConfigError(
            f"--model_args {unknown[0]}: not an argument of the anyorder model; use "
            f"{', '.join(ARGS)}"
        )
    if not isinstance(pretrained, str) or not pretrained:
        raise ConfigError("--model_args pretrained=PATH is required (a run, checkpoint or export)")
    order, ensemble = _order(kwargs.get("order", "l2r"))
    batch = kwargs.get("batch_size", 8)
    if batch in (None, "auto") or (isinstance(batch, str) and batch.startswith("auto")):
        batch = 8
    elif isinstance(batch, str) and batch.isdigit():
        batch = int(batch)
    steps = kwargs.get("steps")
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise ConfigError(f"--model_args tokenizer={tokenizer!r}: give a tokenizer spec")
    device = _device(kwargs.get("device"))
    return Settings(
        pretrained=pretrained,
        order=order,
        ensemble=ensemble,
        num_orders=_int("num_orders", kwargs.get("num_orders", 4), 1),
        seed=_int("seed", kwargs.get("seed", 0), 0),
        weights=_choice("weights", kwargs.get("weights", "ema"), ("ema", "raw")),
        tokenizer=tokenizer,
        gen_order=_choice("gen_order", kwargs.get("gen_order", "l2r"), ("l2r", "random")),
        steps=None if steps is None else _int("steps", steps, 1),
        schedule=_choice("schedule", kwargs.get("schedule", "linear"), ("linear", "cosine")),
        batch_size=_int("batch_size", batch, 1),
        device=device,
    )


@dataclass(frozen=True)
class GenSettings:
    """One ``generate_until`` request's arguments."""

    until: tuple[str, ...]
    max_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None


GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def gen_settings(kwargs: dict[str, Any] | None, eos_text: str) -> GenSettings:
    """A request's ``gen_kwargs``: stop sequences (EOS's text added), ``max_gen_toks``
    (default 256), greedy (``do_sample`` false or temperature 0: top-1) or sampled."""
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - set(GEN_KEYS))
    if unknown:
        raise ConfigError(
            f"gen_kwargs {unknown[0]}: not understood by the anyorder model; use "
            f"{', '.join(GEN_KEYS)}"
        )
    until = kwargs.get("until") or []
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
        raise ConfigError(f"gen_kwargs until={until!r}: give a string or a list of strings")
    until = tuple(until) + ((eos_text,) if eos_text and eos_text not in until else ())
    max_tokens = _int("max_gen_toks", kwargs.get("max_gen_toks", 256), 1, "gen_kwargs")
    temperature = kwargs.get("temperature", 0.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ConfigError(f"gen_kwargs temperature={temperature!r}: give a number >= 0")
    greedy = not kwargs.get("do_sample", False) or temperature <= 0
    top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
    if greedy:
        return GenSettings(until, max_tokens, 1.0, 1, None)
    return GenSettings(until, max_tokens, float(temperature), top_k, top_p)
