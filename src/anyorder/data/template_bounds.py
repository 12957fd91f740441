"""Bounds on what a chat template may make: the budget a render spends, and the sizes of
results predicted from their arguments before they are made (see
:mod:`anyorder.data.chat_template`, which renders with them).

Design choices:

* A value's size is an upper bound of the length of its text: a list counts its items each
  time they appear (``[a, a, a, a]`` four times ``a``), shared items walked once, so a
  structure that doubles at each step is measured in steps, not in its size.
* Each prediction is cheap and conservative: a format string's numbers are all taken as
  widths, a ``wordwrap`` may break at every space.
"""

from __future__ import annotations

import re
import time
from typing import Any

MAX_DEPTH = 256
"""The deepest a value a template makes may nest."""
MAX_INT_BITS = 1 << 14
"""The largest integer a template may make by ``*`` or ``**``, in bits."""


class TemplateLimit(Exception):
    """A render stopped at one of its bounds; the message says which (no template name)."""


class Budget:
    def __init__(self, limit: int, deadline: float, seconds: float) -> None:
        self.limit, self.left, self.deadline, self.seconds = limit, limit, deadline, seconds

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise TemplateLimit(
                f"it did more than {self.limit} units of work (loop items, calls, characters)"
            )
        if time.perf_counter() > self.deadline:
            raise TemplateLimit(f"it ran past its time limit of {self.seconds:g} s")

    def fits(self, size: float, what: str) -> None:
        if size > self.limit:
            raise TemplateLimit(
                f"{what} would make {int(size)} characters or items, more than the "
                f"{self.limit} a render may"
            )


def _attrs(value: Any) -> Any:
    """A Jinja namespace's attributes, else ``value`` (asked by type: an ``Undefined``
    answers any ``getattr`` with an error)."""
    from jinja2.utils import Namespace

    if isinstance(value, Namespace):
        return object.__getattribute__(value, "_Namespace__attrs")
    return value


def size_of(value: Any, cap: int) -> int:
    """An upper bound of ``len(str(value))`` up to just over ``cap`` (a container counts
    its items as often as they appear; shared items are walked once)."""
    memo: dict[int, int] = {}

    def walk(v: Any, depth: int) -> int:
        if isinstance(v, (str, bytes)):
            return len(v) + 2
        if isinstance(v, bool) or v is None:
            return 5
        if isinstance(v, int):
            return v.bit_length() // 3 + 2
        if isinstance(v, float):
            return 24
        if id(v) in memo:
            return memo[id(v)]
        if depth > MAX_DEPTH:
            raise TemplateLimit(f"it made a value nested more than {MAX_DEPTH} levels deep")
        memo[id(v)] = 8  # a cycle prints as [...]
        v = _attrs(v)
        if isinstance(v, dict):
            items: Any = [*v.keys(), *v.values()]
        elif isinstance(v, (list, tuple, set, frozenset)):
            items = v
        else:
            return 64
        total = 2
        for item in items:
            total += walk(item, depth + 1) + 2
            if total > cap:
                break
        memo[id(v)] = total
        return total

    return walk(value, 0)


def _len(value: Any, cap: int) -> int:
    """A string's length, else :func:`size_of`."""
    return len(value) if isinstance(value, (str, bytes)) else size_of(value, cap)


def checked(value: Any, budget: Budget, what: str) -> Any:
    """``value`` after charging its size, refused over the limit."""
    if isinstance(value, (str, bytes)):
        size = len(value)
    elif isinstance(value, (list, tuple, dict, set, frozenset)) or _attrs(value) is not value:
        size = size_of(value, budget.limit)
    elif isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"{what} made an integer of more than {MAX_INT_BITS} bits")
        return value
    else:
        return value
    budget.fits(size, what)
    budget.charge(1 + size)
    return value


def _widths(fmt: str) -> int:
    """The padding a ``%`` or ``format`` string can ask for: its numbers summed."""
    return sum(int(d) if len(d) < 10 else 10**10 for d in re.findall(r"[0-9]+", fmt))


def _format_size(fmt: str, args: Any, budget: Budget) -> int:
    ints = [a for a in _flat(args) if isinstance(a, int)]
    fields = fmt.count("%") + fmt.count("{")
    return len(fmt) + size_of(args, budget.limit) + _widths(fmt) + fields * max(ints, default=0)


def _flat(args: Any) -> list[Any]:
    if isinstance(args, dict):
        return list(args.values())
    return list(args) if isinstance(args, (tuple, list)) else [args]


def check_ints(args: tuple, kwargs: dict, budget: Budget, what: str) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > budget.limit:
            budget.fits(abs(a), what)


def _replace_size(s: Any, old: Any, new: Any, count: Any = -1) -> int:
    try:
        hits = s.count(old) if old else len(s) + 1
        grow = len(new)
    except TypeError:  # text and bytes mixed: replace refuses them too
        return len(s)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * grow


def _join_size(sep: Any, items: list, budget: Budget) -> int:
    return size_of(items, budget.limit) + len(items) * len(str(sep) if sep is not None else "")


def _lines(s: Any) -> int:
    return str(s).count("\n") + 1 if isinstance(s, str) else 1


def filter_size(name: str, value: Any, args: tuple, kw: dict, budget: Budget) -> int:
    """A bound on the size of filter ``name``'s result, from its arguments."""
    get = lambda i, key, default: args[i] if len(args) > i else kw.get(key, default)  # noqa: E731
    if name == "indent":
        width = get(0, "width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return len(str(value)) + _lines(value) * pad
    if name == "wordwrap":
        width = get(0, "width", 79)
        wrap = get(2, "wrapstring", None) or "\n"
        s = str(value)
        breaks = len(s) // max(width if isinstance(width, int) else 1, 1) + s.count(" ") + 1
        return len(s) + breaks * len(str(wrap)) + s.count("\n") * len(str(wrap))
    if name == "replace" and isinstance(value, str):
        return _replace_size(value, get(0, "old", ""), get(1, "new", ""), get(2, "count", -1))
    if name == "join" and isinstance(value, (list, tuple)):
        return _join_size(get(0, "d", ""), list(value), budget)
    if name == "format" and isinstance(value, str):
        return _format_size(value, (*args, *kw.values()), budget)
    if name == "tojson":
        indent = get(0, "indent", None)
        pad = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        return size_of(value, budget.limit) * (1 + pad * MAX_DEPTH // 8)
    if name == "center":
        return max(len(str(value)), get(0, "width", 80) or 0)
    return 0


_STR_GROWERS = {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "format",
                "format_map"}  # fmt: skip


def call_size(obj: Any, args: tuple, kwargs: dict, budget: Budget) -> tuple[int, tuple]:
    """A bound on a call's result from its arguments (and the arguments, a join's items
    listed once)."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    s = getattr(target, "__self__", None)
    name = getattr(target, "__name__", "")
    if isinstance(s, (str, bytes)) and name in _STR_GROWERS:
        if name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            tabs = s.count("\t" if isinstance(s, str) else b"\t")
            return len(s) + tabs * (tab if isinstance(tab, int) else 0), args
        if name == "replace" and len(args) >= 2:
            return _replace_size(s, *args[:3]), args
        if name == "join" and args:
            items = list(args[0])
            return _join_size(s, items, budget), (items, *args[1:])
        if name in ("format", "format_map"):
            return _format_size(s, (*args, *kwargs.values()), budget), args
        width = args[0] if args else 0
        return max(len(s), width if isinstance(width, int) else 0), args
    if getattr(obj, "__name__", "") == "generate_lorem_ipsum":
        n = args[0] if args else kwargs.get("n", 5)
        most = args[3] if len(args) > 3 else kwargs.get("max", 100)
        return 12 * (n if isinstance(n, int) else 1) * (most if isinstance(most, int) else 1), args
    return 0, args


def predict_binop(op: str, left: Any, right: Any, budget: Budget) -> None:
    """Refuse an operator whose result would pass the limits, before it is made."""
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)):
                budget.fits(_len(seq, budget.limit) * max(n, 0), "'*'")
        if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"'*' would make an integer of more than {MAX_INT_BITS} bits")
    elif op == "**" and ints and right > 0 and (abs(left).bit_length() - 1) * right > MAX_INT_BITS:
        raise TemplateLimit(f"'**' would make an integer of more than {MAX_INT_BITS} bits")
    elif op == "%" and isinstance(left, (str, bytes)):
        fmt = left if isinstance(left, str) else left.decode("latin-1")
        budget.fits(_format_size(fmt, right, budget), "'%'")
    elif op == "+" and isinstance(left, (str, bytes, list, tuple)) and type(left) is type(right):
        budget.fits(_len(left, budget.limit) + _len(right, budget.limit), "'+'")
