"""From pretrained left-to-right weights: a ``transformers`` GPT-2 checkpoint -> gpt, aogpt, armd.

Design choices:

* The source is read directly (``config.json`` + ``model.safetensors``, sharded safetensors
  or ``pytorch_model.bin``), as untrusted data (:mod:`anyorder.interop.source`), so converting
  needs neither ``transformers`` nor its model classes; a hub id goes through
  ``huggingface_hub.snapshot_download``.
* The trunk maps one to one: our config supports GPT-2's choices (``norm: layernorm``,
  ``bias: true``, ``qk_norm: false``, ``mlp: gelu`` with the tanh approximation,
  ``pos_emb: learned``, tied head). GPT-2 stores its projections as ``Conv1D`` with weights
  ``(in, out)`` (``y = x W + b``), so every one is transposed into ``nn.Linear``'s
  ``(out, in)``; ``c_attn``'s output is ``[q | k | v]`` with heads split the same way as ours.
* BOS and positions. GPT-2 has no BOS; the usual unconditional start is ``<|endoftext|>``
  (50256) at position 0. Fed ``[eos] + x``, GPT-2's slot ``t >= 1`` holds ``x_(t-1)`` at
  position ``t``, while our decoders put ``x_(t-1)`` at *its own* position ``t-1`` (what
  lets AO-GPT permute). So the converted table is GPT-2's shifted by one,
  ``pos_emb[p] = wpe[p + 1]``, and our learned BOS vector (which replaces the whole slot
  embedding) is ``wte[eos] + wpe[0]``. Then ``gpt`` reproduces GPT-2 on ``[eos] + x``
  exactly, and ``seq_len`` is at most ``n_positions - 1`` (1023 for GPT-2).
* AO-GPT's new parts are its target embedding and adaLN; adaLN is zero-initialised, so the
  converted ``aogpt`` *is* the GPT-2 on the left-to-right order (and a GPT-2 told nothing
  about the target on other orders).
* ARMD cannot start as GPT-2 exactly: its query stream at slot ``t`` must predict ``x_t``
  from earlier slots, and it starts from a prefix mean that never holds the previous token
  ``x_(t-1)`` on its own, which is what GPT-2's state predicting ``x_t`` starts from. It
  has no BOS slot either, so its table is *not* shifted (``pos_emb[p] = wpe[p]``): the
  content stream is exactly GPT-2 fed ``x``, and ``x_0`` at position 0 keeps its role as
  GPT-2's attention sink (GPT-2 was trained without a BOS; its heads park on the first
  token). Our init: every shared weight from GPT-2, and the query MLP fitted (least
  squares, data-free) so that on the left-to-right order ``g0_t = MLP(sin(t)) + prefix
  mean`` matches, in expectation, GPT-2's start at the previous token,
  ``wte[x_(t-1)] + wpe[t-1]``: ``MLP(sin(t)) = wpe[t-1] - mean(wpe[0..t-1])`` (the token
  parts cancel in expectation), and the BOS at ``t = 0``. With the previous token's
  embedding in place of ``g0`` (and every layer two-stream) the converted ARMD is GPT-2
  exactly (``tests/test_convert.py``); the gap from the real ``g0`` is measured there and
  in ``docs/checkpoints.md``. Fine-tuning with the progressive schedule (pure left to
  right until ``i_ar``) closes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from anyorder.checkpoint.exporting import save_pretrained
from anyorder.checkpoint.load import refuse_packed_records
from anyorder.config import ModelConfig
from anyorder.data.untrusted import open_regular, refuse_links_out, refuse_special_files
from anyorder.errors import AnyorderError, CheckpointError, ConfigError
from anyorder.interop.families import MAX_SEQ, bos_of, positive_number, whole_number
from anyorder.interop.hub import resolve_folder
from anyorder.interop.source import INDEX_NAME, Source, checked_state, read_source_json

if TYPE_CHECKING:
    from anyorder.data import Tokenizer
    from anyorder.models.base import AnyOrderLM

CONVERTIBLE = ("gpt", "aogpt", "armd")
"""Model kinds a GPT-2 converts into (the encoder ``mdm`` reads no causal weights)."""
GPT2_EOS = 50256
"""GPT-2's ``<|endoftext|>`` id: the BOS of converted models when the config names none."""
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
"""GPT-2 activations that are the tanh approximation of GELU (what our MLP computes)."""
_SOURCE_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", "vocab.json",
                    "merges.txt", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json"]  # fmt: skip


@dataclass
class GPT2Checkpoint:
    """A GPT-2 checkpoint as read from disk."""

    config: dict[str, Any]
    """Its ``config.json``."""
    weights: dict[str, Tensor]
    """Its tensors, named without the ``transformer.`` prefix (``h.0.attn.c_attn.weight``)."""
    folder: Path | None = None
    """The folder it was read from."""


@dataclass
class Converted:
    """A converted model and what the conversion did."""

    model: AnyOrderLM
    tokenizer: Tokenizer | None
    info: dict[str, Any] = field(default_factory=dict)
    """Conversion details (source, BOS id, position shift), recorded in config.json."""
    folder: Path | None = None
    """The export folder, once written by :func:`convert`."""


# ----------------------------------------------------------------------------- reading


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


_MASKS = (".attn.bias", ".attn.masked_bias")  # old checkpoints' causal-mask buffers


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    """A GPT-2 folder's weights, mask buffers left out, read as untrusted data (Source)."""
    if (folder / "model.safetensors").exists() or (folder / INDEX_NAME).exists():
        with Source(folder) as src:
            return {
                k: src.get(k)
                for k in src.where
                if not (k.endswith(_MASKS) and len(src.shape(k)) != 1)
            }
    path = folder / "pytorch_model.bin"
    if path.exists():
        refuse_links_out(folder, path, "download the checkpoint again", CheckpointError)
        f = open_regular(path, CheckpointError)
        refuse_packed_records(f, str(path), "download the checkpoint again")  # a zip bomb
        try:
            with f:
                obj = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{path} cannot be read ({_first_line(e)}); download the checkpoint again"
            ) from None
        return checked_state(obj, path, _MASKS)
    raise CheckpointError(
        f"{str(folder)!r} holds no weights (model.safetensors, model.safetensors.index.json or "
        "pytorch_model.bin); give a folder saved by transformers' save_pretrained"
    )


def read_gpt2(
    source: str | Path, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> GPT2Checkpoint:
    """Read a ``transformers`` GPT-2 checkpoint from a local folder or a hub id.

    Args:
        source: a folder with ``config.json`` and weights, or a hub id (``gpt2``,
            ``openai-community/gpt2-medium``).
        revision: hub revision for a hub id.
        cache_dir: hub cache folder.

    Raises:
        CheckpointError: a missing folder or file, an unreachable hub id, or not a GPT-2.
    """
    folder = resolve_folder(
        source, revision=revision, cache_dir=cache_dir, allow_patterns=_SOURCE_PATTERNS
    )
    if not folder.is_dir():
        raise CheckpointError(f"{str(source)!r} is not a folder; give a GPT-2 checkpoint folder")
    whole = tuple(p for p in _SOURCE_PATTERNS if "*" not in p)  # read whole, here or by others
    refuse_special_files(folder, whole, CheckpointError)  # regular files, of bounded size
    config = read_source_json(folder, "config.json")
    if config is None:
        raise CheckpointError(
            f"{str(source)!r} has no config.json; give a folder saved by transformers' "
            "save_pretrained (config.json + model.safetensors)"
        )
    if isinstance(config, dict) and config.get("model_type") is None:
        raise CheckpointError(
            f"{str(source)!r}: config.json names no model_type; anyorder convert reads gpt2, "
            'llama, qwen2, qwen3 or mistral checkpoints by it: add the model\'s "model_type" '
            "to config.json (save_pretrained writes it)"
        )
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        got = config.get("model_type") if isinstance(config, dict) else None
        raise CheckpointError(
            f"{str(source)!r} holds a {got!r} model; convert_gpt2 reads GPT-2 checkpoints "
            "(model_type gpt2): convert Llama, Qwen2, Qwen3 and Mistral with "
            "anyorder.interop.streaming.convert_family (the CLI picks it by model_type)"
        )
    model_config_from_gpt2(config, "gpt")  # its sizes checked before any weight is read
    weights = {k.removeprefix("transformer."): v.float() for k, v in _read_tensors(folder).items()}
    return GPT2Checkpoint(config=config, weights=weights, folder=folder)


# ----------------------------------------------------------------------------- config


def model_config_from_gpt2(
    config: dict[str, Any],
    kind: str,
    *,
    seq_len: int | None = None,
    l2s: int | None = None,
    target_dim: int = 128,
    tie_embeddings: bool | None = None,
) -> ModelConfig:
    """Our :class:`ModelConfig` for a GPT-2 ``config.json``.

    Args:
        config: the GPT-2 config.
        kind: ``gpt``, ``aogpt`` or ``armd``.
        seq_len: context length (default and maximum ``n_positions - 1`` for gpt/aogpt,
            whose BOS takes position 0, and ``n_positions`` for armd; see
            :func:`position_shift`).
        l2s: armd: two-stream layers (default ``n_layer // 2``, the paper's).
        target_dim: aogpt: width of the target-position embedding.
        tie_embeddings: whether the head is the embedding (default: the config's).

    Raises:
        ConfigError: a kind that cannot be converted into, or a bad ``seq_len``.
        CheckpointError: a GPT-2 variant our trunk does not compute.
    """
    if kind not in CONVERTIBLE:
        raise ConfigError(
            f"cannot convert GPT-2 into {kind!r}; use --to one of {', '.join(CONVERTIBLE)}"
        )
    act = config.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise CheckpointError(
            f"GPT-2 activation {act!r} is not supported; anyorder's gelu MLP is the tanh "
            f"approximation ({', '.join(TANH_GELUS)})"
        )
    for key, bad in (
        ("scale_attn_by_inverse_layer_idx", True),
        ("scale_attn_weights", False),
        ("add_cross_attention", True),
    ):
        if config.get(key, not bad) == bad:
            raise CheckpointError(f"GPT-2 with {key}={bad} is not supported by anyorder's trunk")
    if "n_embd" not in config:
        raise CheckpointError(
            "config.json says model_type gpt2 but has no 'n_embd', GPT-2's width; give a "
            "GPT-2 checkpoint, or correct model_type (llama, qwen2, qwen3 or mistral: their "
            "configs name hidden_size)"
        )
    d = whole_number(config, "n_embd")
    n_inner = whole_number(config, "n_inner", None, none=True) or 4 * d
    shift = position_shift(kind)
    key = "n_positions" if "n_positions" in config else "n_ctx"
    n_positions = whole_number(config, key, 1024, least=1 + shift)
    longest = min(n_positions - shift, MAX_SEQ)
    if seq_len is None:
        seq_len = longest
    if not 1 <= seq_len <= longest:
        if seq_len > MAX_SEQ >= longest:
            why = f"anyorder convert writes at most {MAX_SEQ} positions"
        else:
            why = f"the GPT-2 has {n_positions} positions"
            why += " and the BOS takes one" if longest < n_positions else " in its table"
        raise ConfigError(f"seq_len={seq_len} must lie in 1..{longest} ({why})")
    if tie_embeddings is None:
        tie_embeddings = bool(config.get("tie_word_embeddings", True))
    return ModelConfig(
        kind=kind,
        vocab_size=whole_number(config, "vocab_size"),
        seq_len=seq_len,
        n_layer=whole_number(config, "n_layer"),
        n_head=whole_number(config, "n_head"),
        d_model=d,
        mlp="gelu",
        mlp_ratio=n_inner / d,
        pos_emb="learned",
        qk_norm=False,
        norm="layernorm",
        bias=True,
        tie_embeddings=tie_embeddings,
        norm_eps=positive_number(config, "layer_norm_epsilon", 1e-5),
        init_std=positive_number(config, "initializer_range", 0.02),
        dropout=0.0,
        target_dim=target_dim,
        l2s=l2s if kind == "armd" else None,
    )


# ----------------------------------------------------------------------------- weights


def _need(w: dict[str, Tensor], name: str) -> Tensor:
    if name not in w:
        raise CheckpointError(
            f"GPT-2 weight {name!r} is missing; the checkpoint is incomplete or not a GPT-2"
        )
    return w[name]


def _copy(dst: Tensor, src: Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise CheckpointError(
            f"GPT-2 weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}; "
            "config.json and the weights disagree"
        )
    dst.copy_(src)


@torch.no_grad()
def load_gpt2_weights(model: AnyOrderLM, ckpt: GPT2Checkpoint, bos_id: int) -> None:
    """Copy GPT-2's weights into a freshly built ``gpt``/``aogpt``/``armd`` (in place).

    The new parts (AO-GPT's target embedding and adaLN, ARMD's query MLP) keep their
    initialisation; :func:`fit_query_mlp` sets ARMD's.
    """
    w = ckpt.weights
    cfg = model.cfg
    wte, wpe = _need(w, "wte.weight"), _need(w, "wpe.weight")
    _copy(model.tok_emb.weight, wte, "wte.weight")
    shift = position_shift(cfg.kind)
    _copy(model.pos_emb.weight, wpe[shift : cfg.seq_len + shift], "wpe.weight")
    if hasattr(model, "bos"):
        model.bos.copy_(wte[bos_id] + wpe[0])
    for i, block in enumerate(model.blocks):
        p = f"h.{i}."
        for ours, theirs in ((block.norm1, "ln_1"), (block.norm2, "ln_2")):
            _copy(ours.weight, _need(w, p + theirs + ".weight"), p + theirs + ".weight")
            _copy(ours.bias, _need(w, p + theirs + ".bias"), p + theirs + ".bias")
        for ours, theirs in (
            (block.attn.qkv, "attn.c_attn"),
            (block.attn.proj, "attn.c_proj"),
            (block.mlp.fc, "mlp.c_fc"),
            (block.mlp.proj, "mlp.c_proj"),
        ):
            # Conv1D keeps (in, out); nn.Linear keeps (out, in).
            _copy(ours.weight, _need(w, p + theirs + ".weight").t(), p + theirs + ".weight")
            _copy(ours.bias, _need(w, p + theirs + ".bias"), p + theirs + ".bias")
    _copy(model.norm_f.weight, _need(w, "ln_f.weight"), "ln_f.weight")
    _copy(model.norm_f.bias, _need(w, "ln_f.bias"), "ln_f.bias")
    if not cfg.tie_embeddings:
        head = w.get("lm_head.weight")
        if head is None:
            raise CheckpointError(
                "the GPT-2 has untied embeddings (tie_word_embeddings=false) but no "
                "lm_head.weight; the checkpoint is incomplete"
            )
        _copy(model.head.weight, head, "lm_head.weight")


def position_shift(kind: str) -> int:
    """Where our position ``p`` sits in GPT-2's table: ``wpe[p + shift]``.

    1 for ``gpt``/``aogpt`` (GPT-2 fed ``[eos] + x``, the BOS taking position 0); 0 for
    ``armd``, which has no BOS slot: its content stream is GPT-2 fed ``x`` itself, and
    ``x_0`` keeps position 0 and with it GPT-2's first-token attention sink.
    """
    return 0 if kind == "armd" else 1


def query_targets(wte: Tensor, wpe: Tensor, bos_id: int, seq_len: int) -> Tensor:
    """What ARMD's ``query_mlp(sin(t))`` should output at target position ``t`` (seq_len, d).

    On the left-to-right order the query at slot ``t`` plays GPT-2's state at the previous
    token (GPT-2 fed ``x``: slot ``t - 1`` predicts ``x_t``), which starts from
    ``wte[x_(t-1)] + wpe[t-1]``; ARMD's starts from ``query_mlp(sin(t)) + mean_(s<t)(wte[x_s]
    + wpe[s])``. The token parts agree in expectation, so the target is the position part,
    ``wpe[t-1] - mean(wpe[0..t-1])``; at ``t = 0`` (no context) it is GPT-2's unconditional
    start, ``wte[bos] + wpe[0]``.
    """
    table = wpe[:seq_len]  # (n, d): the armd's pos_emb
    t = torch.arange(1, seq_len, dtype=wpe.dtype)
    prefix = table.cumsum(dim=0)[: seq_len - 1] / t[:, None]  # mean(wpe[0..t-1]) for t >= 1
    rest = table[: seq_len - 1] - prefix
    return torch.cat([(wte[bos_id] + wpe[0])[None], rest], dim=0)


def fit_query_mlp(model: AnyOrderLM, targets: Tensor, seed: int = 0) -> float:
    """Fit ARMD's query MLP to ``targets`` (seq_len, d) at positions ``0..seq_len-1``.

    The hidden layer keeps random features (seeded, scaled for O(1) pre-activations); the
    output layer is their least-squares fit to the targets, in closed form. (Adam steps on
    both layers lowered the residual but not the converted model's losses, measured.)

    Returns:
        The relative residual ``||MLP(sin(t)) - target|| / ||target||`` after the fit.
    """
    from anyorder.layers import sinusoidal

    mlp = model.query_mlp
    n, d = targets.shape
    x = sinusoidal(torch.arange(n), d)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        first = mlp[0]
        first.weight.copy_(torch.randn(first.weight.shape, generator=gen) / d**0.5)
        first.bias.zero_()
        hidden = mlp[1](first(x))  # (n, d/4)
        feats = torch.cat([hidden, torch.ones(n, 1)], dim=1).double()
        sol = torch.linalg.lstsq(feats, targets.double()).solution  # (d/4 + 1, d)
        mlp[2].weight.copy_(sol[:-1].t().float())
        mlp[2].bias.copy_(sol[-1].float())
        return float((mlp(x) - targets).norm() / targets.norm().clamp(min=1e-12))


def convert_gpt2(
    source: str | Path | GPT2Checkpoint,
    kind: str,
    *,
    seq_len: int | None = None,
    l2s: int | None = None,
    target_dim: int = 128,
    bos_id: int | None = None,
    tokenizer: str | None = None,
    seed: int = 0,
) -> Converted:
    """Build a ``gpt``, ``aogpt`` or ``armd`` from a GPT-2 checkpoint.

    Args:
        source: a GPT-2 folder, a hub id, or a :class:`GPT2Checkpoint`.
        kind: ``gpt``, ``aogpt`` or ``armd``.
        seq_len: context length, at most ``n_positions - 1`` (the default).
        l2s: armd: two-stream layers (default ``n_layer // 2``).
        target_dim: aogpt: width of the target-position embedding.
        bos_id: token whose embedding (at position 0) becomes the BOS vector (default: the
            config's ``bos_token_id``, else 50256).
        tokenizer: a tokenizer spec (see :func:`anyorder.data.load_tokenizer`) to ship with
            the model; default: the source folder's own tokenizer files when it has them.
        seed: seeds the new parts' initialisation.

    Returns:
        A :class:`Converted` (model in eval mode, float32, on the CPU).

    Raises:
        CheckpointError: an unreadable or unsupported source.
        ConfigError: a bad kind, ``seq_len`` or ``bos_id``.
    """
    from anyorder.models import build_model

    ckpt = source if isinstance(source, GPT2Checkpoint) else read_gpt2(source)
    cfg = model_config_from_gpt2(ckpt.config, kind, seq_len=seq_len, l2s=l2s, target_dim=target_dim)
    fix = "the id of the GPT-2's end-of-text token"
    bos_id = bos_of(ckpt.config, bos_id, cfg.vocab_size, "GPT-2", default=GPT2_EOS, fix=fix)
    torch.manual_seed(seed)
    model = build_model(cfg)
    load_gpt2_weights(model, ckpt, bos_id)
    info: dict[str, Any] = {
        "converted_from": str(ckpt.folder) if ckpt.folder else None,
        "bos_id": bos_id,
        "position_shift": position_shift(kind),
    }
    if kind == "armd":
        targets = query_targets(
            ckpt.weights["wte.weight"], ckpt.weights["wpe.weight"], bos_id, cfg.seq_len
        )
        info["query_mlp_fit_residual"] = round(fit_query_mlp(model, targets, seed), 6)
    tok = _tokenizer_for(ckpt, tokenizer)
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"tokenizer {tok.name!r} has {tok.vocab_size} ids but the GPT-2 reads "
            f"{cfg.vocab_size}; give the GPT-2's own tokenizer"
        )
    return Converted(model=model.eval(), tokenizer=tok, info=info)


def _tokenizer_for(ckpt: GPT2Checkpoint, spec: str | None) -> Tokenizer | None:
    from anyorder.data import load_tokenizer

    if spec is not None:
        return load_tokenizer(spec)
    folder = ckpt.folder
    if folder is None:
        return None
    names = {p.name for p in folder.iterdir()}
    if {"vocab.json", "merges.txt"} <= names or "tokenizer.json" in names:
        try:
            return load_tokenizer(str(folder.resolve()))
        except AnyorderError:
            return None  # weights without a usable tokenizer: the caller may pass one
    return None


def convert(
    source: str | Path,
    kind: str,
    out: str | Path,
    *,
    dtype: str | None = None,
    **kwargs: Any,
) -> Converted:
    """Convert a GPT-2 checkpoint and write it as an exported folder.

    The folder's layout is :mod:`anyorder.checkpoint.exported`'s.

    Args:
        source: a GPT-2 folder or hub id.
        kind: ``gpt``, ``aogpt`` or ``armd``.
        out: the export folder to write.
        dtype: stored dtype of the weights (default float32).
        **kwargs: passed to :func:`convert_gpt2`.

    Returns:
        The :class:`Converted` model; its ``folder`` is ``out``.
    """
    conv = convert_gpt2(source, kind, **kwargs)
    conv.folder = save_pretrained(
        conv.model,
        out,
        conv.tokenizer,
        weights="converted",
        step=0,
        source=f"converted from GPT-2 {source}",
        dtype=dtype,
        extra=conv.info,
    )
    return conv
