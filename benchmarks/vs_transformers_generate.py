"""Greedy KV-cached decoding: a converted Llama against ``transformers``' ``generate`` (issue 33).

Builds a random Llama-3.2-1B-shaped model with ``transformers``' own ``LlamaForCausalLM``
(vocabulary 128256, layers of 2048, 32 query and 8 key/value heads, SwiGLU 8192, tied head,
Llama 3 RoPE scaling; ``--layers`` cuts the depth, 16 is the full model), saves it with
``save_pretrained`` in ``--dtype``, converts it with ``anyorder convert`` into ``gpt``, ``aogpt``
and ``armd``, then times, side by side and round-robin in one run (the same weights, dtype,
threads and prompt):

* ``hf generate``: ``model.generate(do_sample=False, use_cache=True)`` on the source, fed
  ``[bos] + prompt``;
* ``gpt``: our left-to-right sampler (:func:`anyorder.sample.sample`, what
  ``anyorder.load(...).generate`` and ``anyorder sample`` call) with ``top_k=1`` (greedy) and
  the KV cache, fed the prompt (the BOS is the converted model's own slot);
* ``aogpt`` / ``armd``: the converted any-order models, random order, one token per pass.
* ``gpt-plain``: the same gpt with the CPU's prepacked weights turned off
  (``use_prepacked(False)``: ``F.linear`` on the weights as loaded, as ``generate`` runs);
  the gpt's first call, which makes the copies, is timed apart and printed.

Before timing, the greedy tokens of ``gpt`` are checked equal to ``generate``'s (fp32: every
token; bf16: the two round in different places, so near-ties may split; the agreeing fraction
is printed). Reported: tokens/s of each (new tokens x batch / the best round on the CPU
clock, see ``_bench.py``), ours over theirs (target >= 1.0), aogpt and armd time over gpt
(targets <= 1.10 and <= 1.25), the CPU and its flags, the load average.

    python benchmarks/vs_transformers_generate.py                 # the full 16 layers
    python benchmarks/vs_transformers_generate.py --layers 2 --new-tokens 32   # a quick look
    python benchmarks/vs_transformers_generate.py --decoders hf,gpt            # 16 layers, 2 models

``--decoders`` keeps the machine's memory in bounds at the full depth: each model maps its
own weights file (fp32: about 5 GB each), and four of them with the source's would not stay
in the page cache of a 24 GB machine together. The ratios need their two decoders (``gpt``
for all of them), so ``hf,gpt`` and ``gpt,aogpt,armd`` are two runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from _bench import add_common, machine, print_table, round_robin, setup, summary, write_json

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=128001,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


def cpu() -> dict:
    """The CPU's model name and the vector flags that decide matmul speed."""
    model, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    return {"model": model, "flags": [f for f in FLAGS if f in flags]}


def build_source(folder: Path, layers: int, dtype: torch.dtype) -> None:
    """A random Llama-3.2-1B-shaped model, built by transformers and saved by it."""
    import transformers as tr

    torch.manual_seed(0)
    config = tr.LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": layers})
    with torch.device("cpu"):
        hf = tr.LlamaForCausalLM(config).to(dtype)
    hf.save_pretrained(str(folder))
    del hf


DECODERS = {
    "hf": "hf generate",
    "gpt": "gpt",
    "gpt-huge": "gpt, huge pages",
    "gpt-plain": "gpt, prepacking off",
    "aogpt": "aogpt random",
    "armd": "armd random",
}
"""``--decoders`` names -> the table's labels (``gpt-huge``: the gpt loaded with
``huge_pages=True``, its weights copied into 2 MB pages; ``gpt-plain``: the same gpt with
the CPU's prepacked weights turned off, ``F.linear`` on the weights as loaded)."""


def decoders(hf, ours: dict, batch: int, p: int, new: int) -> dict:
    """The timed calls on one random prompt of ``p`` tokens, ``new`` tokens each: ``hf``
    (when not None) and each kind in ``ours``."""
    from anyorder.layers.linear import use_prepacked
    from anyorder.sample import sample

    n = p + new
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, LLAMA_1B["vocab_size"], (batch, p), generator=gen)
    full = torch.zeros(batch, n, dtype=torch.long)
    full[:, :p] = prompt
    known = torch.zeros(batch, n, dtype=torch.bool)
    known[:, :p] = True
    inp = torch.cat([torch.full((batch, 1), LLAMA_1B["bos_token_id"]), prompt], dim=1)

    def theirs():
        with torch.inference_mode():
            return hf.generate(
                inp, attention_mask=torch.ones_like(inp), do_sample=False, use_cache=True,
                max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
            )[:, 1:]  # fmt: skip

    def ours_fn(kind: str, order: str):
        def run():
            g = torch.Generator().manual_seed(0)
            with torch.inference_mode(), use_prepacked(kind != "gpt-plain"):
                return sample(
                    ours[kind], n, order=order, batch=batch, prompt=full, known=known,
                    top_k=1, generator=g,
                ).tokens  # fmt: skip

        return run

    fns = {"hf generate": theirs} if hf is not None else {}
    order = dict(gpt="l2r", aogpt="random", armd="random")
    order |= {"gpt-huge": "l2r", "gpt-plain": "l2r"}
    return fns | {DECODERS[kind]: ours_fn(kind, order[kind]) for kind in ours}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16, help="layers (16: Llama-3.2-1B)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp)")
    ap.add_argument(
        "--decoders", default="hf,gpt,aogpt,armd", help="which to time (gpt always runs)"
    )
    add_common(ap, "benchmarks/results/vs_transformers_generate.json")
    args = ap.parse_args()
    device = setup(args)
    import transformers as tr

    import anyorder
    from anyorder.checkpoint.exported import load_exported
    from anyorder.interop.streaming import convert_family

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    root = Path(tempfile.mkdtemp(prefix="vs-hf-", dir=args.dir))
    p, new = args.prompt, args.new_tokens
    wanted = {"gpt", *args.decoders.split(",")}
    if not wanted <= set(DECODERS):
        ap.error(f"--decoders: choose among {', '.join(DECODERS)}")
    n = p + new
    rows, out = [], {}
    try:
        build_source(root / "src", args.layers, dtype)
        hf = None
        if "hf" in wanted:  # and the token check with it
            hf = tr.LlamaForCausalLM.from_pretrained(str(root / "src"), dtype=dtype).eval()
        ours = {}
        for kind in [k for k in ("gpt", "aogpt", "armd") if k in wanted]:
            convert_family(root / "src", kind, root / kind, seq_len=max(n, 64))
            ours[kind] = load_exported(root / kind).model.to(dtype).eval()
        if "gpt-plain" in wanted:
            ours["gpt-plain"] = ours["gpt"]  # the same weights, run without the copies
        if "gpt-huge" in wanted:
            start = time.perf_counter()
            ours["gpt-huge"] = anyorder.load(root / "gpt", huge_pages=True).model.to(dtype)
            print(f"loaded the gpt into huge pages in {time.perf_counter() - start:.1f} s")
        for batch in [int(b) for b in args.batches.split(",")]:
            fns = decoders(hf, ours, batch, p, new)
            agree = None
            start = time.perf_counter()  # the first call makes the prepacked copies
            a = fns["gpt"]()
            first = time.perf_counter() - start
            print(f"batch {batch}: the gpt's first call took {first:.1f} s")
            if hf is not None:
                b = fns["hf generate"]()
                agree = (a[:, p:] == b[:, p:]).float().mean().item()
                print(f"batch {batch}: greedy tokens of gpt equal generate's at {agree:.1%}")
                if dtype == torch.float32:
                    assert torch.equal(a, b), "the converted gpt's greedy tokens differ"
            times, _ = round_robin(fns, args.repeats, device)
            t = {k: summary(v, args.clock, args.stat) for k, v in times.items()}
            tps = {k: new * batch / v for k, v in t.items()}
            ratio = {}
            if "hf generate" in t:
                ratio["gpt"] = ("ours_over_theirs", tps["gpt"] / tps["hf generate"], "x hf")
                for k, key in (("gpt, huge pages", "huge"), ("gpt, prepacking off", "plain")):
                    if k in t:
                        ratio[k] = (f"{key}_over_theirs", tps[k] / tps["hf generate"], "x hf")
            for k in ("aogpt", "armd"):
                if DECODERS[k] in t:
                    ratio[DECODERS[k]] = (f"{k}_over_gpt", t[DECODERS[k]] / t["gpt"], "x gpt time")
            out[batch] = dict(seconds=t, tokens_per_s=tps, agree=agree, rounds=times)
            out[batch]["gpt_first_call_s"] = first
            out[batch] |= {key: value for key, value, _ in ratio.values()}
            for k in fns:
                shown = f"{ratio[k][1]:.2f}{ratio[k][2]}" if k in ratio else ""
                rows.append([k, batch, t[k], tps[k], shown])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    info = machine()
    print_table(
        f"greedy decoding, Llama-3.2-1B shape with {args.layers} layers, {args.dtype}, "
        f"prompt {p} + {new} new tokens, {args.threads} thread(s), {args.clock} clock, "
        f"{args.stat} of {args.repeats} rounds; load {info['load_avg_1_5_15']}",
        ["decoder", "batch", "s", "tokens/s", "ratio"],
        rows,
    )
    print("cpu:", json.dumps(cpu()))
    write_json(
        args.json,
        dict(
            info,
            cpu=cpu(),
            layers=args.layers,
            dtype=args.dtype,
            prompt=p,
            new_tokens=new,
            clock=args.clock,
            stat=args.stat,
            results=out,
        ),  # fmt: skip
    )


if __name__ == "__main__":
    main()
