"""Weights in 2 MB pages: the values, the ties and the logits unchanged, the big parameters
in 2 MB-aligned regions the kernel was asked to back with huge pages, nothing moved where
the kernel offers none."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import anyorder
from anyorder import hugepages
from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import ByteTokenizer

from conftest import tiny_model

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages")


def _vm_flags(t: torch.Tensor) -> list[str]:
    """The VmFlags /proc/self/smaps gives the region that holds ``t``'s first byte."""
    ptr = t.data_ptr()
    text = Path("/proc/self/smaps").read_text()
    for region in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(v, 16) for v in region.split()[0].split("-"))
        if lo <= ptr < hi:
            return re.search(r"VmFlags:(.*)", region).group(1).split()
    raise AssertionError("no region holds the tensor")


def _big_model():
    """A gpt whose tied embedding is exactly one huge page (8192 x 64 fp32)."""
    return tiny_model("gpt", vocab_size=8192, d_model=64, n_layer=1, seq_len=16)


@needs_thp
def test_big_weights_move_into_advised_aligned_regions_and_compute_the_same():
    model = _big_model()
    x = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(x)
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    big = [n for n, p in model.named_parameters() if p.numel() * 4 >= hugepages.HUGE_PAGE]
    assert big == ["tok_emb.weight"]
    assert hugepages.place_in_huge_pages(model) == 8192 * 64 * 4
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name][1], rtol=0, atol=0)
        moved = p.data_ptr() != before[name][0]
        assert moved == (name in big), name
    emb = model.tok_emb.weight
    assert emb.data_ptr() % hugepages.HUGE_PAGE == 0 and "hg" in _vm_flags(emb)
    assert model.head.weight is emb  # still tied: one Parameter
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)


@needs_thp
def test_a_refused_mapping_leaves_the_weights_where_they_are(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    model = _big_model()
    ptr = model.tok_emb.weight.data_ptr()
    monkeypatch.setattr(hugepages.mmap, "mmap", refuse)
    assert hugepages.place_in_huge_pages(model) == 0
    assert model.tok_emb.weight.data_ptr() == ptr


def test_nothing_moves_where_the_kernel_offers_no_huge_pages(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "_THP_MODE", mode)
    model = _big_model()
    ptr = model.tok_emb.weight.data_ptr()
    assert not hugepages.available()
    assert hugepages.place_in_huge_pages(model) == 0 and model.tok_emb.weight.data_ptr() == ptr
    monkeypatch.setattr(hugepages, "_THP_MODE", tmp_path / "absent")
    assert not hugepages.available()


@needs_thp
def test_load_and_sample_take_huge_pages(tmp_path, capsys):
    from anyorder.cli import main

    folder = save_pretrained(_big_model(), tmp_path / "big", ByteTokenizer())
    plain = anyorder.load(folder)
    huge = anyorder.load(folder, huge_pages=True)
    assert "hg" in _vm_flags(huge.model.tok_emb.weight)
    assert "hg" not in _vm_flags(plain.model.tok_emb.weight)
    x = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(huge.model(x), plain.model(x), rtol=0, atol=0)
    outs = []
    for flags in ([], ["--huge-pages"]):
        argv = ["sample", str(folder), "--device", "cpu", "--seed", "3", "--length", "12"]
        assert main([*argv, "--json", *flags]) == 0
        outs.append([s["tokens"] for s in json.loads(capsys.readouterr().out)["samples"]])
    assert outs[0] == outs[1] and len(outs[0][0]) == 12
