"""Peak memory of the likelihood paths at the papers' vocabulary and length.

Each path runs in a process of its own on a model with vocabulary 50257, n = 1024 and 2
small layers (d_model 64), on one block; the figure is the growth of the peak resident set
(``ru_maxrss``) over the process's peak after building the model. The paths:

* ``armd-ensemble``, ``aogpt-ensemble``: a context-order ensemble of M = 8, one order,
  ``--targets`` random target slots (the memory of a call does not depend on how many);
* ``mdm-l2r``: the encoder's left-to-right NLL of the first ``--mdm-slots`` slots of one
  block (one encoder pass of n tokens per slot; a whole block is n of them, the memory of a
  call does not depend on how many);
* ``armd-any-order``, ``aogpt-any-order``, ``mdm-elbo``, ``gpt-l2r``: one order (one mask
  draw) of a batch of ``--batch`` blocks.

A path that would need more than ``--cap-gb`` of memory is stopped by an address-space
limit and reported as above the cap (the machine is shared: nothing here may take it all).

    .venv/bin/python benchmarks/eval_memory.py              # every path, a table
    .venv/bin/python benchmarks/eval_memory.py --only mdm-l2r --json /tmp/m.json
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

PATHS = (
    "armd-ensemble",
    "aogpt-ensemble",
    "mdm-l2r",
    "armd-any-order",
    "aogpt-any-order",
    "mdm-elbo",
    "gpt-l2r",
)
VOCAB, N = 50257, 1024


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build(kind: str):
    import torch

    from anyorder import build_model, preset

    torch.manual_seed(0)
    cfg = preset("tiny", kind=kind, vocab_size=VOCAB, seq_len=N, n_layer=2, n_head=2, d_model=64)
    return build_model(cfg).eval()


def run_path(
    path: str, targets: int, batch: int, max_tokens: int | None, mdm_slots: int = 64
) -> None:
    """Child process: build, note the peak, run the path, print the growth as JSON."""
    import torch

    try:
        from anyorder.evaluation import corpus
    except ImportError:  # a tree from before the evaluation/ package (--src)
        from anyorder import corpus  # type: ignore[no-redef]

    torch.set_num_threads(1)
    kind = path.split("-")[0]
    model = build(kind)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (batch, N), generator=g)
    kw = {} if max_tokens is None else {"max_tokens": max_tokens}
    gc.collect()
    base = _peak_mb()
    t0 = time.perf_counter()
    with torch.no_grad():
        if path.endswith("ensemble"):
            corpus.corpus_ensemble(model, x[:1], 1, 8, targets=targets, progress=False, **kw)
        elif path == "mdm-l2r" and mdm_slots >= N:  # n encoder passes of one block
            corpus.corpus_left_to_right(model, x[:1], batch_size=1, progress=False, **kw)
        elif path == "mdm-l2r":  # the same calls, for the first slots of the order
            model.token_nll(x[:1], torch.arange(mdm_slots)[None], **kw)
        elif path == "gpt-l2r":
            corpus.corpus_left_to_right(model, x, batch_size=batch, progress=False, **kw)
        elif path == "mdm-elbo":
            corpus.corpus_mdm_elbo(model, x, 1, batch_size=batch, progress=False, **kw)
        else:
            corpus.corpus_any_order(model, x, 1, batch_size=batch, progress=False, **kw)
    seconds = time.perf_counter() - t0
    print(json.dumps({"path": path, "growth_mb": _peak_mb() - base, "base_mb": base,
                      "seconds": seconds}))  # fmt: skip


def measure(
    path: str,
    *,
    targets: int = 2,
    batch: int = 2,
    max_tokens: int | None = None,
    mdm_slots: int = 64,
    cap_gb: float = 4.0,
    src: Path | None = None,
) -> dict:
    """Run one path in a child process under an address-space cap; its JSON result.
    ``src``: the package to import (default: this checkout's ``src``)."""
    src = src if src is not None else Path(__file__).resolve().parents[1] / "src"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", path]
    cmd += ["--targets", str(targets), "--batch", str(batch), "--mdm-slots", str(mdm_slots)]
    if max_tokens is not None:
        cmd += ["--max-tokens", str(max_tokens)]
    cap = int((cap_gb + 3.0) * 2**30)  # + what torch maps at import (virtual, not resident)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(src), "PATH": ""}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=limit)
    if r.returncode != 0:
        oom = "MemoryError" in r.stderr or "alloc" in r.stderr.lower()
        if not oom:
            raise RuntimeError(f"{path} failed:\n{r.stderr[-2000:]}")
        return {"path": path, "growth_mb": float("inf"), "over_cap_gb": cap_gb, "seconds": None}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--only", default=None, help="comma-separated paths (default: all)")
    ap.add_argument("--targets", type=int, default=2, help="ensemble target slots")
    ap.add_argument("--batch", type=int, default=2, help="blocks per call (any-order, l2r)")
    ap.add_argument("--mdm-slots", type=int, default=64, help=f"mdm l2r slots ({N}: a block)")
    ap.add_argument("--max-tokens", type=int, default=None, help="the chunk size to pass")
    ap.add_argument("--cap-gb", type=float, default=4.0, help="stop a path above this")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--src",
        type=Path,
        default=None,
        help="the package's src folder (another "
        "commit's, e.g. from `git archive`; default: this checkout's)",
    )
    args = ap.parse_args()
    if args.child:
        run_path(args.child, args.targets, args.batch, args.max_tokens, args.mdm_slots)
        return
    paths = args.only.split(",") if args.only else list(PATHS)
    rows = []
    print(f"peak RSS growth over the loaded model (vocab {VOCAB}, n = {N}, 2 x 64)")
    for p in paths:
        r = measure(p, targets=args.targets, batch=args.batch, max_tokens=args.max_tokens,
                    mdm_slots=args.mdm_slots, cap_gb=args.cap_gb, src=args.src)  # fmt: skip
        rows.append(r)
        grow = f"> {r['over_cap_gb']:g} GB (stopped)" if "over_cap_gb" in r else (
            f"{r['growth_mb']:8.1f} MB")  # fmt: skip
        secs = f"{r['seconds']:.1f} s" if r.get("seconds") is not None else ""
        print(f"  {p:16s} {grow}  {secs}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
