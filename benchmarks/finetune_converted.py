"""Fine-tuning a converted model against the same shape from scratch (issue 33, item 5).

On the CPU, end to end:

1. a tiny random Qwen3-shaped model is built with ``transformers``' own ``Qwen3ForCausalLM``
   (grouped-query attention, ``head_dim`` with ``n_head * head_dim != hidden``, QK-norm,
   untied head; the byte vocabulary, 257 ids, BOS = EOS = 256) and trained left to right
   with a plain torch loop on ``[bos] + x`` for blocks ``x`` of ``builtin:pydoc`` bytes
   (``anyorder``'s own packed train split), then saved with ``save_pretrained``;
2. ``anyorder convert SRC --to armd`` and ``--to aogpt`` (``--tokenizer bytes``: the source
   folder has no tokenizer);
3. step 0: the left-to-right validation NLL of each converted model (what ``anyorder train``
   validates: :func:`anyorder.training.validation.validate`, fp32) beside the source's on
   ``[bos] + x`` over the same validation blocks. The aogpt equals it (the BOS slot, adaLN
   at zero); the armd has no BOS slot and its query stream starts from a fitted position
   MLP, so it starts above (docs/checkpoints.md), by the gap printed;
4. ``anyorder train`` with ``train.init_from`` the converted folder (armd: ARMD's
   progressive schedule from pure left to right; aogpt: AO-GPT's mix, 10% left to right),
   and the same shapes from scratch, the same steps and settings; the validation figures
   at every ``--eval-every`` steps, any order and left to right, in bits per byte.

    python benchmarks/finetune_converted.py                     # about 10-15 min on 2 cores
    python benchmarks/finetune_converted.py --pretrain-steps 50 --steps 20   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BOS = 256  # the byte tokenizer's EOS, also the BOS (as GPT-2's <|endoftext|>)
QWEN3 = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,  # 4 x 24 = 96 != 64, as Qwen3's 0.6B (16 x 128 != 1024)
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=BOS,
    eos_token_id=BOS,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def source_nll(hf, data, blocks: int, batch_size: int) -> float:
    """The source's left-to-right NLL (nats/token) of ``x`` given ``[bos]``, on the first
    ``blocks`` validation blocks (the blocks :func:`validate` reads)."""
    from anyorder.data import iter_eval_blocks

    total, count = 0.0, 0
    with torch.no_grad():
        for x in iter_eval_blocks(data, "val", blocks, batch_size=batch_size):
            inp = torch.cat([torch.full((x.shape[0], 1), BOS), x], dim=1)
            logits = hf(inp).logits[:, :-1].float()
            total += F.cross_entropy(logits.flatten(0, 1), x.flatten(), reduction="sum").item()
            count += x.numel()
    return total / count


def pretrain(folder: Path, data, steps: int, batch: int, lr: float) -> tuple[object, float]:
    """A Qwen3ForCausalLM trained left to right on [bos] + x; saved to ``folder``."""
    import transformers as tr

    torch.manual_seed(0)
    hf = tr.Qwen3ForCausalLM(tr.Qwen3Config(**QWEN3))
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    n = data.num_blocks("train")
    t = time.perf_counter()
    for step in range(1, steps + 1):
        for g in opt.param_groups:  # linear warmup, cosine decay to 10%
            w = min(1.0, step / 20)
            g["lr"] = lr * w * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        x = data.batch("train", torch.randint(0, n, (batch,), generator=gen).numpy())
        inp = torch.cat([torch.full((batch, 1), BOS), x], dim=1)
        loss = F.cross_entropy(hf(inp).logits[:, :-1].flatten(0, 1), x.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps:
            print(f"pretrain step {step}: train nll {loss.item():.3f} nats/token")
    hf.eval()
    hf.save_pretrained(str(folder))
    return hf, time.perf_counter() - t


def run_yaml(path: Path, root: Path, kind: str, model: dict | None, init: Path | None, a) -> Path:
    """A run config: the same data, order schedule, optimizer and steps for both starts."""
    import yaml

    order = (
        dict(kind="progressive", i_ar="10%", i_perm="70%", rho=a.seq_len)
        if kind == "armd"
        else dict(kind="mix", p_l2r=0.1)
    )
    out = root / f"run-{path.stem}"
    train = dict(
        out_dir=str(out), steps=a.steps, batch_size=a.batch, optimizer="adamw", lr=a.lr,
        warmup_steps=a.warmup, eval_every=a.eval_every, eval_batches=a.eval_batches,
        ckpt_every=a.steps, log_every=a.eval_every, compile=False, dtype="fp32",
    )  # fmt: skip
    if init is not None:
        train["init_from"] = str(init)
    cfg = dict(
        model=model or dict(kind=kind),
        data=dict(source="builtin:pydoc", tokenizer="bytes", cache_dir=str(root / "cache")),
        order=order,
        train=train,
    )
    path.write_text(yaml.safe_dump(cfg))
    return out


def val_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "val/ao_bpb" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--pretrain-lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=150, help="fine-tuning / from-scratch steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/finetune_converted.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from anyorder.checkpoint.exported import load_exported
    from anyorder.cli import main as cli
    from anyorder.config import DataConfig, load_config, to_dict
    from anyorder.data import prepare
    from anyorder.evaluation.estimators import bits_per_byte
    from anyorder.training.validation import validate

    root = Path(tempfile.mkdtemp(prefix="finetune-converted-", dir=args.dir))
    result: dict = dict(cpu=cpu_name(), args={k: str(v) for k, v in vars(args).items()})
    try:
        data = prepare(
            DataConfig(source="builtin:pydoc", tokenizer="bytes", cache_dir=str(root / "cache")),
            args.seq_len,
            progress=False,
        )
        bpt = data.bytes_per_token("val")
        blocks = args.eval_batches * args.batch
        hf, secs = pretrain(root / "src", data, args.pretrain_steps, args.batch, args.pretrain_lr)
        src = source_nll(hf, data, blocks, args.batch)
        result["source"] = dict(l2r_nll=src, l2r_bpb=bits_per_byte(src, bpt), seconds=secs)
        print(f"source (qwen3, {args.pretrain_steps} steps left to right): val l2r "
              f"{src:.4f} nats/token, {bits_per_byte(src, bpt):.4f} bits/byte")  # fmt: skip
        step0, runs = {}, {}
        for kind in ("aogpt", "armd"):
            out = root / kind
            argv = ["convert", str(root / "src"), "--to", kind, "--out", str(out)]
            rc = cli([*argv, "--tokenizer", "bytes", "--seq-len", str(args.seq_len)])
            assert rc == 0, f"convert --to {kind} failed"
            model = load_exported(out).model.float()
            cfg = load_config(None, [f"model.kind={kind}"])  # what validation reads
            step0[kind] = validate(
                model, data, cfg, torch.device("cpu"), batches=args.eval_batches,
                batch_size=args.batch,
            )  # fmt: skip
            gap = step0[kind]["val/l2r_nll"] - src
            print(f"converted {kind} at step 0: val l2r {step0[kind]['val/l2r_nll']:.4f} "
                  f"nats/token (source {src:.4f}, gap {gap:+.2e}), any order "
                  f"{step0[kind]['val/ao_bpb']:.4f} bits/byte")  # fmt: skip
            shape = {k: v for k, v in to_dict(model.cfg).items() if k != "dropout"}
            runs[f"{kind} converted"] = run_yaml(
                root / f"{kind}-ft.yaml", root, kind, None, out, args
            )
            runs[f"{kind} scratch"] = run_yaml(
                root / f"{kind}-scratch.yaml", root, kind, shape, None, args
            )
        result["step0"] = step0
        curves = {}
        for name, run in runs.items():
            t = time.perf_counter()
            yaml_path = root / (run.name.removeprefix("run-") + ".yaml")
            assert cli(["train", str(yaml_path), "--no-progress"]) == 0, name
            curves[name] = val_rows(run)
            print(f"{name}: {args.steps} steps in {time.perf_counter() - t:.0f} s")
        result["curves"] = curves
        print(f"\nvalidation in bits/byte ({blocks} blocks of {args.seq_len} bytes; step 0 of "
              "the converted from validate(), fp32), any order / left to right:")  # fmt: skip
        print(f"{'run':18} " + " ".join(f"{'step ' + str(r['step']):>15}" for r in curves[name]))
        for name, rows in curves.items():
            kind = name.split()[0]
            first = ""
            if name.endswith("converted"):
                s0 = step0[kind]
                first = f"  (step 0: {s0['val/ao_bpb']:.3f} / {s0['val/l2r_bpb']:.3f})"
            cells = " ".join(f"{r['val/ao_bpb']:7.3f}/{r['val/l2r_bpb']:7.3f}" for r in rows)
            print(f"{name:18} {cells}{first}")
        result["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
        print("cpu:", result["cpu"], " load:", " ".join(result["loadavg"]))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
