"""The ``anyorder`` harness model's arguments (``--model_args``) and a request's generation
arguments, checked like every other input: a bad one is one line naming it.

The harness hands ``--model_args`` over parsed (``"4"`` is already 4, ``"true"`` True) and
adds ``batch_size``, ``max_batch_size`` and ``device`` from its own flags.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from anyorder import bounds
from anyorder.errors import ConfigError
from anyorder.evaluation.estimators import MAX_ORDERS, check_counts

ARGS = {
    "pretrained": "a run folder, checkpoint, export or hub id (required)",
    "order": "l2r (default), any or ensemble:M",
    "num_orders": "random orders per request for any and ensemble:M (default 4)",
    "seed": "seed of the orders, ensemble keys and sampling (default 0)",
    "rolling": "loglikelihood_rolling's windows: harness (default, lm_eval's) or scratch",
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
    rolling: str = "harness"
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
    """``l2r``, ``any`` or ``ensemble:M`` -> (order, M); ``M`` in ASCII digits (``int("٣")``
    is 3 and ``"²".isdigit()`` is True), at most :data:`MAX_ORDERS` as on the command line."""
    if isinstance(value, str) and value.startswith("ensemble:"):
        m = value.split(":", 1)[1]
        if not re.fullmatch(r"[0-9]+", m, re.ASCII) or not m.strip("0"):
            raise ConfigError(f"--model_args order={value!r}: write ensemble:M with M >= 1")
        digits = m.lstrip("0")  # judged by its length first: int() of 5000 digits is refused
        members = int(digits) if len(digits) <= len(str(MAX_ORDERS)) else MAX_ORDERS + 1
        shown = value if len(value) <= 40 else f"{value[:20]}... ({len(digits)} digits)"
        check_counts(
            1, members, names=("", f"--model_args order={shown!r}"), unit="request",
            fixes=("", "order=ensemble:8"),
        )  # fmt: skip
        return "any", members
    return _choice("order", value, ("l2r", "any")), 1


def _batch(value: Any) -> int:
    """Requests per forward pass, bounded as ``anyorder eval --batch-size`` is."""
    batch = _int("batch_size", value, 1)
    if batch > bounds.MAX_NUM_SAMPLES:
        raise ConfigError(
            f"--batch_size {batch} must be at most {bounds.MAX_NUM_SAMPLES}; use e.g. 8"
        )
    return batch


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
    num_orders = _int("num_orders", kwargs.get("num_orders", 4), 1)
    check_counts(
        num_orders, 1, names=(f"--model_args num_orders={num_orders}", ""), unit="request",
        fixes=("num_orders=16", ""),
    )  # fmt: skip
    seed = bounds.check_seed(_int("seed", kwargs.get("seed", 0), 0), "--model_args seed")
    return Settings(
        pretrained=pretrained,
        order=order,
        ensemble=ensemble,
        num_orders=num_orders,
        seed=seed,
        rolling=_choice("rolling", kwargs.get("rolling", "harness"), ("harness", "scratch")),
        weights=_choice("weights", kwargs.get("weights", "ema"), ("ema", "raw")),
        tokenizer=tokenizer,
        gen_order=_choice("gen_order", kwargs.get("gen_order", "l2r"), ("l2r", "random")),
        steps=None if steps is None else _int("steps", steps, 1),
        schedule=_choice("schedule", kwargs.get("schedule", "linear"), ("linear", "cosine")),
        batch_size=_batch(batch),
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

    @property
    def greedy(self) -> bool:
        """Top-1 at every step: the text depends on no random draw of the sampler."""
        return self.top_k == 1


GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")
SAMPLE_TEMPERATURE = 1.0
"""The temperature of ``do_sample: true`` without one: what ``transformers``' ``generate``
samples at when it is given none (the harness's ``hf`` model passes its default, 0, which
``generate`` refuses with sampling on; its vLLM model decodes greedily)."""


def gen_settings(kwargs: dict[str, Any] | None, eos_text: str) -> GenSettings:
    """A request's ``gen_kwargs``: stop sequences (EOS's text added), ``max_gen_toks``
    (default 256), greedy or sampled as the harness reads them (``normalize_gen_kwargs``):
    ``do_sample`` decides, and left out it is true when the temperature is above 0. Sampling
    without a temperature uses :data:`SAMPLE_TEMPERATURE`; a temperature of 0 is greedy."""
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
    temperature = kwargs.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, (int, float))
    ):
        raise ConfigError(f"gen_kwargs temperature={temperature!r}: give a number >= 0")
    do_sample = kwargs.get("do_sample")
    if do_sample is None:
        do_sample = temperature is not None and temperature > 0
    if temperature is None:
        temperature = SAMPLE_TEMPERATURE
    if not do_sample or temperature <= 0:
        return GenSettings(until, max_tokens, 1.0, 1, None)
    top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
    top_k = None if top_k is None else _int("top_k", top_k, 1, "gen_kwargs")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))):
        raise ConfigError(f"gen_kwargs top_p={top_p!r}: give a number in (0, 1]")
    bounds.check_controls(temperature=float(temperature), top_p=top_p, top_k=top_k)
    return GenSettings(until, max_tokens, float(temperature), top_k, top_p)
