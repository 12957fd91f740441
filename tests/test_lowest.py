"""The lowest versions pyproject.toml claims are the ones `make test-lowest` installs and tests.

constraints/lowest.txt pins every floor of pyproject.toml (the dependencies and every extra);
`make test-lowest` installs them together into .venv-lowest with pip's ``-c`` and runs the
checks of `make test` there. A floor raised or lowered in one file and not the other fails
here, so the range stays one that was tested.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

CONSTRAINTS = REPO / "constraints" / "lowest.txt"


def _name(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> str:
    """A version without its trailing zeros: ``6`` and ``6.0``, ``2.9`` and ``2.9.0`` agree."""
    return re.sub(r"(\.0+)+$", "", version)


def _claims() -> dict[str, str]:
    """Every requirement of pyproject.toml (extras included): name -> its whole specifier."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    claims = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_.-]*)\s*(.*)", line.strip())
        assert match, line
        claims[_name(match[1])] = match[2].replace(" ", "")
    return claims


def _pins() -> dict[str, str]:
    """constraints/lowest.txt: name -> the pinned version (comments and blank lines skipped)."""
    pins = {}
    for raw in CONSTRAINTS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_.-]*)==([0-9][0-9A-Za-z.]*)", line)
        assert match, f"constraints/lowest.txt: {raw!r} is not NAME==VERSION"
        assert _name(match[1]) not in pins, f"constraints/lowest.txt pins {match[1]} twice"
        pins[_name(match[1])] = match[2]
    return pins


def test_every_floor_pyproject_claims_is_the_version_pinned_for_make_test_lowest() -> None:
    claims, pins = _claims(), _pins()
    for name, spec in claims.items():
        floor = re.search(r"(?:^|,)>=([^,]+)", spec)
        assert floor, f"pyproject.toml: {name}{spec} names no lowest version (>=)"
        assert _release(pins.get(name, "")) == _release(floor[1]), (
            f"pyproject.toml claims {name}>={floor[1]}; constraints/lowest.txt pins "
            f"{name}=={pins.get(name)}"
        )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_lowest_installs_with_those_pins_into_its_own_venv(tmp_path) -> None:
    venv = tmp_path / "lowest"
    out = subprocess.run(
        ["make", "-n", "-C", str(REPO), "test-lowest", f"LOWEST={venv}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pip = f"{venv}/bin/pip install -q -c constraints/lowest.txt"
    assert f"{pip} torch" in out.splitlines(), out
    assert f'{pip} -e ".[hf,plot,eval,dev]"' in out.splitlines(), out
    assert f"{venv}/bin/pytest -q" in out.splitlines(), out
    assert f"{REPO}/.venv/" not in out and " .venv/" not in out, out  # make test's venv untouched
