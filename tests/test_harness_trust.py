"""Task folders (``--include-path``) whose YAML would run code: refused in one line unless
``--trust-task-code`` (anyorder.harness.trust); nothing in them runs before that."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import REPO, tiny_model

pytest.importorskip("lm_eval", reason="the harness is the eval extra: pip install anyorder[eval]")

FIXTURES = REPO / "tests" / "fixtures" / "lm_eval"
FIX = "read that code, then add --trust-task-code if you trust it"
PPL = (FIXTURES / "anyorder_ppl.yaml").read_text()
# a module beside the YAML that leaves a mark when imported: it must never be imported
HOOK = """\
from pathlib import Path

Path(__file__).with_name("ran").write_text("ran")


def docs(dataset):
    return dataset
"""


def _folder(tmp_path: Path, yaml_text: str, name: str = "evil.yaml") -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(yaml_text)
    (folder / "hook.py").write_text(HOOK)
    return folder


def _eval(capsys, folder: Path, *extra: str, task: str = "evil") -> tuple[int, str]:
    from anyorder.cli import main as cli

    code = cli(["eval", "nope", "--suite", "lm-eval", "--tasks", task,
                "--include-path", str(folder), *extra])  # fmt: skip
    return code, capsys.readouterr().err.strip()


def test_a_function_tag_is_refused_and_never_imported(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    folder = _folder(tmp_path, "task: evil\nprocess_docs: !function hook.docs\n")
    code, err = _eval(capsys, Path("tasks"))
    assert (code, err) == (
        2,
        "anyorder eval: error: --include-path 'tasks': 'tasks/evil.yaml' has the tag "
        f"'!function' 'hook.docs', with which the harness runs Python code; {FIX}",
    )
    assert not (folder / "ran").exists()


def test_a_python_tag_and_a_verbatim_tag_are_refused(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    _folder(tmp_path, "task: evil\ndoc_to_text: !!python/name:os.system\n")
    assert _eval(capsys, Path("tasks"))[1] == (
        "anyorder eval: error: --include-path 'tasks': 'tasks/evil.yaml' has the tag "
        f"'!!python/name:os.system', with which the harness runs Python code; {FIX}"
    )
    (tmp_path / "tasks" / "evil.yaml").write_text("task: evil\nclass: !<!function> hook.X\n")
    assert "has the tag '!function' 'hook.X'" in _eval(capsys, Path("tasks"))[1]


def test_a_tag_in_an_included_file_outside_the_folder_is_refused(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "base.yaml").write_text("custom_dataset: !function hook.docs\n")
    (outside / "hook.py").write_text(HOOK)
    _folder(tmp_path, "include: ../elsewhere/base.yaml\ntask: evil\n")
    err = _eval(capsys, Path("tasks"))[1]
    assert err == (
        f"anyorder eval: error: --include-path 'tasks': {str(outside / 'base.yaml')!r} has "
        f"the tag '!function' 'hook.docs', with which the harness runs Python code; {FIX}"
    )
    assert not (outside / "ran").exists()


def test_a_metric_from_hf_evaluate_is_refused(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    _folder(tmp_path, "task: evil\nmetric_list:\n  - metric: ./hook.py\n")
    assert _eval(capsys, Path("tasks"))[1] == (
        "anyorder eval: error: --include-path 'tasks': 'tasks/evil.yaml' names the metric "
        "'./hook.py', which is not one of the harness's own; the harness would load it with "
        f"HF evaluate, which runs the metric's Python script; {FIX}"
    )
    _folder(tmp_path, "task: evil\nmetric_list:\n  - {metric: acc, hf_evaluate: true}\n")
    assert "names the metric 'acc', which is not one" in _eval(capsys, Path("tasks"))[1]


def test_the_fixture_tasks_and_the_harness_own_includes_pass(tmp_path) -> None:
    import lm_eval.tasks

    from anyorder.harness.trust import check_task_folder

    check_task_folder(str(FIXTURES))  # no tag, stock metrics
    own = next(Path(lm_eval.tasks.__file__).parent.glob("**/*.yaml"))
    folder = _folder(tmp_path, f"include: {own}\ntask: mine\n", name="mine.yaml")
    check_task_folder(str(folder))  # the harness's own tasks (its own code) are trusted
    # aliases nested 20 levels deep (2**20 paths to a leaf) are walked once each
    names = "abcdefghijklmnopqrst"
    laughs = "a: &a [1, 2]\n" + "".join(
        f"{b}: &{b} [*{a}, *{a}]\n" for a, b in zip(names, names[1:])
    )
    _folder(tmp_path, "task: x\n" + laughs + "metric_list: *t\n", name="mine.yaml")
    check_task_folder(str(folder))


def test_yaml_nested_past_the_stack_is_skipped_as_the_harness_skips_it(
    tmp_path, monkeypatch
) -> None:
    """Python's own YAML reader (where libyaml is absent) recurses once per level."""
    import yaml

    from anyorder.harness.trust import check_task_folder

    monkeypatch.setattr(yaml, "__with_libyaml__", False)
    folder = _folder(tmp_path, "task: x\na: " + "[" * 5000 + "]" * 5000 + "\n")
    check_task_folder(str(folder))


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    from anyorder.checkpoint.exporting import save_pretrained
    from anyorder.data import ByteTokenizer

    root = tmp_path_factory.mktemp("trust")
    model = tiny_model("gpt", seed=3, vocab_size=257, seq_len=64)
    return save_pretrained(model, root / "gpt", ByteTokenizer())


def _ppl_folder(tmp_path: Path, extra: str) -> Path:
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "hook.py").write_text(HOOK)
    shutil.copy(FIXTURES / "ppl.jsonl", folder / "ppl.jsonl")
    text = PPL.replace("anyorder_ppl", "evil").replace("tests/fixtures/lm_eval/", "tasks/")
    (folder / "evil.yaml").write_text(text + extra)
    return folder


def test_a_template_reaching_for_python_is_refused(tmp_path, monkeypatch, capsys, export):
    """Jinja's sandbox: ``cycler.__init__.__globals__`` is where ``os`` is."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    reach = "{{ cycler.__init__.__globals__.os.getcwd() }}"
    folder = _ppl_folder(tmp_path, f'doc_to_text: "{reach}"\n')
    from anyorder.cli import main as cli

    args = ["eval", str(export), "--suite", "lm-eval", "--tasks", "evil", "--device", "cpu",
            "--include-path", "tasks", "--limit", "1"]  # fmt: skip
    assert cli(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "anyorder eval: error: --include-path 'tasks': a task's template reaches beyond its "
        "fields (\"access to attribute '__init__' of 'type' object is unsafe.\"), as "
        f"code does; {FIX}"
    )
    import lm_eval.utils
    from jinja2.sandbox import SandboxedEnvironment

    assert not isinstance(lm_eval.utils.env, SandboxedEnvironment)  # put back
    assert not (folder / "ran").exists()


def test_trusted_task_code_runs(tmp_path, monkeypatch, export) -> None:
    """``trust_task_code=True`` (``--trust-task-code``): the harness as it is, hooks run."""
    from anyorder.harness import run_harness

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = _ppl_folder(tmp_path, "process_docs: !function hook.docs\n")
    res = run_harness(str(export), ["evil"], include_path="tasks", limit=1, trust_task_code=True)
    assert (folder / "ran").read_text() == "ran"
    assert res["results"]["evil"]["bits_per_byte,none"] > 0
