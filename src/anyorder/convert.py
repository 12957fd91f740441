"""Moved to anyorder.interop.convert; kept until the layout merge."""

from anyorder.interop.convert import (
    CONVERTIBLE,
    GPT2_EOS,
    TANH_GELUS,
    Converted,
    GPT2Checkpoint,
    convert,
    convert_gpt2,
    fit_query_mlp,
    load_gpt2_weights,
    model_config_from_gpt2,
    position_shift,
    query_targets,
    read_gpt2,
)

__all__ = [
    "CONVERTIBLE",
    "GPT2_EOS",
    "TANH_GELUS",
    "Converted",
    "GPT2Checkpoint",
    "convert",
    "convert_gpt2",
    "fit_query_mlp",
    "load_gpt2_weights",
    "model_config_from_gpt2",
    "position_shift",
    "query_targets",
    "read_gpt2",
]
