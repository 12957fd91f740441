"""Exported folders load through ``transformers``' Auto classes and give anyorder's logits."""

from __future__ import annotations

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import MODELING_NAME, save_pretrained
from anyorder.data import ByteTokenizer

from conftest import tiny_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["gpt", "aogpt", "armd", "mdm"])
def test_automodel_with_remote_code_matches_anyorder_load(tmp_path, kind: str) -> None:
    folder = save_pretrained(
        tiny_model(kind, seed=5, vocab_size=257, seq_len=16), tmp_path / kind, ByteTokenizer()
    )
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    assert config.model_type == "anyorder" and config.to_model_config().kind == kind
    hf = transformers.AutoModel.from_pretrained(folder, trust_remote_code=True)
    assert isinstance(hf, transformers.PreTrainedModel) and not hf.training
    ours = anyorder.load(folder).model
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 257, (2, 16), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)
        if kind != "gpt":
            order = torch.stack([torch.randperm(16, generator=g) for _ in range(2)])
            torch.testing.assert_close(
                hf(input_ids=x, order=order).logits, ours(x, order), atol=1e-5, rtol=0
            )
    # the modeling file imports the package's classes; it holds no model code of its own
    code = (folder / MODELING_NAME).read_text()
    assert "from anyorder.interop.transformers_model import" in code and "class " not in code


def test_importing_the_module_registers_the_classes(tmp_path) -> None:
    from anyorder.interop.transformers_model import AnyorderModel

    folder = save_pretrained(tiny_model("aogpt", vocab_size=257), tmp_path / "m", ByteTokenizer())
    (folder / MODELING_NAME).unlink()  # no remote code to run
    model = transformers.AutoModel.from_pretrained(folder)
    assert type(model) is AnyorderModel
