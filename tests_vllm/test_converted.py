"""Llama and Qwen models converted into anyorder exports (``anyorder convert``) serve through
vLLM exactly as anyorder decodes them; a prompt that starts with the source tokenizer's BOS
(as vLLM's tokenizer adds it) is the same request as one without."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from anyorder.checkpoint.exported import load_exported
from anyorder.cli import main
from anyorder.vllm import ORDER_KEY

from conftest import anyorder_greedy, engine_logprobs, start, stop

BOS = 1


def convert(tmp_path, family: str, kind: str):
    import transformers as tr

    classes = {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM),
               "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM)}  # fmt: skip
    config_cls, model_cls = classes[family]
    torch.manual_seed(3)
    source = model_cls(config_cls(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
        bos_token_id=BOS, eos_token_id=2, tie_word_embeddings=False,
    )).eval()  # fmt: skip
    with torch.no_grad():  # sharpened: positions show in the logits
        for name, p in source.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    src, out = tmp_path / "source", tmp_path / "export"
    source.save_pretrained(str(src))
    assert main(["convert", str(src), "--to", kind, "--out", str(out), "--seq-len", "24"]) in (
        0,
        None,
    )
    return out, load_exported(out).model.eval()


@pytest.mark.parametrize("family, kind", [("llama", "aogpt"), ("qwen2", "gpt")])
def test_a_converted_model_serves_exactly(tmp_path, family, kind):
    folder, model = convert(tmp_path, family, kind)
    llm = start(folder, skip_tokenizer_init=True)  # token prompts; the source has no tokenizer
    try:
        cases = [([10, 20, 30], list(range(11)))]
        if kind == "aogpt":
            cases += [([10, 20, 30], [4, 0, 7, 1, 2, 3, 5, 6, 8, 9, 10])]
        for prompt, order in cases:
            extra = None if order == sorted(order) else {ORDER_KEY: order}
            params = SamplingParams(
                max_tokens=len(order) - len(prompt), temperature=0.0, logprobs=0,
                detokenize=False, ignore_eos=True, extra_args=extra,
            )  # fmt: skip
            plain, with_bos = llm.generate(
                [
                    TokensPrompt(prompt_token_ids=prompt),
                    TokensPrompt(prompt_token_ids=[BOS, *prompt]),
                ],
                params,
            )
            want, want_lp = anyorder_greedy(model, prompt, order)
            for out in (plain, with_bos):
                assert list(out.outputs[0].token_ids) == want
                got_lp = engine_logprobs(out.outputs[0])
                assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 1e-4
    finally:
        stop(llm)
