"""A synthetic instruction task with exact answers: sort letters, reverse words, add numbers.

A corpus to check instruction tuning against: every prompt has one right answer, so a model
fine-tuned on it is scored by exact match on prompts it never saw, and an untrained model
scores about zero.

Design choices:

* Three tasks, drawn with equal probability, each with answers of varying length:

  - ``sort``: ``"sort: q d a m"`` -> ``"a d m q"`` (2 to 8 letters, repeats allowed);
  - ``reverse``: ``"reverse: red cat sun"`` -> ``"sun cat red"`` (2 to 4 words of
    :data:`WORDS`);
  - ``add``: ``"add: 48+317"`` -> ``"365"`` (two numbers of 1 to 3 digits).

  Prompts and answers are short ASCII (at most 24 and 15 bytes), so a byte-level model with
  a ``seq_len`` of 64 holds any example whole with the plain chat template (48 tokens of
  prompt at most, 16 of answer with its EOS).
* Train and held-out prompts are disjoint by construction, whatever ``n`` and the seed: a
  prompt is held out when a stable hash of its text (SHA-256, not Python's salted ``hash``)
  falls in one bucket of :data:`HELDOUT_BUCKETS`, and each split draws only its own prompts.
  Inside a split the prompts are distinct.
* Everything is drawn from one seeded ``numpy`` generator per split, so the same ``n`` and
  seed give the same files on every machine.
* Records are ``{"prompt", "response", "task"}``: the chat format's fields, and the task for
  per-task scores. :func:`write_instruct` writes ``train.jsonl`` and ``heldout.jsonl``
  atomically (``anyorder data --instruct DIR``).
* :func:`exact_match` compares answers with surrounding whitespace stripped, nothing else
  normalised: ``"1 2"`` is not ``"12"``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from anyorder.errors import ConfigError

TASKS = ("sort", "reverse", "add")
"""The tasks, in the order their names are drawn."""
WORDS = (
    "red", "cat", "sun", "dog", "map", "cup", "box", "pen", "hat", "owl", "fig", "ink",
    "jam", "key", "log", "net", "oak", "pig", "rug", "sky", "toy", "van", "web", "zip",
)  # fmt: skip
"""The words of ``reverse`` (24 three-letter words)."""
HELDOUT_BUCKETS = 8
"""One prompt in this many (by hash) belongs to the held-out split."""
MAX_N = 1_000_000
"""The most examples a split may ask for (the prompt space holds far more)."""


def is_heldout(prompt: str) -> bool:
    """Whether ``prompt`` belongs to the held-out split (a stable hash, see the notes)."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HELDOUT_BUCKETS == 0


def _draw(task: str, rng: np.random.Generator) -> tuple[str, str]:
    """One ``(prompt, response)`` of ``task``."""
    if task == "sort":
        letters = [chr(ord("a") + int(i)) for i in rng.integers(0, 26, int(rng.integers(2, 9)))]
        return "sort: " + " ".join(letters), " ".join(sorted(letters))
    if task == "reverse":
        words = [WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(2, 5)))]
        return "reverse: " + " ".join(words), " ".join(reversed(words))
    a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, 4)))) for _ in range(2))
    return f"add: {a}+{b}", str(a + b)


def make_examples(
    n: int, *, seed: int = 0, split: str = "train", tasks: Sequence[str] = TASKS
) -> list[dict[str, str]]:
    """``n`` examples of one split, with distinct prompts.

    Args:
        n: how many (1..:data:`MAX_N`).
        seed: seed of the draws (each split draws from its own stream of it).
        split: ``train`` or ``heldout`` (disjoint prompts, see the module notes).
        tasks: the tasks to draw from (a subset of :data:`TASKS`).

    Returns:
        Records ``{"prompt", "response", "task"}`` in the order drawn.

    Raises:
        ConfigError: a bad ``n``, ``split`` or task name.
    """
    if not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ConfigError(f"n={n!r} examples must lie in 1..{MAX_N}")
    if split not in ("train", "heldout"):
        raise ConfigError(f"split={split!r}: use train or heldout")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ConfigError(f"tasks={list(tasks)!r}: choose among {', '.join(TASKS)}")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    want_heldout = split == "heldout"
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    while len(out) < n:
        task = tasks[int(rng.integers(0, len(tasks)))]
        prompt, response = _draw(task, rng)
        if prompt in seen or is_heldout(prompt) != want_heldout:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "response": response, "task": task})
    return out


def exact_match(prediction: str, reference: str) -> bool:
    """Whether an answer is right: equal to the reference, surrounding whitespace stripped."""
    return prediction.strip() == reference.strip()


def accuracy(predictions: Sequence[str], references: Sequence[str]) -> float:
    """The fraction of exact matches (:func:`exact_match`) over paired answers."""
    if len(predictions) != len(references) or not references:
        raise ConfigError(
            f"{len(predictions)} predictions for {len(references)} references; give one "
            "prediction per reference (and at least one)"
        )
    return sum(map(exact_match, predictions, references)) / len(references)


def write_instruct(
    out: str | Path, *, n: int = 20000, heldout: int = 1000, seed: int = 0
) -> dict[str, Path]:
    """Write ``train.jsonl`` (``n`` examples) and ``heldout.jsonl`` into the folder ``out``.

    Each file is written whole under a temporary name and renamed into place, so an
    interrupted call leaves no half-written file.

    Returns:
        ``{"train": path, "heldout": path}``.

    Raises:
        ConfigError: bad counts; WriteError: the folder cannot be written.
    """
    from anyorder.atomic import write_text

    splits = {
        "train": make_examples(n, seed=seed),
        "heldout": make_examples(heldout, seed=seed, split="heldout"),
    }
    paths = {}
    for name, records in splits.items():
        paths[name] = Path(out) / f"{name}.jsonl"
        write_text(paths[name], "".join(json.dumps(r) + "\n" for r in records))
    return paths
