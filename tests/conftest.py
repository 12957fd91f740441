"""Shared fixtures: tiny real models, seeded generators, where the GPT-2 tokenizer files are."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest

# As `import anyorder` does for users (OpenMP reads it once, when torch loads it; this file
# imports torch first): waiting OpenMP threads sleep instead of spinning. With spinning, the
# suite's two threads collapsed whenever anything else ran beside it (a small training run
# went at 0.16 steps/s against 4-5 with one thread, at a load of 15 on 2 cores).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from anyorder import build_model, preset
from anyorder.layers import casts as casts_mod
from anyorder.layers import linear as linear_mod
from anyorder.models import _INITS
from anyorder.models.base import AnyOrderLM

REPO = Path(__file__).resolve().parents[1]
GPT2_TOKENIZER_ENV = "ANYORDER_GPT2_TOKENIZER"
GPT2_TOKENIZER_DIR = Path(
    os.environ.get(GPT2_TOKENIZER_ENV) or REPO.parent / "shared" / "tokenizers" / "gpt2"
)
"""A folder with GPT-2's vocab.json and merges.txt (no download needed); the checks that use
the real GPT-2 tokenizer are skipped without it."""
GPT2_SKIP = (
    f"GPT-2 tokenizer files (vocab.json, merges.txt) not found in {GPT2_TOKENIZER_DIR}; set "
    f"{GPT2_TOKENIZER_ENV} to a folder holding them to run this check"
)


def has_gpt2_tokenizer() -> bool:
    return all((GPT2_TOKENIZER_DIR / f).is_file() for f in ("vocab.json", "merges.txt"))


torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

# train.dtype=auto on the CPU measures whether this CPU computes bf16 faster than fp32
# (anyorder.precision): the suite runs as on a CPU without bf16 units, alike everywhere
# (subprocesses of the CLI inherit it); tests/test_precision.py measures and mocks.
os.environ.setdefault("ANYORDER_CPU_BF16", "0")

if not os.environ.get("ANYORDER_CACHE"):
    # data.cache_dir=auto (the default) writes under the cache home: a folder of this
    # session's, not the user's ~/.cache (subprocesses of the CLI inherit it)
    import atexit
    import shutil
    import tempfile

    _CACHE_HOME = tempfile.mkdtemp(prefix="anyorder-test-cache-")
    os.environ["ANYORDER_CACHE"] = _CACHE_HOME
    atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)


def tiny_model(kind: str, seed: int = 0, **overrides) -> AnyOrderLM:
    """A small real model in fp32 (2 layers, width 64 unless overridden)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=11, seq_len=16, n_layer=2, n_head=4, d_model=64)
    cfg.update(overrides)
    return build_model(preset("tiny", kind=kind, **cfg)).eval()


_INIT_FNS = {name: getattr(torch.nn.init, name) for name in _INITS}  # as torch made them


def _process_state_check(when: str) -> None:
    changed = [n for n, fn in _INIT_FNS.items() if getattr(torch.nn.init, n) is not fn]
    assert not changed, f"torch.nn.init's {changed} are not torch's own {when}"
    assert linear_mod._here.packs is None, f"a prepacked() context is open {when}"
    assert casts_mod.current() is None, f"a decode's casts are still read {when}"


@pytest.fixture(autouse=True)
def _process_state_restored():
    """torch.nn.init's functions are torch's own, and no prepacking or decode's casts are
    open in this thread, before and after each test (module fixtures included), so that a leak fails
    where it happens: once, two loads in two threads left init switched off, and every
    later test in the process failed on NaN weights."""
    _process_state_check("before this test (a fixture or an earlier test changed them)")
    yield
    _process_state_check("after this test")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


_ZYGOTE = None


def run_cli(
    *args: str, cwd: Path | str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m anyorder.cli ARGS`` in ``cwd`` with ``env`` (default: this process's),
    forked from one interpreter that has imported the CLI (tests/cli_zygote.py: torch's
    2 s start-up paid once per session, not per call). For checks of interpreter start-up,
    signals, launchers or resource limits, run a real subprocess instead."""
    global _ZYGOTE
    import tempfile

    from cli_zygote import Zygote

    if _ZYGOTE is None:
        import atexit

        _ZYGOTE = Zygote()
        atexit.register(_ZYGOTE.close)
    cwd = Path.cwd() if cwd is None else Path(cwd)
    with tempfile.TemporaryDirectory(prefix="anyorder-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        code = _ZYGOTE.run(list(args), cwd, dict(os.environ if env is None else env), out, err)
        return subprocess.CompletedProcess(
            ["anyorder", *args], code, out.read_text(), err.read_text()
        )


def tiny_bpe(special_tokens: list[str], corpus: list[str]):
    """A byte-level BPE of 300 ids trained on ``corpus`` (``tokenizers``' ``Tokenizer``),
    ``special_tokens`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(corpus, trainer=trainer)
    return raw


def chatml_tokenizer(**tokens):
    """A tiny byte-level BPE (300 ids, ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``
    special) as a ``transformers`` fast tokenizer whose EOS is ``<|im_end|>``; ``tokens``:
    more of its special tokens (``bos_token=...``). No chat template: the caller sets it."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    raw = tiny_bpe(specials, ["hello world user assistant add and"] * 10)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        **tokens,
    )


def gloo_worker(job: str, imports: str, body: str) -> str:
    """The script of one gloo rank for :func:`run_two_ranks`: its arguments read (``job``
    names what ``sys.argv[3]`` holds, as JSON), the process group joined, ``imports`` run,
    then ``body`` (a failure printed, exit 1); the group left, and ``os._exit`` (gloo may
    abort at interpreter exit: MACHINE-NOTES, distributed)."""
    return (
        textwrap.dedent(
            f"""
            import json, os, sys
            from datetime import timedelta

            import torch
            import torch.distributed as dist

            rank, store, {job} = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
            torch.set_num_threads(1)
            dist.init_process_group(
                "gloo", init_method="file://" + store, rank=rank, world_size=2,
                timeout=timedelta(seconds=90),
            )
            """
        )
        + textwrap.dedent(imports)
        + "\ncode = 0\ntry:\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
        + textwrap.dedent(
            """\
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            dist.destroy_process_group()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
            """
        )
    )


def run_two_ranks(script: Path, overrides: str, store: Path, timeout: float = 300) -> list[str]:
    """Two gloo ranks of ``script`` (its arguments: the rank, a rendezvous file, the run's
    overrides as JSON), one thread each, without the caller's launcher variables; returns
    their outputs (stdout and stderr together) once both exit 0, else fails with the output
    of the rank that did not."""
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(store), overrides],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-5000:]
    return outputs


def parquet_declaring(path: Path, declared: int) -> Path:
    """A parquet file of a few kilobytes (one ``text`` column of 3 rows) whose footer
    declares ``declared`` bytes of it uncompressed: the column chunk's and the row group's
    sizes, zigzag varints in the footer's Thrift, are rewritten (the footer grows, and its
    length after it is rewritten too). Only the footer says so; the pages are as written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def varint(value: int) -> bytes:  # Thrift compact: a zigzag i64, 7 bits a byte
        value, out = value << 1, bytearray()
        while value >= 0x80:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        return bytes(out + bytes([value]))

    pq.write_table(pa.table({"text": ["x" * 1000] * 3}), path, compression="zstd")
    data = path.read_bytes()
    n = int.from_bytes(data[-8:-4], "little")
    footer = data[-8 - n : -8]
    real = pq.ParquetFile(path).metadata.row_group(0).column(0).total_uncompressed_size
    field = b"\x16"  # the next field (delta 1), of type i64
    assert field + varint(real) in footer
    footer = footer.replace(field + varint(real), field + varint(declared))
    path.write_bytes(data[: -8 - n] + footer + len(footer).to_bytes(4, "little") + b"PAR1")
    meta = pq.ParquetFile(path).metadata.row_group(0)
    assert meta.column(0).total_uncompressed_size == meta.total_byte_size == declared
    return path
