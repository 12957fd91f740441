"""Tests of anyorder.data: sources, tokenizers, packing, caching and the block sampler.

Every corpus is a handful of small files written into ``tmp_path``; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from anyorder import data
from anyorder.config import DataConfig
from anyorder.data import (
    BlockSampler,
    ByteTokenizer,
    TokenData,
    Tokenizer,
    iter_documents,
    iter_eval_blocks,
    load_tokenizer,
    prepare,
)
from anyorder.errors import ConfigError, DataError

from conftest import GPT2_SKIP, GPT2_TOKENIZER_DIR, has_gpt2_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "short",
    "def f(x):\n    return x + 1\n",
    "Blank lines\n\ndo not split a .txt file.",
    "日本語のテキストも大丈夫です。",
    "a" * 37,
    "The last document.",
]


def write_txt(folder: Path, docs: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc_{i:03d}.txt").write_text(doc, encoding="utf-8")
    return folder


def write_jsonl(folder: Path, docs: list[str], per_file: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(docs), per_file):
        lines = [
            json.dumps({"id": i, "text": d}) for i, d in enumerate(docs[start : start + per_file])
        ]
        (folder / f"part_{start:03d}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def cfg_for(tmp_path: Path, source: str | Path, **kw) -> DataConfig:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return DataConfig(source=str(source), **kw)


def packed(docs: list[str], tok: Tokenizer) -> np.ndarray:
    """The papers' packing, written independently: encode(doc) + [EOS], concatenated."""
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d) + [tok.eos_id]
    return np.array(ids, dtype=np.int64)


def held_out(text: str, val_fraction: float) -> bool:
    return int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 2**32 < val_fraction


def many_docs(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "η", "theta"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 12)))) + f" #{i}" for i in range(n)]


# ----------------------------------------------------------------------------- packing


def test_packing_round_trip(tmp_path):
    src = write_txt(tmp_path / "corpus", DOCS)
    seq_len = 16
    d = prepare(cfg_for(tmp_path, src, val_fraction=0.0), seq_len, progress=False)
    expected = packed(DOCS, ByteTokenizer())
    assert len(expected) % seq_len != 0, "the corpus must leave a remainder to drop"
    blocks = len(expected) // seq_len
    assert d.train.shape == (blocks, seq_len)
    assert d.train.dtype == np.uint16
    np.testing.assert_array_equal(d.train.reshape(-1), expected[: blocks * seq_len])
    # One EOS after every document, at the end of each document's bytes.
    ends = np.cumsum([len(doc.encode()) + 1 for doc in DOCS]) - 1
    kept_ends = ends[ends < blocks * seq_len]
    np.testing.assert_array_equal(np.flatnonzero(d.train.reshape(-1) == 256), kept_ends)
    assert d.val.shape == (0, seq_len)
    split = d.manifest["splits"]["train"]
    assert split["documents"] == len(DOCS)
    assert split["tokens"] == len(expected)
    assert split["blocks"] == blocks
    n_bytes = sum(len(doc.encode()) for doc in DOCS)
    assert split["bytes"] == n_bytes
    assert d.bytes_per_token("train") == pytest.approx(n_bytes / len(expected))
    assert split["sha256"] == hashlib.sha256((d.path / "train.bin").read_bytes()).hexdigest()
    d.verify()


def test_split_by_hash_keeps_corpus_order(tmp_path):
    docs = many_docs(80)
    src = write_txt(tmp_path / "corpus", docs)
    seq_len = 8
    d = prepare(cfg_for(tmp_path, src, val_fraction=0.3), seq_len, progress=False)
    train_docs = [t for t in docs if not held_out(t, 0.3)]
    val_docs = [t for t in docs if held_out(t, 0.3)]
    assert train_docs and val_docs
    assert d.manifest["val_fallback_documents"] == 0
    tok = ByteTokenizer()
    for split, split_docs in (("train", train_docs), ("val", val_docs)):
        expected = packed(split_docs, tok)
        n = len(expected) // seq_len
        np.testing.assert_array_equal(d.split(split).reshape(-1), expected[: n * seq_len])
        assert d.manifest["splits"][split]["documents"] == len(split_docs)
    # The rule does not depend on the document's position or the other documents.
    assert all(data.is_val_document(t, 0.3) == held_out(t, 0.3) for t in docs)


def test_val_fallback_takes_last_documents(tmp_path):
    docs = many_docs(30)
    src = write_txt(tmp_path / "corpus", docs)
    seq_len = 32
    # A share so small that the hash holds out nothing: the last documents move to val.
    assert not any(held_out(t, 1e-12) for t in docs)
    d = prepare(cfg_for(tmp_path, src, val_fraction=1e-12), seq_len, progress=False)
    tok = ByteTokenizer()
    k = 1
    while len(packed(docs[-k:], tok)) < seq_len:
        k += 1
    assert d.manifest["val_fallback_documents"] == k
    expected_val = packed(docs[-k:], tok)
    assert d.val.shape[0] == len(expected_val) // seq_len >= 1
    np.testing.assert_array_equal(d.val.reshape(-1), expected_val[: d.val.size])
    expected_train = packed(docs[:-k], tok)
    np.testing.assert_array_equal(d.train.reshape(-1), expected_train[: d.train.size])
    assert d.manifest["splits"]["train"]["documents"] == len(docs) - k


def test_batch_and_eval_blocks(tmp_path):
    src = write_txt(tmp_path / "corpus", many_docs(60))
    d = prepare(cfg_for(tmp_path, src, val_fraction=0.0), 8, progress=False)
    import torch

    x = d.batch("train", [3, 0, 3])
    assert x.dtype == torch.int64
    assert tuple(x.shape) == (3, 8)
    np.testing.assert_array_equal(x.numpy(), d.train[[3, 0, 3]])
    batches = list(iter_eval_blocks(d, "train", max_blocks=10, batch_size=4))
    assert [tuple(b.shape) for b in batches] == [(4, 8), (4, 8), (2, 8)]
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in batches]), d.train[:10])
    shares = [
        list(iter_eval_blocks(d, "train", 10, batch_size=3, rank=r, world_size=2)) for r in (0, 1)
    ]
    rows = {r: np.concatenate([b.numpy() for b in shares[r]]) for r in (0, 1)}
    np.testing.assert_array_equal(rows[0], d.train[0:10:2])
    np.testing.assert_array_equal(rows[1], d.train[1:10:2])
    with pytest.raises(DataError, match="val_fraction"):
        next(iter_eval_blocks(d, "val"))


def test_unigram_baseline_and_data_main(tmp_path, capsys):
    src = write_txt(tmp_path / "corpus", many_docs(40))
    cfg = cfg_for(tmp_path, src, val_fraction=0.2)
    stats = data.data_main(cfg, 8)
    d = prepare(cfg, 8, progress=False)
    _, counts = np.unique(np.asarray(d.train), return_counts=True)
    p = counts / counts.sum()
    entropy = float(-(p * np.log2(p)).sum())
    assert data.unigram_entropy(d) == pytest.approx(entropy)
    assert data.unigram_bits_per_byte(d) == pytest.approx(entropy / d.bytes_per_token("train"))
    assert stats["unigram_bits_per_byte"] == pytest.approx(data.unigram_bits_per_byte(d))
    assert stats["train"]["blocks"] == d.train.shape[0]
    assert stats["val"]["documents"] == d.manifest["splits"]["val"]["documents"]
    assert "bits/byte" in capsys.readouterr().out


# ----------------------------------------------------------------------------- caching


def test_second_prepare_reuses_without_tokenizing(tmp_path, monkeypatch):
    src = write_txt(tmp_path / "corpus", many_docs(40))
    cfg = cfg_for(tmp_path, src)
    first = prepare(cfg, 16, progress=False)
    assert not first.reused

    def boom(*args, **kwargs):
        raise AssertionError("prepare tokenized or read documents on reuse")

    with monkeypatch.context() as m:
        m.setattr(ByteTokenizer, "encode", boom)
        m.setattr(ByteTokenizer, "encode_batch", boom)
        m.setattr("anyorder.data.build.iter_documents", boom)
        again = prepare(cfg, 16, progress=False)
    assert again.reused and again.path == first.path
    np.testing.assert_array_equal(again.train, first.train)
    np.testing.assert_array_equal(again.val, first.val)

    other_len = prepare(cfg, 8, progress=False)
    assert not other_len.reused and other_len.path != first.path
    other_src = write_txt(tmp_path / "corpus2", many_docs(41))
    other = prepare(cfg_for(tmp_path, other_src), 16, progress=False)
    assert not other.reused and other.path not in (first.path, other_len.path)
    # Editing a file of the same source changes its size: a new key, not stale shards.
    (src / "doc_000.txt").write_text("an edited first document that is longer")
    edited = prepare(cfg, 16, progress=False)
    assert not edited.reused and edited.path != first.path


def test_prepare_is_atomic(tmp_path, monkeypatch):
    src = write_txt(tmp_path / "corpus", many_docs(40))
    cfg = cfg_for(tmp_path, src)
    cache = Path(cfg.cache_dir)

    def fail(path):
        raise RuntimeError("disk on fire")

    # Fails after both shards are fully written, just before the manifest.
    with monkeypatch.context() as m:
        m.setattr("anyorder.data.split.sha256_file", fail)
        with pytest.raises(RuntimeError, match="disk on fire"):
            prepare(cfg, 16, progress=False)
    assert not cache.exists()  # a failed first use leaves no cache folder

    # Fails in the middle of tokenizing.
    calls = []

    def fail_later(self, texts):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("interrupted")
        return [self.encode(t) for t in texts]

    monkeypatch.setattr("anyorder.data.split._ENCODE_CHUNK", 8)
    with monkeypatch.context() as m:
        m.setattr(ByteTokenizer, "encode_batch", fail_later)
        with pytest.raises(RuntimeError, match="interrupted"):
            prepare(cfg, 16, progress=False)
    assert not cache.exists()  # a failed first use leaves no cache folder

    d = prepare(cfg, 16, progress=False)
    assert not d.reused
    assert [p.name for p in cache.iterdir()] == [data.cache_key(cfg, 16)]
    assert sorted(p.name for p in d.path.iterdir()) == [
        "manifest.json",
        "tokenizer",
        "train.bin",
        "val.bin",
        "verified.json",
    ]


def test_corrupt_shard_is_detected(tmp_path):
    src = write_txt(tmp_path / "corpus", many_docs(40))
    d = prepare(cfg_for(tmp_path, src), 8, progress=False)
    with open(d.path / "train.bin", "r+b") as f:
        f.write(b"\xff\xff")
    with pytest.raises(DataError, match="checksum"):
        TokenData.load(d.path).verify()
    with open(d.path / "val.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataError, match="wrong size"):
        TokenData.load(d.path)


# ----------------------------------------------------------------------------- sources


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_hf_local_folder_matches_plain_files(tmp_path, monkeypatch, kind):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    docs = many_docs(30) + DOCS
    folder = tmp_path / "corpus"
    write_jsonl(folder, docs) if kind == "jsonl" else write_txt(folder, docs)
    assert list(iter_documents(f"hf:{folder}")) == list(iter_documents(str(folder)))
    plain = prepare(cfg_for(tmp_path, folder, val_fraction=0.2), 8, progress=False)
    via_hf = prepare(cfg_for(tmp_path, f"hf:{folder}", val_fraction=0.2), 8, progress=False)
    assert via_hf.path != plain.path
    np.testing.assert_array_equal(via_hf.train, plain.train)
    np.testing.assert_array_equal(via_hf.val, plain.val)
    assert via_hf.manifest["splits"] == plain.manifest["splits"]


def test_jsonl_and_parquet_sources(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    docs = many_docs(10) + ["", "after an empty one"]
    jsonl = write_jsonl(tmp_path / "j", docs, per_file=5)
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"body": docs}), tmp_path / "p" / "part.parquet")
    nonempty = [t for t in docs if t]
    assert list(iter_documents(str(jsonl))) == nonempty
    assert list(iter_documents(str(tmp_path / "p"), text_field="body")) == nonempty
    assert list(iter_documents(str(tmp_path / "j" / "*.jsonl"), max_documents=4)) == nonempty[:4]
    with pytest.raises(DataError, match="text_field"):
        list(iter_documents(str(tmp_path / "p")))
    with pytest.raises(DataError, match="text_field"):
        list(iter_documents(str(jsonl), text_field="content"))


def test_builtin_pydoc(tmp_path):
    docs = list(iter_documents("builtin:pydoc"))
    assert len(docs) > 20 and docs == list(iter_documents("builtin:pydoc"))
    a = prepare(
        cfg_for(tmp_path, "builtin:pydoc", cache_dir=str(tmp_path / "a")), 128, progress=False
    )
    b = prepare(
        cfg_for(tmp_path, "builtin:pydoc", cache_dir=str(tmp_path / "b")), 128, progress=False
    )
    assert a.train.shape[0] > 100 and a.val.shape[0] >= 1
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert a.manifest["splits"] == b.manifest["splits"]
    assert a.bytes_per_token("train") < 1.01  # bytes: one per token, EOS aside


def test_builtin_stdlib_documents():
    files = data.stdlib_files()
    assert len(files) > 100 and files == data.stdlib_files()
    assert not any({"site-packages", "test", "tests"} & set(p.parts) for p in files)
    first = list(iter_documents("builtin:stdlib", max_documents=3))
    assert len(first) == 3 and all(first)
    assert first == list(iter_documents("builtin:stdlib", max_documents=3))


def test_source_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        iter_documents(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a supported file")
    with pytest.raises(DataError, match="holds no .txt/.jsonl/.parquet files"):
        iter_documents(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="matches no"):
        iter_documents(str(tmp_path / "*.jsonl"))
    with pytest.raises(DataError, match="does not exist"):
        prepare(cfg_for(tmp_path, tmp_path / "nowhere"), 8, progress=False)
    with pytest.raises(DataError, match="unknown data.source"):
        iter_documents("builtin:nothing")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not valid JSON"):
        list(iter_documents(str(bad)))
    with pytest.raises(DataError, match="does not exist"):
        iter_documents(f"hf:{tmp_path / 'nowhere'}")
    with pytest.raises(DataError, match="needs a dataset name"):
        iter_documents("hf:")


def test_a_named_pipe_among_the_sources_is_refused_not_opened(tmp_path):
    # opening a FIFO blocks until a writer comes: the build would hang for ever
    write_txt(tmp_path / "a", ["hello world"])
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(DataError) as e:
        iter_documents(str(tmp_path / "*.txt"))
    assert str(e.value) == (
        f"data.source glob {str(tmp_path / '*.txt')!r} matches {str(tmp_path / 'pipe.txt')!r}, "
        "a named pipe (FIFO), not a file; remove it or narrow the pattern"
    )
    with pytest.raises(DataError) as e:
        iter_documents(str(tmp_path / "pipe.txt"))
    assert str(e.value) == (
        f"data.source {str(tmp_path / 'pipe.txt')!r} is a named pipe (FIFO), not a file; give "
        "a file, folder or glob of .txt/.jsonl/.parquet files"
    )
    with pytest.raises(DataError) as e:
        iter_documents("/dev/null")
    assert str(e.value) == (
        "data.source '/dev/null' is a device, not a file; give a file, folder or glob of "
        ".txt/.jsonl/.parquet files"
    )
    assert [d for d in iter_documents(str(tmp_path))] == ["hello world"]  # a folder skips it


def test_a_jsonl_line_past_the_bound_is_refused_not_read_whole(tmp_path, monkeypatch):
    """A .jsonl line was read whole: a sparse file of a terabyte (nothing on disk, no newline)
    took memory until a MemoryError traceback. Lines are read up to a bound."""
    from anyorder.data import files
    from anyorder.data.chat import detect_chat

    monkeypatch.setattr(files, "MAX_LINE_CHARS", 1 << 20)
    path = tmp_path / "huge.jsonl"
    path.write_text('{"text": "fine"}\n')
    with open(path, "r+") as f:
        f.truncate(1 << 40)  # the rest: NUL bytes, one line of a terabyte
    assert not detect_chat(str(path))
    with pytest.raises(DataError) as e:
        list(iter_documents(str(path)))
    assert str(e.value) == (
        f"{path}:2 is longer than 1,048,576 characters, more than a record holds; fix the "
        "file (one JSON record a line)"
    )
    small = tmp_path / "ok.jsonl"
    small.write_text('{"text": "' + "x" * 1000 + '"}\n{"text": "y"}')  # no final newline
    assert list(iter_documents(str(small))) == ["x" * 1000, "y"]


def test_corpus_too_small(tmp_path):
    src = write_txt(tmp_path / "tiny", ["hello", "world"])
    with pytest.raises(
        DataError, match=r"fewer than one block of seq_len=64.*smaller model.seq_len"
    ):
        prepare(cfg_for(tmp_path, src, val_fraction=0.0), 64, progress=False)
    with pytest.raises(DataError, match=r"fewer than one train and one validation block"):
        prepare(cfg_for(tmp_path, src, val_fraction=0.5), 8, progress=False)
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ConfigError, match="val_fraction"):
        prepare(cfg_for(tmp_path, src, val_fraction=1.0), 8, progress=False)


def test_out_of_vocabulary_id_is_refused(tmp_path, monkeypatch):
    src = write_txt(tmp_path / "corpus", many_docs(10))
    # 300 fits in uint16 but not in the 257-id vocabulary: it must not reach a shard.
    monkeypatch.setattr(ByteTokenizer, "encode_batch", lambda self, texts: [[300] for _ in texts])
    with pytest.raises(DataError, match="outside 0..256"):
        prepare(cfg_for(tmp_path, src, val_fraction=0.0), 4, progress=False)
    assert not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer(tmp_path):
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.spec) == (257, 256, "bytes")
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode([104, 256, 195, 169, 999, -1]) == "hé"
    assert tok.decode([0xFF, 104]) == "\ufffdh"
    tok.save(tmp_path / "tok")
    again = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(again, ByteTokenizer)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_lone_surrogates_become_question_marks_in_every_tokenizer():
    """A str holding a lone surrogate (argv bytes that are not UTF-8, a Python caller's
    '\\ud800') is encoded as ByteTokenizer documents, with ``?``: the subword tokenizers
    raised TypeError from the tokenizers library (a traceback from Model.generate)."""
    from transformers import PreTrainedTokenizerFast

    from anyorder.data.tokenizers import HFTokenizer

    bpe = load_tokenizer("bpe:300", ["hello world <|endoftext|> " * 20])
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe.tok, eos_token="<|endoftext|>")
    hf = HFTokenizer(fast, name="hf", spec="hf")
    for tok in (ByteTokenizer(), bpe, hf):
        for text in ("a\ud800b", "hello \udcff <|endoftext|> \udfff"):
            assert tok.encode(text) == tok.encode(text.encode("utf-8", "replace").decode())


def test_bpe_trained_saved_and_reloaded(tmp_path):
    texts = list(iter_documents("builtin:pydoc", max_documents=30))
    tok = load_tokenizer("bpe:512", texts)
    assert 257 < tok.vocab_size <= 512
    assert tok.eos_id == tok.tok.token_to_id("<|endoftext|>")
    sample = texts[3][:2000] + " Ünïcödé ✓"
    ids = tok.encode(sample)
    assert len(ids) < len(sample.encode())  # merges were learnt
    assert tok.decode(ids) == sample
    assert tok.decode(ids + [tok.eos_id, 10**6]) == sample
    # A literal EOS string in a document is text, not the EOS token.
    literal = tok.encode("a <|endoftext|> b")
    assert tok.eos_id not in literal and tok.decode(literal) == "a <|endoftext|> b"
    tok.save(tmp_path / "bpe")
    again = load_tokenizer(str(tmp_path / "bpe"))
    assert (again.vocab_size, again.eos_id) == (tok.vocab_size, tok.eos_id)
    for t in texts[:10] + [sample, "a <|endoftext|> b"]:
        assert again.encode(t) == tok.encode(t)
    assert again.encode_batch(texts[:5]) == [tok.encode(t) for t in texts[:5]]
    with pytest.raises(DataError, match="trained on texts"):
        load_tokenizer("bpe:512")
    with pytest.raises(DataError, match="vocabulary size"):
        load_tokenizer("bpe:big", texts)
    # past 64 bits the trainer crashed with an OverflowError traceback; past 32 the ids
    # could not be stored in the shards (uint32)
    for spec in ("bpe:99999999999999999999", "bpe:4294967297"):
        with pytest.raises(DataError) as e:
            load_tokenizer(spec, texts)
        assert str(e.value) == (
            f"tokenizer {spec!r}: the vocabulary must hold at most 4294967296 tokens (ids are "
            "stored as 32-bit integers), e.g. data.tokenizer=bpe:8192"
        )


def test_prepare_with_bpe(tmp_path):
    src = write_txt(tmp_path / "corpus", many_docs(60) + DOCS)
    d = prepare(cfg_for(tmp_path, src, tokenizer="bpe:300", val_fraction=0.0), 8, progress=False)
    assert d.manifest["vocab_size"] == d.tokenizer.vocab_size <= 300
    assert d.tokenizer.eos_id == d.manifest["eos_id"]
    docs = list(iter_documents(str(src)))
    expected = packed(docs, d.tokenizer)
    np.testing.assert_array_equal(d.train.reshape(-1), expected[: d.train.size])
    assert d.bytes_per_token("train") > 1.0


def test_gpt2_tokenizer_from_shared_folder(tmp_path):
    if not has_gpt2_tokenizer():
        pytest.skip(GPT2_SKIP)
    pytest.importorskip("transformers")
    tok = load_tokenizer(str(GPT2_TOKENIZER_DIR))
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.eos_id, tok.vocab_size) == (50256, 50257)
    assert tok.decode([15496, 995, 50256]) == "Hello world"
    assert 50256 not in tok.encode("a <|endoftext|> b")
    tok.save(tmp_path / "gpt2")
    again = load_tokenizer(str(tmp_path / "gpt2"))
    text = "Any-order models decode in any order. <|endoftext|> Ünïcödé"
    assert again.encode(text) == tok.encode(text)
    assert (again.eos_id, again.vocab_size) == (50256, 50257)
    assert tok.encode_batch(["Hello world", text]) == [[15496, 995], tok.encode(text)]


def test_transformers_folder_uses_sep_as_eos(tmp_path):
    transformers = pytest.importorskip("transformers")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words = ["hello", "world", "any", "order"] + [f"w{i}" for i in range(300)]
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(specials + letters + ["##" + c for c in letters] + words) + "\n")
    # vocab= (not vocab_file=, which builds an empty tokenizer in transformers 5).
    transformers.BertTokenizerFast(vocab=str(vocab)).save_pretrained(tmp_path / "bert")
    tok = load_tokenizer(str(tmp_path / "bert"))
    assert tok.eos_id == 3 and tok.vocab_size == len(specials) + 2 * len(letters) + len(words)
    ids = tok.encode("Hello world")  # lower-cased, no [CLS]/[SEP] around it
    first_word = len(specials) + 2 * len(letters)
    assert ids == [first_word, first_word + 1]
    assert tok.decode(ids + [3, 2, 10**6]) == "hello world"
    assert 3 not in tok.encode("a [SEP] b")
    # The silent failure mode: a tokenizer with an empty vocabulary is refused.
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(tmp_path / "empty")
    with pytest.raises(DataError, match="empty or broken vocabulary"):
        load_tokenizer(str(tmp_path / "empty"))


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "no_such_tokenizer"))
    (tmp_path / "junk").mkdir()
    with pytest.raises(DataError, match="holds no tokenizer files"):
        load_tokenizer(str(tmp_path / "junk"))


# ----------------------------------------------------------------------------- sampler


def test_sampler_ranks_share_the_global_batch():
    one = BlockSampler(50, 8, seed=3)
    ranks = [BlockSampler(50, 8, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(20):  # crosses several epochs
        g = one.next_indices()
        a, b = (s.next_indices() for s in ranks)
        assert len(a) == len(b) == 4
        np.testing.assert_array_equal(a, g[0::2])
        np.testing.assert_array_equal(b, g[1::2])
    with pytest.raises(ConfigError, match="divisible"):
        BlockSampler(50, 9, seed=0, rank=0, world_size=2)


def test_sampler_resumes_exactly():
    s = BlockSampler(23, 5, seed=7)
    for _ in range(6):
        s.next_indices()
    state = json.loads(json.dumps(s.state_dict()))  # survives a checkpoint round trip
    expected = [s.next_indices() for _ in range(10)]
    resumed = BlockSampler(23, 5, seed=7)
    resumed.load_state_dict(state)
    for e in expected:
        np.testing.assert_array_equal(resumed.next_indices(), e)
    with pytest.raises(DataError, match="same data"):
        BlockSampler(24, 5, seed=7).load_state_dict(state)


def test_sampler_epochs_visit_every_block_once():
    n, bs = 10, 4
    s = BlockSampler(n, bs, seed=0)
    stream = np.concatenate([s.next_indices() for _ in range(15)])  # 60 = 6 epochs
    epochs = stream.reshape(6, n)
    for e, row in enumerate(epochs):
        np.testing.assert_array_equal(np.sort(row), np.arange(n))
        np.testing.assert_array_equal(row, s.permutation(e))
    assert not all((epochs[0] == row).all() for row in epochs[1:])  # reshuffled per epoch
    assert s.state_dict()["epoch"] == 6 and s.state_dict()["position"] == 0
    big = BlockSampler(3, 7, seed=1)  # a batch longer than an epoch wraps inside the batch
    first = big.next_indices()
    np.testing.assert_array_equal(np.sort(first[:3]), np.arange(3))
    np.testing.assert_array_equal(first[3:6], big.permutation(1))
