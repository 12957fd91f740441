"""Files read whole (a .txt document a bpe:VOCAB tokenizer learns from, a .txt file of an
hf: folder, an eval --data-dir test set) larger than a quarter of the memory available now
are refused from ``os.stat`` before a byte is read (anyorder.data.files.check_whole_read)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from anyorder.errors import DataError

MB = 1 << 20
BPE_FIX = (
    "split it into smaller .txt files, or use a tokenizer trained already "
    "(data.tokenizer=bytes, gpt2 or a tokenizer folder)"
)


@pytest.fixture
def memory(monkeypatch):
    """16 MiB of memory available (4 MiB read whole at a time), whatever the machine."""
    monkeypatch.setattr("anyorder.memory.available_memory", lambda: 16 * MB)


def _text(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(("word " * size)[:size])
    return path


def test_a_document_read_whole_beyond_memory_is_refused(tmp_path, memory) -> None:
    from anyorder.data.sources import iter_documents

    path = _text(tmp_path / "big.txt", 5 * MB)
    with pytest.raises(DataError) as e:
        next(iter_documents(str(path)))
    assert str(e.value) == (
        f"{path} is 5.2 MB, read whole as one document (a bpe:VOCAB tokenizer learns from "
        f"whole documents): more than a quarter of the 16.8 MB of memory available now; {BPE_FIX}"
    )
    small = _text(tmp_path / "small" / "a.txt", 4 * MB)
    assert list(iter_documents(str(small))) == [small.read_text()]  # as before


def test_bpe_training_refuses_it_before_reading(tmp_path, memory) -> None:
    from anyorder.config import DataConfig
    from anyorder.data import prepare

    path = _text(tmp_path / "corpus" / "big.txt", 5 * MB)
    cfg = DataConfig(source=str(path.parent), tokenizer="bpe:300", cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=r"big.txt is 5.2 MB, read whole as one document"):
        prepare(cfg, 32, progress=False)


def test_an_hf_folder_txt_file_beyond_memory_is_refused(tmp_path, memory) -> None:
    pytest.importorskip("datasets")
    from anyorder.data.sources import iter_documents

    folder = tmp_path / "hf"
    path = _text(folder / "big.txt", 5 * MB)
    with pytest.raises(DataError) as e:
        next(iter_documents(f"hf:{folder}"))
    assert str(e.value) == (
        f"{path} is 5.2 MB, and datasets reads each .txt file of an hf: folder whole: more than "
        "a quarter of the 16.8 MB of memory available now; give the folder without hf: "
        f"(data.source={folder}), where a large .txt file is read in pieces, or split the file"
    )


def test_a_zero_shot_set_beyond_memory_is_refused(tmp_path, memory) -> None:
    from anyorder.evaluation.zeroshot import _local_rows

    folder = tmp_path / "lambada"
    _text(folder / "a.txt", 3 * MB)
    (folder / "b.jsonl").write_text('{"text": "' + "x" * 3 * MB + '"}\n')
    with pytest.raises(DataError) as e:
        _local_rows(folder, "text")
    assert str(e.value) == (
        f"{folder} is 6.3 MB, the test examples of its 2 .txt/.jsonl/.json file(s), held "
        "whole: more than a quarter of the 16.8 MB of memory available now; evaluate a smaller "
        "part of the set"
    )
    (folder / "b.jsonl").unlink()
    assert len(_local_rows(folder, "text")) == 1  # 3 MiB: read as before


def test_a_sparse_terabyte_is_refused_without_a_read(tmp_path) -> None:
    """A sparse file takes no disk; os.stat alone says what it would take in memory."""
    from anyorder.data.sources import iter_documents

    path = tmp_path / "huge.txt"
    with open(path, "wb") as f:
        f.truncate(1 << 40)
    if os.stat(path).st_blocks * 512 > 1 << 20:
        pytest.skip("this file system writes no sparse files")
    with pytest.raises(DataError, match=r"huge.txt is 1.1 TB, read whole as one document"):
        next(iter_documents(str(path)))
