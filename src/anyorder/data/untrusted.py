"""Refusing code from downloaded folders: a tokenizer or model folder is untrusted input.

``transformers`` imports Python from a folder when its ``tokenizer_config.json`` or
``config.json`` has an ``auto_map`` (with ``trust_remote_code`` unset it asks on stdin first,
"Do you wish to run the custom code? [y/N]", in the middle of a command). anyorder never runs
a model folder's code, nor asks.

Design choices:

* Every ``from_pretrained`` anyorder calls passes ``trust_remote_code=False``; this module
  refuses, in one line naming the file and the key, what would need code, before
  ``transformers`` reads the folder: an ``auto_map``, or a ``tokenizer_class`` that is not a
  tokenizer class ``transformers`` itself ships. A refusal beats the silent fallback to a
  generic class that ``trust_remote_code=False`` gives, which may tokenize differently.
* A file among those that cannot be read as JSON is refused too (fail closed): the check must
  not skip what ``transformers`` might still read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from anyorder.data.sources import _first_line
from anyorder.errors import DataError

_CODE_FILES = ("tokenizer_config.json", "config.json")
"""The files whose keys make ``transformers`` import Python from the folder."""


def _shipped_tokenizer_class(name: Any) -> bool:
    """Whether ``name`` is a tokenizer class that ``transformers`` itself ships."""
    if not isinstance(name, str):
        return False
    try:
        import transformers
    except ImportError:  # nothing can load it then; the loader says so
        return True
    try:
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        cls = tokenizer_class_from_name(name)
    except Exception:
        cls = getattr(transformers, name, None) if name.isidentifier() else None
    base = getattr(transformers, "PreTrainedTokenizerBase", None)
    return (
        isinstance(cls, type)
        and (base is None or issubclass(cls, base))
        and cls.__module__.startswith("transformers.")
    )


def refuse_custom_code(folder: str | Path) -> None:
    """Refuse a folder whose ``tokenizer_config.json`` or ``config.json`` asks ``transformers``
    to run Python code of its own: an ``auto_map``, or a ``tokenizer_class`` that is not one of
    transformers' classes. A model folder from the hub is untrusted input; anyorder never runs
    code from it. A file that cannot be read as JSON is refused too (fail closed).

    Raises:
        DataError: one line naming the file and the key.
    """
    for name in _CODE_FILES:
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as e:
            raise DataError(
                f"{path} is not readable JSON ({_first_line(e)[:120]}); fix or remove it"
            ) from None
        if not isinstance(data, dict):
            continue
        if "auto_map" in data:
            entry = json.dumps(data["auto_map"])[:120]
            raise DataError(
                f"{path} has an auto_map ({entry}), which asks to run "
                "the folder's own Python code, and anyorder never runs a model folder's code; "
                "use one that needs none (without auto_map)"
            )
        cls = data.get("tokenizer_class")
        if cls is not None and not _shipped_tokenizer_class(cls):
            raise DataError(
                f"{path} names tokenizer_class {str(cls)[:80]!r}, which "
                "is not a class transformers ships, and anyorder never runs a model folder's "
                "code: set it to one of transformers' tokenizers (e.g. PreTrainedTokenizerFast)"
            )


def hub_code_refusal(spec: str) -> DataError:
    """The error for a hub id whose tokenizer asks for code of its own."""
    return DataError(
        f"tokenizer {spec!r} asks to run Python code from the hub (an auto_map), and anyorder "
        "never runs a model's code; pick a tokenizer transformers ships"
    )


def asks_for_code(e: BaseException) -> bool:
    """Whether ``transformers`` refused to load something because it needs remote code."""
    return isinstance(e, ValueError) and "trust_remote_code" in str(e)


def refuse_loaded_auto_map(tok: Any, spec: str) -> None:
    """A hub tokenizer was loaded with remote code refused; refuse it too if it asked for some
    (transformers then falls back to one of its classes, which may not tokenize the same)."""
    if (getattr(tok, "init_kwargs", None) or {}).get("auto_map"):
        raise hub_code_refusal(spec)
