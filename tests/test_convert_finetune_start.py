"""Fine-tuning a converted model starts where the source is (issue 33, item 5).

A tiny Qwen3 over the byte vocabulary (BOS = EOS = 256), built by ``transformers``, is
converted with ``anyorder convert --tokenizer bytes`` (the source folder has no tokenizer);
the validation ``anyorder train`` runs (:func:`anyorder.training.validation.validate`) then
gives the converted aogpt's left-to-right NLL on packed byte blocks ``x``: it must equal the
source's cross-entropy on ``[bos] + x``, computed here with ``transformers``' forward. The
full experiment (pretraining, fine-tuning against from scratch) is
benchmarks/finetune_converted.py; its figures are in docs/results.md.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
import transformers as tr  # noqa: E402

from anyorder.checkpoint.exported import load_exported  # noqa: E402
from anyorder.cli import main  # noqa: E402
from anyorder.config import (
    DataConfig,  # noqa: E402
    load_config,  # noqa: E402
)
from anyorder.data import iter_eval_blocks, prepare  # noqa: E402
from anyorder.training.validation import validate  # noqa: E402

BOS = 256
TEXT = "def f(x):\n    return x * 2  # the quick brown fox jumps over the lazy dog\n"


def source(path):
    torch.manual_seed(0)
    config = tr.Qwen3Config(
        vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=24, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=BOS,
    )  # fmt: skip
    hf = tr.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # QK-norm and RMSNorm weights off their init of ones
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # sharp attention: the BOS's position shows in the loss
    hf.save_pretrained(str(path))
    return hf


def test_converted_aogpt_validates_at_the_sources_left_to_right_loss(tmp_path):
    hf = source(tmp_path / "src")
    out = tmp_path / "aogpt"
    argv = ["convert", str(tmp_path / "src"), "--to", "aogpt", "--out", str(out)]
    assert main([*argv, "--tokenizer", "bytes", "--seq-len", "16"]) == 0
    loaded = load_exported(out)
    assert loaded.tokenizer.name == "bytes" and loaded.tokenizer.eos_id == BOS
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"{i}.txt").write_text(f"{i}: {TEXT * (1 + i % 3)}")
    data = prepare(
        DataConfig(source=str(corpus), val_fraction=0.3, cache_dir=str(tmp_path / "cache")),
        16,
        progress=False,
    )
    cfg = load_config(None, ["model.kind=aogpt"])  # validation reads the kind and the condition
    got = validate(loaded.model, data, cfg, torch.device("cpu"), batches=2, batch_size=4)
    xs = torch.cat(list(iter_eval_blocks(data, "val", 8, batch_size=4)))
    assert got["val/blocks"] == len(xs) == 8
    inp = torch.cat([torch.full((len(xs), 1), BOS), xs], dim=1)
    with torch.no_grad():
        logits = hf(inp).logits[:, :-1]
    ref = F.cross_entropy(logits.flatten(0, 1), xs.flatten()).item()
    assert abs(got["val/l2r_nll"] - ref) < 1e-5
