"""Every row of docs/errors.md: the real CLI, one line on stderr, exit code 2, no files.

Each row runs ``python -m anyorder.cli`` in a folder of its own (a copy of a prepared
world: a trained tiny ARMD run, its data cache, a tokenizer of another vocabulary, bad
corpora and configs) with relative paths, so the messages are stable and the documented
message can be matched whole: ``<...>`` in the table stands for any text. The rows run
four at a time, each forked from an interpreter that has imported the CLI
(tests/cli_zygote.py: most of a row's time was torch's start-up), or in a fresh interpreter
where the row sets environment variables of its own. Every test then checks its own row:

* stderr is exactly one line, the documented message, and holds no ``Traceback``;
* the exit code is the documented one (2);
* the row's folder holds exactly the files it held before (names, sizes and times).

The set of rows here and the set of rows in docs/errors.md must be the same.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cli_zygote import Zygote

from conftest import REPO, parquet_declaring

ERRORS_MD = REPO / "docs" / "errors.md"
CONFIG = """\
model: {kind: armd, n_layer: 2, n_head: 2, d_model: 32, seq_len: 32}
data: {source: "builtin:pydoc", max_documents: 40, cache_dir: cache}
train: {out_dir: run, steps: 2, batch_size: 8, lr: 0.01, warmup_steps: 1, eval_every: 0,
        eval_batches: 1, ckpt_every: 0, log_every: 1, device: cpu}
"""
CKPT = "run/checkpoints/step_0000002"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _truncate(folder: Path) -> None:
    path = folder / CKPT / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_byte(folder: Path) -> None:
    path = folder / CKPT / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor: same size, other bytes
    path.write_bytes(bytes(data))


def _data_folder(folder: Path) -> Path:
    (cache,) = (folder / "cache").iterdir()
    return cache


def _edit_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _flip_shard_byte(folder: Path) -> None:
    path = _data_folder(folder) / "val.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01  # another byte-level token id: same size, other checksum
    path.write_bytes(bytes(data))


def _token_beyond_vocab(folder: Path) -> None:
    """A token id the vocabulary lacks, with the manifest's checksum made to match."""
    import hashlib

    cache = _data_folder(folder)
    data = bytearray((cache / "val.bin").read_bytes())
    data[10:12] = (300).to_bytes(2, "little")  # uint16 shards
    (cache / "val.bin").write_bytes(bytes(data))

    def fix(m):
        m["splits"]["val"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
        return m

    _edit_json(cache / "manifest.json", fix)


def _shard_dtype(folder: Path) -> None:
    _edit_json(_data_folder(folder) / "manifest.json", lambda m: {**m, "dtype": "uint32"})


def _manifest(folder: Path) -> Path:
    return folder / CKPT / "manifest.json"


def _manifest_list(folder: Path) -> None:
    _manifest(folder).write_text("[]")


def _manifest_no_bytes(folder: Path) -> None:
    def drop(m):
        del m["files"]["model.safetensors"]["bytes"]
        return m

    _edit_json(_manifest(folder), drop)


def _manifest_bad_step(folder: Path) -> None:
    _edit_json(_manifest(folder), lambda m: {**m, "step": "two"})


def _unlisted_ema(folder: Path) -> None:
    """EMA weights whose manifest entry was removed (here: a file no entry vouches for)."""
    shutil.copy(folder / CKPT / "model.safetensors", folder / CKPT / "ema.safetensors")


def _no_manifests(folder: Path) -> None:
    for p in (folder / "run" / "checkpoints").glob("step_*/manifest.json"):
        p.unlink()


def _huge_export_config(folder: Path) -> None:
    _edit_json(folder / "exp" / "config.json", lambda c: {**c, "n_layer": 4096, "d_model": 4096})


def _tasks(yaml_text: str):
    """A setup writing a task folder ``tasks/`` of one YAML file (``evil.yaml``), a module
    beside it that leaves a mark if it is ever imported, and the fixture's perplexity data."""

    def setup(folder: Path) -> None:
        (folder / "tasks").mkdir()
        (folder / "tasks" / "evil.yaml").write_text(yaml_text)
        (folder / "tasks" / "hook.py").write_text("open('pwned', 'w').close()\ndocs = None\n")
        shutil.copy(REPO / "tests" / "fixtures" / "lm_eval" / "ppl.jsonl", folder / "tasks")

    return setup


_TEMPLATE_TASK = """\
task: evil
dataset_path: json
dataset_kwargs: {data_files: {test: tasks/ppl.jsonl}}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{ cycler.__init__.__globals__.os.getcwd() }}"
metric_list: [{metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}]
"""
LM_EVAL_TASKS = ["eval", "run", "--suite", "lm-eval", "--tasks", "evil", "--include-path", "tasks"]


def _sparse(name: str):
    """A setup writing ``name``: a sparse file of 1 TiB (no disk; only ``stat`` may see it)."""

    def setup(folder: Path) -> None:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        with open(folder / name, "wb") as f:
            f.truncate(1 << 40)

    return setup


_HELD: list = []  # run-folder locks held by this process for the rows' lifetime


def _hold_run_lock(folder: Path) -> None:
    from anyorder.runlock import RunLock

    _HELD.append(RunLock(folder / "run").acquire())


REF = REPO / "tests" / "fixtures" / "aogpt-ref"  # checkpoints in the AO-GPT authors' format


def _ref_truncated(folder: Path) -> None:
    data = (REF / "aogpt" / "ckpt_1234.pt").read_bytes()
    (folder / "ckpt_1234.pt").write_bytes(data[: len(data) // 2])


def _ref_ema_short(folder: Path) -> None:
    import torch

    ckpt = torch.load(REF / "aogpt" / "ckpt_1234.pt", weights_only=True)
    ckpt["ema_model"]["shadow_params"].pop()
    torch.save(ckpt, folder / "ckpt_1234.pt")


def _ref_sigma(folder: Path) -> None:
    shutil.copy(REF / "sigmagpt" / "ckpt_1234.pt", folder / "ckpt_1234.pt")


def _write(name: str, data: bytes):
    """A setup that writes ``name`` into the row's folder."""

    def setup(folder: Path) -> None:
        (folder / name).write_bytes(data)

    return setup


# a billion laughs: 6 levels of 9 aliases each, 9**6 values from 250 bytes
_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcde", "bcdef")
)


def _chat_row(bad: dict | str) -> tuple[list[str], dict[str, str], object]:
    """A row training on corpus/chat.jsonl: a good prompt/response record, then ``bad`` (a
    record, or a line of text as it is)."""
    good = json.dumps({"prompt": "1+1", "response": "2"})
    lines = "".join(
        r + "\n" for r in (good, bad if isinstance(bad, str) else json.dumps(bad), good)
    )
    setup = _write("corpus/chat.jsonl", lines.encode())
    return [*TRAIN, "data.source=corpus/chat.jsonl", *FRESH], {}, setup


def _user_folder(folder: Path) -> None:
    """A folder of the user's own, holding files of the names a run writes."""
    (folder / "mine").mkdir()
    (folder / "mine" / "config.yaml").write_text("# my notes\nmodel: {kind: gpt}\n")
    (folder / "mine" / "summary.json").write_text("{}\n")


# issue 24: a user's own files (write errors, weights that are not finite, damaged files)


def _good_export(folder: Path) -> Path:
    from anyorder.checkpoint.exporting import export

    return export(folder / "run", folder / "good")


def _hostile_chat_export(folder: Path) -> None:
    """An export whose tokenizer's chat template loops for ever (three nested ranges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from anyorder.checkpoint.exporting import save_pretrained
    from anyorder.data import load_tokenizer

    from conftest import tiny_model

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=alphabet, show_progress=False)  # fmt: skip
    raw.train_from_iterator(["hello world"] * 10, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    loop = "{% for i in range(99999) %}"
    tok.chat_template = loop * 3 + "{% endfor %}" * 3
    tok.save_pretrained(str(folder / "tok"))
    model = tiny_model("aogpt", seed=1, vocab_size=320, seq_len=32, n_layer=1, d_model=32)
    save_pretrained(model, folder / "chat", load_tokenizer(str(folder / "tok")))


def _sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _nan_into(path: Path) -> None:
    """One NaN in the first float tensor of a safetensors file (header and size unchanged)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    with open(path, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little"))).get("__metadata__")
    name = sorted(state)[0]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(path), metadata=meta)


def _nan_export(folder: Path) -> None:
    good = _good_export(folder)
    _nan_into(good / "model.safetensors")
    sha = _sha(good / "model.safetensors")
    _edit_json(good / "config.json", lambda c: {**c, "weights_sha256": sha})


def _relist(folder: Path, name: str) -> None:
    """Update the manifest entry of ``name`` in the world's checkpoint after editing it."""
    path = folder / CKPT / name
    entry = {"bytes": path.stat().st_size, "sha256": _sha(path)}
    _edit_json(_manifest(folder), lambda m: {**m, "files": {**m["files"], name: entry}})


def _nan_checkpoint(folder: Path) -> None:
    _nan_into(folder / CKPT / "model.safetensors")
    _relist(folder, "model.safetensors")


def _state_empty(folder: Path) -> None:
    import torch

    torch.save({}, folder / CKPT / "state.pt")
    _relist(folder, "state.pt")


def _state_rng_text(folder: Path) -> None:
    import torch

    state = torch.load(folder / CKPT / "state.pt", weights_only=True)
    state["rng"] = "abc"  # of length 3: it was taken for 3 processes' RNGs and reseeded
    torch.save(state, folder / CKPT / "state.pt")
    _relist(folder, "state.pt")


class _Payload:
    """A pickle that would run a command when unpickled (it must never run)."""

    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _state_code(folder: Path) -> None:
    import torch

    torch.save({"optimizer": _Payload()}, folder / CKPT / "state.pt")
    _relist(folder, "state.pt")


def _ref_code(folder: Path) -> None:
    import torch

    torch.save({"model": _Payload(), "model_args": {}}, folder / "ckpt_1234.pt")


def _ref_claims_layers(folder: Path) -> None:
    import torch

    ckpt = torch.load(REF / "aogpt" / "ckpt_1234.pt", weights_only=True)
    ckpt["model_args"]["n_layer"] = 10**6
    torch.save(ckpt, folder / "ckpt_1234.pt")


def _ref_claims_context(folder: Path) -> None:
    import torch

    ckpt = torch.load(REF / "aogpt" / "ckpt_1234.pt", weights_only=True)
    ckpt["model_args"]["block_size"] = 10**12
    torch.save(ckpt, folder / "ckpt_1234.pt")


def _export_config_nested(folder: Path) -> None:
    _good_export(folder)
    (folder / "good" / "config.json").write_text("[" * 100_000 + "]" * 100_000)


def _export_config_infinity(folder: Path) -> None:
    _good_export(folder)
    path = folder / "good" / "config.json"
    config = json.loads(path.read_text())
    config["norm_eps"] = float("inf")
    path.write_text(json.dumps(config))  # Python's json writes Infinity, which JSON has not
    assert '"norm_eps": Infinity' in path.read_text()


def _export_config_overflow(folder: Path) -> None:
    _good_export(folder)
    path = folder / "good" / "config.json"
    text = path.read_text()
    assert '"mlp_ratio": 4.0' in text
    path.write_text(text.replace('"mlp_ratio": 4.0', '"mlp_ratio": 1e400'))  # JSON; read as inf


def _export_config_seq_len(folder: Path) -> None:
    _good_export(folder)
    _edit_json(folder / "good" / "config.json", lambda c: {**c, "seq_len": 1e9})


def _export_config_seq_len_huge(folder: Path) -> None:
    _good_export(folder)  # the weights do not hold seq_len (ARMD with RoPE): the length can
    _edit_json(folder / "good" / "config.json", lambda c: {**c, "seq_len": 10**15})


def _export_no_checksum(folder: Path) -> None:
    _good_export(folder)
    _edit_json(
        folder / "good" / "config.json",
        lambda c: {k: v for k, v in c.items() if k != "weights_sha256"},
    )


def _ref_copy(folder: Path) -> None:
    shutil.copy(REF / "aogpt" / "ckpt_1234.pt", folder / "ckpt_1234.pt")


_FAMILY = dict(
    model_type="mistral", vocab_size=320, hidden_size=32, intermediate_size=64,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    hidden_act="silu", sliding_window=None,
)  # fmt: skip


def _family(**config):
    """A transformers-style source folder (config.json alone: the refusals come before any
    weight is read)."""

    def setup(folder: Path) -> None:
        (folder / "src").mkdir()
        (folder / "src" / "config.json").write_text(json.dumps({**_FAMILY, **config}))

    return setup


def _family_index_outside(folder: Path) -> None:
    _family()(folder)
    index = {"weight_map": {"lm_head.weight": "../secret.safetensors"}}
    (folder / "src" / "model.safetensors.index.json").write_text(json.dumps(index))


def _family_config_pipe(folder: Path) -> None:
    (folder / "src").mkdir()
    os.mkfifo(folder / "src" / "config.json")


def _family_config_nested(folder: Path) -> None:
    (folder / "src").mkdir()
    (folder / "src" / "config.json").write_text("[" * 100_000)


def _family_shard_header(folder: Path) -> None:
    _family()(folder)
    (folder / "src" / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")


TRAIN = ["train", "cfg.yaml", "--no-progress"]
CONVERT_REF = ["convert", "ckpt_1234.pt", "--from", "aogpt-ref", "--out", "ao"]
CONVERT_HF = ["convert", "src", "--to", "gpt", "--out", "ao"]
NEW = "train.out_dir=new"  # a run folder that must not appear
FRESH = [NEW, "data.cache_dir=newcache"]  # and a data cache that must not appear either
# id: (command line, extra environment, setup of the row's folder)
ROWS: dict[str, tuple[list[str], dict[str, str], object]] = {
    "config-unknown-key": ([*TRAIN, "model.n_layr=2"], {}, None),
    "config-unknown-key-far": ([*TRAIN, "train.zzzz=1"], {}, None),
    "config-unknown-section": ([*TRAIN, "trian.steps=1"], {}, None),
    "config-ill-typed": ([*TRAIN, "train.steps=many"], {}, None),
    "config-file-unknown-key": (["train", "typo.yaml"], {}, None),
    "config-missing-file": (["train", "nope.yaml"], {}, None),
    # stat only: a named pipe is never opened (opening one blocks until a writer comes)
    "config-fifo": (["train", "pipe.yaml"], {}, lambda f: os.mkfifo(f / "pipe.yaml")),
    "config-folder": (["train", "confs"], {}, lambda f: (f / "confs").mkdir()),
    "config-bad-yaml": (["train", "broken.yaml"], {}, None),
    "config-not-key-value": ([*TRAIN, "train.steps"], {}, None),
    "cli-bad-option": (["sample", "run", "--top-p", "abc"], {}, None),
    "cli-unknown-command": (["trian"], {}, None),
    "cli-bad-choice": (["sample", "run", "--order", "rnadom"], {}, None),
    "cli-unknown-option": (["demo", "--stpes", "3"], {}, None),
    "config-bad-value": ([*TRAIN, "train.lr=0", NEW], {}, None),
    "lora-without-init-from": ([*TRAIN, "train.lora.r=8", NEW], {}, None),
    "data-missing": ([*TRAIN, "data.source=missing.txt", *FRESH], {}, None),
    "data-empty-file": ([*TRAIN, "data.source=corpus/empty.txt", *FRESH], {}, None),
    "data-empty-folder": ([*TRAIN, "data.source=emptydir", *FRESH], {}, None),
    "data-unreadable": ([*TRAIN, "data.source=corpus/bad.parquet", *FRESH], {}, None),
    "data-txt-too-large-bpe": (
        [*TRAIN, "data.source=corpus/huge", "data.tokenizer=bpe:300", *FRESH],
        {},
        _sparse("corpus/huge/huge.txt"),
    ),
    "data-hf-txt-too-large": (
        [*TRAIN, "data.source=hf:corpus/huge", *FRESH],
        {},
        _sparse("corpus/huge/huge.txt"),
    ),
    "eval-data-dir-too-large": (
        ["eval", "run", "--suite", "zero-shot", "--datasets", "lambada", "--data-dir", "dd"],
        {},
        _sparse("dd/lambada/huge.txt"),
    ),
    "data-parquet-too-large": (
        [*TRAIN, "data.source=corpus/claims.parquet", *FRESH],
        {},
        lambda folder: parquet_declaring(folder / "corpus" / "claims.parquet", 10**15),
    ),
    "data-too-small": ([*TRAIN, "data.source=corpus/tiny.txt", *FRESH], {}, None),
    "tokenizer-vocab-resume": ([*TRAIN, "data.tokenizer=tok300"], {}, None),
    "tokenizer-vocab-init-from": (
        [*TRAIN, "train.init_from=run", "data.tokenizer=tok300", NEW],
        {},
        None,
    ),
    "tokenizer-vocab-export": (["sample", "exp"], {}, None),
    "checkpoint-missing": (["sample", "nowhere"], {}, None),
    "checkpoint-none": (["sample", "emptydir"], {}, None),
    "checkpoint-truncated": (["sample", "run"], {}, _truncate),
    "checkpoint-corrupted": (["sample", "run"], {}, _flip_byte),
    "checkpoint-kind-resume": ([*TRAIN, "model.kind=aogpt"], {}, None),
    "checkpoint-kind-init-from": (
        [*TRAIN, "train.init_from=run", "model.kind=gpt", NEW],
        {},
        None,
    ),
    "convert-ref-truncated": (CONVERT_REF, {}, _ref_truncated),
    "convert-ref-ema-mismatch": (CONVERT_REF, {}, _ref_ema_short),
    "convert-ref-other-format": (CONVERT_REF, {}, _ref_sigma),
    "prompt-too-long": (["sample", "run", "--prompt", "x" * 40], {}, None),
    "infill-hole-out-of-range": (["sample", "run", "--infill", "ab[MASK:40]"], {}, None),
    "infill-template-too-long": (["sample", "run", "--infill", "y" * 30 + "[MASK:4]"], {}, None),
    "infill-overlapping-holes": (["sample", "run", "--infill", "a[MASK:3[MASK:2]]b"], {}, None),
    "infill-bad-hole": (["sample", "run", "--infill", "a[MASK:0]b"], {}, None),
    "infill-no-hole": (["sample", "run", "--infill", "abc"], {}, None),
    "streams-do-not-divide": (["sample", "run", "--streams", "5"], {}, None),
    "streams-zero": (["sample", "run", "--streams", "0"], {}, None),
    "chat-with-length": (["sample", "run", "--chat", "hi", "--length", "20"], {}, None),
    "max-new-tokens-without-chat": (["sample", "run", "--max-new-tokens", "4"], {}, None),
    "chat-prompt-too-long": (["sample", "run", "--chat", "x" * 20], {}, None),
    "chat-max-new-tokens-out-of-range": (
        ["sample", "run", "--chat", "x", "--max-new-tokens", "9"],
        {},
        None,
    ),
    "chat-streams-not-a-divisor": (
        ["sample", "run", "--chat", "x", "--max-new-tokens", "7", "--streams", "2"],
        {},
        None,
    ),
    "top-p-out-of-range": (["sample", "run", "--top-p", "1.5"], {}, None),
    "temperature-not-positive": (["sample", "run", "--temperature", "0"], {}, None),
    "gpu-train": ([*TRAIN, "train.device=cuda", NEW], {}, None),
    "gpu-sample": (["sample", "run", "--device", "cuda"], {}, None),
    "gpu-eval": (["eval", "run", "--device", "cuda"], {}, None),
    "torchrun-rendezvous": (
        [*TRAIN, NEW],
        {
            "WORLD_SIZE": "2",
            "RANK": "1",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "CLOSED_PORT",
            "ANYORDER_DIST_TIMEOUT_S": "2",
        },
        None,
    ),
    # issue 17: one writer per run folder, bounds, verified data, manifests, tracebacks
    "run-folder-busy": ([*TRAIN], {}, _hold_run_lock),
    "sample-steps-too-many": (["sample", "run", "--steps", "100000000"], {}, None),
    # issue 25: a flag that would be ignored is refused, naming what works
    "sample-step-flags-without-steps": (["sample", "run", "--reveal", "reference"], {}, None),
    "sample-confidence-flags-without-confidence": (["sample", "run", "--per-pass", "4"], {}, None),
    "sample-per-pass-with-speculative": (
        ["sample", "run", "--order", "confidence", "--speculative", "4", "--per-pass", "2"],
        {},
        None,
    ),
    "data-shard-corrupted": (["eval", "run"], {}, _flip_shard_byte),
    "data-token-out-of-range": (["eval", "run"], {}, _token_beyond_vocab),
    "data-manifest-damaged": (["eval", "run"], {}, _shard_dtype),
    "data-val-fraction-zero": ([*TRAIN, "data.val_fraction=0", *FRESH], {}, None),
    "checkpoint-manifest-damaged": (["sample", "run"], {}, _manifest_list),
    "checkpoint-manifest-no-bytes": (["sample", "run"], {}, _manifest_no_bytes),
    "checkpoint-manifest-bad-step": (["sample", "run"], {}, _manifest_bad_step),
    "checkpoint-ema-unlisted": (["sample", "run"], {}, _unlisted_ema),
    "checkpoint-manifests-missing": ([*TRAIN], {}, _no_manifests),
    "infill-hole-huge": (["sample", "run", "--infill", "a[MASK:" + "9" * 5000 + "]"], {}, None),
    "seed-out-of-range": (["sample", "run", "--seed", str(2**70)], {}, None),
    "num-samples-out-of-range": (["sample", "run", "--num-samples", "100000000"], {}, None),
    "length-zero": (["sample", "run", "--length", "0"], {}, None),
    # issue 26: speculative sampling
    "speculative-with-steps": (["sample", "run", "--speculative", "4", "--steps", "8"], {}, None),
    "speculative-zero": (["sample", "run", "--speculative", "0"], {}, None),
    "eval-targets-zero": (["eval", "run", "--ensemble", "2", "--targets", "0"], {}, None),
    "eval-gen-sweep-empty": (["eval", "run", "--suite", "gen", "--steps", ","], {}, None),
    "eval-out-is-file": (["eval", "run", "--out", "cfg.yaml"], {}, None),
    "eval-lm-eval-no-tasks": (["eval", "run", "--suite", "lm-eval"], {}, None),
    "eval-lm-eval-model-args": (
        ["eval", "run", "--suite", "lm-eval", "--tasks", "wikitext", "--model-args", "order=up"],
        {},
        None,
    ),
    "eval-lm-eval-task-code": (
        LM_EVAL_TASKS,
        {},
        _tasks("task: evil\nprocess_docs: !function hook.docs\n"),
    ),
    "eval-lm-eval-task-metric": (
        LM_EVAL_TASKS,
        {},
        _tasks("task: evil\nmetric_list: [{metric: ./hook.py}]\n"),
    ),
    # a fresh interpreter: the harness's data loading draws no progress bars on stderr
    "eval-lm-eval-task-template": (
        [*LM_EVAL_TASKS, "--limit", "1", "--device", "cpu"],
        {"HF_DATASETS_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"},
        _tasks(_TEMPLATE_TASK),
    ),
    "out-dir-is-file": ([*TRAIN, "train.out_dir=cfg.yaml"], {}, None),
    "out-dir-unwritable": ([*TRAIN, "train.out_dir=/proc/anyorder-run"], {}, None),
    "cache-dir-under-file": (
        [*TRAIN, NEW, "data.cache_dir=cfg.yaml/cache"],
        {},
        None,
    ),
    "serve-port-out-of-range": (["serve", "run", "--port", "99999"], {}, None),
    "serve-time-limit-infinite": (["serve", "run", "--time-limit", "inf"], {}, None),
    "serve-host-empty": (["serve", "run", "--host", ""], {}, None),
    "serve-max-draft-out-of-range": (["serve", "run", "--max-draft", "0"], {}, None),
    "config-empty-file": (["train", "empty.yaml"], {}, None),
    "tokenizer-hub-unreachable": (
        [*TRAIN, "data.tokenizer=nope", *FRESH],
        {"HF_ENDPOINT": "http://127.0.0.1:CLOSED_PORT"},
        None,
    ),
    "export-config-does-not-fit": (["sample", "exp"], {}, _huge_export_config),
    # issue 24: run folders that are not a run's; configs that expand, nest or decode badly
    "out-dir-empty": ([*TRAIN, "train.out_dir="], {}, None),
    "out-dir-current-folder": ([*TRAIN, "train.out_dir=."], {}, None),
    "out-dir-not-a-run": ([*TRAIN, "train.out_dir=mine"], {}, _user_folder),
    "config-aliases-expand": (
        ["train", "laughs.yaml"],
        {},
        _write("laughs.yaml", (_LAUGHS + "train: {steps: *f}\n").encode()),
    ),
    "config-alias-loop": (["train", "loop.yaml"], {}, _write("loop.yaml", b"train: &a [*a]\n")),
    "config-nested-deep": (
        ["train", "deep.yaml"],
        {},
        _write("deep.yaml", b"train: {steps: " + b"[" * 5000 + b"]" * 5000 + b"}\n"),
    ),
    "config-not-utf8": (
        ["train", "latin1.yaml"],
        {},
        _write("latin1.yaml", "train: {steps: 3}  # caf\xe9\n".encode("latin-1")),
    ),
    "config-utf16": (
        ["train", "utf16.yaml"],
        {},
        _write("utf16.yaml", "train: {steps: 3}\n".encode("utf-16")),
    ),
    "config-duplicate-key": (
        ["train", "dup.yaml"],
        {},
        _write("dup.yaml", b"train: {steps: 3}\nmodel: {d_model: 64, d_model: 32}\n"),
    ),
    # issue 24: sizes refused before the allocator sees them, numbers at their edges
    "train-step-too-large": ([*TRAIN, "train.batch_size=100000000", NEW], {}, None),
    "model-too-wide": ([*TRAIN, "model.d_model=1000000", NEW], {}, None),
    "model-too-deep": ([*TRAIN, "model.n_layer=10000000", NEW], {}, None),
    "eval-orders-too-many": (["eval", "run", "--orders", "1000000000"], {}, None),
    "eval-ensemble-too-large": (["eval", "run", "--ensemble", "1000000"], {}, None),
    "train-seed-out-of-range": ([*TRAIN, f"train.seed={2**70}", NEW], {}, None),
    "train-beta2-one": ([*TRAIN, "train.beta2=1", NEW], {}, None),
    "order-streams-zero": ([*TRAIN, "order.kind=strided", "order.streams=0", NEW], {}, None),
    "order-sbp-streams-zero": (
        [*TRAIN, "order.kind=sbp", "order.sbp_streams=[0]", NEW],
        {},
        None,
    ),
    "temperature-subnormal": (["sample", "run", "--temperature", "5e-324"], {}, None),
    "cache-dir-empty": ([*TRAIN, NEW, "data.cache_dir="], {}, None),
    "config-number-too-long": ([*TRAIN, "train.steps=" + "9" * 5000], {}, None),
    "config-value-too-long": ([*TRAIN, "model.kind=" + "x" * 5000, NEW], {}, None),
    "model-kv-heads-not-divisor": ([*TRAIN, "model.n_kv_head=3", NEW], {}, None),
    "model-head-dim-odd-rope": ([*TRAIN, "model.head_dim=7", NEW], {}, None),
    "model-rope-scaling-unknown": ([*TRAIN, "model.rope_scaling_type=yarn", NEW], {}, None),
    "model-rope-scaling-learned": (
        [
            *TRAIN,
            "model.pos_emb=learned",
            "model.rope_scaling_type=linear",
            "model.rope_factor=2",
            NEW,
        ],
        {},
        None,
    ),
    "model-rope-factor-alone": ([*TRAIN, "model.rope_factor=2", NEW], {}, None),
    "model-llama3-field-alone": (
        [
            *TRAIN,
            "model.rope_scaling_type=linear",
            "model.rope_factor=2",
            "model.rope_original_max_pos=4096",
            NEW,
        ],
        {},
        None,
    ),  # fmt: skip
    "model-llama3-band-empty": (
        [
            *TRAIN,
            "model.rope_scaling_type=llama3",
            "model.rope_low_freq_factor=4",
            "model.rope_high_freq_factor=1",
            NEW,
        ],
        {},
        None,
    ),  # fmt: skip
    # issue 24: lenient inputs made strict
    "infill-hole-non-ascii-digit": (["sample", "run", "--infill", "a[MASK:\u0663]b"], {}, None),
    "sample-text-not-utf8": (["sample", "run", "--prompt", "a\udcffb"], {}, None),
    "data-not-utf8": (
        [*TRAIN, "data.source=corpus/latin1.txt", *FRESH],
        {},
        _write("corpus/latin1.txt", "caf\xe9 au lait\n".encode("latin-1") * 20),
    ),
    "data-utf16": (
        [*TRAIN, "data.source=corpus/utf16.txt", *FRESH],
        {},
        _write("corpus/utf16.txt", ("some text\n" * 20).encode("utf-16")),
    ),
    "data-binary": (
        [*TRAIN, "data.source=corpus/random.txt", *FRESH],
        {},
        _write("corpus/random.txt", bytes(range(256)) * 800),
    ),
    "data-nul-bytes": (
        [*TRAIN, "data.source=corpus/nul.txt", *FRESH],
        {},
        _write("corpus/nul.txt", b"hello\x00world " * 20),
    ),
    # issue 34: conversational records, one line naming the file and line
    "data-chat-missing-field": _chat_row({"prompt": "q"}),
    "data-chat-empty-answer": _chat_row({"prompt": "q", "response": ""}),
    "data-chat-long-prompt": _chat_row({"prompt": "q" * 40, "response": "a"}),
    "data-chat-bad-role": _chat_row(
        {"messages": [{"role": "bot", "content": "q"}, {"role": "assistant", "content": "a"}]}
    ),
    "data-chat-too-deep": _chat_row('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "data-chat-huge-number": _chat_row(
        '{"prompt": "q", "response": "a", "n": ' + "9" * 10_000 + "}"
    ),
    "config-condition-text-data": ([*TRAIN, "order.condition=prompt", *FRESH], {}, None),
    # issue 24: write errors, weights that are not finite, damaged files, paths
    "export-out-unwritable": (["export", "run", "--out", "/proc/anyorder-export"], {}, None),
    "export-out-under-file": (["export", "run", "--out", "cfg.yaml/exp"], {}, None),
    "export-adapters-only-full-run": (
        ["export", "run", "--out", "ad", "--adapters-only"],
        {},
        None,
    ),
    "export-out-name-too-long": (["export", "run", "--out", "e" * 300], {}, None),
    "convert-out-unwritable": ([*CONVERT_REF[:-1], "/proc/anyorder-ao"], {}, _ref_copy),
    "eval-out-unwritable": (["eval", "run", "--out", "/proc/anyorder-eval/x"], {}, None),
    "path-too-long": (["sample", "r" * 5000], {}, None),
    "run-folder-not-utf8": ([*TRAIN, "train.out_dir=run\udcff"], {}, None),
    "export-weights-not-finite": (["sample", "good"], {}, _nan_export),
    "checkpoint-weights-not-finite": (["sample", "run"], {}, _nan_checkpoint),
    "init-from-not-finite": ([*TRAIN, "train.init_from=good", NEW], {}, _nan_export),
    "state-wrong-content": ([*TRAIN, "train.steps=4"], {}, _state_empty),
    "state-wrong-types": ([*TRAIN, "train.steps=4"], {}, _state_rng_text),
    "state-python-objects": ([*TRAIN, "train.steps=4"], {}, _state_code),
    "convert-ref-python-objects": (CONVERT_REF, {}, _ref_code),
    "convert-family-window": (CONVERT_HF, {}, _family(sliding_window=16)),
    "convert-family-moe": (CONVERT_HF, {}, _family(num_local_experts=8)),
    "convert-family-rope-type": (
        CONVERT_HF,
        {},
        _family(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
    ),
    "convert-family-gemma": (CONVERT_HF, {}, _family(model_type="gemma")),
    "convert-family-no-bos": (CONVERT_HF, {}, _family(bos_token_id=None)),
    "convert-family-says-gpt2": (CONVERT_HF, {}, _family(model_type="gpt2")),
    "convert-family-type-not-name": (CONVERT_HF, {}, _family(model_type=["mistral"])),
    "convert-no-model-type": (CONVERT_HF, {}, _family(model_type=None)),
    "convert-family-rope-not-object": (CONVERT_HF, {}, _family(rope_scaling="yarn")),
    "convert-family-size-not-int": (CONVERT_HF, {}, _family(hidden_size=32.0)),
    "convert-seq-len-bound": (
        ["convert", "src", "--to", "aogpt", "--seq-len", "10000000", "--out", "ao"],
        {},
        _family(max_position_embeddings=2**41),
    ),
    "convert-ref-claims-layers": (CONVERT_REF, {}, _ref_claims_layers),
    "convert-ref-claims-context": (CONVERT_REF, {}, _ref_claims_context),
    "convert-index-outside": (CONVERT_HF, {}, _family_index_outside),
    # a fresh interpreter (a variable of its own) has a timeout: a pipe read does not hang
    "convert-source-pipe": (CONVERT_HF, {"HF_HUB_OFFLINE": "1"}, _family_config_pipe),
    "convert-config-nested": (CONVERT_HF, {}, _family_config_nested),
    "convert-shard-header": (CONVERT_HF, {}, _family_shard_header),
    "chat-template-unbounded": (
        ["sample", "chat", "--chat", "hi", "--device", "cpu"],
        {},
        _hostile_chat_export,
    ),
    "export-config-nested": (["sample", "good"], {}, _export_config_nested),
    "export-config-infinity": (["sample", "good"], {}, _export_config_infinity),
    "export-config-overflow": (["sample", "good"], {}, _export_config_overflow),
    "export-config-seq-len-float": (["sample", "good"], {}, _export_config_seq_len),
    "export-config-seq-len-huge": (["sample", "good"], {}, _export_config_seq_len_huge),
    "export-no-checksum": (["sample", "good"], {}, _export_no_checksum),
    "convert-hub-offline": (
        ["convert", "hf:owner/repo/ckpt_1.pt", "--from", "aogpt-ref", "--out", "ao"],
        {"HF_ENDPOINT": "http://127.0.0.1:CLOSED_PORT"},
        None,
    ),
    "convert-gpt2-hub-offline": (
        ["convert", "owner/gpt2-copy", "--to", "gpt", "--out", "g"],
        {"HF_ENDPOINT": "http://127.0.0.1:CLOSED_PORT"},
        None,
    ),
    # hostile-input review: flags that did nothing, checks a dry run skipped, long values
    "sample-infill-no-stop-at-eos": (
        ["sample", "run", "--infill", "a[MASK:2]b", "--no-stop-at-eos"],
        {},
        None,
    ),
    "dry-run-out-dir-not-a-run": (
        [*TRAIN, "--dry-run", "train.out_dir=mine"],
        {},
        _user_folder,
    ),
    "dry-run-out-dir-is-file": ([*TRAIN, "--dry-run", "train.out_dir=cfg.yaml"], {}, None),
    "dry-run-out-dir-other-run": ([*TRAIN, "--dry-run", "model.n_layer=3"], {}, None),
}


# ----------------------------------------------------------------------------- the table


def documented_rows() -> dict[str, tuple[str, int]]:
    """``{id: (message pattern, exit code)}`` from the table in docs/errors.md."""
    rows: dict[str, tuple[str, int]] = {}
    for line in ERRORS_MD.read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 5 or not re.fullmatch(r"`[a-z0-9-]+`", cells[0]):
            continue
        ident, code, message = cells[0].strip("`"), cells[3], cells[4]
        m = re.fullmatch(r"`(.*)`", message)
        assert m, f"docs/errors.md row {ident}: the message cell must be one `code span`"
        rows[ident] = (m.group(1).replace("\\|", "|"), int(code))
    return rows


def message_regex(documented: str) -> re.Pattern[str]:
    """The documented message as a regex: ``<...>`` placeholders match any text."""
    parts = re.split(r"<[^<>]*>", documented)
    return re.compile(".+?".join(re.escape(p) for p in parts))


def test_every_documented_row_has_a_test_and_back() -> None:
    assert set(documented_rows()) == set(ROWS)


# ----------------------------------------------------------------------------- the world


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: relative path -> (size, mtime in ns) for files,
    (0, 0) for folders (a temporary folder made and removed again changes a folder's mtime,
    not what it holds)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[str((Path(dirpath) / name).relative_to(root)) + "/"] = (0, 0)
        for name in filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The folder every row starts from (copied per row)."""
    from anyorder.config import load_config
    from anyorder.data import BPETokenizer
    from anyorder.training.loop import train

    root = tmp_path_factory.mktemp("errors_world")
    (root / "cfg.yaml").write_text(CONFIG)
    (root / "typo.yaml").write_text("train: {stpes: 3}\n")
    (root / "broken.yaml").write_text("model: {kind: [armd\n")
    (root / "empty.yaml").write_text("# nothing set\n")
    (root / "corpus").mkdir()
    (root / "corpus" / "empty.txt").write_text("")
    (root / "corpus" / "tiny.txt").write_text("hello\n")
    (root / "corpus" / "bad.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    (root / "emptydir").mkdir()
    from pydoc_data.topics import topics

    cwd = os.getcwd()
    os.chdir(root)  # the run's config keeps the relative paths the rows use
    try:
        train(load_config("cfg.yaml"), progress=False)
    finally:
        os.chdir(cwd)
    BPETokenizer.train(list(topics.values())[:40], 300).save(root / "tok300")
    # an export whose tokenizer folder was swapped for one of another vocabulary
    from anyorder.checkpoint.exporting import export

    export(root / "run", root / "exp")
    shutil.rmtree(root / "exp" / "tokenizer")
    shutil.copytree(root / "tok300", root / "exp" / "tokenizer")
    assert (root / CKPT / "manifest.json").is_file()
    return root


def _run_row(ident: str, world: Path, base: Path, zygotes: queue.Queue) -> dict:
    args, extra, setup = ROWS[ident]
    folder = base / ident
    shutil.copytree(world, folder, symlinks=True)
    if setup is not None:
        setup(folder)
    # CUDA_VISIBLE_DEVICES="" makes any machine one without a GPU (the gpu-* rows)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({k: v.replace("CLOSED_PORT", str(_closed_port())) for k, v in extra.items()})
    before = _tree(folder)
    if extra:  # variables of its own, perhaps read at import time: a fresh interpreter
        out = subprocess.run(
            [sys.executable, "-m", "anyorder.cli", *args],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    else:  # the same CLI, forked from an interpreter that has imported it (tests/cli_zygote.py)
        zygote = zygotes.get()
        try:
            outs = base / f"{ident}.stdout", base / f"{ident}.stderr"
            code = zygote.run(args, folder, env, *outs)
        finally:
            zygotes.put(zygote)
        stdout, stderr = (p.read_text() for p in outs)
    return {
        "code": code,
        "stderr": stderr,
        "stdout": stdout,
        "before": before,
        "after": _tree(folder),
    }


@pytest.fixture(scope="module")
def outcomes(world, tmp_path_factory) -> dict[str, dict]:
    """Every row, four at a time, each forked from one of four interpreters that have
    imported the CLI (most of a row's time was interpreter and torch start-up)."""
    base = tmp_path_factory.mktemp("errors_rows")
    zygotes: queue.Queue = queue.Queue()
    for _ in range(4):
        zygotes.put(Zygote())
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {i: pool.submit(_run_row, i, world, base, zygotes) for i in ROWS}
            results = {i: f.result() for i, f in futures.items()}
    finally:
        while not zygotes.empty():
            zygotes.get().close()
    report = base / "outcomes.json"
    clean = sum(r["code"] == 2 and len(r["stderr"].splitlines()) == 1 for r in results.values())
    report.write_text(json.dumps({"rows": len(results), "clean": clean}) + "\n")
    print(f"\nbad inputs tried: {len(results)}, clean one-line errors (exit 2): {clean}")
    return results


@pytest.mark.parametrize("ident", sorted(ROWS))
def test_documented_error(ident: str, outcomes) -> None:
    pattern, code = documented_rows()[ident]
    r = outcomes[ident]
    lines = r["stderr"].splitlines()
    assert "Traceback" not in r["stderr"], r["stderr"]
    assert len(lines) == 1, r["stderr"]
    assert message_regex(pattern).fullmatch(lines[0]), f"{lines[0]!r} !~ {pattern!r}"
    assert r["code"] == code == 2, r["stderr"]
    changed = sorted(set(r["after"].items()) ^ set(r["before"].items()))
    assert not changed, f"files were left behind or changed: {changed}"
