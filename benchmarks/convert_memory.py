"""Peak memory of ``anyorder convert`` on a checkpoint of a real family's shape (issue 33).

Writes a random checkpoint of Llama-3.2-1B's shape (vocabulary 128256, 16 layers of 2048,
32 query and 8 key/value heads, SwiGLU 8192, tied head, Llama 3 RoPE scaling) in bf16,
sharded, tensor by tensor (the writer never holds the model either); converts it in a child
process; reports the child's peak resident set (``ru_maxrss`` of the children) against the
checkpoint's bytes, beside the peak of a child that only imports what the converter imports
(the interpreter, torch, safetensors: paid whatever the model). Target: at most 1.3x the
checkpoint, and the export in bf16 (no fp32 copy). The big files are deleted afterwards.

Then, unless ``--no-train``, ``anyorder train --dry-run`` with ``train.init_from`` on a
converted model of the same width with ``--train-layers`` layers (a full 1B model's AdamW
step needs about 20 GB: params, gradients and two moments in fp32).

    .venv/bin/python benchmarks/convert_memory.py                  # about 2.5 GB on disk
    .venv/bin/python benchmarks/convert_memory.py --layers 2 --no-train   # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_1B = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    torch_dtype="bfloat16",
)
SHARD_BYTES = 1 << 30


def shapes(config: dict) -> list[tuple[str, list[int]]]:
    """The tensors of a Llama checkpoint of ``config`` (tied: no lm_head)."""
    d, f = config["hidden_size"], config["intermediate_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", [config["vocab_size"], d])]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", [d]),
            (p + "self_attn.q_proj.weight", [q, d]),
            (p + "self_attn.k_proj.weight", [kv, d]),
            (p + "self_attn.v_proj.weight", [kv, d]),
            (p + "self_attn.o_proj.weight", [d, q]),
            (p + "post_attention_layernorm.weight", [d]),
            (p + "mlp.gate_proj.weight", [f, d]),
            (p + "mlp.up_proj.weight", [f, d]),
            (p + "mlp.down_proj.weight", [d, f]),
        ]
    return out + [("model.norm.weight", [d])]


def write_source(folder: Path, config: dict) -> int:
    """A random bf16 checkpoint, sharded at 1 GiB, written tensor by tensor; its bytes."""
    import torch

    from anyorder.interop.streaming import write_safetensors

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    shards: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in shapes(config):
        n = torch.Size(shape).numel() * 2
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    gen = torch.Generator().manual_seed(0)

    def produce(name: str) -> torch.Tensor:
        shape = dict(shapes(config))[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        out = torch.empty(shape, dtype=torch.bfloat16)
        for i in range(0, shape[0], 4096):  # no full-size fp32 temporary
            rows = out[i : i + 4096]
            rows.copy_(torch.randn(rows.shape, generator=gen) * 0.02)
        return out

    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        specs = [(n, s, torch.bfloat16) for n, s in shard]
        write_safetensors(folder / fname, specs, produce, {"format": "pt"})
        weight_map.update({n: fname for n, _ in shard})
        total += (folder / fname).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def child_peak_mb(argv: list[str]) -> tuple[float, float, str]:
    """Run ``argv`` in a fresh child; (its peak RSS in MiB, seconds, its stdout+stderr).

    ``ru_maxrss`` of RUSAGE_CHILDREN is the largest of the waited-for children, so every
    measurement runs in a grandchild of its own (a fresh runner per call)."""
    runner = (
        "import resource, subprocess, sys, json, time; t = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(json.dumps([resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
        "time.perf_counter() - t, p.returncode, p.stdout + p.stderr]))"
    )
    out = subprocess.run([sys.executable, "-c", runner, *argv], capture_output=True, text=True)
    kib, seconds, rc, text = json.loads(out.stdout)
    if rc != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({rc}):\n{text}")
    return kib / 1024, seconds, text


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16, help="layers (16: Llama-3.2-1B)")
    ap.add_argument("--kind", default="gpt", choices=("gpt", "aogpt", "armd"))
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp)")
    ap.add_argument("--no-train", action="store_true", help="skip the init_from dry run")
    ap.add_argument("--train-layers", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/convert_memory.json"))
    args = ap.parse_args()
    config = {**LLAMA_1B, "num_hidden_layers": args.layers}
    root = Path(tempfile.mkdtemp(prefix="convert-memory-", dir=args.dir))
    cli = [sys.executable, "-m", "anyorder.cli"]
    try:
        t = time.perf_counter()
        ckpt = write_source(root / "src", config)
        print(f"wrote a random {args.layers}-layer Llama-3.2-1B-shaped bf16 checkpoint: "
              f"{ckpt / 2**30:.2f} GiB in {time.perf_counter() - t:.0f} s")  # fmt: skip
        imports = "import torch, safetensors, anyorder.interop.streaming, anyorder.cli.main"
        base_mb, _, _ = child_peak_mb([sys.executable, "-c", imports])
        argv = [*cli, "convert", str(root / "src"), "--to", args.kind, "--out", str(root / "out")]
        peak_mb, seconds, _ = child_peak_mb(argv)
        exported = json.loads((root / "out" / "config.json").read_text())
        out_bytes = (root / "out" / "model.safetensors").stat().st_size
        result = {
            "cpu": cpu_name(),
            "layers": args.layers,
            "kind": args.kind,
            "checkpoint_bytes": ckpt,
            "export_bytes": out_bytes,
            "export_dtype": exported["torch_dtype"],
            "peak_rss_mb": round(peak_mb, 1),
            "import_only_peak_rss_mb": round(base_mb, 1),
            "peak_over_checkpoint": round(peak_mb * 2**20 / ckpt, 3),
            "seconds": round(seconds, 1),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        }
        print(f"convert --to {args.kind}: peak RSS {peak_mb:.0f} MiB = "
              f"{result['peak_over_checkpoint']:.2f}x the checkpoint ({ckpt / 2**20:.0f} MiB; "
              f"imports alone {base_mb:.0f} MiB), export {exported['torch_dtype']}, "
              f"{seconds:.0f} s")  # fmt: skip
        shutil.rmtree(root / "src")
        shutil.rmtree(root / "out")
        if not args.no_train:
            result["train_dry_run"] = dry_run(root, cli, args.train_layers)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tokenizer_of_size(texts: list[str], size: int):
    """A byte-level BPE with ``<|endoftext|>``, padded with reserved tokens to ``size`` ids
    (the random checkpoint's vocabulary: a run's tokenizer must match it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    n = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(size - n)])
    return tok


def dry_run(root: Path, cli: list[str], layers: int) -> dict:
    """``anyorder train --dry-run`` from a converted model of the 1B width, ``layers`` deep."""
    from pydoc_data.topics import topics

    config = {**LLAMA_1B, "num_hidden_layers": layers}
    write_source(root / "small", config)
    texts = [topics[k] for k in sorted(topics)[:20]]
    tokenizer_of_size(texts, config["vocab_size"]).save(str(root / "small" / "tokenizer.json"))
    out = root / "small-gpt"
    subprocess.run(
        [*cli, "convert", str(root / "small"), "--to", "aogpt", "--out", str(out),
         "--seq-len", "128"], check=True, capture_output=True,
    )  # fmt: skip
    text = root / "text"
    text.mkdir()
    for i, body in enumerate(texts):
        (text / f"{i}.txt").write_text(body)
    (root / "run.yaml").write_text(
        f"data: {{source: {text}, tokenizer: {out / 'tokenizer'}, cache_dir: {root / 'cache'}}}\n"
        f"train: {{init_from: {out}, out_dir: {root / 'run'}, batch_size: 2, eval_every: 0}}\n"
    )
    argv = [*cli, "train", str(root / "run.yaml"), "--dry-run", "--no-progress"]
    peak_mb, seconds, log = child_peak_mb(argv)
    print(f"train --dry-run from the converted {layers}-layer aogpt: one step, peak RSS "
          f"{peak_mb:.0f} MiB, {seconds:.0f} s")  # fmt: skip
    return {"layers": layers, "peak_rss_mb": round(peak_mb, 1), "seconds": round(seconds, 1),
            "log_tail": log.strip().splitlines()[-3:]}  # fmt: skip


if __name__ == "__main__":
    main()
