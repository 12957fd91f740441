"""``anyorder convert`` (GPT-2, Llama, Qwen2, Qwen3 and Mistral weights, the AO-GPT
authors' checkpoints) and ``anyorder export`` (a training checkpoint as an uploadable
folder).

Flags that belong to one source format are refused for the other with one line naming the
flag, before anything is read.
"""

from __future__ import annotations

import argparse

# ----------------------------------------------------------------------------- convert, export


def add_convert(p: argparse.ArgumentParser) -> None:
    from anyorder.interop.families import MAX_SEQ

    p.add_argument(
        "source",
        help="gpt2: a transformers checkpoint (hub id or folder with config.json) of model_type "
        "gpt2, llama, qwen2, qwen3 or mistral; aogpt-ref / sigmagpt-ref: the authors' "
        "ckpt_N.pt, or hf:OWNER/REPO/PATH/ckpt_N.pt",
    )
    p.add_argument(
        "--from",
        dest="source_format",
        choices=("gpt2", "aogpt-ref", "sigmagpt-ref"),
        default="gpt2",
        help="what the source is: a transformers checkpoint (GPT-2, Llama, Qwen2, Qwen3, "
        "Mistral: its config.json's model_type decides), or a checkpoint of the AO-GPT "
        "authors' code (scxue/AO-GPT-MDM: AO-GPT or sigma-GPT)",
    )
    p.add_argument(
        "--to",
        default=None,
        choices=("gpt", "aogpt", "armd"),
        help="model kind (--from gpt2: required; the reference formats give aogpt)",
    )
    p.add_argument("--out", required=True, help="folder to write the converted model to")
    p.add_argument(
        "--weights",
        choices=("ema", "raw"),
        default=None,
        help="reference formats: the EMA or the raw weights (default: EMA when kept)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer to ship with it (default: the source folder's own, when it has one; "
        "GPT-2's for a reference checkpoint with GPT-2's vocabulary; none: no tokenizer)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="context (default: the source's positions less the BOS's, at most 4096 for the "
        f"RoPE families; never more than the source's positions nor {MAX_SEQ})",
    )
    p.add_argument("--l2s", type=int, default=None, help="armd: two-stream layers (n_layer/2)")
    p.add_argument("--target-dim", type=int, default=128, help="aogpt: target embedding width")
    p.add_argument(
        "--bos-id",
        type=int,
        default=None,
        help="token whose embedding is the BOS (default: config.json's bos_token_id; GPT-2: 50256)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="stored dtype (default: the source's for the RoPE families, float32 for GPT-2)",
    )


def _convert_reference(args: argparse.Namespace):
    from anyorder.errors import ConfigError
    from anyorder.interop.reference import convert_ref

    if args.to not in (None, "aogpt"):
        raise ConfigError(f"--from {args.source_format} converts into aogpt; leave out --to")
    gpt2_only = {"--seq-len": args.seq_len, "--l2s": args.l2s, "--bos-id": args.bos_id}
    given = [k for k, v in gpt2_only.items() if v is not None]
    if given or args.target_dim != 128:
        flag = given[0] if given else "--target-dim"
        raise ConfigError(f"{flag} is for --from gpt2; a reference checkpoint fixes its own sizes")
    return convert_ref(
        args.source,
        args.out,
        args.source_format,
        dtype=args.dtype,
        weights=args.weights,
        tokenizer=args.tokenizer,
    )


def run_convert(args: argparse.Namespace) -> int:
    from anyorder.errors import ConfigError
    from anyorder.interop.convert import convert

    if args.source_format != "gpt2":
        conv = _convert_reference(args)
    else:
        if args.to is None:
            raise ConfigError("--from gpt2 needs --to gpt, aogpt or armd")
        if args.weights is not None:
            raise ConfigError("--weights is for the reference formats; a GPT-2 has one set")
        from anyorder.interop.hub import resolve_folder
        from anyorder.interop.streaming import SOURCE_PATTERNS, convert_family, model_type_of

        folder = resolve_folder(args.source, allow_patterns=SOURCE_PATTERNS)
        gpt2 = model_type_of(folder) in (None, "gpt2")
        conv = (convert if gpt2 else convert_family)(
            args.source,
            args.to,
            args.out,
            dtype=args.dtype,
            seq_len=args.seq_len,
            l2s=args.l2s,
            target_dim=args.target_dim,
            bos_id=args.bos_id,
            tokenizer=args.tokenizer,
        )
    m = conv.model
    tok = conv.tokenizer.name if conv.tokenizer is not None else "none (pass --tokenizer)"
    what = (
        f" ({conv.info['reference_weights']} weights)" if "reference_weights" in conv.info else ""
    )
    from anyorder.config import method_name

    name = method_name(m.kind, m.cfg.target_injection)  # sigma-GPT is an aogpt module
    name = m.kind if name.lower().replace("-", "") == m.kind else f"{name} ({m.kind})"
    print(
        f"{name}{what}: {m.num_params() / 1e6:.2f}M parameters, {m.cfg.n_layer} layers x "
        f"{m.cfg.d_model}, seq_len {m.cfg.seq_len}, tokenizer {tok}"
    )
    print(f"wrote {conv.folder}")
    return 0


def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run folder (its latest checkpoint) or checkpoint folder")
    p.add_argument("--out", required=True, help="folder to write (uploadable to the hub as is)")
    p.add_argument(
        "--weights", choices=("ema", "raw"), default="ema", help="default: ema (raw if no EMA)"
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="stored dtype"
    )
    p.add_argument(
        "--adapters-only",
        action="store_true",
        help="a LoRA run (train.lora): write its adapters apart in peft's layout "
        "(adapter_config.json, adapter_model.safetensors) instead of merging them into the base",
    )
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="then upload it")
    p.add_argument("--private", action="store_true", help="create the hub repository private")


def run_export(args: argparse.Namespace) -> int:
    from anyorder.checkpoint.exported import read_export_config
    from anyorder.checkpoint.exporting import export
    from anyorder.interop.hub import push_to_hub

    source = args.checkpoint
    if args.adapters_only:  # resolved once: the line names the weights export writes
        from anyorder.checkpoint.layout import resolve_checkpoint

        source = resolve_checkpoint(args.checkpoint)
    folder = export(
        source,
        args.out,
        weights=args.weights,
        dtype=args.dtype,
        adapters_only=args.adapters_only,
    )
    if args.adapters_only:
        from anyorder.checkpoint.exporting import adapter_weights_label

        label = adapter_weights_label(source, args.weights)  # raw where the run kept no EMA
        print(f"LoRA adapters ({label} weights): wrote {folder}")
    else:
        cfg = read_export_config(folder)
        print(
            f"{cfg['anyorder_kind']} step {cfg['step']} ({cfg['weights']} weights): wrote {folder}"
        )
    if args.push_to_hub:
        url = push_to_hub(folder, args.push_to_hub, private=args.private)
        print(f"pushed to {url}")
    return 0
