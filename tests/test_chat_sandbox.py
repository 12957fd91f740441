"""A chat template is untrusted code (issue 40, item 9): rendering it is bounded in work,
size and time, through ``anyorder sample --chat`` and ``anyorder serve``; a template within
the bounds renders exactly as ``transformers`` renders it."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from anyorder.data import load_tokenizer
from anyorder.data.chat import render_messages

from conftest import chatml_tokenizer, tiny_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# written here in the styles of the Llama 3 and Qwen3 templates: a BOS variable, a system
# turn taken apart, a namespace over the reversed messages, split/strip, tojson, loop flags
LLAMA3_STYLE = (
    "{{ bos_token }}{{ date_string }}{% if tools is not none %}T{% endif %}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]"
    "['content'] | trim %}{% set rest = messages[1:] %}{% else %}{% set system = 'Be kind.' %}"
    "{% set rest = messages %}{% endif %}<|im_start|>system\n\n{{ system }}<|im_end|>"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}"
)
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- set i = (messages|length - 1) - loop.index0 %}"
    "{%- if m.role == 'user' and ns.last_query == messages|length - 1 %}"
    "{%- set ns.last_query = i %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m.content %}"
    "{%- if m.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ content ~ '<|im_end|>' + '\\n' }}"
    "{%- if loop.last and loop.index0 > ns.last_query %}{{ {'n': loop.length} | tojson }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GENERATION = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}<|im_start|>{{ m.content }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": " be brief "},
        {"role": "user", "content": "add 2 and 2"},
        {"role": "assistant", "content": "<think>\nsum</think>\n4"},
        {"role": "user", "content": "and 3?"},
    ],
]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A tokenizer folder with a ChatML template, and an aogpt export that reads it."""
    from anyorder.checkpoint.exporting import save_pretrained

    root = tmp_path_factory.mktemp("sandbox")
    tok = chatml_tokenizer(bos_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(str(root / "tok"))
    model = tiny_model("aogpt", seed=1, vocab_size=320, seq_len=64, n_layer=1, d_model=32)
    save_pretrained(model, root / "exp", load_tokenizer(str(root / "tok")))
    return root


@pytest.mark.parametrize("template", [CHATML, LLAMA3_STYLE, QWEN3_STYLE, GENERATION])
def test_a_template_within_bounds_renders_as_transformers_does(world, template):
    tok = load_tokenizer(str(world / "tok"))
    raw = tok.tok
    raw.chat_template = template
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = raw.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            want = raw.encode(text, add_special_tokens=False)
            assert render_messages(messages, tok, add_generation_prompt=gen) == want


SNIPPETS = [
    "{{ x }}{{ [x] }}{{ x ~ 1 }}{% for a in x %}{% endfor %}{{ x|default(1) }}{{ x|length }}",
    "{{ messages|tojson }}{{ messages|tojson(indent=2) }}{{ messages|map(attribute='role')|"
    "join(',') }}",
    "{% set ns = namespace(a=x, b=[1]) %}{% set ns.b = ns.b + [2] %}{{ ns.a }}{{ ns.b }}",
    "{{ '%05.1f|%s' % (3.14159, 'a') }}{{ '{:>6}|{}'.format('ab', 1) }}{{ '%(a)s' % {'a': 1} }}",
    "{{ 'ab' * 3 }}{{ [1] * 2 }}{{ 2 ** 10 }}{{ 7 // 2 }}{{ 7 / 2 }}{{ 7 % 3 }}{{ -3 - 2 }}",
    "{{ 'a b c'|wordwrap(3) }}{{ 'a\nb'|indent(2, true) }}{{ 'x'|center(7) }}{{ 'ab'|title }}",
    "{{ range(5)|batch(2)|list }}{{ range(5)|slice(2)|list }}{{ 'x'|list }}{{ [3, 1]|sort }}",
    "{% macro m(a) %}<{{ a }}>{{ caller() if caller }}{% endmacro %}{{ m(1) }}"
    "{% call m(2) %}in{% endcall %}",
    "{% for m in messages %}{{ loop.index }}{{ loop.length }}{{ loop.last }}{{ loop.cycle('a', "
    "'b') }}{% endfor %}{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}"
    "{% endfor %}",
    "{% for x in [[1, [2]], 3] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}"
    "{% endif %}{% endfor %}",
    "{% set s %}{{ messages|length }}{% endset %}{{ s }}{% filter upper %}hi {{ messages[0]"
    ".content }}{% endfilter %}{% generation %}g{% endgeneration %}",
    "{{ dict(a=1) }}{{ {'b': [1, (2, 3)]} }}{{ 'a,b'|replace(',', ';') }}{{ 'abc'.replace('b', "
    "'xx') }}{{ ','.join(['a', 'b']) }}{{ 'A<'|e }}{{ none }}{{ true }}{{ 'x'.encode() * 2 }}",
    "{{ [1, 2.5, 0.1, 0.2]|sum }}{{ [[1], [2]]|sum(start=[]) }}{{ [(1,), (2,)]|sum(start=(0,)) }}"
    "{{ messages|map(attribute='content')|map('length')|sum }}{{ [{'n': 1}]|sum(attribute='n') }}",
]


@pytest.mark.parametrize("snippet", SNIPPETS)
def test_constructs_render_as_transformers_does(world, snippet):
    """Each construct the bounds touch (operators, filters, calls, literals, loops, macros,
    blocks, undefined names) gives transformers' text."""
    tok = load_tokenizer(str(world / "tok"))
    raw = tok.tok
    raw.chat_template = snippet
    messages = CONVERSATIONS[1]
    text = raw.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = raw.encode(text, add_special_tokens=False)
    assert render_messages(messages, tok, add_generation_prompt=True) == want


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ ", "cannot render the conversation (TemplateSyntaxError: unexpected 'end of "
         "template'); fix the template or remove it from the tokenizer's files"),
        ("{% include 'x' %}", "cannot render the conversation (TypeError: no loader for this "
         "environment specified); fix the template or remove it from the tokenizer's files"),
        ("{{ undefined_macro() }}", "cannot render the conversation (UndefinedError: "
         "'undefined_macro' is undefined); fix the template or remove it from the tokenizer's "
         "files"),
        ("{{ raise_exception('roles must alternate') }}", "refused the conversation "
         "(TemplateError: roles must alternate); check the roles' order"),
    ],
)  # fmt: skip
def test_a_broken_template_is_named_as_broken(world, template, message):
    """A template that does not compile or fails by itself was reported as refusing the
    conversation, with the fix "check the roles' order"; only its raise_exception is that."""
    from anyorder.errors import DataError

    tok = load_tokenizer(str(world / "tok"))
    tok.tok.chat_template = template
    with pytest.raises(DataError) as e:
        render_messages(CONVERSATIONS[0], tok, add_generation_prompt=True)
    assert str(e.value) == f"the chat template of tokenizer {tok.spec!r} {message}"


def _limit_memory() -> None:  # a regression must not take the shared machine's memory
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def _hostile(world: Path, tmp_path: Path, template: str) -> Path:
    folder = tmp_path / "exp"
    shutil.copytree(world / "exp", folder)
    (folder / "tokenizer" / "chat_template.jinja").write_text(template)
    return folder


WORK = r"it did more than \d+ units of work \(loop items, calls, characters\)"
SIZE = r"{what} would make \d+ characters or items, more than the \d+ a render may"
ATTACKS = {
    "nested-loops": (
        "{% for i in range(99999) %}{% for j in range(99999) %}{% for k in range(99999) %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        WORK,
    ),
    "loops-over-a-string": (
        "{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s if false %}{% endfor %}"
        "{% endfor %}",
        WORK,
    ),
    "repetition": ("{{ 'x' * 10000000000 }}", SIZE.format(what="'\\*'")),
    "bytes-repetition": ("{{ 'x'.encode() * 10000000000 }}", SIZE.format(what="'\\*'")),
    "list-repetition": ("{{ ['x'] * 10000000000 }}", SIZE.format(what="'\\*'")),
    "doubling": ("{% set a = 'xxxxxxxx' %}" + "{% set a = a ~ a %}" * 40, WORK),
    "nested-literals": (
        "{% set a = ['x'] %}" + "{% set a = [a, a, a, a] %}" * 25 + "{{ a }}",
        SIZE.format(what="a literal"),
    ),
    "percent-width": ("{{ '%99999999s' % 'x' }}", SIZE.format(what="'%'")),
    "format-width": ("{{ '{:>99999999}'.format('x') }}", SIZE.format(what="a call of format")),
    "center": ("{{ 'x' | center(10000000000) }}", SIZE.format(what="filter center's argument")),
    "indent": ("{{ ('x\n' * 500000) | indent(999999) }}", SIZE.format(what="filter indent")),
    "join": ("{{ (['x'] * 90000) | join('z' * 90) }}", SIZE.format(what="filter join")),
    "replace": (
        "{{ ('x' * 99999).replace('x', 'y' * 99999) }}",
        SIZE.format(what="a call of replace"),
    ),
    # one filter call of quadratic work (each + copies the running list): 13 minutes
    "sum-of-lists": ("{{ ('x' * 999999) | batch(1) | sum(start=[]) }}", WORK),
    "power": ("{{ 10 ** 10000000 }}", r"'\*\*' would make an integer of more than 16384 bits"),
    "macro-tree": (
        "{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}"
        "{{ m(60) }}",
        WORK,
    ),
    "macro-recursion": (
        "{% macro m(n) %}{{ m(n) }}{% endmacro %}{{ m(1) }}",
        "its macros or recursive loops nest deeper than Python allows",
    ),
    "too-long": (
        "{{ 'x' }}" * 30_000,
        "it is 270000 characters long, more than the 200000 a chat template may be",
    ),  # fmt: skip
    "block": (
        "{% macro m() %}{% for i in range(99999) %}" + "x" * 1000 + "{% endfor %}{% endmacro %}"
        "{% set y = m() %}",
        SIZE.format(what="a block"),
    ),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_hostile_template_is_refused_by_sample_chat(world, tmp_path, name):
    template, reason = ATTACKS[name]
    folder = _hostile(world, tmp_path, template)
    argv = [sys.executable, "-m", "anyorder.cli", "sample", str(folder), "--chat", "hi",
            "--device", "cpu", "--max-new-tokens", "4"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env,
                          preexec_fn=_limit_memory)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    prefix = re.escape(
        f"anyorder sample: error: the chat template of tokenizer '{folder}/tokenizer' was stopped: "
    )
    suffix = "; use a template that renders within these bounds"
    assert re.fullmatch(prefix + reason + suffix + "\n", done.stderr), done.stderr[-2000:]
    assert done.stdout == ""


def _post(url: str, body: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(f"{url}api/generate", data=json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_refuses_a_hostile_template_and_keeps_serving(world, tmp_path):
    """A render stops at the server's --time-limit (a template slow without being big:
    hashing a 175,000-item tuple 100,000 times, minutes) or at its work bound (about 1 s
    here: the 10 s limit leaves it room on a loaded machine); the server answers 400 in one
    line and serves the next request."""
    slow = (
        "{% set t = ('',) * 175000 %}{% set d = {} %}{% for i in range(100000) %}"
        "{% if t in d %}{% endif %}{% endfor %}"
    )
    first = "messages[0]['content']"
    template = (
        f"{{% if {first}.startswith('slow') %}}{slow}"
        f"{{% elif {first} == 'loop' %}}{ATTACKS['nested-loops'][0]}{{% endif %}}{CHATML}"
    )
    folder = _hostile(world, tmp_path, template)
    argv = [sys.executable, "-m", "anyorder.cli", "serve", str(folder), "--port", "0",
            "--device", "cpu", "--time-limit", "10"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=_limit_memory)  # fmt: skip
    try:
        url = proc.stdout.readline().split(" at ")[1].split()[0]
        prefix = f"the chat template of tokenizer '{folder}/tokenizer' was stopped: "
        suffix = "; use a template that renders within these bounds"
        t0 = time.monotonic()
        # 50,000 characters of message: a render may do 1,400,000 units of work
        body = {"text": "slow" + "x" * 50_000, "chat": True, "max_new_tokens": 4}
        status, answer = _post(url, body)
        assert (status, answer) == (400, {"error": f"{prefix}it ran past its time limit of 10 s"
                                                   f"{suffix}"})  # fmt: skip
        assert time.monotonic() - t0 < 60  # stopped near 10 s, not after the whole render
        status, answer = _post(url, {"text": "loop", "chat": True, "max_new_tokens": 4})
        assert status == 400 and re.fullmatch(re.escape(prefix) + WORK + suffix,
                                              answer["error"]), answer  # fmt: skip
        status, answer = _post(url, {"text": "hi", "chat": True, "max_new_tokens": 4})
        assert status == 200 and "event: done" in answer, answer
    finally:
        proc.terminate()
        proc.wait(timeout=30)
