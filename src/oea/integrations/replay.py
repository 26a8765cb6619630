"""Routing replay: which of the expert ids an engine returns for a token (vLLM ``routed_experts``, SGLang
``return_routed_experts``) are fillers, recognisable from the ids alone.

Shape legend: k = the model's top_k; ids are ``[..., k]`` (vLLM and SGLang return ``[tokens, layers, k]``).

The rule, the same in every adapter: a decode token OEA routes to fewer than k experts (the batch's union holds
fewer experts than the token has slots, or ``OEA_MAX_EXPERTS`` caps it) keeps k slots; each unused slot is a
*filler*: weight exactly 0, and its id repeats an expert the same token already names in that layer (the
token's own best expert, ``oea.routing``). A real route never names an expert twice, so a slot is a filler iff
its id occurs in an earlier slot of the same row: a trainer that replays the ids masks those slots
(``filler_slots``), and the distinct ids of a row are exactly the experts the layer ran for that token with a
non-zero weight. Why a repeat and not an id outside 0..N-1: vLLM returns the ids as ``uint8`` when the model
has at most 256 experts (``-1`` would arrive as 255, a real expert of a 256-expert model), a trainer that
gathers scores at the returned ids accepts any id in range, and the MoE kernels run a repeated id (vLLM's as
they are; SGLang's native CPU MoE after ``sglang/fillers.py``'s renaming, which the capture does not see).

Where an adapter hands its MoE kernel other ids than OEA's for the same routing (SGLang: distinct zero-weight
fillers), the engine's capture must still receive OEA's: ``ReplayIds`` carries them from the routing call to
the capture. Prefill and every step OEA leaves alone are the engine's own ids, untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def filler_slots(ids: Any) -> torch.Tensor:
    """[..., k] bool: True where the slot's id occurs in an earlier slot of its row (last axis): a zero-weight
    filler that a replaying trainer masks. Accepts a tensor or anything ``torch.as_tensor`` reads (a numpy array
    of any integer dtype, vLLM's ``uint8`` included)."""
    values = ids if isinstance(ids, torch.Tensor) else torch.from_numpy(np.array(ids, copy=True))
    values = values.long()  # uint8 / uint16 / int32 as returned, compared as int64
    k = values.shape[-1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=values.device).tril(-1)  # [j, i]: i < j
    return ((values[..., :, None] == values[..., None, :]) & earlier).any(dim=-1)


def real_slots(ids: Any) -> torch.Tensor:
    """[..., k] bool: the slots a trainer replays (each expert of a row once, in the row's order)."""
    return ~filler_slots(ids)


class ReplayIds:
    """OEA's ids for the engine's routed-experts capture, where the kernel is handed other ids for the same rows.

    ``note(kernel_ids, replay_ids)`` in the routing call; the engine then captures ``kernel_ids`` (the very tensor
    object) and the adapter's wrapper of its capture asks ``swap(ids)``, which returns ``replay_ids`` once for that
    object and anything else unchanged. Graph-safe: the swap is decided in Python when the capture call runs (at
    CUDA-graph capture, so a replay copies the right tensor); nothing is read from a device.
    """

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def note(self, kernel_ids: torch.Tensor, replay_ids: torch.Tensor) -> None:
        self._pending = None if kernel_ids is replay_ids else (kernel_ids, replay_ids)

    def swap(self, ids: Any) -> Any:
        pending = self._pending
        if pending is not None and ids is pending[0]:
            self._pending = None
            return pending[1]
        return ids
