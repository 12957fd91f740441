"""Property-based fuzzing of the two parsers users type into: infill templates and config
overrides (plus config files). Whatever the input, they return a well-formed result or
raise the documented error (:class:`SamplingError`, :class:`ConfigError`), nothing else.

The example counts are moderate so that the default run stays fast; every test counts the
examples it ran and the module prints the total at the end (``-s`` shows it; hypothesis's
own ``--hypothesis-show-statistics`` gives the same per test).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyorder.config import RunConfig, describe, load_config, parse_override
from anyorder.data import ByteTokenizer
from anyorder.errors import ConfigError, SamplingError
from anyorder.sample import parse_template
from anyorder.training.setup import check_config

EXAMPLES = int(os.environ.get("ANYORDER_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RAN: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print(f"\nfuzz examples run: {sum(RAN.values())} ({dict(RAN)})")


# ----------------------------------------------------------------------------- templates

BYTES = ByteTokenizer()
# Pieces that put the parser's edge cases close together: hole starts, digits, brackets.
PIECES = st.sampled_from(
    ["[MASK", "[MASK:", "]", ":", "[", "0", "1", "7", "12", "-3", " ", "x", "é", "\n", "\x00"]
)
TEMPLATE_TEXT = st.one_of(
    st.text(max_size=60),
    st.lists(st.one_of(PIECES, st.text(max_size=4)), max_size=20).map("".join),
)


def _tokenizers():
    from pydoc_data.topics import topics

    from anyorder.data import BPETokenizer

    return [BYTES, BPETokenizer.train(list(topics.values())[:20], 300)]


TOKENIZERS = _tokenizers()


@FUZZ
@given(
    text=TEMPLATE_TEXT, max_len=st.one_of(st.none(), st.integers(1, 64)), which=st.integers(0, 1)
)
def test_template_parser_returns_a_template_or_a_sampling_error(text, max_len, which):
    RAN["template"] += 1
    tok = TOKENIZERS[which]
    try:
        tokens, known = parse_template(text, tok, max_len)
    except SamplingError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert tokens.shape == known.shape and tokens.dim() == 1
    assert (~known).any()  # at least one hole
    assert max_len is None or len(tokens) <= max_len
    assert bool((tokens[~known] == 0).all())
    assert int(tokens.min()) >= 0 and int(tokens.max()) < tok.vocab_size


# Well-formed templates: literal runs without "[MASK" between holes of known sizes.
LITERAL = st.text(max_size=8).filter(lambda s: "[MASK" not in s)


@FUZZ
@given(parts=st.lists(st.tuples(LITERAL, st.integers(1, 5)), min_size=1, max_size=5), tail=LITERAL)
def test_well_formed_templates_parse_to_their_holes(parts, tail):
    RAN["template-roundtrip"] += 1
    # No "[MASK" can span a literal and a hole: a hole has one "[", at its start.
    text = "".join(f"{lit}[MASK:{k}]" for lit, k in parts) + tail
    tokens, known = parse_template(text, BYTES)
    want: list[bool] = []
    for lit, k in parts:
        want += [True] * len(lit.encode("utf-8", "replace")) + [False] * k
    want += [True] * len(tail.encode("utf-8", "replace"))
    assert known.tolist() == want
    assert tokens[known].tolist() == list(
        "".join(lit for lit, _ in parts).encode("utf-8", "replace")
        + tail.encode("utf-8", "replace")
    )


# ----------------------------------------------------------------------------- overrides

KEYS = [k for k, _, _ in describe()]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
YAML_VALUES = st.one_of(
    SCALARS.map(repr),
    st.sampled_from(
        [
            "",
            "~",
            "[1, 2]",
            "[]",
            "{}",
            "{a: 1}",
            "1e-3",
            ".nan",
            "-.inf",
            "yes",
            "0x1F",
            "[1,",
            "{",
            "'x",
            "!!python/object:os.system",
            "&a [*a]",
            "2024-01-01",
            "1_000",
            "-0",
        ]
    ),
    st.text(max_size=16),
)


@FUZZ
@given(item=st.text(max_size=40))
def test_override_parser_never_crashes(item):
    RAN["override"] += 1
    try:
        parts, value = parse_override(item)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert parts and all(p.isidentifier() for p in parts)
    assert "=" in item and item.partition("=")[0].strip() == ".".join(parts)


@FUZZ
@given(
    overrides=st.lists(
        st.tuples(
            st.one_of(
                st.sampled_from(KEYS),
                st.sampled_from(KEYS).map(lambda k: k + "x"),
                st.sampled_from(["model", "train", "order", "data", "modle.kind"]),
            ),
            YAML_VALUES,
        ).map(lambda kv: f"{kv[0]}={kv[1]}"),
        max_size=4,
    )
)
def test_config_overrides_give_a_config_or_a_config_error(overrides):
    RAN["config"] += 1
    try:
        cfg = load_config(None, overrides)
        check_config(cfg)  # the training-time checks (divisors, ranges) must hold as well
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert isinstance(cfg, RunConfig)
    sections = [cfg.train]
    while sections:  # every value has its declared type, in nested sections too (train.lora)
        section = sections.pop()
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if dataclasses.is_dataclass(v):
                sections.append(v)
            else:
                assert v is None or isinstance(v, (int, float, str, bool, tuple))


@settings(
    max_examples=max(10, EXAMPLES // 3),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    text=st.one_of(
        st.text(max_size=80),
        st.lists(
            st.tuples(
                st.sampled_from(["model", "train", "order", "data", "x"]),
                st.sampled_from(KEYS).map(lambda k: k.split(".")[1]),
                YAML_VALUES,
            ),
            max_size=4,
        ).map(lambda rows: "".join(f"{s}:\n  {k}: {v}\n" for s, k, v in rows)),
    )
)
def test_config_files_give_a_config_or_a_config_error(text):
    RAN["config-file"] += 1
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.yaml")
        with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(text)
        try:
            cfg = load_config(path)
        except ConfigError as e:
            assert str(e) and "\n" not in str(e)
            return
    assert isinstance(cfg, RunConfig)
