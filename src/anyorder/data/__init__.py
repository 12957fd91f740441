"""Data: text sources, tokenizers, packing into fixed-length token blocks, the shard cache.

From the bottom up (each module imports only those above it, and only the core below):

* :mod:`~anyorder.data.synthetic`: ``builtin:synthetic``, a corpus of known entropy;
* :mod:`~anyorder.data.sources`: documents of local files, hub datasets and the builtins;
* :mod:`~anyorder.data.untrusted`: refusing code from downloaded folders;
* :mod:`~anyorder.data.tokenizers`: bytes, BPE and ``transformers`` tokenizers;
* :mod:`~anyorder.data.chat`: conversational records and chat templates;
* :mod:`~anyorder.data.shards`: a prepared folder (:class:`TokenData`), opened and verified;
* :mod:`~anyorder.data.split`: packing documents into blocks, the train/validation split;
* :mod:`~anyorder.data.chat_pack`: one block per conversational example, prompt lengths;
* :mod:`~anyorder.data.build`: :func:`prepare`, the cache key, atomic cache folders;
* :mod:`~anyorder.data.blocks`: the seeded :class:`BlockSampler` and evaluation batches;
* :mod:`~anyorder.data.stats`: the unigram baseline and the ``anyorder data`` command.

``transformers``, ``datasets`` and ``torch`` are imported only where they are needed, so
importing this package is cheap.
"""

from anyorder.data.blocks import BlockSampler, iter_eval_blocks
from anyorder.data.build import BPE_TRAIN_CHARS, DATA_FORMATS, cache_key, data_format, prepare
from anyorder.data.chat import (
    Example,
    encode_example,
    render_messages,
    render_prompt,
)
from anyorder.data.shards import (
    FORMAT_VERSION,
    SPLITS,
    STAMP,
    TokenData,
    data_manifest_problem,
    sha256_file,
    token_dtype,
)
from anyorder.data.sources import (
    TEXT_SUFFIXES,
    iter_documents,
    resolve_files,
    source_bytes,
    stdlib_files,
)
from anyorder.data.split import ESTIMATE_OVER_S, is_val_document
from anyorder.data.stats import data_main, unigram_bits_per_byte, unigram_entropy
from anyorder.data.tokenizers import (
    EOT,
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "BPE_TRAIN_CHARS",
    "DATA_FORMATS",
    "EOT",
    "ESTIMATE_OVER_S",
    "FORMAT_VERSION",
    "SPLITS",
    "STAMP",
    "TEXT_SUFFIXES",
    "BPETokenizer",
    "BlockSampler",
    "ByteTokenizer",
    "Example",
    "HFTokenizer",
    "TokenData",
    "Tokenizer",
    "cache_key",
    "data_format",
    "data_main",
    "data_manifest_problem",
    "encode_example",
    "is_val_document",
    "iter_documents",
    "iter_eval_blocks",
    "load_tokenizer",
    "prepare",
    "render_messages",
    "render_prompt",
    "resolve_files",
    "sha256_file",
    "source_bytes",
    "stdlib_files",
    "token_dtype",
    "unigram_bits_per_byte",
    "unigram_entropy",
]
