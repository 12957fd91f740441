"""The AO-GPT authors' checkpoints (``ckpt_N.pt`` of scxue/AO-GPT-MDM) -> an exported aogpt.

The authors released AO-GPT and sigma-GPT, Small and Medium, on the Hugging Face hub
(``Cauthyyy/AO-GPT-MDM``) as the ``.pt`` files their training script writes: a dict
``{model, ema_model: {shadow_params: [...]}, ema_rate, model_args, iter_num, config}``
(sometimes an ``optimizer`` too). :func:`convert_reference` reads one and builds the same
network on our trunk; :func:`convert_ref` writes it as an exported folder that
``anyorder.load`` and every command take.

Design choices:

* The architecture is ours, set to compute what theirs computes: ``model.variant``
  ``aogpt-ref`` or ``sigmagpt-ref`` (see :data:`anyorder.config.VARIANTS`) plus the sizes in
  ``model_args``. Every tensor maps one to one (their ``wnonee`` row is our ``bos`` vector,
  their ``wpe`` with ``block_size + 1`` rows our position table under ``bos_pos_row``; the
  name tables are :mod:`anyorder.interop.reference_names`), so the converted model
  reproduces their logits (``tests/test_convert_ref.py`` checks them against logits their
  code computed).
* ``torch.load(weights_only=True)`` only: a file that needs arbitrary unpickling is refused.
* EMA weights by default. The EMA is a list of tensors in their ``model.parameters()``
  order, which is the order of their state dict less buffers and the tied head (sigma-GPT's
  ``lm_head.weight`` is its ``wte.weight``): the list is matched to names by that order and
  checked in length and shapes.
* The vocabulary is GPT-2's 50257 ids padded to 50304 rows. The padding rows are kept (so
  the weights map one to one) but the head computes the 50257 real ids only
  (``model.padded_vocab``): padding ids are never sampled. Their softmax therefore runs over
  the real ids; the reference's also counts the 47 padding ids, which training never
  targets (their probability mass is what separates the two).
* Every check runs before anything is written, and the export is written atomically: a
  wrong or damaged file leaves no folder behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from anyorder.checkpoint.exporting import save_pretrained
from anyorder.checkpoint.load import load_plain
from anyorder.config import VARIANTS, ModelConfig, expand_model_values
from anyorder.data.files import special_kind
from anyorder.errors import AnyorderError, CheckpointError, ConfigError
from anyorder.interop.convert import Converted
from anyorder.interop.reference_names import our_name, their_name

if TYPE_CHECKING:
    from anyorder.data import Tokenizer

FORMATS = ("aogpt-ref", "sigmagpt-ref")
"""Reference formats :func:`convert_reference` reads (named after :data:`VARIANTS`)."""
GPT2_VOCAB = 50257
"""GPT-2's ids; the reference pads them to the next multiple of 64 (50304)."""
HF_PREFIX = "hf:"
_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
_PREFIX = "_orig_mod."  # what a torch.compile'd model leaves on its state-dict keys
_BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.bias$")  # the causal mask, not a weight


@dataclass
class ReferenceCheckpoint:
    """A reference ``.pt`` as read and checked."""

    format: str
    """``aogpt-ref`` or ``sigmagpt-ref``."""
    model_args: dict[str, Any]
    state: dict[str, Tensor]
    """``model``'s tensors, keys without ``_orig_mod.``."""
    ema: list[Tensor] | None
    """``ema_model.shadow_params`` (None: the checkpoint kept no EMA)."""
    iter_num: int | None
    ema_rate: float | None
    path: Path


# ----------------------------------------------------------------------------- reading


def _first_line(e: BaseException) -> str:
    """``Kind: first sentence`` of an exception (torch's messages run to paragraphs)."""
    text = " ".join(str(e).split())
    first = text.split(". ")[0].rstrip(".")
    return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__


def resolve_source(spec: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The local file of ``spec``: a path, or ``hf:OWNER/REPO/PATH/ckpt_N.pt`` fetched with
    ``huggingface_hub.hf_hub_download`` (which reads its cache first; offline, only it).

    Raises:
        CheckpointError: a missing file, a folder, or a hub file that cannot be fetched.
    """
    text = str(spec)
    if text.startswith(HF_PREFIX):
        parts = text[len(HF_PREFIX) :].strip("/").split("/")
        if len(parts) < 3 or not all(parts):
            raise CheckpointError(
                f"{text!r} is not a hub file; write hf:OWNER/REPO/PATH/ckpt_N.pt, e.g. "
                "hf:Cauthyyy/AO-GPT-MDM/124M/ckpt_250000.pt"
            )
        try:
            from huggingface_hub import hf_hub_download
        except ImportError:
            raise CheckpointError(
                f"fetching {text!r} needs huggingface_hub; pip install 'anyorder[hf]' or give "
                "the downloaded file"
            ) from None
        from anyorder.interop.hub import _cached_or_reachable

        def download(local_files_only: bool) -> str:
            return hf_hub_download(
                repo_id="/".join(parts[:2]),
                filename="/".join(parts[2:]),
                cache_dir=None if cache_dir is None else str(cache_dir),
                local_files_only=local_files_only,
            )

        try:
            fix = "connect to the network, or give the downloaded file"
            local = _cached_or_reachable(download, text, fix)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"{text!r} cannot be fetched from the hub ({_first_line(e)}); check the repository "
                "and path and the network, or give the downloaded file"
            ) from None
        return Path(local)
    path = Path(spec).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"reference checkpoint {text!r} does not exist; give a ckpt_N.pt file or "
            "hf:OWNER/REPO/PATH/ckpt_N.pt"
        )
    if path.is_dir():
        raise CheckpointError(f"{text!r} is a folder; give the ckpt_N.pt file inside it")
    special = special_kind(path)
    if special:  # never opened: a named pipe blocks until a writer comes
        raise CheckpointError(f"{text!r} is {special}, not a file; give the ckpt_N.pt file")
    return path


def _load_pt(path: Path) -> Any:
    """The file, read as plain tensors and values (:func:`load_plain`)."""
    return load_plain(path, "download it again")


def detect_format(state: dict[str, Tensor]) -> str | None:
    """``aogpt-ref`` (adaLN layers), ``sigmagpt-ref`` (a target table, no adaLN) or None."""
    if any(".adaLN." in k or "adaLN_final" in k for k in state):
        return "aogpt-ref"
    if "transformer.wtpe.weight" in state:
        return "sigmagpt-ref"
    return None


def _model_args(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: model_args is a {type(raw).__name__}, not a dict")
    for key in _ARGS:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(
                f"{where}: model_args[{key!r}] is {value!r}, not a positive integer; the "
                "checkpoint's model_args are damaged"
            )
    if raw["n_embd"] % raw["n_head"]:
        raise CheckpointError(
            f"{where}: model_args n_embd={raw['n_embd']} is not divisible by "
            f"n_head={raw['n_head']}; the checkpoint's model_args are damaged"
        )
    return dict(raw)


def _check_claims(args: dict[str, Any], state: dict[str, Tensor], where: str) -> None:
    """The sizes ``model_args`` claim, against the tensors the file holds, before anything
    is built: a file claiming ``n_layer=10**6`` must not make us build a million layers."""
    layers = {k.split(".")[2] for k in state if k.startswith("transformer.h.") and k.count(".") > 2}
    wte = state.get("transformer.wte.weight")
    wpe = state.get("transformer.wpe.weight")
    claims = [
        ("n_layer", args["n_layer"], len(layers), "layers"),
        ("vocab_size", args["vocab_size"], None if wte is None else wte.shape[0], "wte rows"),
        (
            "n_embd",
            args["n_embd"],
            None if wte is None or wte.dim() < 2 else wte.shape[1],
            "wte columns",
        ),
        ("block_size", args["block_size"] + 1, None if wpe is None else wpe.shape[0], "wpe rows"),
    ]
    for key, claimed, held, what in claims:
        if held is not None and held != claimed:
            claimed = claimed - 1 if key == "block_size" else claimed  # wpe has a BOS row
            raise CheckpointError(
                f"{where}: model_args claim {key}={claimed}, but the weights hold {held} "
                f"{what}; the checkpoint's model_args are damaged"
            )


def read_reference(source: str | Path, fmt: str | None = None) -> ReferenceCheckpoint:
    """Read and check a reference ``.pt`` (a path or ``hf:...``; see :func:`resolve_source`).

    Args:
        source: the file.
        fmt: the format the caller expects (``aogpt-ref``/``sigmagpt-ref``); None: detect.

    Raises:
        CheckpointError: an unreadable file, a dict of another layout, or the other format.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"reference format {fmt!r} is unknown; use one of {', '.join(FORMATS)}")
    path = resolve_source(source)
    where = repr(str(source))
    obj = _load_pt(path)
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{where} holds a {type(obj).__name__}, not an AO-GPT training checkpoint (a dict "
            "with model and model_args); give a ckpt_N.pt written by train_AOGPT_CL.py"
        )
    missing = [k for k in ("model", "model_args") if k not in obj]
    if missing:
        raise CheckpointError(
            f"{where} has no {' or '.join(repr(k) for k in missing)}: it is not an AO-GPT training "
            "checkpoint (a dict with model, model_args, ema_model); give a ckpt_N.pt"
        )
    model = obj["model"]
    if not isinstance(model, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in model.items()
    ):
        raise CheckpointError(f"{where}: 'model' is not a state dict of tensors; it is damaged")
    state = {k.removeprefix(_PREFIX): v for k, v in model.items()}
    state = {k: v for k, v in state.items() if not _BUFFER.match(k)}
    for key, t in state.items():  # a cast to float32 would make numbers of anything
        if not t.is_floating_point():
            raise CheckpointError(
                f"{where}: weight {key!r} holds {t.dtype} values, not floating point; the "
                "checkpoint is damaged: download it again"
            )
    found = detect_format(state)
    if found is None:
        raise CheckpointError(
            f"{where}: 'model' holds neither an AO-GPT (adaLN) nor a sigma-GPT (target table) "
            "state dict; give a checkpoint of model_AOGPT_*.py or model_sigmaGPT.py"
        )
    if fmt is not None and found != fmt:
        raise CheckpointError(
            f"{where} is a {found} checkpoint, not {fmt}; convert it with --from {found}"
        )
    ema = None
    if obj.get("ema_model") is not None:
        shadow = obj["ema_model"].get("shadow_params") if isinstance(obj["ema_model"], dict) else 0
        if not isinstance(shadow, (list, tuple)) or not all(isinstance(t, Tensor) for t in shadow):
            raise CheckpointError(
                f"{where}: ema_model has no list of tensors under 'shadow_params'; it is "
                "damaged: use --weights raw or download it again"
            )
        ema = list(shadow)
        for i, t in enumerate(ema):
            if not t.is_floating_point():
                raise CheckpointError(
                    f"{where}: EMA tensor {i} holds {t.dtype} values, not floating point; the "
                    "EMA is damaged: use --weights raw or download it again"
                )
    iter_num, rate = obj.get("iter_num"), obj.get("ema_rate")
    args = _model_args(obj["model_args"], where)
    _check_claims(args, state, where)
    return ReferenceCheckpoint(
        format=found,
        model_args=args,
        state=state,
        ema=ema,
        iter_num=int(iter_num) if isinstance(iter_num, int) else None,
        ema_rate=float(rate) if isinstance(rate, (int, float)) else None,
        path=path,
    )


# ----------------------------------------------------------------------------- mapping


def parameter_order(ref: ReferenceCheckpoint) -> list[str]:
    """The reference's ``model.parameters()`` names: its state-dict keys less the tied head."""
    keys = list(ref.state)
    if ref.format == "sigmagpt-ref":  # lm_head.weight *is* wte.weight there
        keys = [k for k in keys if k != "lm_head.weight"]
    return keys


def model_config_from_reference(
    ref: ReferenceCheckpoint, vocab_size: int | None = None
) -> ModelConfig:
    """Our :class:`ModelConfig` for a reference checkpoint.

    Args:
        ref: the checkpoint.
        vocab_size: the real ids (a tokenizer's); the rest of the table is padding. None:
            GPT-2's 50257 when the table is GPT-2's padded to a multiple of 64, else all rows.

    Raises:
        CheckpointError: a tokenizer with more ids than the table has rows.
    """
    a = ref.model_args
    rows = a["vocab_size"]
    if vocab_size is None:
        vocab_size = GPT2_VOCAB if GPT2_VOCAB <= rows < GPT2_VOCAB + 64 else rows
    if vocab_size > rows:
        raise CheckpointError(
            f"the tokenizer has {vocab_size} ids but the checkpoint's table has {rows} rows; "
            "give the tokenizer the model was trained with"
        )
    values = {
        "variant": ref.format,
        "n_layer": a["n_layer"],
        "n_head": a["n_head"],
        "d_model": a["n_embd"],
        "seq_len": a["block_size"],
        "vocab_size": vocab_size,
        "padded_vocab": rows if rows > vocab_size else None,
        "bias": bool(a.get("bias", True)),
    }
    from anyorder.config import _build

    return _build(ModelConfig, expand_model_values(values), "model")


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def map_state(ref: ReferenceCheckpoint, weights: str, want: dict[str, Tensor]) -> dict:
    """Our state dict from the reference's ``model`` (``raw``) or EMA list (``ema``), checked
    against ``want`` (the built model's state dict) name by name and shape by shape."""
    where = repr(str(ref.path))
    order = parameter_order(ref)
    if weights == "ema":
        if len(ref.ema) != len(order):
            raise CheckpointError(
                f"{where}: the EMA list holds {len(ref.ema)} tensors but the model has "
                f"{len(order)} parameters; the EMA does not belong to these weights: use "
                "--weights raw"
            )
        source = dict(zip(order, ref.ema))
        for name, t in source.items():
            if _shape(t) != _shape(ref.state[name]):
                raise CheckpointError(
                    f"{where}: EMA tensor {order.index(name)} has shape {_shape(t)} but parameter "
                    f"{name!r} has {_shape(ref.state[name])}; the EMA list does not match the "
                    "parameters: use --weights raw"
                )
    else:
        source = {k: ref.state[k] for k in order}
    out: dict[str, Tensor] = {}
    for key, t in source.items():
        name = our_name(key)
        if name is None or name not in want:
            raise CheckpointError(
                f"{where}: weight {key!r} has no place in a {ref.format} model of these "
                "model_args; the checkpoint is of another architecture"
            )
        if name == "bos":
            t = t.reshape(-1)
        if _shape(t) != _shape(want[name]):
            raise CheckpointError(
                f"{where}: weight {key!r} has shape {_shape(t)}, but model_args give "
                f"{_shape(want[name])}; model_args and the weights disagree"
            )
        out[name] = t.detach().to(torch.float32).clone()
    if ref.format == "sigmagpt-ref":
        out["head.weight"] = out["tok_emb.weight"]  # tied, as in the reference
    missing = [k for k in want if k not in out]  # in the model's order
    if missing:
        raise CheckpointError(
            f"{where}: the weights lack {their_name(missing[0], ref.format)!r} ({len(missing)} "
            "missing); the checkpoint is incomplete or of another architecture"
        )
    return out


# ----------------------------------------------------------------------------- converting


def _tokenizer(spec: str | None, rows: int) -> Tokenizer | None:
    """The tokenizer to ship: ``spec``; else GPT-2's for a GPT-2-sized table; ``none``: none."""
    from anyorder.data import load_tokenizer

    if spec == "none":
        return None
    if spec is None:
        if rows < GPT2_VOCAB:
            return None  # not GPT-2's vocabulary: the caller may pass one
        spec = "gpt2"
    try:
        return load_tokenizer(spec)
    except AnyorderError as e:
        why = str(e).split("; pass ")[0]  # its own fix names a config key, not this option
        raise CheckpointError(
            f"{why}; pass --tokenizer with a folder holding GPT-2's vocab.json and merges.txt "
            "(or another tokenizer of the checkpoint), or --tokenizer none"
        ) from None


def convert_reference(
    source: str | Path,
    fmt: str | None = None,
    *,
    weights: str | None = None,
    tokenizer: str | None = None,
) -> Converted:
    """Build our aogpt from a reference checkpoint.

    Args:
        source: a ``ckpt_N.pt`` path or ``hf:OWNER/REPO/PATH/ckpt_N.pt``.
        fmt: ``aogpt-ref`` or ``sigmagpt-ref`` (None: detected).
        weights: ``ema`` or ``raw``; None: EMA when the checkpoint kept one, else raw.
        tokenizer: a tokenizer spec to ship (see :func:`anyorder.data.load_tokenizer`),
            ``none``, or None for GPT-2's when the table is GPT-2's.

    Returns:
        A :class:`~anyorder.interop.convert.Converted` (model in eval mode, float32, on the CPU).

    Raises:
        CheckpointError: an unreadable, damaged or mismatched checkpoint.
        ConfigError: an unknown format or weights choice.
    """
    from anyorder.models import build_model

    if weights not in (None, "ema", "raw"):
        raise ConfigError(f"weights={weights!r}: use ema or raw")
    ref = read_reference(source, fmt)
    if weights is None:
        weights = "ema" if ref.ema is not None else "raw"
    if weights == "ema" and ref.ema is None:
        raise CheckpointError(
            f"{str(source)!r} has no EMA weights (no ema_model); convert its raw weights with "
            "--weights raw"
        )
    tok = _tokenizer(tokenizer, ref.model_args["vocab_size"])
    cfg = model_config_from_reference(ref, None if tok is None else tok.vocab_size)
    model = build_model(cfg)
    state = map_state(ref, weights, model.state_dict())
    model.load_state_dict(state, strict=True)
    info = {
        "converted_from": str(source),
        "reference_format": ref.format,
        "reference_weights": weights,
        "reference_iter_num": ref.iter_num,
        "reference_ema_rate": ref.ema_rate,
    }
    return Converted(model=model.eval(), tokenizer=tok, info=info)


def convert_ref(
    source: str | Path,
    out: str | Path,
    fmt: str | None = None,
    *,
    dtype: str | None = None,
    **kwargs: Any,
) -> Converted:
    """:func:`convert_reference`, written as an exported folder.

    The folder's layout is :mod:`anyorder.checkpoint.exported`'s.

    Returns:
        The :class:`~anyorder.interop.convert.Converted` model; its ``folder`` is ``out``.
    """
    conv = convert_reference(source, fmt, **kwargs)
    weights = conv.info["reference_weights"]
    conv.folder = save_pretrained(
        conv.model,
        out,
        conv.tokenizer,
        weights=weights,
        step=conv.info["reference_iter_num"],
        source=f"converted from the AO-GPT authors' checkpoint {source} ({weights} weights)",
        dtype=dtype,
        extra=conv.info,
    )
    return conv


__all__ = [
    "FORMATS",
    "VARIANTS",
    "ReferenceCheckpoint",
    "convert_ref",
    "convert_reference",
    "model_config_from_reference",
    "read_reference",
]
