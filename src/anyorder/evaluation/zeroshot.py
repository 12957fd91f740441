"""The zero-shot perplexity protocol of SEDD, RADD and AO-GPT (METHOD.md section 5).

Each test set is read (from the Hugging Face hub through ``datasets``, or from local files),
every example is detokenized with its dataset's rules, tokenized with the *checkpoint's*
tokenizer, followed by one EOS, concatenated, cut into blocks of the model's ``seq_len``
(1024 for the paper models), and the remainder is dropped. Peers' numbers are comparable
only this way.

Datasets (name: hub path, config, split, field):

* ``wikitext2``: ``wikitext``, ``wikitext-2-raw-v1``, test, ``text``
* ``wikitext103``: ``wikitext``, ``wikitext-103-raw-v1``, test, ``text``
* ``ptb``: ``ptb_text_only``, test, ``sentence``
* ``lambada``: OpenAI's ``lambada_test.jsonl`` (through the ``json`` builder), ``text``
* ``lm1b``: ``lm1b``, test, ``text``

Splits and protocols: every set is read on its test split (``ours``, the SEDD/RADD
protocol), except where a protocol or ``--splits`` says otherwise. ``reference`` reproduces
the AO-GPT reference code (scxue/AO-GPT-MDM, ``data.get_valid_dataloaders``): WikiText-2 on
its *train* split, the others on test, so its published WikiText-2 column (31.52 / 33.73 /
30.16) is on other text than a test-split figure. That code also scores one random order
per block on up to 128 randomly drawn blocks per set (PTB: all); use ``--orders 1`` and
``--max-blocks`` to come close (ours takes the first blocks). It also cuts blocks per group
of examples, not over the whole set (:func:`reference_groups`: 8 contiguous shards, each in
map batches of 1000 examples, every group's remainder dropped); the ``reference`` protocol
does the same, so its blocks are the reference's blocks.

Offline layout (``--data-dir DIR``): one folder per dataset, named as above, holding that
dataset's *test split*; another split goes in a subfolder named after it
(``DIR/wikitext2/train/wiki.train.raw.txt``; a ``test/`` subfolder is read before the
files beside it). Files in any of

* ``.txt``: one example per line, line ending kept; a whitespace-only line is the empty
  example ``""`` (this is how the ``wikitext`` builder turns ``wiki.test.raw`` into rows);
* ``.jsonl`` / ``.json`` (JSON lines): one example per line, the dataset's field;
* ``.parquet``: one example per row, the dataset's field (a ``datasets`` export).

e.g. ``DIR/wikitext2/wiki.test.raw.txt``, ``DIR/ptb/test.parquet``,
``DIR/lambada/lambada_test.jsonl``. Files are read in name order.

The run over the sets and its table: :mod:`anyorder.evaluation.zeroshot_table`.

Design choices:

* Every example gets its EOS, empty ones included (a wikitext blank row is a lone EOS), as
  in the peers' pipeline, which maps the tokenizer over every row without filtering.
* The detokenizers (:mod:`anyorder.evaluation.detokenize`) are written from the published rules;
  each is a pure ``str -> str`` function.
* Bits per byte use the UTF-8 bytes of the detokenized text over all its tokens (EOS
  included), before the remainder is dropped, as :mod:`anyorder.data` does.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from anyorder.data.files import bounded_lines, check_parquet_text, check_whole_read
from anyorder.data.untrusted import open_regular
from anyorder.errors import DataError
from anyorder.evaluation.detokenize import (  # noqa: F401 (re-exported: the protocol's detokenizers)
    lambada_detokenize,
    lm1b_detokenize,
    ptb_detokenize,
    wikitext_detokenize,
)

# ----------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class ZeroShotSet:
    """Where one test set lives and how its text is restored.

    Attributes:
        name: short name, also the folder name under ``--data-dir``.
        path: the ``datasets`` path (a hub id, a builder such as ``json``, or a folder).
        config: the dataset configuration, if any.
        split: the ``datasets`` split that holds the *test* set.
        field: the column that holds the text.
        detokenize: ``str -> str``.
        data_files: files or URLs for a builder path such as ``json``.
        splits: the splits the set has (``test`` is ``split`` on the hub).
    """

    name: str
    path: str
    config: str | None
    split: str
    field: str
    detokenize: Callable[[str], str]
    data_files: str | None = None
    splits: tuple[str, ...] = ("train", "validation", "test")

    def hub_split(self, split: str) -> str:
        """The ``datasets`` split name of ``split`` (``test``: :attr:`split`).

        Raises:
            DataError: a split the set does not have.
        """
        if split not in self.splits:
            raise DataError(
                f"{self.name} has no {split!r} split; use one of {', '.join(self.splits)}"
            )
        return self.split if split == "test" else split


LAMBADA_URL = "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl"

DATASETS: dict[str, ZeroShotSet] = {
    s.name: s
    for s in (
        ZeroShotSet("lambada", "json", None, "train", "text", lambada_detokenize, LAMBADA_URL,
                    splits=("test",)),
        ZeroShotSet("wikitext2", "wikitext", "wikitext-2-raw-v1", "test", "text",
                    wikitext_detokenize),
        ZeroShotSet("ptb", "ptb_text_only", None, "test", "sentence", ptb_detokenize),
        ZeroShotSet("wikitext103", "wikitext", "wikitext-103-raw-v1", "test", "text",
                    wikitext_detokenize),
        ZeroShotSet("lm1b", "lm1b", None, "test", "text", lm1b_detokenize,
                    splits=("train", "test")),
    )
}  # fmt: skip
"""The paper's five test sets, in the order of its table (the ``json`` builder names its
only split ``train``: it is LAMBADA's test file)."""

PROTOCOLS: dict[str, tuple[str, dict[str, str]]] = {
    "ours": ("every set on its test split (SEDD/RADD)", {}),
    "reference": (
        "the AO-GPT reference code's splits: WikiText-2 on train, the others on test",
        {"wikitext2": "train"},
    ),
}
"""Zero-shot protocols: a description and the splits that differ from ``test``."""


def resolve_splits(
    names: Sequence[str], protocol: str = "ours", overrides: dict[str, str] | None = None
) -> dict[str, str]:
    """The split of each set: ``test``, the protocol's preset, then ``overrides``.

    Raises:
        DataError: an unknown protocol, set or split.
    """
    if protocol not in PROTOCOLS:
        raise DataError(f"unknown protocol {protocol!r}; use one of {', '.join(PROTOCOLS)}")
    preset = PROTOCOLS[protocol][1]
    for name in overrides or {}:
        dataset(name)
    out = {}
    for name in names:
        split = (overrides or {}).get(name, preset.get(name, "test"))
        dataset(name).hub_split(split)  # validates
        out[name] = split
    return out


def parse_splits(text: str | None) -> dict[str, str]:
    """``"wikitext2=train,ptb=test"`` -> a dict (None or empty: none).

    Raises:
        DataError: an entry that is not ``NAME=SPLIT``.
    """
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, split = item.partition("=")
        if not sep or not name.strip() or not split.strip():
            raise DataError(f"--splits entry {item!r}: give NAME=SPLIT, e.g. wikitext2=train")
        out[name.strip()] = split.strip()
    return out


def dataset(name: str) -> ZeroShotSet:
    """The :class:`ZeroShotSet` called ``name``.

    Raises:
        DataError: an unknown name.
    """
    if name not in DATASETS:
        raise DataError(f"unknown zero-shot dataset {name!r}; use one of {', '.join(DATASETS)}")
    return DATASETS[name]


class _BadRecord(ValueError):
    """A JSON line that is not a record with the field's text (its message says which)."""


def _json_rows(lines: TextIO, field: str, path: Path) -> list[str]:
    """The text of ``field`` in each JSON line (blank lines skipped).

    Raises:
        KeyError: a record without the field.
        DataError: a line past :data:`~anyorder.data.files.MAX_LINE_CHARS`.
        ValueError: a line that is not JSON; :class:`_BadRecord`: not an object, nested too
            deep, or a field that is not text.
    """
    rows: list[str] = []
    for n, line in bounded_lines(lines, path):  # never a line of gigabytes read whole
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except RecursionError:
            raise _BadRecord(f"line {n} nests too deep for a JSON reader") from None
        if not isinstance(record, dict):
            kind = type(record).__name__
            raise _BadRecord(f"line {n} holds {kind}, not an object with field {field!r}")
        text = record[field]
        if not isinstance(text, str):
            raise _BadRecord(f"line {n}: field {field!r} holds {type(text).__name__}, not text")
        rows.append(text)
    return rows


def _local_rows(folder: Path, field: str) -> list[str]:
    files = sorted(
        p for p in folder.iterdir() if p.suffix in (".txt", ".jsonl", ".json", ".parquet")
    )
    if not files:
        raise DataError(
            f"{folder} holds no .txt, .jsonl or .parquet file; put the test split there"
        )
    # the set is held whole (and a .txt file read whole): sized before a byte is read
    sizes = [p.stat().st_size for p in files if p.is_file() and p.suffix != ".parquet"]
    check_whole_read(
        folder, f"the test examples of its {len(sizes)} .txt/.jsonl/.json file(s), held whole",
        "evaluate a smaller part of the set", size=sum(sizes),
    )  # fmt: skip
    rows: list[str] = []
    for path in files:
        f = open_regular(path)  # never a named pipe (it would block for ever) or a device
        if f is None:
            continue  # a dangling link
        try:
            with f:
                if path.suffix == ".txt":
                    text = f.read().decode("utf-8")
                    rows += [t if t.strip() else "" for t in text.splitlines(keepends=True)]
                elif path.suffix == ".parquet":
                    import pyarrow.parquet as pq

                    check_parquet_text(pq.ParquetFile(f).metadata, field, path, whole=True)
                    rows += [str(v) for v in pq.read_table(f, columns=[field]).column(field)]
                else:
                    rows += _json_rows(io.TextIOWrapper(f, encoding="utf-8"), field, path)
        except (KeyError, ValueError, OSError) as e:
            why = str(e) if isinstance(e, _BadRecord) else f"{type(e).__name__}: {e}"
            raise DataError(
                f"{path} could not be read as {path.suffix[1:]} with field {field!r} "
                f"({why}); fix the file or the layout"
            ) from None
    return rows


def load_texts(
    spec: ZeroShotSet, data_dir: str | Path | None = None, split: str = "test"
) -> list[str]:
    """The raw (not yet detokenized) examples of one split of a set.

    Args:
        spec: the set.
        data_dir: read ``data_dir/<name>/[<split>/]`` instead of the hub (module docstring).
        split: ``test`` (default), ``train`` or ``validation`` where the set has it.

    Raises:
        DataError: a missing folder or file, a split the set lacks, or a dataset
            ``datasets`` cannot load.
    """
    hub_split = spec.hub_split(split)
    if data_dir is not None:
        folder = Path(data_dir).expanduser() / spec.name
        if (folder / split).is_dir():
            return _local_rows(folder / split, spec.field)
        if split != "test":
            raise DataError(
                f"no folder {folder / split} for the {split} split of {spec.name}; put it "
                "there (see `anyorder eval --help` for the layout) or choose another split"
            )
        if not folder.is_dir():
            raise DataError(
                f"no folder {folder} for {spec.name}; put its test split there (see "
                "`anyorder eval --help` for the layout) or leave out --data-dir"
            )
        return _local_rows(folder, spec.field)
    try:
        import datasets
    except ImportError:
        raise DataError(
            "loading test sets by name needs datasets; pip install 'anyorder[hf]'"
        ) from None
    try:
        ds = datasets.load_dataset(
            spec.path, spec.config, split=hub_split, data_files=spec.data_files,
            trust_remote_code=False,  # never a loading script (datasets < 3 ran them unasked)
        )  # fmt: skip
        return [str(t) for t in ds[spec.field]]
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"could not load {spec.name} ({spec.path}, {spec.config}) through datasets "
            f"({first}); download it once, or pass --data-dir with a local copy"
        ) from None


# ----------------------------------------------------------------------------- blocks


@dataclass
class ZeroShotCorpus:
    """One test set turned into model blocks."""

    name: str
    blocks: np.ndarray
    """(N, seq_len) int64 token blocks; the remainder past the last full block dropped."""
    examples: int
    tokens: int
    """Tokens before the cut, one EOS per example included."""
    bytes: int
    """UTF-8 bytes of the detokenized text."""

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(1, self.tokens)


def pack_examples(
    texts: Iterable[str],
    tokenizer: Any,
    seq_len: int,
    detokenize: Callable[[str], str] | None = None,
    *,
    name: str = "corpus",
    chunk: int = 1024,
    groups: Sequence[int] | None = None,
) -> ZeroShotCorpus:
    """Detokenize, tokenize, append EOS to every example, concatenate, cut into blocks.

    Args:
        texts: the raw examples.
        tokenizer: has ``encode`` (and optionally ``encode_batch``) and ``eos_id``.
        seq_len: tokens per block.
        detokenize: the dataset's detokenizer (None: the text as it is).
        name: the corpus name in errors and reports.
        chunk: examples per batched tokenizer call.
        groups: examples per group, in order, each group concatenated and cut on its own
            (its remainder dropped): :func:`reference_groups`. None: one group.
    """
    ids: list[int] = []
    ends = [0]  # each example's end in ``ids``
    examples = nbytes = 0
    texts = list(texts)
    encode_batch = getattr(tokenizer, "encode_batch", None)
    for start in range(0, len(texts), chunk):
        part = texts[start : start + chunk]
        if detokenize is not None:
            part = [detokenize(t) for t in part]
        encoded = encode_batch(part) if encode_batch else [tokenizer.encode(t) for t in part]
        for text, tok in zip(part, encoded):
            ids += tok
            ids.append(tokenizer.eos_id)
            ends.append(len(ids))
            nbytes += len(text.encode("utf-8"))
        examples += len(part)
    bounds = np.cumsum([0, *(groups if groups is not None else [examples])])
    if bounds[-1] != examples:
        raise ValueError(f"groups cover {bounds[-1]} examples, not {examples}")
    flat = np.asarray(ids, dtype=np.int64)
    cut = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        start, stop = ends[a], ends[b]
        cut.append(flat[start : start + (stop - start) // seq_len * seq_len])
    if sum(len(c) for c in cut) == 0:
        raise DataError(
            f"{name}: {len(ids)} tokens do not fill one block of {seq_len}; use more text"
        )
    blocks = np.concatenate(cut).reshape(-1, seq_len)
    return ZeroShotCorpus(name, blocks, examples, len(ids), nbytes)


def reference_groups(examples: int, num_proc: int = 8, batch: int = 1000) -> list[int]:
    """How the AO-GPT reference code groups a test set's examples before cutting blocks
    (``data.get_dataset``: ``map(group_texts, batched=True, num_proc=8)``): ``datasets``
    splits the rows into ``num_proc`` contiguous shards (the first ``examples % num_proc``
    one row longer; fewer shards than rows never), and maps each shard in batches of 1000
    rows; ``group_texts`` concatenates a batch and drops its own remainder. Returns the
    rows per group, in order."""
    procs = max(1, min(num_proc, examples))
    div, mod = divmod(examples, procs)
    out: list[int] = []
    for rank in range(procs):
        size = div + (rank < mod)
        out += [min(batch, size - start) for start in range(0, size, batch)]
    return out


def load_corpus(
    name: str,
    tokenizer: Any,
    seq_len: int,
    data_dir: str | Path | None = None,
    max_examples: int | None = None,
    split: str = "test",
    protocol: str = "ours",
) -> ZeroShotCorpus:
    """A set's split by name, through the whole protocol: read, detokenize, pack (the
    ``reference`` protocol cuts blocks per group of examples, :func:`reference_groups`)."""
    spec = dataset(name)
    texts = load_texts(spec, data_dir, split)
    if max_examples is not None:
        texts = texts[:max_examples]
    groups = reference_groups(len(texts)) if protocol == "reference" else None
    return pack_examples(texts, tokenizer, seq_len, spec.detokenize, name=name, groups=groups)
