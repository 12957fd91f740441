"""Lemma 1 and one-token-per-pass decoding beside the AO-GPT authors' ``generate()``.

Side by side in one run, round-robin (``_bench.py``), on the CPU: the authors' model and
sampler (``model_AOGPT_generate.py`` of scxue/AO-GPT-MDM, read from a folder the repository
ignores, never committed) and ours (the ``aogpt-ref`` variant, the same parameterisation),
at the issue's shape: 4 layers x 256, vocabulary 256, n = 1024, bf16 autocast, random
weights (speed does not depend on them). Rows, at each batch size:

* ``ref T=1024`` / ``ours seq``: one token per pass;
* ``ref T=256`` / ``ours lemma1 T=256``: Lemma 1 in 256 steps, the reference's reveal
  counts (``reveal="reference"``: 4 tokens per pass, never an empty step), top-p 0.9 and
  temperature 0.9 as the authors sample.

``--profile`` adds, for the T = 256 rows at the first batch size, the aten ops that take the
most CPU time in one generation of each (``torch.profiler``): where our passes lose.

Get the reference once (the folder is listed in .git/info/exclude)::

    git clone https://github.com/scxue/AO-GPT-MDM .ref      # or the fetch tool's mirror
    python benchmarks/lemma1_vs_reference.py --batches 1,16 --threads 2   # the issue's setting

``TORCHDYNAMO_DISABLE=1`` turns their ``@torch.compile`` decorators into no-ops (eager on
both sides; compiling on the CPU takes minutes and needs a C compiler). The script sets it
itself before importing torch.

It also sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads OpenMP, unless it is set: what
``import anyorder`` sets (docs/performance.md, "Under load"), which this script's earlier
``import torch`` came too late for. Both sides share the process, so both get it. With
threads that spin (``OMP_WAIT_POLICY=ACTIVE``, the GNU default) on a machine running other
programs, a pass's time is mostly waiting for the partner thread: at batch 1, 2 threads, a
load of about 4.5, two runs gave 2.97x and 1.28x for Lemma 1, where passive threads gave
1.35x and 1.36x; the profiles of such runs inflate every op alike (read ``--profile`` at
``--threads 1`` or with passive threads).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see above

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from _bench import add_common, machine, print_table, round_robin, setup, summary, write_json  # noqa: E402
from anyorder import build_model, preset  # noqa: E402
from anyorder.sample import lemma1_sample, sequential_sample  # noqa: E402

SHAPE = dict(n_layer=4, n_head=4, d_model=256, vocab_size=256)
N = 1024  # the reference's generate() hard-codes 1024 tokens


def reference_model(ref_dir: Path):
    """The authors' generation model at :data:`SHAPE`, random weights, eval mode."""
    sys.path.insert(0, str(ref_dir))
    import model_AOGPT_generate as ref  # noqa: PLC0415

    cfg = ref.AOGPTConfig()
    cfg.block_size, cfg.vocab_size = N, SHAPE["vocab_size"]
    cfg.n_layer, cfg.n_head, cfg.n_embd = SHAPE["n_layer"], SHAPE["n_head"], SHAPE["d_model"]
    cfg.dropout, cfg.bias = 0.0, True
    torch.manual_seed(0)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        return ref.AOGPT(cfg).eval()


def reference_generate(model, batch: int, steps: int, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):  # it prints a shape
        model.past_key_values = None
        return model.generate(batch, steps, "cpu", "linear", topp=0.9, temperature=0.9)


def ours(model, batch: int, steps: int | None, seed: int):
    g = torch.Generator().manual_seed(seed)
    kw = dict(batch=batch, generator=g, temperature=0.9, top_p=0.9)
    if steps is None:
        return sequential_sample(model, N, **kw)
    return lemma1_sample(model, N, steps, reveal="reference", **kw)


def profile(fn, rows: int = 15) -> str:
    """The aten ops of one call, by self CPU time."""
    from torch.profiler import ProfilerActivity  # noqa: PLC0415
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ref-dir", type=Path, default=Path(__file__).parents[1] / ".ref")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=256, help="T of the Lemma-1 rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-sequential", action="store_true", help="only the T rows")
    ap.add_argument("--profile", action="store_true", help="profile the T rows (see above)")
    add_common(ap, "benchmarks/results/lemma1_vs_reference.json")
    args = ap.parse_args()
    device = setup(args)
    if not (args.ref_dir / "model_AOGPT_generate.py").is_file():
        sys.exit(f"{args.ref_dir}/model_AOGPT_generate.py not found: clone scxue/AO-GPT-MDM there")
    ref = reference_model(args.ref_dir)
    torch.manual_seed(0)
    mine = build_model(preset("tiny", variant="aogpt-ref", seq_len=N, **SHAPE)).eval()
    T = args.steps
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        fns = {
            f"ref T={T}": functools.partial(reference_generate, ref, batch, T, 0),
            f"ours lemma1 T={T}": functools.partial(ours, mine, batch, T, 0),
        }
        if not args.no_sequential:
            fns[f"ref T={N}"] = functools.partial(reference_generate, ref, batch, N, 0)
            fns["ours seq"] = functools.partial(ours, mine, batch, None, 0)
        with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
            times, _ = round_robin(fns, args.repeats, device)
        sec = {k: summary(v, args.clock, args.stat) for k, v in times.items()}
        table = []
        for label in fns:
            base = f"ref T={N}" if label in ("ours seq", f"ref T={N}") else f"ref T={T}"
            speed = sec[base] / sec[label]
            table.append([label, sec[label], batch * N / sec[label], speed])
            results.append(dict(batch=batch, sampler=label, seconds=sec[label], speed_x_ref=speed))
        print_table(
            f"batch {batch}, n={N}, 4x256, vocab 256, bf16 autocast, {args.clock} clock, "
            f"{args.stat} of {args.repeats}",
            ["sampler", "s/batch", "tokens/s", "speed x ref"],
            table,
        )
        if args.profile and batch == int(args.batches.split(",")[0]):
            with torch.autocast("cpu", torch.bfloat16), torch.no_grad():
                for label in (f"ref T={T}", f"ours lemma1 T={T}"):
                    print(f"\n--- profile: {label}, batch {batch}")
                    print(profile(fns[label]))
    write_json(
        args.json, dict(meta=dict(machine(), clock=args.clock, stat=args.stat), rows=results)
    )


if __name__ == "__main__":
    main()
