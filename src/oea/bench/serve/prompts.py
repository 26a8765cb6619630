"""Prompts of ``oea bench serve`` (and the held-out text ``oea bench decode`` cuts its prompts from):
random token ids with exact lengths, or windows of held-out text."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

DATASETS: tuple[str, ...] = ("random", "text")
# Token ids used by the random dataset: above typical special tokens, below any real vocabulary size.
RANDOM_TOKEN_RANGE: tuple[int, int] = (16, 4000)


@dataclass(frozen=True)
class Prompt:
    """One request: ``prompt`` is text or a list of token ids; ``output_len`` is ``max_tokens``."""

    prompt: str | list[int]
    output_len: int


def random_prompts(num: int, input_len: int, output_len: int, seed: int, range_ratio: float = 1.0,
                   token_range: tuple[int, int] = RANDOM_TOKEN_RANGE) -> list[Prompt]:
    """``num`` prompts of random token ids (sent as token-id prompts, so lengths are exact).

    Lengths are drawn uniformly from [len * range_ratio, len] as in ``sglang.bench_serving``.
    """
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--random-input-len and --random-output-len must be >= 1, got {input_len}, {output_len}")
    if not 0.0 < range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in (0, 1], got {range_ratio}")
    rng = random.Random(seed)
    low, high = token_range
    prompts = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        prompts.append(Prompt([rng.randrange(low, high) for _ in range(n_in)], n_out))
    return prompts


def heldout_texts() -> list[str]:
    """Held-out documents: the embedded model's (``oea.models.heldout_documents()``) when its file list
    exists, else the held-out split of the Python standard library files (``oea.models.data``)."""
    from oea.models.data import read_text, split_files, stdlib_files

    try:
        from oea.models import heldout_documents

        docs = [text for _name, text in heldout_documents()]
        if docs:
            return docs
    except (ImportError, FileNotFoundError):
        pass  # no embedded model yet (or another Python's stdlib): the hash split below is the fallback
    _, heldout = split_files(stdlib_files())
    return [read_text(f.path) for f in heldout]


def text_prompts(num: int, input_chars: int, output_len: int, seed: int,
                 documents: Sequence[str] | None = None) -> list[Prompt]:
    """``num`` prompts cut from held-out text: windows of ``input_chars`` characters starting at a line."""
    if input_chars < 1 or output_len < 1:
        raise ValueError(f"--text-input-chars and --random-output-len must be >= 1, got {input_chars}, {output_len}")
    docs = [d for d in (heldout_texts() if documents is None else documents) if len(d) > input_chars]
    if not docs:
        raise ValueError(f"no held-out document is longer than --text-input-chars={input_chars}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        doc = rng.choice(docs)
        start = rng.randrange(0, len(doc) - input_chars)
        line_start = doc.rfind("\n", 0, start) + 1
        prompts.append(Prompt(doc[line_start:line_start + input_chars], output_len))
    return prompts


def make_prompts(dataset: str, num: int, seed: int, input_len: int, output_len: int,
                 range_ratio: float = 1.0, input_chars: int = 512) -> list[Prompt]:
    """Prompts for ``dataset`` (one of ``DATASETS``)."""
    if dataset == "random":
        return random_prompts(num, input_len, output_len, seed, range_ratio)
    if dataset == "text":
        return text_prompts(num, input_chars, output_len, seed)
    raise ValueError(f"--dataset must be one of {DATASETS}, got {dataset!r}")
