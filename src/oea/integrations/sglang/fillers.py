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

import importlib
from typing import Any

import torch

from oea.integrations.replay import ReplayIds

CAPTURER_MODULE = "sglang.srt.state_capturer.routed_experts"  # get_global_experts_capturer(): None unless capture is on
REPLAY = ReplayIds()


def distinct_fillers(ids: torch.Tensor, weights: torch.Tensor, k: int, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` / ``weights`` [M, k + s] with each repeated id among a row's first ``k`` columns renamed.

    A slot is a repeat when an earlier slot of its row holds the same id; it gets weight 0 and the row's r-th
    repeat the r-th expert of the row's free candidates: experts outside the row that some row of the call
    routes to (ascending id), then experts nobody routes to (ascending id). Rows without repeats and the s
    appended columns are returned as given. Graph-safe: fixed shapes, no host synchronisation.
    """
    m = ids.shape[0]
    if m == 0 or k < 2:
        return ids, weights
    routed = ids[:, :k].long()  # [M, k]
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)  # [j, i]: i < j
    repeat = ((routed[:, :, None] == routed[:, None, :]) & earlier).any(dim=-1)  # [M, k]
    in_row = torch.zeros(m, num_experts + 1, dtype=torch.bool, device=ids.device)
    in_row.scatter_(1, routed.clamp(0, num_experts), True)  # an id out of range lands in the dummy column N
    in_row = in_row[:, :num_experts]  # [M, N]
    active = in_row.any(dim=0)  # [N] experts the call already runs
    # Candidate order per row: active experts outside the row, then inactive ones, then the row's own (never
    # reached: a row has at most k - 1 repeats and N - (k - repeats) >= repeats free experts).
    expert = torch.arange(num_experts, device=ids.device)
    rank_key = torch.where(in_row, 2 * num_experts, torch.where(active, 0, num_experts)) + expert  # [M, N]
    candidates = rank_key.argsort(dim=1)[:, : k]  # [M, k] ascending key: lower ids first within a class
    which = (repeat.long().cumsum(dim=1) - 1).clamp(min=0)  # [M, k] the r-th repeat of its row
    renamed = torch.where(repeat, candidates.gather(1, which), routed)
    new_ids = ids.clone()
    new_ids[:, :k] = renamed.to(ids.dtype)
    new_weights = weights.clone()
    new_weights[:, :k] = torch.where(repeat, torch.zeros_like(weights[:, :k]), weights[:, :k])
    return new_ids, new_weights


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
    try:
        module = importlib.import_module(CAPTURER_MODULE)
    except ImportError:  # an SGLang without routed-experts capture
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
