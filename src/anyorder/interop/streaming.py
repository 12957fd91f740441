"""Converting a Llama / Qwen2 / Qwen3 / Mistral checkpoint tensor by tensor, in bounded memory.

:func:`convert_family` reads the source's safetensors (one file, or shards through
``model.safetensors.index.json``; each header checked first) one tensor at a time
(:class:`~anyorder.interop.source.Source`), maps it through its family's table
(:mod:`anyorder.interop.families`) and writes it straight into the export's
``model.safetensors`` (:func:`write_safetensors`). At no time does it hold the whole model,
nor any of it in float32: the peak is about the largest tensor (twice for a joined q/k/v or
gate/up) beside the interpreter (``benchmarks/convert_memory.py`` measures it).

Design choices:

* The model is built on the ``meta`` device: its state dict gives every name and shape the
  export needs, and its tied aliases, without allocating. Only the parts the source does not
  have (AO-GPT's target embedding and adaLN, ARMD's query MLP: small) are materialised and
  initialised as :func:`anyorder.models.build_model` would (adaLN at zero, so the converted
  ``aogpt`` is the source on the left-to-right order).
* The source dtype is kept (``--dtype`` casts); the BOS vector is the embedding row of the
  BOS id (RoPE adds nothing at the input).
* Everything is checked before the first byte is written (family, features, shapes, BOS
  id, tokenizer), and the folder is written atomically: a refusal or a failure leaves
  nothing behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from anyorder.atomic import atomic_folder
from anyorder.checkpoint.exported import CONFIG_NAME, WEIGHTS_NAME
from anyorder.checkpoint.exporting import _EXPORT_WHERE, _prepare_target, write_export_files
from anyorder.checkpoint.weights import tied_aliases
from anyorder.config import ModelConfig
from anyorder.data.untrusted import refuse_special_files
from anyorder.errors import AnyorderError, CheckpointError, ConfigError
from anyorder.interop.convert import Converted, fit_query_mlp
from anyorder.interop.families import (
    bos_of,
    ending_at,
    family_of,
    model_config_from_hf,
    source_eos_ids,
    weight_map,
)
from anyorder.interop.source import (
    INDEX_NAME,
    Source,
    read_source_json,
    weight_files,
    write_safetensors,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHUNK = 1 << 22  # elements checked for finiteness at a time: no full-size mask


def _check_finite(t: Tensor, name: str) -> None:
    flat = t.view(-1)
    for i in range(0, flat.numel(), _CHUNK):
        if not bool(torch.isfinite(flat[i : i + _CHUNK]).all()):
            raise CheckpointError(
                f"source weight {name!r} holds NaN or infinite values; nothing was written: "
                "convert a checkpoint with finite weights"
            )


def _read_config(folder: Path, source: str) -> dict[str, Any]:
    config = read_source_json(folder, CONFIG_NAME)
    if config is None:
        raise CheckpointError(
            f"{source!r} has no config.json; give a folder saved by transformers' "
            "save_pretrained (config.json + model.safetensors)"
        )
    if not isinstance(config, dict):
        raise CheckpointError(f"{folder / CONFIG_NAME} does not hold a JSON object")
    return config


def _tokenizer(folder: Path, spec: str | None, vocab: int, stops: list[int]):
    from anyorder.data import load_tokenizer

    if spec == "none":
        return None
    if spec is None:
        names = {p.name for p in folder.iterdir()}
        if not names & {"tokenizer.json", "tokenizer_config.json"}:
            return None
        spec = str(folder.resolve())
    try:
        tok = load_tokenizer(spec)
    except AnyorderError as e:
        raise ConfigError(f"the tokenizer cannot be shipped ({e}); pass --tokenizer") from None
    if tok.vocab_size > vocab:
        raise ConfigError(
            f"tokenizer {tok.name!r} has {tok.vocab_size} ids but the model reads {vocab}; "
            "give the model's own tokenizer"
        )
    return ending_at(tok, stops)  # the EOS the source's generate stops on


def _plan(model: torch.nn.Module, mapping: dict, src: Source, name: str) -> dict[str, Any]:
    """Where each tensor of the export comes from, checked against the source's shapes."""
    aliases = tied_aliases(model)
    plan: dict[str, Any] = {}
    for key, meta in model.state_dict().items():
        if key in aliases:
            continue
        theirs = mapping.get(key)
        if theirs is None:
            plan[key] = "bos" if key == "bos" else "new"
            continue
        missing = [t for t in theirs if not src.has(t)]
        if missing:
            raise CheckpointError(
                f"{name} weight {missing[0]!r} is missing; the checkpoint is incomplete or "
                "its config.json describes another model"
            )
        for t in theirs:
            src.dtype(t)  # one convert reads
        rows = sum(src.shape(t)[0] for t in theirs)
        got = [rows, *src.shape(theirs[0])[1:]]
        if got != list(meta.shape):
            raise CheckpointError(
                f"{name} weight {theirs[0]!r} gives {tuple(got)} for {key}, expected "
                f"{tuple(meta.shape)}; config.json and the weights disagree"
            )
        plan[key] = theirs
    return plan


def _warn_skipped(src: Source, plan: dict, source: str, family: str, n_layer: int) -> None:
    """One line on stderr for each choice the conversion would make silently: a tensor found
    in two files (one copy is read), tensors the export does not take (layers beyond the
    config's, names the family's map does not know)."""
    if src.doubles:
        key, kept, other, why = src.doubles[0]
        more = f" (and {len(src.doubles) - 1} more tensors)" if len(src.doubles) > 1 else ""
        _warn(
            f"{source!r} holds tensor {key!r} in two files, {kept} and {other}{more}; "
            f"converting the copy in {kept} ({why})"
        )
    used = {t for how in plan.values() if not isinstance(how, str) for t in how}
    left = sorted(k for k in src.where if k not in used and not k.endswith(".inv_freq"))
    if left:
        named = ", ".join(repr(k[:80]) for k in left[:3]) + (", ..." if len(left) > 3 else "")
        _warn(
            f"{len(left)} tensors of {source!r} are not converted ({named}): layers beyond "
            f"the {n_layer} its config.json has, or names the {family} map does not know"
        )


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _new_parts(model: torch.nn.Module, plan: dict, cfg: ModelConfig, seed: int) -> None:
    """Materialise and initialise the modules the source has no weights for."""
    from anyorder.layers import init_weights

    torch.manual_seed(seed)
    owners = {k.rpartition(".")[0] for k, how in plan.items() if how == "new"}
    for name in sorted(owners):
        module = model.get_submodule(name)
        module.to_empty(device="cpu", recurse=False)
        init_weights(module, cfg)


def convert_family(
    source: str | Path,
    kind: str,
    out: str | Path,
    *,
    dtype: str | None = None,
    seq_len: int | None = None,
    l2s: int | None = None,
    target_dim: int = 128,
    bos_id: int | None = None,
    tokenizer: str | None = None,
    seed: int = 0,
) -> Converted:
    """Convert a Llama, Qwen2, Qwen3 or Mistral checkpoint and write it as an export folder.

    Args:
        source: a folder saved by ``transformers`` (safetensors, sharded or not) or a hub id.
        kind: ``gpt``, ``aogpt`` or ``armd``.
        out: the export folder to write.
        dtype: stored dtype (default: the source's).
        seq_len: context length (default: the source's positions, the BOS aside, at most
            :data:`anyorder.interop.families.DEFAULT_MAX_SEQ`).
        l2s: armd: two-stream layers (default ``n_layer // 2``).
        target_dim: aogpt: width of the target-position embedding.
        bos_id: the token whose embedding is the BOS vector (default ``bos_token_id``).
        tokenizer: a tokenizer spec to ship (default: the source's own; ``none``: none).
        seed: seeds the new parts' initialisation.

    Returns:
        A :class:`~anyorder.interop.convert.Converted` whose ``model`` is the architecture
        on the ``meta`` device (no weights: load ``folder`` to use it).

    Raises:
        CheckpointError: an unreadable source, or a family or feature that cannot be mapped.
        ConfigError: a bad kind, ``seq_len``, BOS id, dtype or tokenizer.
    """
    from anyorder.interop.hub import resolve_folder
    from anyorder.models import build_model

    if kind not in ("gpt", "aogpt", "armd"):
        raise ConfigError(f"cannot convert into {kind!r}; use --to gpt, aogpt or armd")
    folder = resolve_folder(source, allow_patterns=SOURCE_PATTERNS)
    refuse_special_files(folder, SOURCE_FILES, CheckpointError)  # read whole, here or by others
    config = _read_config(folder, str(source))
    fam = family_of(config, str(source))
    cfg = model_config_from_hf(
        config, kind, seq_len=seq_len, l2s=l2s, target_dim=target_dim, source=str(source)
    )
    bos = bos_of(config, bos_id, cfg.vocab_size, fam.name)
    generation = read_source_json(folder, "generation_config.json")
    stops = source_eos_ids(config, generation, cfg.vocab_size)
    tok = _tokenizer(folder, tokenizer, cfg.vocab_size, stops)
    with Source(folder) as src:
        with torch.device("meta"):
            model = build_model(cfg, init=False)  # names and shapes only
        mapping = weight_map(fam, cfg.n_layer)
        if cfg.tie_embeddings:
            mapping.pop("head.weight")
        plan = _plan(model, mapping, src, fam.name)
        _warn_skipped(src, plan, str(source), fam.name, cfg.n_layer)
        emb = fam.top["tok_emb.weight"][0]
        if dtype is not None and dtype not in _DTYPES:
            raise ConfigError(f"dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
        stored = _DTYPES[dtype] if dtype is not None else src.dtype(emb)
        _new_parts(model, plan, cfg, seed)
        info: dict[str, Any] = {"converted_from": str(source), "family": config["model_type"]}
        if kind == "armd":  # the query at slot 0 starts as the source's BOS; no position table
            targets = torch.zeros(cfg.seq_len, cfg.d_model)
            targets[0] = src.row(emb, bos).float()
            info["query_mlp_fit_residual"] = round(fit_query_mlp(model, targets, seed), 6)
        new = dict(model.state_dict())

        def produce(key: str) -> Tensor:
            how = plan[key]
            if how == "bos":
                t = src.row(emb, bos)
            elif how == "new":
                t = new[key].detach()
            else:
                parts = [src.get(n) for n in how]
                for n, part in zip(how, parts, strict=True):
                    _check_finite(part, n)
                t = parts[0] if len(parts) == 1 else torch.cat(parts)
            return t.to(stored)

        specs = [(k, list(new[k].shape), stored) for k in plan]
        eos = tok.eos_id if tok is not None else stops[0] if stops else None
        info.update(bos_id=bos, bos_token_id=bos, eos_token_id=eos,
                    pad_token_id=config.get("pad_token_id"))  # fmt: skip
        _prepare_target(Path(out).expanduser())
        with atomic_folder(Path(out).expanduser(), _EXPORT_WHERE) as tmp:
            aliases = json.dumps(tied_aliases(model))
            write_safetensors(tmp / WEIGHTS_NAME, specs, produce, {"format": "pt", "tied": aliases})
            write_export_files(
                tmp, cfg, model.num_params(), tok, weights="converted", step=0,
                source=f"converted from {fam.name} {source}", dtype=str(stored).split(".")[1],
                extra=info,
            )  # fmt: skip
        return Converted(model=model, tokenizer=tok, info=info, folder=Path(out).expanduser())


SOURCE_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
]
"""Files a hub download of a source fetches (GPT-2's too: the CLI reads the config first)."""

SOURCE_FILES = tuple(p for p in SOURCE_PATTERNS if "*" not in p)
"""The files of a source folder that are read whole (by anyorder or by ``transformers``)."""


def model_type_of(folder: Path) -> str | None:
    """``model_type`` of the ``config.json`` in ``folder``, or None when there is none (or it
    names none: the caller's own reader then says what is wrong).

    The CLI asks this before it picks a reader, so the folder is checked here as
    :class:`Source` checks it, for the GPT-2 reader too: ``config.json`` and the index regular
    files of bounded size, the index's names inside the folder and no pipe among them.

    Raises:
        CheckpointError: a file that must not be read (a pipe, a device, too large, nested
            too deeply), or an index naming a file outside the folder.
    """
    folder = Path(folder)
    config = read_source_json(folder, CONFIG_NAME)
    if (folder / "model.safetensors").exists() or (folder / INDEX_NAME).exists():
        names, _ = weight_files(folder)
        refuse_special_files(folder, tuple(names), CheckpointError, limit=1 << 62)
    refuse_special_files(folder, SOURCE_FILES, CheckpointError)
    return config.get("model_type") if isinstance(config, dict) else None
