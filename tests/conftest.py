"""Shared fixtures: tiny real models, seeded generators, the path of ../shared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from anyorder import build_model, preset
from anyorder.models.base import AnyOrderLM

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
GPT2_TOKENIZER_DIR = SHARED / "tokenizers" / "gpt2"

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def tiny_model(kind: str, seed: int = 0, **overrides) -> AnyOrderLM:
    """A small real model in fp32 (2 layers, width 64 unless overridden)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=11, seq_len=16, n_layer=2, n_head=4, d_model=64)
    cfg.update(overrides)
    return build_model(preset("tiny", kind=kind, **cfg)).eval()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
