"""A parquet file whose text column declares more, uncompressed, than memory can hold is
refused from its footer before a page of it is read (anyorder.data.files.check_parquet_text):
a data source (a row group at a time), an hf: folder, a zero-shot test set (whole)."""

from __future__ import annotations

from pathlib import Path

import pytest

from anyorder.errors import DataError

from conftest import parquet_declaring

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

MB = 1 << 20
FIX_ROWS = (
    "write it in smaller row groups, e.g. pyarrow.parquet.write_table(table, path, "
    "row_group_size=10000), or split it into smaller files"
)


@pytest.fixture
def memory(monkeypatch):
    """8 MiB of memory available (2 MiB of parquet text at a time), whatever the machine."""
    monkeypatch.setattr("anyorder.memory.available_memory", lambda: 8 * MB)


def _compressible(path: Path, rows: int, row_group_size: int | None = None) -> Path:
    """``rows`` rows of 1 MiB of one letter each: kilobytes on disk (zstd, no dictionary)."""
    table = pa.table({"text": [chr(97 + i % 26) * MB for i in range(rows)]})
    pq.write_table(table, path, compression="zstd", use_dictionary=False,
                   row_group_size=row_group_size)  # fmt: skip
    assert path.stat().st_size < 64 * 1024
    return path


def test_a_data_source_declaring_more_than_memory_is_refused(tmp_path, memory) -> None:
    from anyorder.data.sources import iter_documents

    path = _compressible(tmp_path / "bomb.parquet", rows=4)
    with pytest.raises(DataError) as e:
        next(iter_documents(str(path)))
    size = pq.ParquetFile(path).metadata.row_group(0).column(0).total_compressed_size
    assert str(e.value) == (
        f"{path}: column 'text' declares 4.2 MB of text uncompressed ({size / 1e3:,.0f} kB on "
        f"disk), more than a quarter of the 8.4 MB of memory available now; {FIX_ROWS}"
    )


def test_row_groups_that_each_fit_are_read_as_before(tmp_path, memory) -> None:
    """A source is read a row group at a time: 4 groups of 1 MiB pass the 2 MiB bound, and
    read the same documents as without it; a zero-shot set, read whole, is refused."""
    from anyorder.data.sources import iter_documents
    from anyorder.evaluation.zeroshot import _local_rows

    (tmp_path / "set").mkdir()
    path = _compressible(tmp_path / "set" / "test.parquet", rows=4, row_group_size=1)
    docs = list(iter_documents(str(path)))
    assert docs == [c * MB for c in "abcd"]
    with pytest.raises(DataError) as e:
        _local_rows(path.parent, "text")
    assert str(e.value).startswith(f"{path}: column 'text' declares 4.2 MB of text uncompressed (")
    assert str(e.value).endswith("of memory available now; split it into smaller files")


def test_the_largest_row_group_is_named(tmp_path, memory) -> None:
    from anyorder.data.sources import iter_documents

    table = pa.table({"text": ["a" * MB, "b" * MB, "c" * MB, "d" * MB, "e" * MB]})
    path = tmp_path / "groups.parquet"
    with pq.ParquetWriter(path, table.schema, compression="zstd", use_dictionary=False) as w:
        w.write_table(table.slice(0, 1))
        w.write_table(table.slice(1, 4))  # row group 1: 4 MiB
    with pytest.raises(DataError, match=r"groups.parquet: row group 1 of column 'text' declares"):
        list(iter_documents(str(path)))


def test_an_hf_folder_of_parquet_is_checked_before_datasets_reads_it(tmp_path, memory) -> None:
    pytest.importorskip("datasets")
    from anyorder.data.sources import iter_documents

    (tmp_path / "hf").mkdir()
    _compressible(tmp_path / "hf" / "train.parquet", rows=4)
    with pytest.raises(DataError, match=r"train.parquet: column 'text' declares 4.2 MB"):
        next(iter_documents(f"hf:{tmp_path / 'hf'}"))


def test_a_footer_declaring_a_petabyte_is_refused_on_any_machine(tmp_path) -> None:
    from anyorder.data.sources import iter_documents

    path = parquet_declaring(tmp_path / "claims.parquet", 10**15)
    with pytest.raises(DataError, match=r"declares 1,000.0 TB of text uncompressed"):
        next(iter_documents(str(path)))


def test_an_ordinary_file_reads_as_before(tmp_path) -> None:
    from anyorder.data.sources import iter_documents

    path = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"text": ["one", None, "two", ""]}), path)
    assert list(iter_documents(str(path))) == ["one", "two"]
