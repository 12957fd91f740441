"""Moved to anyorder.interop.hub and anyorder.checkpoint; kept until the layout merge."""

from anyorder.checkpoint.exported import (
    CARD_NAME,
    CONFIG_NAME,
    FORMAT_VERSION,
    MODEL_TYPE,
    RUN_CONFIG_NAME,
    TOKENIZER_DIR,
    WEIGHTS_NAME,
    is_exported,
    load_state,
    model_config_of,
    read_export_config,
)
from anyorder.checkpoint.exporting import WEIGHT_LABELS, export, save_pretrained
from anyorder.interop.hub import (
    architecture_diff,
    from_pretrained,
    init_model_config,
    init_weights_from,
    load_any,
    push_to_hub,
    resolve_folder,
)

__all__ = [
    "CARD_NAME",
    "CONFIG_NAME",
    "FORMAT_VERSION",
    "MODEL_TYPE",
    "RUN_CONFIG_NAME",
    "TOKENIZER_DIR",
    "WEIGHTS_NAME",
    "WEIGHT_LABELS",
    "architecture_diff",
    "export",
    "from_pretrained",
    "init_model_config",
    "init_weights_from",
    "is_exported",
    "load_any",
    "load_state",
    "model_config_of",
    "push_to_hub",
    "read_export_config",
    "resolve_folder",
    "save_pretrained",
]
