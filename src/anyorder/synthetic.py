"""Moved to :mod:`anyorder.data.synthetic`; kept until the layout merge."""

from anyorder.data.synthetic import *  # noqa: F403
from anyorder.data.synthetic import (  # noqa: F401 - the names code and tests use
    ALPHABET,
    DOC_BYTES,
    DOCUMENTS,
    ORDER,
    SEED,
    SUCCESSORS,
    VERSION,
    Chain,
    chain,
    describe,
    documents,
    entropy_rate_bits,
    floor_bits_per_byte,
    start_entropy_bits,
    unigram_bits,
)
