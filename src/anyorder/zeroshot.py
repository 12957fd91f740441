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

Offline layout (``--data-dir DIR``): one folder per dataset, named as above, holding that
dataset's *test split only*, in any of

* ``.txt``: one example per line, line ending kept; a whitespace-only line is the empty
  example ``""`` (this is how the ``wikitext`` builder turns ``wiki.test.raw`` into rows);
* ``.jsonl`` / ``.json`` (JSON lines): one example per line, the dataset's field;
* ``.parquet``: one example per row, the dataset's field (a ``datasets`` export).

e.g. ``DIR/wikitext2/wiki.test.raw.txt``, ``DIR/ptb/test.parquet``,
``DIR/lambada/lambada_test.jsonl``. Files are read in name order.

Design choices:

* Every example gets its EOS, empty ones included (a wikitext blank row is a lone EOS), as
  in the peers' pipeline, which maps the tokenizer over every row without filtering.
* The detokenizers are written from the published rules (wikitext's ``@-@`` separators,
  spacing around punctuation and brackets, ``= =`` headings; PTB's ``<unk>`` -> ``?``,
  ``N`` -> ``1`` and joined clitics; LM1B's clitics and punctuation; LAMBADA's straight
  quotes and leading newline). Each is a pure ``str -> str`` function.
* Bits per byte use the UTF-8 bytes of the detokenized text over all its tokens (EOS
  included), before the remainder is dropped, as :mod:`anyorder.data` does.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anyorder.errors import DataError

# ----------------------------------------------------------------------------- detokenizers


def _apply(text: str, literal: Sequence[tuple[str, str]]) -> str:
    for old, new in literal:
        text = text.replace(old, new)
    return text


_WIKI_NUMBERS = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))
_WIKI_PUNCT = tuple((f" {p} ", f"{p} ") for p in ":;.!?,")
# Inner padding of paired brackets and quotes: "( a b )" -> "(a b)".
_PAIRS = tuple(
    (re.compile(rf"{re.escape(o)}\s*([^{re.escape(c)}]*?)\s*{re.escape(c)}"), f"{o}\\1{c}")
    for o, c in (("(", ")"), ("[", "]"), ("{", "}"), ('"', '"'), ("'", "'"))
)
_HEADINGS = (("= = = =", "===="), ("= = =", "==="), ("= =", "=="))


def wikitext_detokenize(text: str) -> str:
    """WikiText's tokenized text back to plain text.

    ``" @-@ "`` -> ``-`` (likewise ``@,@`` and ``@.@``), no space before ``: ; . ! ? ,``,
    no padding inside brackets and quotes, ``= = x = =`` headings -> ``== x ==``, `` ° ``
    -> ``°``, no space at line edges, `` N `` -> `` 1 ``, `` 's`` -> ``'s``.
    """
    text = text.replace("s '", "s'")
    text = _apply(text, _WIKI_NUMBERS + _WIKI_PUNCT)
    for pattern, repl in _PAIRS:
        text = pattern.sub(repl, text)
    text = _apply(text, _HEADINGS)
    return (
        _apply(text, ((" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"), (" \n", "\n"), ("\n ", "\n")))
        .replace(" N ", " 1 ")
        .replace(" 's", "'s")
    )


def ptb_detokenize(text: str) -> str:
    """Penn Treebank (``ptb_text_only``) sentences back to plain text.

    Clitics join (`` 's`` -> ``'s``, `` n't`` -> ``n't``, ``s ' `` -> ``s' ``), ``\\/`` ->
    ``/``, the number placeholder `` N `` -> `` 1 `` (repeated, so runs of ``N`` all
    change), ``$ 1`` -> ``$1``, ``# 1`` -> ``#1``, and ``<unk>`` -> ``?``.
    """
    text = _apply(text, ((" 's", "'s"), ("s ' ", "s' "), (" n't", "n't"), (" \n ", "\n")))
    text = text.replace("\\/", "/")
    while " N " in text:  # " N N " needs two passes: the matches overlap
        text = text.replace(" N ", " 1 ")
    return _apply(text, (("$ 1", "$1"), ("# 1", "#1"), ("<unk>", "?")))


_LM1B_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"http : / / ", "http://"),
        (r"https : / / ", "https://"),
        (r" '(\w+)", r"'\1"),  # clitics: " 's" -> "'s", " 've" -> "'ve"
        (r" (\w+) \. ", r" \1. "),
        (r" (\w+) \.$", r" \1."),
        (r" \? ", "? "),
        (r" \?$", "?"),
        (r" ! ", "! "),
        (r" !$", "!"),
        (r" , ", ", "),
        (r" : ", ": "),
        (r" ; ", "; "),
        (r" / ", "/"),
        (r'" ([^"]+) "', r'"\1"'),
        (r"' ([^']+) '", r"'\1'"),
        (r"\( ([^()]+) \)", r"(\1)"),
        (r"\[ ([^\[\]]+) \]", r"[\1]"),
        (r"\$ ", "$"),
        ("\N{POUND SIGN} ", "\N{POUND SIGN}"),
    )
)


def lm1b_detokenize(text: str) -> str:
    """One Billion Word sentences back to plain text: URLs, clitics (`` 's`` -> ``'s``), no
    space before ``. ? ! , : ;``, no padding inside quotes and brackets, ``$``/``£`` joined."""
    for pattern, repl in _LM1B_RULES:
        text = pattern.sub(repl, text)
    return text


def lambada_detokenize(text: str) -> str:
    """LAMBADA: curly double quotes straightened, the text stripped, a newline prepended."""
    text = text.replace("\N{LEFT DOUBLE QUOTATION MARK}", '"')
    text = text.replace("\N{RIGHT DOUBLE QUOTATION MARK}", '"')
    return "\n" + text.strip()


# ----------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class ZeroShotSet:
    """Where one test set lives and how its text is restored.

    Attributes:
        name: short name, also the folder name under ``--data-dir``.
        path: the ``datasets`` path (a hub id, a builder such as ``json``, or a folder).
        config: the dataset configuration, if any.
        split: the split to read.
        field: the column that holds the text.
        detokenize: ``str -> str``.
        data_files: files or URLs for a builder path such as ``json``.
    """

    name: str
    path: str
    config: str | None
    split: str
    field: str
    detokenize: Callable[[str], str]
    data_files: str | None = None


LAMBADA_URL = "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl"

DATASETS: dict[str, ZeroShotSet] = {
    s.name: s
    for s in (
        ZeroShotSet("lambada", "json", None, "train", "text", lambada_detokenize, LAMBADA_URL),
        ZeroShotSet("wikitext2", "wikitext", "wikitext-2-raw-v1", "test", "text",
                    wikitext_detokenize),
        ZeroShotSet("ptb", "ptb_text_only", None, "test", "sentence", ptb_detokenize),
        ZeroShotSet("wikitext103", "wikitext", "wikitext-103-raw-v1", "test", "text",
                    wikitext_detokenize),
        ZeroShotSet("lm1b", "lm1b", None, "test", "text", lm1b_detokenize),
    )
}  # fmt: skip
"""The paper's five test sets, in the order of its table (the ``json`` builder names its
only split ``train``: it is LAMBADA's test file)."""


def dataset(name: str) -> ZeroShotSet:
    """The :class:`ZeroShotSet` called ``name``.

    Raises:
        DataError: an unknown name.
    """
    if name not in DATASETS:
        raise DataError(f"unknown zero-shot dataset {name!r}; use one of {', '.join(DATASETS)}")
    return DATASETS[name]


def _local_rows(folder: Path, field: str) -> list[str]:
    files = sorted(
        p for p in folder.iterdir() if p.suffix in (".txt", ".jsonl", ".json", ".parquet")
    )
    if not files:
        raise DataError(
            f"{folder} holds no .txt, .jsonl or .parquet file; put the test split there"
        )
    rows: list[str] = []
    for path in files:
        try:
            if path.suffix == ".txt":
                text = path.read_text(encoding="utf-8")
                rows += [line if line.strip() else "" for line in text.splitlines(keepends=True)]
            elif path.suffix == ".parquet":
                import pyarrow.parquet as pq

                rows += [str(v) for v in pq.read_table(path, columns=[field]).column(field)]
            else:
                with path.open(encoding="utf-8") as f:
                    rows += [json.loads(line)[field] for line in f if line.strip()]
        except (KeyError, ValueError, OSError) as e:
            raise DataError(
                f"{path} could not be read as {path.suffix[1:]} with field {field!r} "
                f"({type(e).__name__}: {e}); fix the file or the layout"
            ) from None
    return rows


def load_texts(spec: ZeroShotSet, data_dir: str | Path | None = None) -> list[str]:
    """The raw (not yet detokenized) examples of a test set.

    Args:
        spec: the test set.
        data_dir: read ``data_dir/<name>/`` instead of the hub (see the module docstring).

    Raises:
        DataError: a missing folder or file, or a dataset ``datasets`` cannot load.
    """
    if data_dir is not None:
        folder = Path(data_dir).expanduser() / spec.name
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
            spec.path, spec.config, split=spec.split, data_files=spec.data_files
        )
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
) -> ZeroShotCorpus:
    """Detokenize, tokenize, append EOS to every example, concatenate, cut into blocks.

    Args:
        texts: the raw examples.
        tokenizer: has ``encode`` (and optionally ``encode_batch``) and ``eos_id``.
        seq_len: tokens per block.
        detokenize: the dataset's detokenizer (None: the text as it is).
        name: the corpus name in errors and reports.
        chunk: examples per batched tokenizer call.
    """
    ids: list[int] = []
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
            nbytes += len(text.encode("utf-8"))
        examples += len(part)
    usable = len(ids) // seq_len * seq_len
    if usable == 0:
        raise DataError(
            f"{name}: {len(ids)} tokens do not fill one block of {seq_len}; use more text"
        )
    blocks = np.asarray(ids[:usable], dtype=np.int64).reshape(-1, seq_len)
    return ZeroShotCorpus(name, blocks, examples, len(ids), nbytes)


def load_corpus(
    name: str,
    tokenizer: Any,
    seq_len: int,
    data_dir: str | Path | None = None,
    max_examples: int | None = None,
) -> ZeroShotCorpus:
    """A test set by name, through the whole protocol: read, detokenize, pack."""
    spec = dataset(name)
    texts = load_texts(spec, data_dir)
    if max_examples is not None:
        texts = texts[:max_examples]
    return pack_examples(texts, tokenizer, seq_len, spec.detokenize, name=name)


# ----------------------------------------------------------------------------- the table


def zero_shot(
    model: Any,
    tokenizer: Any,
    names: Sequence[str] = tuple(DATASETS),
    *,
    data_dir: str | Path | None = None,
    max_blocks: int | None = None,
    progress: bool = True,
    echo: bool = True,
    **suite: Any,
) -> dict[str, Any]:
    """Run :func:`anyorder.corpus.likelihood_suite` on each test set.

    Args:
        model: the model (its ``cfg.seq_len`` is the block length).
        tokenizer: the checkpoint's tokenizer.
        names: the test sets.
        data_dir: local copies (see the module docstring); None reads the hub.
        max_blocks: evaluate only the first blocks of each set (quick runs).
        progress: tqdm bars.
        echo: print each set's result as it is done.
        **suite: passed to ``likelihood_suite`` (orders, ensemble, targets, seed, ...).

    Returns:
        ``{"datasets": {name: result}, "ensemble": M, ...}`` ready for :func:`table_markdown`.
    """
    from anyorder.corpus import format_likelihood, likelihood_suite

    seq_len = model.cfg.seq_len
    results: dict[str, Any] = {}
    for name in names:
        corpus = load_corpus(name, tokenizer, seq_len, data_dir)
        blocks = corpus.blocks[:max_blocks] if max_blocks else corpus.blocks
        res = likelihood_suite(
            model, blocks, bytes_per_token=corpus.bytes_per_token, progress=progress, **suite
        )
        res.update(examples=corpus.examples, blocks_total=len(corpus.blocks))
        results[name] = res
        if echo:
            print(f"[{name}] " + format_likelihood(res), flush=True)
    return {"datasets": results, "ensemble": suite.get("ensemble", 1), "seq_len": seq_len}


def _ppl(m: dict[str, Any] | None) -> str:
    if m is None:
        return "n/a"
    se = m.get("stderr") or 0.0
    if se and math.isfinite(se):
        return f"{m['ppl']:.2f} ± {m['ppl'] * se:.2f}"  # delta method: d(e^x) = e^x dx
    return f"{m['ppl']:.2f}"


def table_rows(table: dict[str, Any]) -> list[list[str]]:
    """Header and one row per dataset: name, blocks, PPL l2r, any-order, any-order + ens."""
    M = table.get("ensemble", 1)
    head = ["dataset", "blocks", "PPL l2r", "PPL any-order", f"PPL any-order + ens x{M}"]
    rows = [head]
    for name, r in table["datasets"].items():
        rows.append(
            [name, str(r["blocks"]), _ppl(r["l2r"]), _ppl(r["any_order"]), _ppl(r["ensemble"])]
        )
    return rows


def table_markdown(table: dict[str, Any]) -> str:
    """The paper-style table as Markdown (± is one standard error over random orders)."""
    rows = table_rows(table)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    fmt.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    notes = sorted({n for r in table["datasets"].values() for n in r["notes"]})
    tail = ["", "± is one standard error over the random orders (the text is fixed)."]
    return "\n".join(fmt + tail + [f"- {n}" for n in notes]) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are for reading
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_table(table: dict[str, Any], out_dir: str | Path, stem: str = "zero_shot") -> list[Path]:
    """Write ``stem.json`` and ``stem.md`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    js, md = out / f"{stem}.json", out / f"{stem}.md"
    write_atomic(js, json.dumps(table, indent=2) + "\n")
    write_atomic(md, table_markdown(table))
    return [js, md]
