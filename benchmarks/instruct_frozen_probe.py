"""What keeps LoRA from learning experiment 9's task: the low rank, or the frozen rest?

Under ``train.lora`` everything but the adapters is frozen: the token embeddings (tied to
the head, the EOS row included, which pretraining on plain text never used), the position
embeddings and the norms. This probe fine-tunes the layers LoRA ``attn+mlp`` adapts (every
block's qkv, attention output and MLP matrices) at full rank, from the same base with the
same recipe as the experiment's gpt-full arm (lr 2e-3, 800 steps, batch 16), and freezes
the rest as LoRA does. Learning like gpt-full points at the adapters' low rank; staying near
LoRA's zero points at the frozen embeddings and norms.

The run is the experiment's own (``instruct_run`` with gpt-full's overrides, in its own
folder ``instruct-gpt-blocks-only-sSEED``), scored by the experiment's ``run_scores`` on the
same 200 held-out prompts; the freezing wraps ``train.init_from``'s loader, which the trainer
calls before it builds the optimizer (AdamW over the parameters that require gradients).
The script checks that the frozen weights came out of training bit for bit the base's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/instruct_frozen_probe.py --seeds 2

Run ``anyorder experiment instruct --arms gpt-full`` first (same ``--out``): the bases and
the task are reused from there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

TRAINED = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")
"""The parameters that train: the blocks' linear layers (what LoRA attn+mlp adapts)."""


def _freezing(load):
    """``init_weights_from`` that leaves only :data:`TRAINED` requiring gradients."""

    def wrapped(model, spec):
        loaded = load(model, spec)
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith(TRAINED))
        return loaded

    return wrapped


def main() -> None:
    import anyorder.interop.hub as hub
    from anyorder.checkpoint import list_checkpoints, load_model
    from anyorder.experiments.instruct import (
        DECODERS,
        _steps,
        base_run,
        instruct_run,
        run_scores,
        task_data,
    )
    from anyorder.experiments.runs import Context

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/experiments", help="the experiment's --out")
    p.add_argument("--seeds", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(args.out)
    ctx = Context(out=root / "instruct", runs=root / "runs")
    data = task_data(ctx)
    hub.init_weights_from = _freezing(hub.init_weights_from)
    rows = []
    for seed in range(args.seeds):
        name = "instruct-gpt-blocks-only"
        run = instruct_run(ctx, "gpt-full", seed, data["train"], _steps(ctx), name=name)
        base = load_model(base_run(ctx, seed)["run_dir"]).model.state_dict()
        last = load_model(list_checkpoints(run["run_dir"])[-1], weights="raw").model
        frozen = {k: v for k, v in last.state_dict().items() if not k.endswith(TRAINED)}
        moved = [k for k, v in frozen.items() if not torch.equal(v, base[k])]
        assert not moved, f"frozen weights moved: {moved}"
        trained = sum(v.numel() for k, v in last.state_dict().items() if k.endswith(TRAINED))
        scores = run_scores(ctx, run, list(DECODERS)[:1], data, seed)[list(DECODERS)[0]]
        bpt = [r["val/l2r_bpt"] for r in run["rows"] if "val/l2r_bpt" in r][-1]
        row = {
            "seed": seed,
            "trained": trained,
            "total": sum(v.numel() for v in last.parameters()),
            "accuracy": {s: v["accuracy"] for s, v in sorted(scores.items())},
            "tasks": scores[max(scores)]["tasks"],
            "answer_bpt": bpt,
            "wall_s": run["wall_s"],
            "frozen_unchanged": sorted(frozen),
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "frozen_unchanged"}), flush=True)
    (root / "instruct-frozen-probe.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
