"""The Makefile's set-up: which index torch comes from (`make -n`: nothing is run)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _torch_line(tmp_path, *variables: str) -> str:
    """The pip line that installs torch in a fresh venv (``make -n``: printed, not run)."""
    out = subprocess.run(
        ["make", "-n", "-C", str(REPO), "setup", f"VENV={tmp_path / 'venv'}", *variables],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [ln for ln in out.splitlines() if "pip install" in ln and "torch==" in ln]
    assert len(lines) == 1, out
    return lines[0]


def test_torch_comes_from_pips_default_index_unless_an_index_is_named(tmp_path) -> None:
    pip = f"{tmp_path / 'venv'}/bin/pip install -q"
    assert _torch_line(tmp_path) == f'{pip} "torch==2.13.0"'
    assert _torch_line(tmp_path, f"TORCH_INDEX={CPU_INDEX}") == (
        f'{pip} --index-url {CPU_INDEX} "torch==2.13.0"'
    )
    assert _torch_line(tmp_path, "TORCH_EXTRA_INDEX=https://mirror.example/simple") == (
        f'{pip} --extra-index-url https://mirror.example/simple "torch==2.13.0"'
    )
    assert _torch_line(
        tmp_path, "TORCH_INDEX=https://a.example", "TORCH_EXTRA_INDEX=https://b.example"
    ) == (
        f'{pip} --index-url https://a.example --extra-index-url https://b.example "torch==2.13.0"'
    )


def test_the_cpu_only_build_is_documented_where_set_up_is() -> None:
    for page in ("README.md", "docs/quickstart.md"):
        assert f"TORCH_INDEX={CPU_INDEX}" in (REPO / page).read_text(), page
