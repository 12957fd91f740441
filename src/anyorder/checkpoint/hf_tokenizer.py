"""``transformers``' files for an export's byte tokenizer: ``tokenizer.json`` and
``tokenizer_config.json`` at the top of the folder, so that ``AutoTokenizer.from_pretrained``
and ``pipeline("text-generation", model=folder)`` read it like any model's.

The ids are :class:`~anyorder.data.ByteTokenizer`'s: byte ``b`` is id ``b``, ``<|endoftext|>``
is EOS (256); decoding skips EOS (``skip_special_tokens``) and replaces bad UTF-8 as
anyorder does.

Design choices:

* A ``tokenizers`` byte-level BPE with no merges: ``tokenizers``' ``ByteLevel`` pre-tokenizer
  turns each byte into one character of GPT-2's byte alphabet, and the vocabulary maps that
  character to the byte's value; no regex split, no prefix space, no normalizer, no
  post-processor (nothing added, nothing changed). The ``ByteLevel`` decoder maps back.
* The file is written as JSON here, not built with ``tokenizers``: an export needs nothing
  installed, and the file is the same on every version.
* The one difference from anyorder's tokenizer: ``transformers`` reads the text
  ``<|endoftext|>`` as EOS (as for GPT-2); anyorder spells it as its 13 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from anyorder.data.tokenizers import EOT

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def byte_alphabet() -> list[str]:
    """The character ``tokenizers``' ``ByteLevel`` pre-tokenizer writes for each byte
    0..255 (GPT-2's table): printable Latin-1 bytes stand for themselves; the other 68 take
    the code points from 256 up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def byte_tokenizer_json(eos_id: int) -> dict:
    """The ``tokenizer.json`` of the byte tokenizer with EOS ``eos_id``."""
    level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    eos = {
        "id": eos_id, "content": EOT, "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": False, "special": True,
    }  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [eos],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {char: b for b, char in enumerate(byte_alphabet())},
            "merges": [],
        },
    }


def write_byte_tokenizer(folder: Path, eos_id: int, max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the byte tokenizer into
    ``folder``; ``max_length`` (the model's context) is ``model_max_length``."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOT,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,  # else " ." would decode as "."
    }
    (folder / TOKENIZER_JSON).write_text(json.dumps(byte_tokenizer_json(eos_id)) + "\n")
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
