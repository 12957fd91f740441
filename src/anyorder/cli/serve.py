"""``anyorder serve``: the flags of the live page, checked before the model loads."""

from __future__ import annotations

import argparse

# ----------------------------------------------------------------------------- serve


def add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        nargs="?",
        default=None,
        help="export, hub id, run folder or checkpoint (default: runs/demo, the main job's model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: local only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--max-samples", type=int, default=4, help="samples per request at most")
    p.add_argument(
        "--max-draft",
        type=int,
        default=16,
        help="largest K a speculative request may ask for (tokens one pass commits)",
    )
    p.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds per request at most (wall clock)"
    )
    p.add_argument("--weights", choices=("ema", "raw"), default="ema", help="default: ema")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="auto: bf16 on CUDA"
    )
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.add_argument(
        "--huge-pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="copy the weights into 2 MB pages on a CPU (Linux): faster decoding, a slower load",
    )


def run_serve(args: argparse.Namespace) -> int:
    from anyorder.bounds import MAX_NUM_SAMPLES
    from anyorder.errors import ConfigError
    from anyorder.serve import MAX_DRAFT, MAX_TIME_LIMIT_S, Limits, serve

    if not 1 <= args.max_samples <= MAX_NUM_SAMPLES:
        raise ConfigError(f"--max-samples {args.max_samples} must lie in 1..{MAX_NUM_SAMPLES}")
    if not 0 < args.time_limit <= MAX_TIME_LIMIT_S:  # False for nan and inf too
        raise ConfigError(
            f"--time-limit {args.time_limit:g} must be a number of seconds above 0 and at most "
            f"{MAX_TIME_LIMIT_S:g} (a day)"
        )
    if not 1 <= args.max_draft <= MAX_DRAFT:
        raise ConfigError(
            f"--max-draft {args.max_draft} must lie in 1..{MAX_DRAFT} (the largest K, in tokens "
            "per pass, a speculative request may ask for)"
        )
    if not args.host.strip():  # the empty address is every interface, with no authentication
        raise ConfigError(
            "--host is empty (an unset shell variable?); give an address such as 127.0.0.1 "
            "(this machine only), or 0.0.0.0 for every interface"
        )
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} must lie in 0..65535 (0: any free port)")
    limits = Limits(
        max_samples=args.max_samples, time_limit_s=args.time_limit, max_draft=args.max_draft
    )
    serve(
        args.checkpoint,
        host=args.host,
        port=args.port,
        limits=limits,
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        verbose=args.verbose,
        huge_pages=args.huge_pages,
    )
    return 0
