"""Instruction tuning works: a tiny model fine-tuned with ``order.condition=prompt`` on the
synthetic task answers held-out prompts exactly, far above an untrained one; and the
experiment's batched decoding is ``Model.chat``'s."""

from __future__ import annotations

import json

import pytest
import torch

import anyorder
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer
from anyorder.data.instruct import make_examples
from anyorder.experiments.instruct import ANSWER, DECODERS, decode_answers, score

from conftest import tiny_model


def test_batched_answers_are_model_chat(tmp_path) -> None:
    """decode_answers decodes a prompt's group with the seed ``seed * 1000 + its length``:
    for a group of one, that is ``Model.chat`` with that seed."""
    model = tiny_model("aogpt", seed=2, vocab_size=257, seq_len=64, n_layer=1, d_model=32)
    api = anyorder.load(save_pretrained(model, tmp_path / "m", ByteTokenizer()))
    prompts = ["add: 1+2", "sort: c a b"]  # rendered lengths differ: one group each
    lengths = [len(p) + 24 for p in prompts]  # <|user|>\n, EOS, <|assistant|>\n
    for name in ("random, 1 token/pass", "speculative K=4", "Lemma 1, 4 tokens/pass"):
        got, ppt = decode_answers(api.model, api.tokenizer, prompts, 3, **DECODERS[name])
        want = [
            api.chat(p, seed=3000 + k, max_new_tokens=ANSWER, **DECODERS[name])
            for p, k in zip(prompts, lengths)
        ]
        assert got == want, name
        assert (ppt == 1.0) == (name.startswith("random")), (name, ppt)


def _train(tmp_path, kind: str, steps: int, seed: int = 0):
    from anyorder.config import load_config
    from anyorder.training.loop import train

    data = tmp_path / "train.jsonl"
    records = make_examples(3000, seed=seed, tasks=("reverse",))
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = [
        f"model.kind={kind}", "model.n_layer=2", "model.n_head=4", "model.d_model=64",
        "model.seq_len=64", "model.target_dim=32", f"data.source={data}", "data.tokenizer=bytes",
        f"data.cache_dir={tmp_path / 'cache'}", "order.condition=prompt",
        f"train.out_dir={tmp_path / 'run'}", f"train.steps={steps}", "train.batch_size=16",
        "train.lr=3e-3", f"train.warmup_steps={steps // 10}", "train.ema=0",
        f"train.eval_every={steps}", "train.eval_batches=1", f"train.ckpt_every={steps}",
        "train.log_every=1000", "train.device=cpu", "train.dtype=fp32", f"train.seed={seed}",
    ]  # fmt: skip
    torch.manual_seed(seed)
    train(load_config(None, overrides), resume=False, progress=False)
    return anyorder.load(tmp_path / "run", weights="raw")


@pytest.mark.slow  # 137 s at a load of 17 (400 steps); fast variants: the two tests beside it
def test_fine_tuning_beats_an_untrained_model_by_far(tmp_path) -> None:
    from anyorder.models import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a busy machine ran 20x slower (spinning)
    try:
        api = _train(tmp_path, "gpt", 400)
    finally:
        torch.set_num_threads(threads)
    held = make_examples(64, seed=0, split="heldout", tasks=("reverse",))
    trained = score(api.model, api.tokenizer, held, 0, order="l2r")["accuracy"]
    torch.manual_seed(0)
    fresh = build_model(api.model.cfg).eval()
    untrained = score(fresh, api.tokenizer, held, 0, order="l2r")["accuracy"]
    assert untrained == 0.0
    assert trained >= 0.5, trained


def test_instruct_runs_at_cpu_scale_only(tmp_path) -> None:
    from anyorder.errors import ConfigError
    from anyorder.experiments import Context, run_experiment

    ctx = Context(out=tmp_path / "i", runs=tmp_path / "r", scale="paper", print_only=True)
    with pytest.raises(ConfigError, match=r"^experiment instruct runs at --scale cpu only"):
        run_experiment("instruct", ctx)
