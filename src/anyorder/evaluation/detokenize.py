"""The zero-shot sets' detokenizers (:mod:`anyorder.evaluation.zeroshot`): tokenized text back to
plain text, as the SEDD/RADD/AO-GPT protocol does before the GPT-2 tokenizer.

Each is a pure ``str -> str`` function written from the published rules: WikiText's
``@-@`` separators, spacing around punctuation and brackets and ``= =`` headings; PTB's
``<unk>`` -> ``?``, ``N`` -> ``1`` and joined clitics; LM1B's clitics and punctuation;
LAMBADA's straight quotes and leading newline.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def _apply(text: str, literal: Sequence[tuple[str, str]]) -> str:
    for old, new in literal:
        text = text.replace(old, new)
    return text


_WIKI_NUMBERS = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))
_WIKI_PUNCT = tuple((f" {p} ", f"{p} ") for p in ":;.!?,")
# Inner padding of paired brackets and quotes: "( a b )" -> "(a b)".
_PAIRS = tuple(
    (re.compile(rf"{re.escape(o)}\s*([^{re.escape(c)}]*?)\s*{re.escape(c)}"), f"{o}\\1{c}")
    for o, c in (("(", ")"), ("[", "]"), ("{", "}"), ('"', '"'), ("'", "'"))
)
_HEADINGS = (("= = = =", "===="), ("= = =", "==="), ("= =", "=="))


def wikitext_detokenize(text: str) -> str:
    """WikiText's tokenized text back to plain text.

    ``" @-@ "`` -> ``-`` (likewise ``@,@`` and ``@.@``), no space before ``: ; . ! ? ,``,
    no padding inside brackets and quotes, ``= = x = =`` headings -> ``== x ==``, `` ° ``
    -> ``°``, no space at line edges, `` N `` -> `` 1 ``, `` 's`` -> ``'s``.
    """
    text = text.replace("s '", "s'")
    text = _apply(text, _WIKI_NUMBERS + _WIKI_PUNCT)
    for pattern, repl in _PAIRS:
        text = pattern.sub(repl, text)
    text = _apply(text, _HEADINGS)
    return (
        _apply(text, ((" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"), (" \n", "\n"), ("\n ", "\n")))
        .replace(" N ", " 1 ")
        .replace(" 's", "'s")
    )


def ptb_detokenize(text: str) -> str:
    """Penn Treebank (``ptb_text_only``) sentences back to plain text.

    Clitics join (`` 's`` -> ``'s``, `` n't`` -> ``n't``, ``s ' `` -> ``s' ``), ``\\/`` ->
    ``/``, the number placeholder `` N `` -> `` 1 `` (repeated, so runs of ``N`` all
    change), ``$ 1`` -> ``$1``, ``# 1`` -> ``#1``, and ``<unk>`` -> ``?``.
    """
    text = _apply(text, ((" 's", "'s"), ("s ' ", "s' "), (" n't", "n't"), (" \n ", "\n")))
    text = text.replace("\\/", "/")
    while " N " in text:  # " N N " needs two passes: the matches overlap
        text = text.replace(" N ", " 1 ")
    return _apply(text, (("$ 1", "$1"), ("# 1", "#1"), ("<unk>", "?")))


_LM1B_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"http : / / ", "http://"),
        (r"https : / / ", "https://"),
        (r" '(\w+)", r"'\1"),  # clitics: " 's" -> "'s", " 've" -> "'ve"
        (r" (\w+) \. ", r" \1. "),
        (r" (\w+) \.$", r" \1."),
        (r" \? ", "? "),
        (r" \?$", "?"),
        (r" ! ", "! "),
        (r" !$", "!"),
        (r" , ", ", "),
        (r" : ", ": "),
        (r" ; ", "; "),
        (r" / ", "/"),
        (r'" ([^"]+) "', r'"\1"'),
        (r"' ([^']+) '", r"'\1'"),
        (r"\( ([^()]+) \)", r"(\1)"),
        (r"\[ ([^\[\]]+) \]", r"[\1]"),
        (r"\$ ", "$"),
        ("\N{POUND SIGN} ", "\N{POUND SIGN}"),
    )
)


def lm1b_detokenize(text: str) -> str:
    """One Billion Word sentences back to plain text: URLs, clitics (`` 's`` -> ``'s``), no
    space before ``. ? ! , : ;``, no padding inside quotes and brackets, ``$``/``£`` joined."""
    for pattern, repl in _LM1B_RULES:
        text = pattern.sub(repl, text)
    return text


def lambada_detokenize(text: str) -> str:
    """LAMBADA: curly double quotes straightened, the text stripped, a newline prepended."""
    text = text.replace("\N{LEFT DOUBLE QUOTATION MARK}", '"')
    text = text.replace("\N{RIGHT DOUBLE QUOTATION MARK}", '"')
    return "\n" + text.strip()
