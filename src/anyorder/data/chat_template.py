"""Chat templates rendered in a sandbox that bounds their work, their memory and their time.

A tokenizer's chat template is Jinja code from a model folder: untrusted input. Jinja's
immutable sandbox (what ``transformers`` renders it in) stops escapes but not work: three
nested ``range(99999)`` loops render for ever and ``'x' * 10000000000`` takes all memory.
:func:`render_chat` renders the template the way ``apply_chat_template`` does (the same
environment options, filters and globals, the special tokens as variables), so a template
that keeps to its bounds gives the very same text, and stops one that does not with
:class:`TemplateLimit`.

Design choices:

* One budget of work a render spends, ``limit`` = 1,000,000 plus 8 times the size of what it
  is given (the messages and special tokens): every loop item, call, filter and operator
  costs a unit, a loop or macro body as many as it has nodes and constant characters, every
  string it outputs or makes its length. No string, list or number the template makes may
  exceed ``limit`` either (a list's size counts its items' sizes, each time they appear).
* Sizes are predicted before the work, from the arguments: repetition (``*``), powers,
  ``%``/``format`` widths, ``join``, ``replace``, ``indent``, ``wordwrap``, ``tojson``
  indents, padding widths (an integer argument over ``limit`` is refused outright): the
  memory is never taken. What cannot grow past its inputs is checked after.
* Every loop, macro and call block is instrumented when the template is compiled (its
  iterable and body charge the budget; ``~`` and list/tuple/dict literals are checked), so a
  tight loop passes through the budget at every item; no threads or signals are needed, and
  the check holds in a server's request thread.
* A deadline backs the budget for what is slow without being large (comparing two big lists
  in a loop): :data:`RENDER_SECONDS` per render, or less where :func:`render_deadline` says
  (the server's time limit per request).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from anyorder.data.template_bounds import (
    Budget,
    TemplateLimit,
    call_size,
    check_ints,
    checked,
    filter_size,
    predict_binop,
    size_of,
)

RENDER_SECONDS = 10.0
"""The longest a render may take (a server's request may give it less)."""
MAX_TEMPLATE_CHARS = 200_000
"""The longest chat template compiled (the largest in the wild are tens of thousands)."""
_budget: ContextVar[Budget | None] = ContextVar("anyorder_chat_budget", default=None)
_deadline: ContextVar[tuple[float, float] | None] = ContextVar(
    "anyorder_chat_deadline", default=None
)


@contextlib.contextmanager
def render_deadline(started: float, seconds: float) -> Iterator[None]:
    """Renders in this block stop ``seconds`` after ``started`` (a ``time.perf_counter()``
    value) if not before: a server's time limit per request, which their refusal names."""
    token = _deadline.set((started + seconds, seconds))
    try:
        yield
    finally:
        _deadline.reset(token)


# ----------------------------------------------------------------------------- hooks


def _active() -> Budget | None:
    return _budget.get()


def _charge(weight: int) -> str:
    """Called at the start of every loop, macro and call block body (compiled in)."""
    budget = _active()
    if budget is not None:
        budget.charge(weight)
    return ""


def _items(iterable: Any) -> Any:
    """A loop's iterable, its items charged (compiled around every ``for``)."""
    budget = _active()
    if budget is None:
        return iterable
    try:
        budget.charge(len(iterable))
        return iterable
    except TypeError:  # a generator (map, select): charged item by item

        def each() -> Iterator[Any]:
            for item in iterable:
                budget.charge(1)
                yield item

        return each()


def _concat(*parts: Any) -> str:
    """``a ~ b``: the parts' text joined, each checked before it is made."""
    budget = _active()
    if budget is not None:
        total = sum(len(p) if isinstance(p, str) else size_of(p, budget.limit) for p in parts)
        budget.fits(total, "'~'")
    out = "".join(map(str, parts))
    return out if budget is None else checked(out, budget, "'~'")


def _literal(value: Any) -> Any:
    """A list, tuple or dict literal: checked like every value a template makes."""
    budget = _active()
    return value if budget is None else checked(value, budget, "a literal")


_HELPERS = (_charge, _items, _concat, _literal)


def _weight(body: list) -> int:
    """What a body costs each time it runs: its nodes (taken or not)."""
    from jinja2 import nodes

    return 1 + sum(1 + sum(1 for _ in top.find_all(nodes.Node)) for top in body)


def _instrument(template: Any) -> None:
    """Compile the budget into a parsed template (see the module notes)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def call(helper: Any, *args: Any) -> Any:
        return nodes.Call(
            nodes.ImportedName(f"{__name__}.{helper.__name__}"), list(args), [], None, None
        )

    class Instrument(NodeTransformer):
        def visit_For(self, node: Any) -> Any:  # noqa: N802
            self.generic_visit(node)
            node.iter = call(_items, node.iter)
            node.body.insert(0, nodes.ExprStmt(call(_charge, nodes.Const(_weight(node.body)))))
            return node

        def visit_Macro(self, node: Any) -> Any:  # noqa: N802
            self.generic_visit(node)
            node.body.insert(0, nodes.ExprStmt(call(_charge, nodes.Const(_weight(node.body)))))
            return node

        visit_CallBlock = visit_Macro  # noqa: N815

        def visit_Concat(self, node: Any) -> Any:  # noqa: N802
            self.generic_visit(node)
            return call(_concat, *node.nodes)

        def literal(self, node: Any) -> Any:
            self.generic_visit(node)
            if getattr(node, "ctx", "load") != "load":
                return node
            return call(_literal, node)

        visit_List = visit_Tuple = visit_Dict = literal  # noqa: N815

    Instrument().visit(template)


# ----------------------------------------------------------------------------- environment


def _bounded_filter(name: str, f: Any) -> Any:
    """Filter ``f`` charging the budget, its result's size predicted and checked."""
    passed = getattr(f, "jinja_pass_arg", None)

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        budget = _active()
        if budget is None:  # compiling: a filter of constants is not run then
            raise TemplateLimit("filters run only in a render")
        budget.charge(1)
        at = 1 if passed else 0
        value, rest = args[at], args[at + 1 :]
        if name == "join" and not isinstance(value, (str, list, tuple)):
            value = list(value) if value is not None else value  # sized once, then joined
            args = (*args[:at], value, *rest)
        check_ints(rest, kwargs, budget, f"filter {name}'s argument")
        budget.fits(filter_size(name, value, rest, kwargs, budget), f"filter {name}")
        return checked(f(*args, **kwargs), budget, f"filter {name}")

    return run


def _raise_exception(message: Any) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """Jinja's ``sum`` filter with each addition charged: adding lists or tuples copies the
    running total, so one call over many small lists did quadratic work between two checks
    of the budget (minutes for a million items)."""
    from jinja2.filters import make_attrgetter

    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    budget = _active()

    def charged(items: Any, running: int) -> Iterator[Any]:
        for item in items:
            running += len(item) if isinstance(item, (list, tuple)) else 0
            if budget is not None:
                budget.charge(1 + running)
            yield item

    return sum(charged(iterable, len(start) if isinstance(start, (list, tuple)) else 0), start)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _finalize(value: Any) -> Any:
    budget = _active()
    return value if budget is None else checked(value, budget, "an output")


def _transformers_parts() -> tuple[Any, dict[str, Any]]:
    """The ``{% generation %}`` extension and the globals transformers' environment has."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: its body, as transformers renders it."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateDict:  # dict() and dict.fromkeys, not the type itself
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore names, as transformers
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a namespace cannot hold {name!r}")

    globals_ = dict(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
    return Generation, globals_


@functools.cache
def _environment() -> Any:
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Instrumented(CodeGenerator):
        def visit_Template(self, node: Any, frame: Any = None) -> None:  # noqa: N802
            _instrument(node)
            super().visit_Template(node, frame)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+", "-", "//", "/"})
        code_generator_class = Instrumented

        @staticmethod
        def concat(parts: Any) -> str:  # a macro's, a set block's body: sized, then joined
            budget = _active()
            if budget is None:
                return "".join(parts)
            parts = list(parts)
            size = sum(map(len, parts))
            budget.fits(size, "a block")
            budget.charge(size)
            return "".join(parts)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            if any(__obj is helper for helper in _HELPERS):
                return __obj(*args)
            budget = _active()
            if budget is None:
                return super().call(__context, __obj, *args, **kwargs)
            budget.charge(1)
            check_ints(args, kwargs, budget, "a call's argument")
            size, args = call_size(__obj, args, kwargs, budget)
            budget.fits(size, f"a call of {getattr(__obj, '__name__', 'a function')}")
            out = super().call(__context, __obj, *args, **kwargs)
            return checked(out, budget, "a call")

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _active()
            if budget is not None:
                budget.charge(1)
                predict_binop(operator, left, right, budget)
            out = self.binop_table[operator](left, right)
            return out if budget is None else checked(out, budget, f"'{operator}'")

    generation, globals_ = _transformers_parts()
    env = Bounded(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[generation, jinja2.ext.loopcontrols],
        finalize=_finalize,
    )
    env.filters["tojson"] = _tojson
    env.filters["sum"] = jinja2.pass_environment(_sum)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(globals_)
    return env


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    return _environment().from_string(source)


def render_chat(source: str, **variables: Any) -> str:
    """Render chat template ``source`` with ``variables`` (``messages``,
    ``add_generation_prompt``, the special tokens) within the bounds of the module notes.

    Raises:
        TemplateLimit: the render passed a bound (the message names which).
        jinja2.TemplateError: the template's own errors (syntax, ``raise_exception``).
    """
    if len(source) > MAX_TEMPLATE_CHARS:  # compiling takes seconds per 100,000
        raise TemplateLimit(
            f"it is {len(source)} characters long, more than the {MAX_TEMPLATE_CHARS} a chat "
            "template may be"
        )
    try:
        template = _compiled(source)
    except RecursionError:  # (((...))) 10,000 deep
        raise TemplateLimit("it nests deeper than Python's parser goes") from None
    limit = 1_000_000 + 8 * size_of(variables, 1 << 62)
    deadline, seconds = time.perf_counter() + RENDER_SECONDS, RENDER_SECONDS
    outer = _deadline.get()
    if outer is not None and outer[0] < deadline:
        deadline, seconds = outer
    budget = Budget(limit, deadline, seconds)
    token = _budget.set(budget)
    try:
        parts, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            budget.fits(size, "its output")
            parts.append(piece)
        return "".join(parts)
    except RecursionError:  # a macro calling itself without end
        raise TemplateLimit(
            "its macros or recursive loops nest deeper than Python allows"
        ) from None
    finally:
        _budget.reset(token)
