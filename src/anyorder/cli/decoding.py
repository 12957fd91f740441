"""``anyorder sample``'s decode: the sampler its flags ask for, run under the options that
wrap it (compiled passes), and the line that reports what capturing or compiling cost."""

from __future__ import annotations

import contextlib


def graphs_line(captured: dict | None) -> str | None:
    """The line that reports what capturing CUDA graphs and compiling the passes cost (None:
    nothing captured or compiled)."""
    if not captured:
        return None
    cuda, backend = captured["mode"] == "cuda", captured.get("compiled")
    if backend is None and not cuda:
        return None
    what = "captured" if backend is None else f"compiled ({backend})"
    if backend is not None and cuda:
        what += " and captured"
    head = "CUDA graphs" if cuda else "compiled passes"
    tail = " (--no-cuda-graphs: eager)" if cuda else ""
    return (
        f"{head}: {captured['shapes']} pass shapes {what} in {captured['capture_s']:.2f} s, in "
        f"the time above{tail}"
    )


def run_sampler(args, model, n, order, streams, prompt, known, gen, stop, stream):
    """The sampler the flags ask for (:func:`_sampler`), its passes compiled under
    ``--compile-passes``."""
    if args.compile_passes is None:
        compiling = contextlib.nullcontext()
    else:
        from anyorder.sampling.graphs import compiled_passes

        compiling = compiled_passes(args.compile_passes)
    with compiling:
        return _sampler(args, model, n, order, streams, prompt, known, gen, stop, stream)


def _sampler(args, model, n, order, streams, prompt, known, gen, stop, stream):
    """The sampler the flags ask for: confidence order, speculative, or :func:`sample`."""
    from anyorder.sample import sample
    from anyorder.sampling.confidence import confidence_sample
    from anyorder.sampling.speculative import speculative_sample

    controls = dict(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=gen,
        batch=args.num_samples, prompt=prompt, known=known,
    )  # fmt: skip
    if order == "confidence":
        return confidence_sample(
            model, n, 1 if args.per_pass is None else args.per_pass,
            speculative=args.speculative, subset=args.score_subset, graphs=args.cuda_graphs,
            **controls,
        )  # fmt: skip
    if args.speculative is not None:
        return speculative_sample(
            model, n, args.speculative, order=order, graphs=args.cuda_graphs, **controls
        )
    return sample(
        model, n, order=None if order == "strided" else order, streams=streams,
        steps=args.steps, schedule=args.schedule or "linear", shared_counts=args.shared_counts,
        reveal=args.reveal or "binomial", graphs=args.cuda_graphs, stop_at_eos=stop,
        on_step=stream,
        **controls,
    )  # fmt: skip
