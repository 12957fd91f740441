"""Reading a training checkpoint: its config, tokenizer, state and weights; :func:`load_model`.

Design choices:

* Every read verifies the files it reads against the manifest first
  (:func:`anyorder.checkpoint.layout.verify`).
* ``state.pt`` is read with ``torch.load(weights_only=True)``: it holds only tensors and
  plain Python values (the numpy RNG state is stored as a tensor), never pickled objects.
* EMA weights are the default, and never replaced by the raw ones silently: a run that kept
  EMA weights but whose manifest does not list them is an error (``--weights raw`` is the
  explicit choice).
* :func:`load_model` holds the checkpoint while it reads it (:func:`reading`), and when a
  training prunes the latest checkpoint in between, starts again once on the new latest.
  It also reads exported folders (:mod:`anyorder.checkpoint.exported`).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from anyorder.checkpoint.exported import is_exported, load_exported
from anyorder.checkpoint.layout import (
    CONFIG_FILE,
    EMA_FILE,
    MANIFEST,
    MODEL_FILE,
    STATE_FILE,
    TOKENIZER_DIR,
    WEIGHTS,
    read_manifest,
    resolve_checkpoint,
    verify,
)
from anyorder.checkpoint.loaded import Loaded, check_tokenizer_fits
from anyorder.checkpoint.save import reading
from anyorder.checkpoint.weights import header_problem, load_weights, read_header_shapes
from anyorder.config import RunConfig, load_config
from anyorder.errors import AnyorderError, CheckpointError, ConfigError

if TYPE_CHECKING:
    from anyorder.data import Tokenizer


def read_config(ckpt: str | Path) -> RunConfig:
    """The run config stored in a checkpoint (its checksum checked).

    Raises:
        CheckpointError: a missing, altered or invalid ``config.yaml``.
    """
    ckpt = Path(ckpt)
    verify(ckpt, [CONFIG_FILE])
    try:
        return load_config(ckpt / CONFIG_FILE)
    except ConfigError as e:
        if not ckpt.is_dir():
            raise CheckpointError(
                f"checkpoint {ckpt} disappeared while it was read (pruned by a running "
                "training?); give the run folder to use its latest checkpoint"
            ) from None
        raise CheckpointError(
            f"{ckpt / CONFIG_FILE} is not a config this version reads ({e}); use the anyorder "
            "version that wrote it"
        ) from None


def read_tokenizer(ckpt: str | Path) -> Tokenizer:
    """The tokenizer stored in a checkpoint (its checksums checked)."""
    from anyorder.data import load_tokenizer

    ckpt = Path(ckpt)
    verify(ckpt, [TOKENIZER_DIR + "/"])
    try:
        return load_tokenizer(str(ckpt / TOKENIZER_DIR))
    except AnyorderError as e:
        raise CheckpointError(f"the tokenizer in {ckpt} cannot be loaded: {e}") from None


def _looks_exported(path: Path) -> bool:
    """A folder with an export's ``config.json`` and no checkpoints: an export, even when
    its config.json cannot be read."""
    try:
        return (path / "config.json").is_file() and not (path / "checkpoints").exists()
    except OSError:
        return False


def read_state(ckpt: str | Path) -> dict[str, Any]:
    """The training state (``state.pt``) of a checkpoint, for resuming.

    Raises:
        CheckpointError: a checkpoint without training state, or a damaged one.
    """
    ckpt = Path(ckpt)
    manifest = verify(ckpt, [STATE_FILE])
    if STATE_FILE not in manifest["files"]:
        raise CheckpointError(
            f"{ckpt} holds weights only (no {STATE_FILE}); it cannot be resumed, only loaded"
        )
    path = ckpt / STATE_FILE
    state = load_plain(path, f"delete {ckpt} and use an earlier checkpoint")
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} holds a {type(state).__name__}, not a training state; delete {ckpt} and "
            "use an earlier checkpoint"
        )
    missing = [k for k in STATE_KEYS if k not in state]
    step = state.get("step")
    wrong = [
        what
        for what, bad in (
            ("step is not a whole number", not isinstance(step, int) or isinstance(step, bool)),
            ("optimizer is not a dict", not isinstance(state.get("optimizer"), dict)),
            ("rng is not a list", not isinstance(state.get("rng"), (list, tuple))),
        )
        if bad
    ]
    if missing or wrong:
        problem = f"no {', '.join(missing)}" if missing else "; ".join(wrong)
        raise CheckpointError(
            f"{path} is damaged ({problem}); delete {ckpt} and use an earlier checkpoint"
        )
    return state


STATE_KEYS = ("optimizer", "step", "sampler", "order_generator", "rng")
"""What every ``state.pt`` holds (:func:`anyorder.training.state.restore_state` reads them)."""


def refuse_packed_records(file: Path | BinaryIO, where: str, fix: str) -> None:
    """Refuse a ``torch.save`` zip archive holding a compressed record, before ``torch``
    reads it: ``torch.save`` compresses none, and ``torch.load`` unpacks a record whole into
    memory (a file of a megabyte unpacked a gigabyte). Not a zip archive (the legacy format,
    or a damaged file): left to ``torch.load``. A file object is read from its start and
    left there.

    Raises:
        CheckpointError: the first compressed record, with its unpacked size.
    """
    try:
        with zipfile.ZipFile(file) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        infos = []
    finally:
        if not isinstance(file, Path):
            file.seek(0)
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"{where} cannot be read as a torch checkpoint (its record "
                f"{info.filename[:80]!r} is compressed, {info.file_size:,} bytes unpacked, and "
                f"torch.save compresses none); the file is damaged or not a .pt: {fix}"
            )


def load_plain(path: Path, fix: str) -> Any:
    """``torch.load(weights_only=True)`` (memory-mapped when the file allows it), with one
    :class:`CheckpointError` for every way the file can be wrong. Nothing in the file runs:
    a pickle that would call code or build objects is refused as "holds Python objects".

    Args:
        path: the ``.pt`` file.
        fix: what to do, said at the end of a message about a damaged file.
    """
    where = repr(str(path))
    refuse_packed_records(path, where, fix)
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            # torch.save's legacy (pre-zip) format cannot be memory-mapped: read it whole
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        text = str(e)
        if "Weights only load failed" in text and ("global" in text.lower() or "reduce" in text):
            raise CheckpointError(
                f"{where} holds Python objects besides tensors and plain values; anyorder "
                "reads checkpoints with torch.load(weights_only=True) and never unpickles code: "
                "re-save it as plain tensors and dicts"
            ) from None
        first = " ".join(text.split()).split(". ")[0].rstrip(".")  # torch writes paragraphs
        if "Weights only load failed" in text:
            why = "WeightsUnpickler error"
        else:
            why = f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__
        raise CheckpointError(
            f"{where} cannot be read as a torch checkpoint ({why}); the file is damaged, "
            f"incomplete or not a .pt: {fix}"
        ) from None


def weights_file(ckpt: str | Path, weights: str = "ema") -> Path:
    """The weights file to read: ``ema.safetensors`` if asked for and present, else raw.

    Raises:
        ConfigError: ``weights`` is neither ``ema`` nor ``raw``.
    """
    if weights not in WEIGHTS:
        raise ConfigError(f"weights={weights!r} is not a choice; use ema or raw")
    manifest = read_manifest(ckpt)
    if weights == "ema" and EMA_FILE in manifest["files"]:
        return Path(ckpt) / EMA_FILE
    if weights == "ema" and (Path(ckpt) / EMA_FILE).exists():
        # The run kept EMA weights but the manifest does not vouch for them: never fall back
        # to the raw weights silently (--weights raw is the explicit choice).
        raise CheckpointError(
            f"{Path(ckpt) / MANIFEST} does not list {EMA_FILE}, which is there; the manifest "
            f"is damaged: delete {ckpt} and use an earlier checkpoint, or pass --weights raw"
        )
    return Path(ckpt) / MODEL_FILE


def load_model(
    path: str | Path, *, weights: str = "ema", device: str | torch.device = "cpu"
) -> Loaded:
    """Load a trained model from a run folder (its latest checkpoint) or a checkpoint folder.

    Args:
        path: a run folder or ``RUN/checkpoints/step_*`` (or an exported folder, read by
            :func:`~anyorder.checkpoint.exported.load_exported`; ``weights`` does not apply to it).
        weights: ``ema`` (the EMA weights; the raw ones when the run had no EMA) or ``raw``.
        device: where to put the model.

    Returns:
        A :class:`Loaded` with the model in eval mode.

    Raises:
        CheckpointError: a missing path, a folder without checkpoints, or a damaged file.
    """
    if is_exported(path) or _looks_exported(Path(path)):
        # an exported model (anyorder export/convert): one set of weights; a damaged
        # config.json is named by load_exported, not taken for a folder without checkpoints
        return load_exported(path, device=device)
    for attempt in (1, 2):  # a training may prune the latest checkpoint while it is read
        ckpt = resolve_checkpoint(path)
        try:
            with reading(ckpt):
                return _load_checkpoint(ckpt, weights, device)
        except CheckpointError:
            if attempt == 2 or ckpt.is_dir() or ckpt == Path(path).expanduser():
                raise
    raise AssertionError("unreachable")


def _adapted(ckpt: Path, config: RunConfig, file: Path) -> Any:
    """A LoRA checkpoint's model: its base (an export or a run, as training read it) with
    its adapters merged (:mod:`anyorder.checkpoint.adapters`)."""
    from anyorder.checkpoint.adapters import adapted_model, base_of

    path = base_of(ckpt)["path"]
    try:
        base = load_model(path).model
    except CheckpointError as e:
        raise CheckpointError(
            f"the base of the LoRA adapters in {ckpt} cannot be loaded ({e}); restore "
            f"{path} (train.init_from={config.train.init_from!r})"
        ) from None
    return adapted_model(base, path, config, ckpt, file)


def _load_checkpoint(ckpt: Path, weights: str, device: str | torch.device) -> Loaded:
    from anyorder.models import build_model

    manifest = read_manifest(ckpt)
    config = read_config(ckpt)
    tokenizer = read_tokenizer(ckpt)
    check_tokenizer_fits(tokenizer, config.model.vocab_size, str(ckpt))
    file = weights_file(ckpt, weights)
    if weights == "ema" and file.name != EMA_FILE and config.train.ema > 0:
        raise CheckpointError(
            f"{ckpt / MANIFEST} lists no {EMA_FILE} but the run kept EMA weights "
            f"(train.ema={config.train.ema}); delete {ckpt} and use an earlier checkpoint, or "
            "pass --weights raw"
        )
    verify(ckpt, [file.name])
    if config.train.lora.r > 0:  # adapters: put on their base and merged
        model = _adapted(ckpt, config, file)
    else:
        shapes = read_header_shapes(file, f"; delete {ckpt} and use an earlier checkpoint")
        problem = header_problem(config.model, shapes)
        if problem:
            raise CheckpointError(
                f"weights in {file} do not fit the model its config.yaml describes "
                f"({problem}); the checkpoint was altered or written by another version"
            )
        model = build_model(config.model, init=False)  # every weight is loaded next
        load_weights(model, file)
    model.to(device).eval()
    return Loaded(
        model=model,
        tokenizer=tokenizer,
        config=config,
        step=int(manifest["step"]),
        path=ckpt,
        weights="ema" if file.name == EMA_FILE else "raw",
    )
