"""Task folders (``--include-path``) that would run code, refused unless trusted.

The harness's task YAML can run Python three ways: a tag (``!function utils.process_docs``
imports ``utils.py`` from beside the YAML or any importable module; ``class:`` and
``custom_dataset:`` take their callables the same way), a metric that is not one of the
harness's own (``lm_eval`` hands its name to HF ``evaluate.load``, which runs the metric's
Python script, a local one included), and a Jinja template (``doc_to_text`` and the others
render in a plain ``jinja2.Environment``, where ``{{ cycler.__init__.__globals__ }}`` reaches
``os``). :func:`check_task_folder` reads every task YAML under the folder, and every file
their ``include:`` keys reach, with a safe loader that only records tags (nothing is
imported); :func:`sandboxed_templates` renders the templates in Jinja's sandbox while the
harness runs. ``trust_task_code`` (``--trust-task-code``) turns both off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from anyorder.atomic import short_path
from anyorder.errors import ConfigError, preview

_IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as lm_eval.tasks._index walks
_CORE_TAG = "tag:yaml.org,2002:"
_FIX = "read that code, then add --trust-task-code if you trust it"


def _loader(found: list):
    """A safe YAML loader that records every tag it does not know (``!function``,
    ``!!python/name:``) in ``found`` as ``(tag, value)`` and constructs nothing for it."""
    import yaml

    base = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader

    class Loader(base):  # type: ignore[misc, valid-type]
        pass

    def record(loader, node):
        value = node.value if isinstance(node, yaml.ScalarNode) else ""
        tag = node.tag.replace(_CORE_TAG, "!!", 1) if node.tag.startswith(_CORE_TAG) else node.tag
        found.append((tag, value))
        return None

    Loader.add_constructor(None, record)
    return Loader


def _walk(value) -> Iterator[dict]:
    """Every mapping in ``value`` (aliases and cycles visited once, no recursion)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen or not isinstance(v, (dict, list)):
            continue
        seen.add(id(v))
        if isinstance(v, dict):
            yield v
            stack.extend(v.values())
        else:
            stack.extend(v)


def _metrics(cfg) -> Iterator[tuple[str, bool]]:
    """``(metric, hf_evaluate)`` of every ``metric_list`` entry in ``cfg``."""
    for d in _walk(cfg):
        entries = d.get("metric_list")
        for entry in entries if isinstance(entries, list) else ():
            if isinstance(entry, dict) and isinstance(entry.get("metric"), str):
                yield entry["metric"], entry.get("hf_evaluate") is True


def _yaml_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    files = (p for p in root.glob("**/*.yaml") if not _IGNORE_DIRS & set(p.parts))
    return sorted(files, key=lambda p: p.as_posix())


def check_task_folder(include_path: str, trust: bool = False) -> None:
    """Refuse a task folder whose YAML would run code (unless ``trust``); see the module."""
    if trust:
        return
    import lm_eval.api.metrics  # noqa: F401 (fills the metric registry)
    import lm_eval.tasks
    import yaml
    from lm_eval.api.registry import metric_registry

    own = Path(lm_eval.tasks.__file__).parent.resolve()  # the harness's own tasks: trusted
    where = f"--include-path {short_path(include_path)}"
    todo = _yaml_files(Path(include_path))
    seen: set[Path] = set()
    while todo:
        path = todo.pop(0)
        real = path.resolve()
        if real in seen or real.is_relative_to(own) or not real.is_file():
            continue
        seen.add(real)
        found: list = []
        try:
            with open(real, "rb") as f:
                cfg = yaml.load(f, Loader=_loader(found))  # noqa: S506 (a safe loader)
        except (OSError, yaml.YAMLError, RecursionError):  # nested past Python's stack
            continue  # the harness skips a file it cannot read as YAML all the same
        if found:
            tag, value = found[0]
            raise ConfigError(
                f"{where}: {short_path(path)} has the tag {preview(tag, 40)}"
                f"{f' {preview(value, 40)}' if value else ''}, with which the harness runs "
                f"Python code; {_FIX}"
            )
        for name, hf in _metrics(cfg):
            if hf or name not in metric_registry:
                raise ConfigError(
                    f"{where}: {short_path(path)} names the metric {preview(name, 40)}, "
                    "which is not one of the harness's own; the harness would load it with "
                    f"HF evaluate, which runs the metric's Python script; {_FIX}"
                )
        includes = cfg.get("include") if isinstance(cfg, dict) else None
        for inc in includes if isinstance(includes, list) else [includes]:
            if isinstance(inc, str):  # as lm_eval.tasks._yaml_loader.load_yaml finds it
                todo.append((real.parent / inc).resolve())  # an absolute inc as it is


@contextlib.contextmanager
def sandboxed_templates(include_path: str | None, trust: bool = False) -> Iterator[None]:
    """The harness's Jinja templates rendered in Jinja's sandbox (unless ``trust``): a
    template of the task folder that reaches for Python's internals is refused in one line."""
    if trust:
        yield
        return
    import lm_eval.utils
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import SandboxedEnvironment

    plain = lm_eval.utils.env
    sandbox = SandboxedEnvironment(
        loader=plain.loader, undefined=plain.undefined,
        keep_trailing_newline=plain.keep_trailing_newline,
    )  # fmt: skip
    sandbox.filters.update(plain.filters)
    lm_eval.utils.env = sandbox
    try:
        yield
    except SecurityError as e:
        raise ConfigError(
            f"--include-path {short_path(include_path or '')}: a task's template reaches beyond "
            f"its fields ({preview(str(e), 80)}), as code does; {_FIX}"
        ) from None
    finally:
        lm_eval.utils.env = plain
