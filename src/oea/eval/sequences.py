"""Evaluation sequences: fixed-length token windows of held-out documents, batched so that the rows
of a batch come from different documents whenever there are enough documents."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Batch:
    """``ids`` [B, L] int64 token windows; ``documents[b]`` is the index of row b's document."""

    ids: torch.Tensor
    documents: tuple[int, ...]


def document_windows(tokenizer: Any, texts: list[str], length: int) -> list[list[torch.Tensor]]:
    """Per document, its non-overlapping ``length``-token windows of ``[BOS] + tokens`` (short tail dropped)."""
    if tokenizer.bos_token_id is None and tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has neither a bos_token_id nor an eos_token_id to start documents with")
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    windows = []
    for text in texts:
        # verbose=False: whole documents exceed model_max_length on purpose (they are cut into windows)
        tokens = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids = torch.tensor([start, *tokens], dtype=torch.int64)
        windows.append([ids[i : i + length] for i in range(0, len(ids) - length + 1, length)])
    return windows


def make_batches(
    windows: list[list[torch.Tensor]], batch_size: int, num_batches: int, seed: int
) -> list[Batch]:
    """``num_batches`` batches of ``batch_size`` windows, rows drawn round-robin over documents.

    Documents are visited in an order shuffled by ``seed``; round r takes window r of every
    document that has one, so a batch repeats a document only when ``batch_size`` exceeds the
    number of documents still having windows. Raises ``ValueError`` when there are too few windows.
    """
    if batch_size < 1 or num_batches < 1:
        raise ValueError(f"batch_size and num_batches must be >= 1, got {batch_size} and {num_batches}")
    order = list(range(len(windows)))
    random.Random(seed).shuffle(order)
    pool: list[tuple[int, torch.Tensor]] = []
    for rnd in range(max((len(w) for w in windows), default=0)):
        pool.extend((doc, windows[doc][rnd]) for doc in order if rnd < len(windows[doc]))
    needed = batch_size * num_batches
    if len(pool) < needed:
        raise ValueError(
            f"need {needed} evaluation windows (batch size {batch_size} x {num_batches} batches), "
            f"the documents give only {len(pool)}; lower --num-batches or --positions"
        )
    batches = []
    for i in range(num_batches):
        rows = pool[i * batch_size : (i + 1) * batch_size]
        batches.append(Batch(torch.stack([w for _, w in rows]), tuple(doc for doc, _ in rows)))
    return batches
