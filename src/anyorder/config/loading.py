"""Loading configs: defaults <- YAML file <- ``key=value`` overrides, strictly.

Design choices:

* Layered and strict: an unknown key or a value of the wrong type is a
  :class:`~anyorder.errors.ConfigError` that names the key.
* Help text comes from the fields' docstrings (the string literal under each field), read
  from the source with :mod:`ast` (:func:`field_docs`), so the documentation lives next to
  the default.
* YAML 1.1 reads ``1e-3`` (no dot) as a string; a float field takes it as the number it
  plainly is.
* YAML is read strictly too (:func:`read_yaml`): UTF-8 only, no key twice in a mapping,
  aliases allowed but a file may expand to at most :data:`MAX_NODES` values nested at most
  :data:`MAX_DEPTH` deep (a few hundred bytes of nested aliases expand to gigabytes). Errors
  quote values through :func:`~anyorder.errors.preview`, never whole.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from anyorder.config.model import PRESETS, VARIANTS, ModelConfig, expand_model_values
from anyorder.config.run import RunConfig
from anyorder.errors import ConfigError, did_you_mean, preview

_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A float in exponent notation without a dot (``1e-3``), which YAML 1.1 leaves a string."""


MAX_NODES = 10_000
"""The most values (aliases expanded) a config file or an override may hold; a whole run
config is about a hundred."""
MAX_DEPTH = 32
"""The deepest nesting a config may have; a run config is three levels deep."""
MAX_CONFIG_FILE_BYTES = 16 << 20
"""The largest config file read (a run config is a few KB): a larger one, a sparse file of a
terabyte say, is refused before it is read."""


def _strict_loader() -> type:
    """PyYAML's safe loader that refuses a key given twice in one mapping (PyYAML keeps the
    last silently; a careful user means one of them, and only they know which)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                    continue
                key = self.construct_object(key_node)
                if not isinstance(key, typing.Hashable):
                    continue
                if key in seen:
                    first = seen[key].start_mark.line + 1
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {preview(key)} given twice (first on line {first})",
                        key_node.start_mark,
                    )  # fmt: skip
                seen[key] = key_node
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _bounded(value: Any, what: str) -> Any:
    """``value`` unchanged when it expands (aliases repeated) to at most :data:`MAX_NODES`
    values nested at most :data:`MAX_DEPTH` deep; counted once per distinct object, without
    recursion, so a billion laughs costs as little as its file.

    Raises:
        ConfigError: naming ``what`` (the file or the override) and the fix.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(value, False)]
    open_: set[int] = set()
    while stack:
        node, done = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        kids = list(node.values()) if isinstance(node, dict) else node
        if done:
            open_.discard(id(node))
            size[id(node)] = 1 + sum(size.get(id(k), 1) for k in kids)
            depth[id(node)] = 1 + max((depth.get(id(k), 0) for k in kids), default=0)
            if size[id(node)] > MAX_NODES:
                raise ConfigError(
                    f"{what} expands to more than {MAX_NODES:,} values (YAML aliases repeat "
                    "what they name); a run config holds about a hundred: write the values out"
                )
            if depth[id(node)] > MAX_DEPTH:
                raise ConfigError(
                    f"{what} is nested more than {MAX_DEPTH} levels deep; a run config is "
                    "sections of keys: fix the nesting"
                )
            continue
        if id(node) in size:
            continue
        if id(node) in open_:
            raise ConfigError(f"{what} holds a value that contains itself (a YAML alias "
                              "inside its own anchor); write the values out")  # fmt: skip
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
    return value


def read_yaml(text: str, what: str) -> Any:
    """Parse ``text`` strictly (see the module notes) and bound what it expands to.

    Raises:
        yaml.YAMLError: not YAML, or a key given twice.
        ConfigError: nested too deep, expanding too far, or holding itself.
    """
    import yaml

    try:
        loaded = yaml.load(text, Loader=_strict_loader())  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise ConfigError(
            f"{what} is nested more than {MAX_DEPTH} levels deep; a run config is sections "
            "of keys: fix the nesting"
        ) from None
    except ValueError as e:  # a number of more than 4,300 digits, a date out of range, ...
        raise ConfigError(
            f"{what} holds a value YAML cannot read ({str(e).split(';')[0][:100]}); fix it"
        ) from None
    return _bounded(loaded, what)


def _decode(data: bytes, path: Path) -> str:
    """The text of a config file, which must be UTF-8 (a UTF-8 byte-order mark is allowed).

    Raises:
        ConfigError: naming the first bad byte, or the UTF-16/32 byte-order mark.
    """
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or data[:4] == b"\x00\x00\xfe\xff":
        raise ConfigError(
            f"config file {str(path)!r} is UTF-16 or UTF-32 text (it starts with a "
            "byte-order mark); save it as UTF-8"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} "
            f"at offset {e.start}); save it as UTF-8"
        ) from None


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a named preset (``tiny``, ``small``, ``medium``);
    ``variant=`` (see :data:`VARIANTS`) may be among the overrides."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; use one of {', '.join(PRESETS)}")
    return _build(ModelConfig, expand_model_values({"preset": name, **overrides}), "model")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert ints to floats and lists to tuples."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, item, key) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "2e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        # YAML 1.1 reads 1e-3 (no dot) as a string; take it as the number it plainly is.
        if isinstance(value, str) and _EXP_FLOAT.fullmatch(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    else:  # pragma: no cover - every field type is listed above
        return value
    raise ConfigError(
        f"config key {preview(key)} expects {_type_name(tp)}, got {preview(value)} "
        f"({type(value).__name__}); "
        f"fix the value in the file or on the command line"
    )


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """Construct dataclass ``cls`` from a dict, strictly (unknown keys are errors)."""
    if not isinstance(values, dict):
        raise ConfigError(
            f"config section {preview(prefix)} must be a mapping, got {preview(values)}"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise unknown_key(full, str(key), names, prefix)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build_section(tp, value, full)
        else:
            kwargs[key] = _coerce(value, tp, full)
    return cls(**kwargs)


def unknown_key(full: str, key: str, names: list[str], prefix: str) -> ConfigError:
    """The error for an unknown key ``full`` (``key`` in section ``prefix``; "" for a
    section): the closest known key when one is close (a typo), else every known one."""
    close = did_you_mean(key, names)
    if close is not None:
        fix = f"{prefix}.{close}" if prefix else close
        return ConfigError(
            f"unknown config key {preview(full)}; did you mean {fix}? (anyorder info "
            "--config-keys lists every key)"
        )
    known = f"known keys in {prefix}" if prefix else "known sections"
    return ConfigError(f"unknown config key {preview(full)}; {known}: {', '.join(names)}")


def _build_section(cls: type, value: Any, prefix: str) -> Any:
    if cls is ModelConfig and isinstance(value, dict):
        value = expand_model_values(value, prefix)
    return _build(cls, value, prefix)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into ``(["a", "b"], value)``; the value is parsed as YAML."""
    import yaml

    if "=" not in item:
        raise ConfigError(f"override {preview(item)} is not key=value; write e.g. train.steps=100")
    key, _, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p.isidentifier() for p in parts):
        raise ConfigError(f"override key {preview(key)} is not a dotted name like train.steps")
    try:
        value = read_yaml(raw, f"override {preview(item)}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def _not_a_file(path: Path) -> str:
    """Why ``path`` cannot be read as a config file (it is not a regular file), and the fix.
    Only ``stat`` is asked: a named pipe is never opened, so nothing blocks on it."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return f"config file {str(path)!r} does not exist; give a YAML file path"
    if stat.S_ISDIR(mode):
        return f"config file {str(path)!r} is a folder, not a file; give the YAML file's path"
    kinds = (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    what = next((name for test, name in kinds if test(mode)), "a special file")
    return (
        f"config file {str(path)!r} is {what}, not a file; save the config to a YAML "
        "file and give its path"
    )


def load_config(
    source: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Load a :class:`RunConfig`: defaults <- YAML file ``source`` <- ``overrides``.

    Args:
        source: a YAML file, or None for the defaults.
        overrides: ``key=value`` strings with dotted keys (``model.n_layer=6``).

    Raises:
        ConfigError: a missing file, bad YAML, an unknown key or a wrongly typed value.
    """
    import yaml

    values: dict[str, Any] = {}
    if source is not None:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(_not_a_file(path))
        size = path.stat().st_size
        if size > MAX_CONFIG_FILE_BYTES:  # never read whole (a sparse file takes no disk)
            raise ConfigError(
                f"config file {str(path)!r} is {size:,} bytes, more than a run config holds "
                "(a few KB); give the YAML file of the run"
            )
        try:
            loaded = read_yaml(_decode(path.read_bytes(), path), f"config file {str(path)!r}")
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = " ".join(str(getattr(e, "problem", None) or e).split())[:200]
            raise ConfigError(
                f"config file {str(path)!r} is not valid YAML ({problem}{where}); fix the file"
            ) from None
        if loaded is None:  # an empty file (or only comments) is a mistake, not "defaults"
            raise ConfigError(
                f"config file {str(path)!r} is empty; write the settings to change (e.g. "
                "model: {kind: armd}), or start from a file in configs/"
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
        values = loaded
    given: set[str] = set()  # model keys set by the overrides so far
    for item in overrides:
        parts, value = parse_override(item)
        if parts[0] == "model" and len(parts) == 2:
            if parts[1] == "variant":
                _drop_variant_keys(values, value, given)
            given.add(parts[1])
        node = values
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {preview(item)}: {preview(p)} is not a section")
            node = child
        node[parts[-1]] = value
    return config_from_dict(values)


def _drop_variant_keys(values: dict[str, Any], variant: Any, given: set[str]) -> None:
    """A variant given on the command line defines its keys over the file's: drop the file's
    model keys it sets (``pos_emb: rope`` beside ``model.variant=aogpt-ref`` would otherwise
    train a hybrid under the variant's name). Keys given on the command line still win."""
    model = values.get("model")
    if not isinstance(model, dict) or variant not in VARIANTS:
        return  # an unknown variant is refused, naming the known ones, when the model is built
    for key in VARIANTS[variant]:
        if key not in given:
            model.pop(key, None)


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """A :class:`RunConfig` from a nested mapping (a saved config, or sections of one):
    fields it lacks take today's defaults, so configs saved before a field existed still
    load. Raises :class:`ConfigError` on an unknown key or a wrongly typed value."""
    if not isinstance(values, dict):
        raise ConfigError("a config must be a mapping of sections")
    try:
        return _build_run(values)
    except TypeError as e:  # a section given as a scalar, etc.
        raise ConfigError(f"bad config: {e}") from None


def _build_run(values: dict[str, Any]) -> RunConfig:
    names = [f.name for f in dataclasses.fields(RunConfig)]
    for key in values:
        if key not in names:
            raise unknown_key(str(key), str(key), names, "")
    hints = typing.get_type_hints(RunConfig)
    return RunConfig(**{k: _build_section(hints[k], v, k) for k, v in values.items()})


def describe(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(key, default, help)`` for every field, for the CLI and the docs."""
    rows: list[tuple[str, str, str]] = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((key, repr(default), docs.get(f.name, "")))
    return rows
