"""``model.generate`` of :class:`~anyorder.hf.model.AnyorderModel`: anyorder's samplers
behind ``transformers``' call.

``generate(input_ids, max_new_tokens=32, do_sample=True, temperature=0.8, top_k=50,
top_p=0.9, num_return_sequences=4)`` draws exactly what ``anyorder.load(folder).generate``
draws with the same settings and ``seed``: the prompt is the known prefix of ``n = P +
max_new_tokens`` positions, the rest decoded by the sampler the request names.

Design choices:

* ``transformers``' own parameters are read the way its ``generate`` reads them (the call,
  then ``generation_config``, then the model's, then ``transformers``' defaults: greedy,
  ``max_length`` 20, ``top_k`` 50 when sampling). Greedy is ``top_k=1``: the argmax, left
  to right unless ``order`` says otherwise (a drawn order would make greedy search random).
* anyorder's own keywords choose the sampler: ``order`` (``random``, the default for the
  any-order kinds, ``l2r``, ``strided``, ``confidence``), ``steps``, ``streams``,
  ``speculative``, ``per_pass``, ``schedule``, ``shared_counts``, ``reveal``, and ``seed``
  (default: drawn from torch's global generator, so ``torch.manual_seed`` repeats a call).
* Everything else that would change the result and that the samplers do not do (beams,
  repetition penalties, logits processors, stopping criteria, scores...) is refused in one
  line naming it, never ignored. A streamer gets the prompt, then the new tokens once
  decoding ends (an any-order decode finishes no prefix before the end).
* ``eos_token_id``: every position after a row's first EOS among the new tokens is set to
  ``pad_token_id`` (EOS when there is none); left-to-right one-token decoding stops early.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from anyorder.errors import ConfigError, SamplingError

ANYORDER_KEYS = (
    "order", "steps", "streams", "speculative", "per_pass", "schedule", "shared_counts",
    "reveal", "seed",
)  # fmt: skip
# generation-config fields read below, or that change nothing here (bookkeeping, the KV
# cache, which is always used, token ids of other roles)
_HANDLED = {
    "max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "num_return_sequences", "eos_token_id", "pad_token_id", "bos_token_id", "num_beams",
    "use_cache", "return_dict_in_generate", "transformers_version", "_from_model_config",
    "decoder_start_token_id", "cache_implementation",
}  # fmt: skip
# model_kwargs the pipeline or a user passes that are honoured or checked below
_MODEL_KEYS = {"attention_mask", "streamer", "stopping_criteria", "logits_processor", "tokenizer"}


def _unsupported(config: Any) -> list[str]:
    """Fields of the merged generation config set away from ``transformers``' defaults that
    the samplers do not do."""
    from transformers import GenerationConfig

    # transformers 5 leaves unset fields None and fills them in generate from this table;
    # before 5, GenerationConfig() holds the defaults itself
    filled = getattr(GenerationConfig, "_get_default_generation_params", dict)
    defaults = {**GenerationConfig().to_dict(), **filled()}
    off = (None, False)  # the model config's False where transformers' default is None

    def changed(key: str, value: Any) -> bool:
        default = defaults.get(key, value)
        return value != default and not (value in off and default in off)

    return sorted(k for k, v in config.to_dict().items() if k not in _HANDLED and changed(k, v))


def _length(config: Any, prompt_len: int, seq_len: int) -> int:
    """``n``: prompt and new tokens, from ``max_new_tokens`` (first) or ``max_length``,
    within the model's context.

    Raises:
        SamplingError: no new token, or more than the context holds.
    """
    new = config.max_new_tokens
    if new is not None:
        if isinstance(new, bool) or not isinstance(new, int) or new < 1:
            raise SamplingError(f"max_new_tokens={new} must be a whole number >= 1")
        n, asked = prompt_len + new, f"max_new_tokens={new}"
    else:
        n, asked = config.max_length, f"max_length={config.max_length}"
        if isinstance(n, bool) or not isinstance(n, int) or n <= prompt_len:
            raise SamplingError(
                f"{asked} leaves no new token after the {prompt_len}-token prompt; pass "
                "max_new_tokens"
            )
    if n > seq_len:
        room = seq_len - prompt_len
        fix = f"use max_new_tokens <= {room}" if room > 0 else "shorten the prompt"
        raise SamplingError(
            f"{asked} after a {prompt_len}-token prompt makes {n} tokens, more than the "
            f"model's context ({seq_len}); {fix}"
        )
    return n


def _rows(prompts: int, copies: Any) -> int:
    """Sequences in the batch: each prompt ``copies`` times, within the samplers' bound.

    Raises:
        SamplingError: not a count >= 1, or too many.
    """
    from anyorder.bounds import MAX_NUM_SAMPLES

    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise SamplingError(f"num_return_sequences={copies} must be a whole number >= 1")
    if prompts * copies > MAX_NUM_SAMPLES:
        raise SamplingError(
            f"{prompts} prompt(s) x num_return_sequences={copies} make {prompts * copies} "
            f"sequences, more than {MAX_NUM_SAMPLES} in one call; split the batch"
        )
    return prompts * copies


def _first_id(ids: Any) -> int | None:
    """One token id from ``eos_token_id``/``pad_token_id`` (an int, a list, a tensor)."""
    if ids is None:
        return None
    if isinstance(ids, Tensor):
        ids = ids.flatten().tolist()
    if isinstance(ids, (list, tuple)):
        if len(ids) > 1:
            raise SamplingError(f"eos_token_id={ids}: anyorder stops at one EOS id; give one")
        return int(ids[0]) if ids else None
    return int(ids)


def check_mask(attention_mask: Tensor | None, input_ids: Tensor | None) -> None:
    """An attention mask is all ones, of the shape of ``input_ids``, or None.

    Raises:
        ConfigError: a mask with zeros (padding), or of another shape.
    """
    if attention_mask is None:
        return
    shape = None if input_ids is None else tuple(input_ids.shape)
    if tuple(attention_mask.shape) != shape:
        raise ConfigError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {shape}"
        )
    if not bool((attention_mask == 1).all()):
        raise ConfigError(
            "attention_mask has zeros (padding): an anyorder model reads unpadded rows; pass "
            "prompts of one length (or one at a time)"
        )


def _model_kwargs(model_kwargs: dict[str, Any], input_ids: Tensor | None) -> Any:
    unknown = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_KEYS and v is not None)
    if unknown:
        raise SamplingError(f"generate() does not take {', '.join(unknown)}")
    check_mask(model_kwargs.get("attention_mask"), input_ids)
    for key in ("stopping_criteria", "logits_processor"):
        if model_kwargs.get(key):
            raise SamplingError(
                f"generate({key}=...) is not applied by anyorder's samplers; use eos_token_id, "
                "max_new_tokens and the sampling controls"
            )
    return model_kwargs.get("streamer")


def generate(
    hf_model: Any,
    input_ids: Tensor | None,
    generation_config: Any = None,
    **kwargs: Any,
) -> Any:
    """Sample continuations of ``input_ids`` (B, P) with anyorder's samplers.

    Args:
        hf_model: the :class:`~anyorder.hf.model.AnyorderModel`.
        input_ids: the prompts, unpadded (None: no prompt, one row).
        generation_config: a ``transformers.GenerationConfig`` (merged as ``transformers``
            does with the keywords and the model's).
        **kwargs: ``transformers``' generation parameters (``max_new_tokens``,
            ``max_length``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
            ``num_return_sequences``, ``eos_token_id``, ``pad_token_id``,
            ``attention_mask`` of ones, ``streamer``) and anyorder's (:data:`ANYORDER_KEYS`,
            as :meth:`anyorder.api.Model.generate`).

    Returns:
        (B * num_return_sequences, P + new) token ids, prompts included (a
        ``GenerateDecoderOnlyOutput`` with ``sequences`` when ``return_dict_in_generate``).

    Raises:
        SamplingError: a request out of range, or an option the samplers do not do.
    """
    from anyorder import bounds

    ours = {k: kwargs.pop(k) for k in ANYORDER_KEYS if k in kwargs}
    try:  # transformers' own checks of its parameters (max_new_tokens > 0, ...)
        config, model_kwargs = hf_model._prepare_generation_config(generation_config, **kwargs)
    except ValueError as e:
        raise SamplingError(f"generate(): {str(e).strip().splitlines()[0]}") from None
    model = hf_model.model
    ids = torch.zeros(1, 0, dtype=torch.long) if input_ids is None else input_ids
    if ids.dim() != 2:
        raise SamplingError(f"input_ids must be (batch, length), not of shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise SamplingError(f"input_ids must be integer token ids, not {ids.dtype}")
    streamer = _model_kwargs(model_kwargs, ids if input_ids is not None else None)
    bad = _unsupported(config)
    if config.num_beams != 1:
        raise SamplingError(
            f"num_beams={config.num_beams}: anyorder samples, it has no beam search; use "
            "num_beams=1 (do_sample=False is the greedy decode)"
        )
    if bad:
        raise SamplingError(f"generate() does not apply {', '.join(bad)} (anyorder's samplers)")
    rows = _rows(ids.shape[0], config.num_return_sequences)
    if streamer is not None and rows != 1:
        raise SamplingError(
            f"a streamer takes one sequence, this call makes {rows}; stream one prompt with "
            "num_return_sequences=1"
        )
    n = _length(config, ids.shape[1], model.cfg.seq_len)
    seed = ours.pop("seed", None)
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    greedy = not config.do_sample
    if greedy and ours.get("order") is None and ours.get("streams") is None:
        ours["order"] = "l2r"  # greedy search is deterministic: not along a drawn order
    temperature, top_k = (1.0, 1) if greedy else (config.temperature, config.top_k)
    top_p = None if greedy or config.top_p == 1.0 else config.top_p
    bounds.check_controls(
        temperature=temperature, top_p=top_p, top_k=top_k, num_samples=rows, seed=seed,
        steps=ours.get("steps"), length=n,
    )  # fmt: skip
    n = bounds.check_fit(model.cfg.seq_len, length=n, steps=ours.get("steps"))
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < model.cfg.vocab_size:
        raise SamplingError(f"input_ids hold ids outside 0..{model.cfg.vocab_size - 1}")
    eos = _first_id(config.eos_token_id)
    pad = _first_id(config.pad_token_id)
    prompt, known = _prefix(ids, n, config.num_return_sequences)
    if streamer is not None:
        streamer.put(ids.cpu())
    controls = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = _sample(model, n, rows, prompt, known, controls, seed, eos, **ours)
    if eos is not None:
        tokens = _after_eos(tokens, ids.shape[1], eos, eos if pad is None else pad)
    if streamer is not None:
        streamer.put(tokens[:, ids.shape[1] :].cpu())
        streamer.end()
    tokens = tokens.to(ids.device)
    if config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=tokens)
    return tokens


def _sample(
    model: Any,
    n: int,
    rows: int,
    prompt: Tensor | None,
    known: Tensor | None,
    controls: dict[str, Any],
    seed: int,
    eos: int | None,
    order: str | None = None,
    steps: int | None = None,
    streams: int | None = None,
    speculative: int | None = None,
    per_pass: int = 1,
    schedule: str = "linear",
    shared_counts: bool = False,
    reveal: str = "binomial",
) -> Tensor:
    """The sampler ``anyorder.load(...).generate`` picks for the same request (api.py)."""
    from anyorder import bounds
    from anyorder.api import GENERATE_ORDERS, decode_mode
    from anyorder.sample import sample
    from anyorder.sampling.confidence import confidence_sample
    from anyorder.sampling.speculative import speculative_sample

    if order is not None and order not in GENERATE_ORDERS:
        raise SamplingError(f"order={order!r}: use one of {', '.join(GENERATE_ORDERS)}")
    order, sequential = decode_mode(model.kind, order, steps, streams, speculative)
    stop = eos if sequential and order == "l2r" and model.kind != "mdm" else None
    gen = torch.Generator(model.device).manual_seed(seed)
    if prompt is not None:
        prompt, known = prompt.to(model.device), known.to(model.device)
    common = dict(batch=rows, prompt=prompt, known=known, generator=gen, **controls)
    with bounds.out_of_memory_as_error(f"{rows} sequences x {n} tokens"):
        if order == "confidence":
            result = confidence_sample(model, n, per_pass, speculative=speculative, **common)
        elif speculative is not None:
            result = speculative_sample(model, n, speculative, order=order, **common)
        else:
            result = sample(
                model, n, order=None if order == "strided" else order, streams=streams,
                steps=steps, schedule=schedule, shared_counts=shared_counts, reveal=reveal,
                stop_at_eos=stop, **common,
            )  # fmt: skip
    return result.tokens


def _prefix(ids: Tensor, n: int, copies: int) -> tuple[Tensor | None, Tensor | None]:
    """The prompts as known prefixes of ``n`` slots, as ``anyorder.load(...).generate``
    passes them: none without a prompt, (n,) for one prompt shared by every row (the
    sampler then prefills it once), else (rows, n)."""
    if ids.shape[1] == 0:
        return None, None
    rows = ids.shape[0] * copies
    shape = (n,) if ids.shape[0] == 1 else (rows, n)
    prompt = torch.zeros(shape, dtype=torch.long)
    prompt[..., : ids.shape[1]] = (
        ids[0] if ids.shape[0] == 1 else ids.repeat_interleave(copies, 0)
    ).cpu()
    known = torch.zeros(shape, dtype=torch.bool)
    known[..., : ids.shape[1]] = True
    return prompt, known


def _after_eos(tokens: Tensor, start: int, eos: int, pad: int) -> Tensor:
    """``tokens`` with every position after a row's first EOS at or after ``start`` set to
    ``pad`` (what ``transformers`` returns for a finished row)."""
    new = tokens[:, start:]
    hit = (new == eos).int().cumsum(1)
    after = (hit - (new == eos).int()) > 0  # strictly after the first EOS
    out = tokens.clone()
    out[:, start:] = new.masked_fill(after, pad)
    return out
