"""``train.dtype=auto`` on the CPU: bf16 only where this CPU computes it faster (measured once,
cached under the CPU's identity), and a cache file that cannot poison the answer."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from anyorder import precision
from anyorder.config import load_config
from anyorder.errors import ConfigError
from anyorder.training.setup import autocast_context

CPU = torch.device("cpu")


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """A cache home of the test's own, no override, and a probe that returns ``calls.ratio``
    and counts its calls (``calls.n``)."""
    monkeypatch.setenv("ANYORDER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(precision.OVERRIDE, raising=False)

    class Calls:
        n = 0
        ratio = 8.0

    def measure(width: int) -> float:
        Calls.n += 1
        return Calls.ratio

    monkeypatch.setattr(precision, "measure", measure)
    return Calls


@pytest.mark.parametrize("ratio,want", [(0.3, True), (0.89, True), (0.95, False), (8.0, False)])
def test_auto_is_bf16_on_the_cpu_only_where_bf16_is_faster(probe, ratio, want):
    probe.ratio = ratio
    assert precision.use_bf16("auto", CPU, 256) is want
    assert precision.use_bf16("bf16", CPU, 256) is True
    assert precision.use_bf16("fp32", CPU, 256) is False
    assert precision.use_bf16("auto", torch.device("cuda"), 256) is True
    assert probe.n == 1  # measured once, then read from the cache


@pytest.mark.parametrize("ratio,autocast", [(0.4, True), (6.0, False)])
def test_training_autocasts_by_the_rule(probe, ratio, autocast):
    """training.setup.autocast_context: auto follows the probe; fp32 and bf16 are as named."""
    probe.ratio = ratio
    cfg = load_config(None, ["model.preset=tiny"])
    assert isinstance(autocast_context(cfg, CPU), torch.autocast) is autocast
    cfg.train.dtype = "fp32"
    assert isinstance(autocast_context(cfg, CPU), contextlib.nullcontext)
    cfg.train.dtype = "bf16"
    assert isinstance(autocast_context(cfg, CPU), torch.autocast)


def test_bf16_on_a_slow_cpu_says_what_it_costs(probe):
    probe.ratio = 7.46
    assert precision.slower_note("train.dtype", 128) == (
        "train.dtype=bf16: bf16 autocast is 7.5x slower than fp32 on this CPU (its matrix "
        "products at width 128, measured); train.dtype=auto would use fp32"
    )
    probe.ratio = 0.5
    assert precision.slower_note("train.dtype", 64) is None


def test_the_override_answers_without_measuring(probe, monkeypatch):
    for flag, want in (("1", True), ("0", False)):
        monkeypatch.setenv(precision.OVERRIDE, flag)
        assert precision.use_bf16("auto", CPU, 256) is want
    assert probe.n == 0
    monkeypatch.setenv(precision.OVERRIDE, "yes")
    with pytest.raises(ConfigError) as e:
        precision.use_bf16("auto", CPU, 256)
    assert str(e.value) == (
        "ANYORDER_CPU_BF16='yes': use 1 (bf16 autocast on this CPU) or 0 (fp32), or unset it "
        "to measure"
    )


def test_the_cache_is_keyed_by_the_cpu_the_isa_limits_and_the_width(probe, monkeypatch):
    precision.bf16_cost(256)
    precision.bf16_cost(512)  # probed at 256: the same entry
    assert probe.n == 1
    precision.bf16_cost(128)
    assert probe.n == 2
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # another instruction set: measured anew
    precision.bf16_cost(256)
    assert probe.n == 3
    monkeypatch.setattr(precision, "cpu_identity", lambda: {"cpu": "another CPU"})
    precision.bf16_cost(256)
    assert probe.n == 4
    entries = json.loads(precision.cache_path().read_text())["entries"]
    assert len(entries) == 4 and set(entries.values()) == {8.0}


def _poisons(key: str) -> dict[str, bytes]:
    def doc(value) -> bytes:
        return json.dumps({"entries": {key: value}}).encode()

    return {
        "garbage": os.urandom(300),
        "not utf-8": b"\xff\xfe" + doc(0.5),
        "truncated": doc(0.5)[:-7],
        "a list": b"[0.5]",
        "entries a list": json.dumps({"entries": [key, 0.5]}).encode(),
        "a string": doc("0.5"),
        "a bool": doc(True),
        "an int": doc(1),
        "a dict": doc({"ratio": 0.5}),
        "null": doc(None),
        "huge": doc(1e300),
        "tiny": doc(1e-300),
        "negative": doc(-0.5),
        "zero": doc(0.0),
        "nan": b'{"entries": {"%s": NaN}}' % key.encode(),
        "infinity": b'{"entries": {"%s": Infinity}}' % key.encode(),
        "a bad key": json.dumps({"entries": {key[:-1]: 0.5, 7: 0.5}}).encode(),
        "oversized": doc(0.5) + b" " * (precision.MAX_CACHE_BYTES + 1),
    }


@pytest.mark.parametrize("kind", list(_poisons("k" * 32)))
def test_a_poisoned_cache_is_measured_again_and_replaced(probe, kind):
    """Every bad file: no crash, no trust (the probe runs), and a valid file afterwards."""
    path = precision.cache_path()
    path.parent.mkdir(parents=True)
    key = precision.cache_key(256)
    path.write_bytes(_poisons(key)[kind])
    assert precision.bf16_cost(256) == 8.0 and probe.n == 1
    assert json.loads(path.read_text())["entries"][key] == 8.0
    assert precision.bf16_cost(256) == 8.0 and probe.n == 1  # the rewritten file is read


def test_another_cpus_entry_is_not_taken(probe):
    path = precision.cache_path()
    path.parent.mkdir(parents=True)
    other = "0" * 32
    path.write_text(json.dumps({"entries": {other: 0.2}}))
    assert precision.bf16_cost(256) == 8.0 and probe.n == 1
    assert json.loads(path.read_text())["entries"] == {other: 0.2, precision.cache_key(256): 8.0}


def test_a_symlink_or_a_folder_in_the_caches_place_is_not_followed(probe, tmp_path):
    path = precision.cache_path()
    path.parent.mkdir(parents=True)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"entries": {precision.cache_key(256): 0.5}}))
    path.symlink_to(target)
    assert precision.bf16_cost(256) == 8.0 and probe.n == 1
    assert not path.is_symlink() and path.is_file()  # replaced, the target untouched
    assert json.loads(target.read_text())["entries"] == {precision.cache_key(256): 0.5}
    path.unlink()
    path.mkdir()
    assert precision.bf16_cost(256) == 8.0 and probe.n == 2  # a folder: measured, no crash


def test_a_cache_that_cannot_be_written_still_answers(probe, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("ANYORDER_CACHE", str(blocker / "cache"))  # under a file: no folder
    assert precision.bf16_cost(256) == 8.0
    assert precision.bf16_cost(256) == 8.0 and probe.n == 2  # nothing kept, nothing raised


def test_the_probe_is_quick_and_in_range():
    ratio = precision.measure(64)
    assert precision.RATIO_RANGE[0] <= ratio <= precision.RATIO_RANGE[1]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISA limits")
def test_the_probe_finds_bf16_slow_on_a_cpu_limited_to_avx2(tmp_path):
    """The kernels limited to AVX2 (no bf16 units, as most laptops): the real measurement
    finds bf16 slower and auto picks fp32, from a fresh process with that environment."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    env.pop(precision.OVERRIDE, None)
    env["ANYORDER_CACHE"] = str(tmp_path)
    code = (
        "import torch; from anyorder import precision as p; "
        "print(p.bf16_cost(256), p.use_bf16('auto', torch.device('cpu'), 256))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert float(out[0]) > 1.5 and out[1] == "False"


def test_a_run_that_names_bf16_on_a_slow_cpu_says_so_once(probe, tmp_path, capsys):
    """``anyorder train`` with train.dtype=bf16 where the probe finds bf16 7.5x slower: one
    line with the cost and the fix, and the run still trains in bf16 as asked."""
    from anyorder.training import train

    probe.ratio = 7.46
    values = {
        "model.kind": "gpt", "model.n_layer": 1, "model.n_head": 2, "model.d_model": 32,
        "model.seq_len": 16, "data.source": "builtin:synthetic", "train.steps": 1,
        "train.batch_size": 2, "train.eval_every": 0, "train.ckpt_every": 0,
        "train.device": "cpu", "train.dtype": "bf16", "train.out_dir": str(tmp_path / "run"),
        "data.cache_dir": str(tmp_path / "data"),
    }  # fmt: skip
    train(load_config(None, [f"{k}={v}" for k, v in values.items()]), progress=False)
    out = capsys.readouterr().out.splitlines()
    want = (
        "train.dtype=bf16: bf16 autocast is 7.5x slower than fp32 on this CPU (its matrix "
        "products at width 32, measured); train.dtype=auto would use fp32"
    )
    assert out.count(want) == 1
