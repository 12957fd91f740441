"""Moved to anyorder.interop.reference; kept until the layout merge."""

from anyorder.interop.reference import (
    FORMATS,
    GPT2_VOCAB,
    HF_PREFIX,
    VARIANTS,
    ReferenceCheckpoint,
    convert_ref,
    convert_reference,
    detect_format,
    map_state,
    model_config_from_reference,
    parameter_order,
    read_reference,
    resolve_source,
)
from anyorder.interop.reference_names import our_name, their_name

__all__ = [
    "FORMATS",
    "GPT2_VOCAB",
    "HF_PREFIX",
    "VARIANTS",
    "ReferenceCheckpoint",
    "convert_ref",
    "convert_reference",
    "detect_format",
    "map_state",
    "model_config_from_reference",
    "our_name",
    "parameter_order",
    "read_reference",
    "resolve_source",
    "their_name",
]
