"""Which trace tokens form each simulated batch (``make_batches``), and how many distinct batches exist.

Shape legend: T = trace tokens, B = batch size (rows), nb = number of batches.

The independent unit of a simulation is the batch: a row's interval is over its batches
(``oea.sim.summary``), so a batch counted twice is one sample, not two.

* ``mixed``: B tokens drawn uniformly without replacement from the whole pool, independently per batch
  (the pool holds C(T, B) distinct batches; two equal draws are vanishingly rare unless B is close to T).
* ``lockstep``: B requests at one decode position (in a trace recorded from an engine, ``step_ids``: B rows
  of one engine step). The trace holds only Σ_g C(n_g, B) distinct such batches (n_g requests at position
  g): as few as the number of positions when B is every request. Lockstep batches are therefore drawn
  without repeats: a position uniformly among those that still have an unused batch, then B of its
  requests not drawn together before (positions with few combinations enumerate them; the others draw and
  redraw a repeat). Once every distinct batch is drawn, fewer batches than asked come back.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from oea.traces import Trace

MODES: tuple[str, ...] = ("mixed", "lockstep")
ENUMERATE_LIMIT = 4096  # a position with at most this many distinct batches lists them instead of redrawing


def make_batches(
    trace: Trace, batch_size: int, mode: str, num_batches: int, generator: torch.Generator,
    exclude: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token indices of up to ``num_batches`` batches: [nb, B] int64.

    ``mixed``: ``num_batches`` batches of B tokens, each without replacement from the pool.
    ``lockstep``: B requests at one random decode position that at least B requests reach (with
    ``step_ids``: B rows of one engine step of at least B rows; a step of exactly B rows is replayed as the
    engine batched it). No two lockstep batches hold the same tokens, nor any batch of ``exclude``
    ([m, B], batches drawn before); fewer than ``num_batches`` come back when the trace has no more
    (``distinct_batches``).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be an integer >= 1, got {batch_size!r}")
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    if mode == "mixed":
        if batch_size > trace.num_tokens:
            raise ValueError(f"batch size {batch_size} is larger than the pool of trace {trace.name!r} "
                             f"({trace.num_tokens} tokens); use batch sizes <= {trace.num_tokens}")
        return torch.stack([torch.randperm(trace.num_tokens, generator=generator)[:batch_size]
                            for _ in range(num_batches)])
    groups = lockstep_groups(trace, batch_size)
    seen = set() if exclude is None else {tuple(sorted(batch)) for batch in exclude.tolist()}
    batches = _distinct_draws(groups, batch_size, num_batches, generator, seen)
    return torch.stack(batches) if batches else torch.empty((0, batch_size), dtype=torch.int64)


def distinct_batches(trace: Trace, batch_size: int, mode: str) -> int:
    """How many different batches of ``batch_size`` tokens ``make_batches`` can form from ``trace``."""
    if mode == "mixed":
        return math.comb(trace.num_tokens, batch_size)
    return sum(math.comb(len(tokens), batch_size) for tokens in lockstep_groups(trace, batch_size))


def lockstep_groups(trace: Trace, batch_size: int) -> list[torch.Tensor]:
    """The token groups a lockstep batch of ``batch_size`` rows is drawn from (engine steps or positions with
    at least that many rows); ``ValueError`` naming the trace when it records neither or has none that big."""
    if trace.step_ids is None and (trace.request_ids is None or trace.positions is None):
        raise ValueError(f"mode 'lockstep' needs request ids and positions (or engine step ids), which trace "
                         f"{trace.name!r} does not record; use mode 'mixed'")
    groups = _tokens_by_step(trace) if trace.step_ids is not None else _tokens_by_position(trace)
    eligible = [tokens for tokens in groups if len(tokens) >= batch_size]
    if not eligible:
        most = max(len(tokens) for tokens in groups)
        where = "one engine step" if trace.step_ids is not None else "one position"
        raise ValueError(f"lockstep batch size {batch_size} needs {batch_size} requests at {where}, but "
                         f"trace {trace.name!r} has at most {most}; use batch sizes <= {most}")
    return eligible


def _distinct_draws(groups: list[torch.Tensor], batch_size: int, count: int, generator: torch.Generator,
                    seen: set[tuple[int, ...]]) -> list[torch.Tensor]:
    """Up to ``count`` batches, none of them (as a set of tokens) in ``seen`` or drawn twice."""
    sizes = [math.comb(len(tokens), batch_size) for tokens in groups]
    group_of = {token: g for g, tokens in enumerate(groups) for token in tokens.tolist()}
    used = [0] * len(groups)
    for key in seen:
        if key and key[0] in group_of:
            used[group_of[key[0]]] += 1
    unused: dict[int, list[tuple[int, ...]]] = {}  # enumerated groups: their batches not drawn yet
    open_groups = [g for g in range(len(groups)) if used[g] < sizes[g]]
    batches: list[torch.Tensor] = []
    while len(batches) < count and open_groups:
        pick = int(torch.randint(len(open_groups), (1,), generator=generator))
        g = open_groups[pick]
        tokens = groups[g]
        if sizes[g] <= ENUMERATE_LIMIT:
            if g not in unused:
                unused[g] = [c for c in itertools.combinations(tokens.tolist(), batch_size)
                             if tuple(sorted(c)) not in seen]
            choices = unused[g]
            batch = torch.tensor(choices.pop(int(torch.randint(len(choices), (1,), generator=generator))))
        else:
            batch = tokens[torch.randperm(len(tokens), generator=generator)[:batch_size]]
        key = tuple(sorted(batch.tolist()))
        if key in seen:
            continue
        seen.add(key)
        batches.append(batch)
        used[g] += 1
        if used[g] == sizes[g]:
            open_groups.pop(pick)
    return batches


def _tokens_by_step(trace: Trace) -> list[torch.Tensor]:
    """Per recorded engine step, its tokens (rows of one forward pass), in trace order."""
    assert trace.step_ids is not None
    order = torch.argsort(trace.step_ids, stable=True)
    _, counts = torch.unique_consecutive(trace.step_ids[order], return_counts=True)
    return list(torch.split(order, counts.tolist()))


def _tokens_by_position(trace: Trace) -> list[torch.Tensor]:
    """Per decode position, one token index per request (the first if a request repeats)."""
    assert trace.request_ids is not None and trace.positions is not None
    groups = []
    for position in torch.unique(trace.positions):
        tokens = torch.nonzero(trace.positions == position).flatten()
        _, first = np.unique(trace.request_ids[tokens].numpy(), return_index=True)
        groups.append(tokens[torch.from_numpy(np.sort(first))])
    return groups
