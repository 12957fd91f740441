"""A downloaded model folder is untrusted input: loading it never runs its Python, nor asks.

Each attack folder holds ``evil.py``, which writes a marker file when imported. Every command
gets ``y`` on stdin, so a "Do you wish to run the custom code? [y/N]" prompt would be answered
yes; the checks are that the marker never appears and that the refusal is one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from anyorder.checkpoint.exporting import save_pretrained
from anyorder.data import EOT, ByteTokenizer, load_tokenizer
from anyorder.errors import DataError

from conftest import REPO, tiny_model

pytest.importorskip("transformers")

VOCAB = 300


def _evil(folder: Path, marker: Path) -> None:
    """The module an ``auto_map`` or ``tokenizer_class`` would import: it leaves ``marker``."""
    (folder / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast, PretrainedConfig\n"
        "class EvilTok(PreTrainedTokenizerFast):\n    pass\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )


def _tokenizer_folder(folder: Path) -> Path:
    """A real ``transformers`` tokenizer folder (tokenizer.json + tokenizer_config.json, no
    anyorder marker) of VOCAB tokens, EOT among them."""
    from tokenizers import Tokenizer as Raw
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {EOT: 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    raw = Raw(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=EOT, unk_token="[UNK]")
    tok.save_pretrained(str(folder))
    return folder


def _edit(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def _export(tmp_path: Path) -> Path:
    """An export whose tokenizer/ is a plain transformers folder (as a hub upload may hold)."""
    folder = save_pretrained(tiny_model("aogpt", vocab_size=VOCAB), tmp_path / "m", ByteTokenizer())
    shutil.rmtree(folder / "tokenizer")
    _tokenizer_folder(folder / "tokenizer")
    return folder


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "anyorder.cli", *args],
        cwd=cwd,
        env=env,
        input="y\ny\ny\n",  # a prompt, if any, is answered yes
        capture_output=True,
        text=True,
        timeout=300,
    )


def _refused(out: subprocess.CompletedProcess, command: str, marker: Path) -> str:
    """The one error line of a refused command, after checking that no code ran."""
    assert not marker.exists(), "the folder's code ran"
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(f"anyorder {command}: error: ")
    assert "[y/N]" not in out.stdout + out.stderr
    return lines[0]


# (file in tokenizer/, its changes, the message's tail)
AUTO_MAP = {"AutoTokenizer": ["evil.EvilTok", "evil.EvilTok"]}
ATTACKS = {
    # no tokenizer_class: transformers 5 asks on stdin, and runs evil.py on "y"
    "auto-map": (
        "tokenizer_config.json",
        {"auto_map": AUTO_MAP, "tokenizer_class": None},
        "has an auto_map ({auto}), which asks to run the folder's own Python code, and anyorder "
        "never runs a model folder's code; use one that needs none (without auto_map)",
    ),
    # the legacy list form of auto_map
    "auto-map-list": (
        "tokenizer_config.json",
        {"auto_map": ["evil.EvilTok", None], "tokenizer_class": None},
        "has an auto_map ({auto}), which asks to run the folder's own Python code, and anyorder "
        "never runs a model folder's code; use one that needs none (without auto_map)",
    ),
    # a config.json beside the tokenizer: AutoTokenizer reads it through AutoConfig
    "config-auto-map": (
        "config.json",
        {"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}},
        "has an auto_map ({auto}), which asks to run the folder's own Python code, and anyorder "
        "never runs a model folder's code; use one that needs none (without auto_map)",
    ),
    # a class transformers does not ship, by name or as a module path
    "custom-class": (
        "tokenizer_config.json",
        {"tokenizer_class": "EvilTok"},
        "names tokenizer_class 'EvilTok', which is not a class transformers ships, and anyorder "
        "never runs a model folder's code: set it to one of transformers' tokenizers (e.g. "
        "PreTrainedTokenizerFast)",
    ),
    "module-path-class": (
        "tokenizer_config.json",
        {"tokenizer_class": "evil.EvilTok"},
        "names tokenizer_class 'evil.EvilTok', which is not a class transformers ships, and "
        "anyorder never runs a model folder's code: set it to one of transformers' tokenizers "
        "(e.g. PreTrainedTokenizerFast)",
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_sample_refuses_an_export_whose_tokenizer_asks_for_code(tmp_path, attack) -> None:
    name, changes, tail = ATTACKS[attack]
    folder = _export(tmp_path)
    tok = folder / "tokenizer"
    _edit(tok / name, **changes)
    marker = tmp_path / "PWNED"
    _evil(tok, marker)
    out = _cli("sample", str(folder), "--num-samples", "1", "--length", "4", cwd=tmp_path)
    line = _refused(out, "sample", marker)
    auto = json.dumps(changes.get("auto_map"))
    assert line == (
        f"anyorder sample: error: the tokenizer in {tok} cannot be loaded: "
        f"{tok.resolve() / name} " + tail.format(auto=auto)
    )


def test_a_symlinked_code_file_is_refused_the_same(tmp_path) -> None:
    folder = _export(tmp_path)
    tok = folder / "tokenizer"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    marker = tmp_path / "PWNED"
    _evil(elsewhere, marker)
    (tok / "evil.py").symlink_to(elsewhere / "evil.py")
    _edit(tok / "tokenizer_config.json", auto_map=AUTO_MAP, tokenizer_class=None)
    import anyorder
    from anyorder.errors import CheckpointError

    with pytest.raises(CheckpointError, match="has an auto_map") as e:
        anyorder.load(folder)
    assert "\n" not in str(e.value)
    assert not marker.exists()


def test_a_clean_transformers_tokenizer_still_loads(tmp_path) -> None:
    # no false alarm: the same folder without the attack loads and round-trips text
    folder = _export(tmp_path)
    import anyorder

    tok = anyorder.load(folder).tokenizer
    assert tok.vocab_size == VOCAB and tok.eos_id == 0
    assert tok.decode(tok.encode("w5 w7 w299")) == "w5 w7 w299"


def test_config_json_that_is_not_json_is_refused_not_skipped(tmp_path) -> None:
    tok = _tokenizer_folder(tmp_path / "tok")
    (tok / "config.json").write_bytes(b"\xef\xbb\xbf{}")  # a BOM: json refuses it
    with pytest.raises(DataError, match=r"config.json is not readable JSON \("):
        load_tokenizer(str(tok))


@pytest.mark.parametrize("declared", [None, "PreTrainedTokenizerFast"])
def test_a_hub_tokenizer_that_asks_for_code_is_refused(tmp_path, declared) -> None:
    # without tokenizer_class transformers would ask (and run evil.py on "y"); with one it
    # would fall back to that class quietly: both are refused in the same line
    pytest.importorskip("huggingface_hub")
    folder = save_pretrained(tiny_model("aogpt", vocab_size=VOCAB), tmp_path / "m", ByteTokenizer())
    src = _tokenizer_folder(tmp_path / "tok")
    _edit(src / "tokenizer_config.json", auto_map=AUTO_MAP, tokenizer_class=declared)
    (src / "config.json").write_text("{}")  # as a hub model repository has
    marker = tmp_path / "PWNED"
    _evil(src, marker)
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / "models--someone--evil"
    shutil.copytree(src, root / "snapshots" / commit)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = _cli("sample", str(folder), "--tokenizer", "someone/evil", "--length", "4", cwd=tmp_path,
               env=env)  # fmt: skip
    line = _refused(out, "sample", marker)
    assert line == (
        "anyorder sample: error: tokenizer 'someone/evil' asks to run Python code from the hub "
        "(an auto_map), and anyorder never runs a model's code; pick a tokenizer transformers "
        "ships"
    )


def test_eval_refuses_a_judge_folder_that_asks_for_code(tmp_path) -> None:
    folder = save_pretrained(tiny_model("aogpt", vocab_size=257), tmp_path / "m", ByteTokenizer())
    judge = _tokenizer_folder(tmp_path / "judge")
    auto = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    _edit(judge / "config.json", model_type="evil", auto_map=auto)
    marker = tmp_path / "PWNED"
    _evil(judge, marker)
    out = _cli("eval", str(folder), "--suite", "gen", "--judge", str(judge), "--num-samples",
               "1", "--out", str(tmp_path / "out"), cwd=tmp_path)  # fmt: skip
    line = _refused(out, "eval", marker)
    assert line == (
        f"anyorder eval: error: judge {str(judge)!r}: {judge / 'config.json'} has an auto_map "
        f"({json.dumps(auto)}), which asks to run the folder's own Python code, and anyorder "
        "never runs a model folder's code; use one that needs none (without auto_map)"
    )


def test_hf_datasets_never_run_a_loading_script(tmp_path, monkeypatch) -> None:
    # datasets >= 4 refuses loading scripts itself; datasets 2.x (which pyproject allows) ran
    # one unasked unless told trust_remote_code=False. Both the hf: source and the zero-shot
    # sets say so, whatever the installed version.
    datasets = pytest.importorskip("datasets")
    from anyorder.data import iter_documents
    from anyorder.evaluation import zeroshot

    seen = []

    def fake_load(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code", "unset"))
        return {"text": ["a"], "sentence": ["a"]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    with pytest.raises(DataError):  # the fake's rows are not records; only the call matters
        list(iter_documents("hf:someone/evil"))
    zeroshot.load_texts(zeroshot.DATASETS["ptb"])
    assert seen == [False, False]
    # and the real thing on a local folder with a loading script: no marker, one line
    monkeypatch.undo()
    marker = tmp_path / "PWNED"
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"^could not read dataset hf:evil:default") as e:
        list(iter_documents("hf:evil:default"))
    assert "\n" not in str(e.value) and not marker.exists()
