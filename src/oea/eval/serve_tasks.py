"""The items ``oea eval serve`` sends, and how each answer is scored.

The bundled task (``BUNDLED_TASK``, no download): finish a line of held-out text. Each item cuts a line of one of
the embedded model's held-out documents (``oea.bench.serve.prompts.heldout_texts``: Python standard-library files
the model never trained on) at a word boundary; the prompt is the text before the cut (up to ``context_chars``
characters, from a line start), the target the rest of the line. The server answers greedily, stopping at the end
of the line; two scores per item:

* ``exact_match`` (pass/fail): the answer's first line, trailing blanks stripped, equals the target;
* ``similarity`` (graded, in [0, 1]): ``difflib.SequenceMatcher`` ratio of the answer's first line and the target
  (2 x matching characters / total characters).

Items are a pure function of (documents, seed, count): every arm, concurrency and round gets the same ones.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BUNDLED_TASK = "heldout-lines"
METRICS: tuple[str, ...] = ("exact_match", "similarity")
CUT_AFTER = " (.=,[:"  # a cut lands right after one of these: a word boundary the tokenizer sees too
MIN_TARGET_CHARS = 4
MIN_LINE_CHARS = 16


@dataclass(frozen=True)
class Item:
    """One request: ``item_id`` names it in every arm's rows; ``target`` is what a perfect answer writes."""

    item_id: str
    prompt: str
    target: str
    max_tokens: int


def first_line(text: str) -> str:
    """``text`` up to its first newline, trailing blanks stripped."""
    return text.split("\n", 1)[0].rstrip()


def score_answer(answer: str, target: str) -> dict[str, float]:
    """``{"exact_match": 0 or 1, "similarity": 0..1}`` of ``answer`` (its first line) against ``target``."""
    line, goal = first_line(answer), target.rstrip()
    return {"exact_match": float(line == goal),
            "similarity": difflib.SequenceMatcher(None, line, goal, autojunk=False).ratio() if line or goal else 1.0}


def _cuts(line: str) -> list[int]:
    """Positions in ``line`` after a ``CUT_AFTER`` character, past the indentation and leaving a target of at
    least ``MIN_TARGET_CHARS`` characters that holds more than blanks."""
    indent = len(line) - len(line.lstrip())
    return [i + 1 for i in range(indent, len(line) - MIN_TARGET_CHARS)
            if line[i] in CUT_AFTER and line[i + 1:].strip()]


def line_items(count: int, seed: int, documents: Sequence[tuple[str, str]] | None = None,
               context_chars: int = 512, max_tokens: int = 32) -> list[Item]:
    """``count`` items of the bundled task (module docstring) from ``documents`` (``[(name, text)]``; default: the
    embedded model's held-out documents), chosen with ``random.Random(seed)``; distinct cut points."""
    if count < 1:
        raise ValueError(f"--num-items must be >= 1, got {count}")
    docs = list(documents) if documents is not None else _heldout()
    candidates = [(name, start, line) for name, text in docs for start, line in _lines(text)
                  if len(line.strip()) >= MIN_LINE_CHARS and _cuts(line)]
    if len(candidates) < count:
        raise ValueError(f"--num-items: the held-out documents have {len(candidates)} usable lines, asked for {count}")
    rng = random.Random(seed)
    texts = dict(docs)
    items = []
    for name, start, line in rng.sample(candidates, count):
        cut = rng.choice(_cuts(line))
        before = texts[name][:start + cut]
        context_start = max(0, len(before) - context_chars)
        context_start = before.find("\n", context_start - 1) + 1 if context_start else 0
        items.append(Item(f"{name}:{start + cut}", before[context_start:], line[cut:].rstrip(), max_tokens))
    return items


def _lines(text: str) -> list[tuple[int, str]]:
    """``[(offset of the line in text, line)]``."""
    out, offset = [], 0
    for line in text.split("\n"):
        out.append((offset, line))
        offset += len(line) + 1
    return out


def _heldout() -> list[tuple[str, str]]:
    from oea.bench.serve.prompts import heldout_texts

    return [(f"doc{i}", text) for i, text in enumerate(heldout_texts())]


def bundled_items(task: str, count: int, seed: int) -> tuple[list[Item], Callable[[str, str], dict[str, float]]]:
    """The items and the scorer of a bundled task; ``ValueError`` naming ``--task`` for another name."""
    if task != BUNDLED_TASK:
        raise ValueError(f"--task must be {BUNDLED_TASK} (bundled) or an lm-eval generate_until task with "
                         f"--include-path, got {task!r}")
    return line_items(count, seed), score_answer
