"""Filler slots SGLang's native MoE can run: distinct ids within each row, taken from the batch's active experts.

Shape legend: M = rows of one router call, k = routed top-k, s = appended shared-expert columns, N = routed experts.

OEA gives a token fewer than k experts by filling its spare slots with a zero-weight repeat of one of its own
experts (``oea.routing``: no extra expert is loaded). SGLang's ``moe_forward_native`` (the MoE on its CPU path
without AMX kernels) counts each row's experts with ``scatter_(1, topk_ids, 1)``, which counts a repeated id
once, and then slices the sorted token copies by those counts: a repeated id shifts every later expert's tokens
and the layer fails with a shape mismatch. ``distinct_fillers`` renames each repeated slot to an expert that row
does not use, chosen among the experts other rows already route to (no expert added to the layer's work;
zero weight, so no output changes). Only a call whose union of experts is smaller than k (a row then cannot
hold k distinct experts of it) takes unused experts, the lowest ids, the same for every row: at most
k - |union| zero-weight experts more for ``moe_forward_native`` to run. SGLang's other MoE runners count per
slot and are indifferent to the renaming.

Routed-experts capture (``--enable-return-routed-experts``, ``return_routed_experts``) must not see the renaming:
a distinct filler cannot be told from a real route by a trainer that replays the ids. SGLang captures the ids
``_post_process_topk_ids`` is given, so ``capture_replay_ids`` wraps SGLang's capturer once: when it captures
the renamed tensor, it captures OEA's ids instead, whose fillers repeat the row's own expert
(``oea.integrations.replay``: the rule every adapter returns).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from oea.integrations.replay import ReplayIds

CAPTURER_MODULE = "sglang.srt.state_capturer.routed_experts"  # get_global_experts_capturer(): None unless capture is on
REPLAY = ReplayIds()


def distinct_fillers(ids: torch.Tensor, weights: torch.Tensor, k: int, num_experts: int,
                     earlier: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` / ``weights`` [M, k + s] with each repeated id among a row's first ``k`` columns renamed.

    A slot is a repeat when an earlier slot of its row holds the same id; it gets weight 0 and the row's r-th
    repeat the r-th expert of the row's free candidates: experts outside the row that some row of the call
    routes to (ascending id), then experts nobody routes to (ascending id). Rows without repeats and the s
    appended columns are returned as given. Graph-safe: fixed shapes, no host synchronisation.

    Every row's candidates are one order of the call's experts (active ascending, then inactive ascending) with
    the row's own experts left out; a row has d distinct experts and k - d repeats, so its r-th candidate lies
    within the first d + (k - d) <= 2k - 1 experts of that order: only those are ranked ([L], L = min(N, 2k - 1)),
    not all N per row (the hot path of every rewritten call). ``earlier``: ``earlier_mask(k, device)``, when the
    caller keeps one.
    """
    m = ids.shape[0]
    if m == 0 or k < 2:
        return ids, weights
    routed = ids[:, :k].long()  # [M, k]
    mask = _earlier(k, ids.device) if earlier is None else earlier
    repeat = ((routed[:, :, None] == routed[:, None, :]) & mask).any(dim=-1)  # [M, k]
    clamped = routed.clamp(0, num_experts)  # an id out of range lands in the dummy column N
    active = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device)
    active = active.scatter(0, clamped.flatten(), True)[:num_experts]  # [N] experts the call already runs
    expert = torch.arange(num_experts, device=ids.device)
    span = min(num_experts, 2 * k - 1)
    order = (torch.where(active, 0, num_experts) + expert).topk(span, largest=False).indices  # [L] active first
    free = ~(clamped[:, :, None] == order[None, None, :]).any(dim=1)  # [M, L] not one of the row's experts
    which = repeat.long().cumsum(dim=1)  # [M, k] r at the row's r-th repeat (1-based)
    position = torch.searchsorted(free.long().cumsum(dim=1), which).clamp(max=span - 1)  # the r-th free one
    renamed = torch.where(repeat, order[position], routed).to(ids.dtype)
    kept_weights = weights[:, :k].masked_fill(repeat, 0)
    if ids.shape[1] == k and weights.shape[1] == k:
        return renamed, kept_weights
    new_ids = ids.clone()
    new_ids[:, :k] = renamed
    new_weights = weights.clone()
    new_weights[:, :k] = kept_weights
    return new_ids, new_weights


def distinct_fillers_on_host(ids: torch.Tensor, weights: torch.Tensor, k: int, num_experts: int,
                             earlier: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``distinct_fillers`` for CPU tensors outside tracing: the same rule in numpy (a few microseconds where each
    of the torch version's ~20 ops costs a few), and ``ids`` / ``weights`` themselves when no slot repeats (the
    usual decode batch, whose union holds at least k experts). Not graph-safe: it reads the tensors on the host.
    ``earlier``: ``distinct_fillers``' mask as a numpy array (default: made here).
    """
    m = ids.shape[0]
    if m == 0 or k < 2:
        return ids, weights
    routed = (ids if ids.shape[1] == k else ids[:, :k]).numpy()  # [M, k], a view
    ordered = np.sort(routed, axis=1)
    if not np.count_nonzero(ordered[:, 1:] == ordered[:, :-1]):  # no row holds an id twice
        return ids, weights
    routed = routed.astype(np.int64)
    mask = np.tri(k, k, -1, dtype=bool) if earlier is None else earlier
    repeat = ((routed[:, :, None] == routed[:, None, :]) & mask).any(axis=-1)  # [M, k]
    clamped = routed.clip(0, num_experts)  # an id out of range lands in the dummy column N
    active = np.zeros(num_experts + 1, dtype=bool)
    active[clamped.ravel()] = True
    active = active[:num_experts]
    span = min(num_experts, 2 * k - 1)
    order = np.concatenate([np.flatnonzero(active), np.flatnonzero(~active)])[:span]  # [L] active first
    free = ~(clamped[:, :, None] == order[None, None, :]).any(axis=1)  # [M, L]
    which = repeat.cumsum(axis=1)  # [M, k]
    position = (free.cumsum(axis=1)[:, None, :] < which[:, :, None]).sum(axis=-1).clip(max=span - 1)  # [M, k]
    new_ids = ids.clone()
    new_ids[:, :k] = torch.from_numpy(np.where(repeat, order[position], routed)).to(ids.dtype)
    new_weights = weights.clone()
    new_weights[:, :k] = weights[:, :k].masked_fill(torch.from_numpy(repeat), 0)
    return new_ids, new_weights


_EARLIER: dict[tuple[int, str], torch.Tensor] = {}  # (k, device) -> [k, k] bool, [j, i]: i < j


def earlier_mask(k: int, device: torch.device) -> torch.Tensor | None:
    """The [k, k] mask ``distinct_fillers`` takes, for a caller to keep (None while tracing or capturing, where a
    tensor made must not outlive the traced or captured region)."""
    return None if _tracing_or_capturing(device) else torch.ones(k, k, dtype=torch.bool, device=device).tril(-1)



def _earlier(k: int, device: torch.device) -> torch.Tensor:
    key = (k, str(device))
    mask = _EARLIER.get(key)
    if mask is None:
        mask = torch.ones(k, k, dtype=torch.bool, device=device).tril(-1)
        if not _tracing_or_capturing(device):  # a tensor made in a traced or captured region must not outlive it
            _EARLIER[key] = mask
    return mask


def _tracing_or_capturing(device: torch.device) -> bool:
    capturing = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return bool(torch.compiler.is_compiling() or capturing)


def capture_replay_ids(kernel_ids: torch.Tensor, replay_ids: torch.Tensor) -> None:
    """Have SGLang's routed-experts capture (when it is on) take ``replay_ids`` where it is handed ``kernel_ids``
    (the renamed tensor this routing call returns). Nothing happens without a capturer."""
    capturer = _capturer()
    if capturer is None:
        return
    if not getattr(capturer, "_oea_replay_ids", False):
        _wrap(capturer)
    REPLAY.note(kernel_ids, replay_ids)


def _capturer() -> Any:
    # Only a lookup, never an import: this runs inside torch.compile'd and graph-captured forwards, where Dynamo
    # refuses importlib, and a capturer can only exist once SGLang has imported its module.
    module = sys.modules.get(CAPTURER_MODULE)
    if module is None:
        return None
    getter = getattr(module, "get_global_experts_capturer", None)
    return None if getter is None else getter()


def _wrap(capturer: Any) -> None:
    """``capturer.capture(layer_id, topk_indices)`` with ``topk_indices`` swapped for OEA's ids (``REPLAY``)."""
    original = capturer.capture

    def capture(*args: Any, **kwargs: Any) -> Any:
        if "topk_indices" in kwargs:
            kwargs["topk_indices"] = REPLAY.swap(kwargs["topk_indices"])
        elif len(args) >= 2:
            args = (args[0], REPLAY.swap(args[1]), *args[2:])
        return original(*args, **kwargs)

    capturer.capture = capture
    capturer._oea_replay_ids = True
