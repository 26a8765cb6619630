"""The ranking rule every routing path shares: by score, best first; equal scores go to the lower expert index.

``torch.topk`` leaves the order of equal values to its implementation (it differs between CPU and CUDA and
between sizes), so two implementations that both call it can disagree on ties, which bf16 logits make
common. Routing therefore ranks by integer keys that are unique per expert and ordered as
(float32 score descending, expert index ascending); the fast kernels (``oea.kernels``) apply the same rule,
which is what makes their ids bit-equal to ``oea.route``'s. ``-0.0`` and ``+0.0`` are equal scores.

Shape legend: M rows, N experts (or groups).
"""

from __future__ import annotations

import torch

KEY_MIN = torch.iinfo(torch.int64).min
"""A key below every real key: marks entries that must not be chosen."""


def rank_keys(scores: torch.Tensor) -> torch.Tensor:
    """[M, N] float32 scores without NaN -> [M, N] int64 keys, all distinct within a row.

    ``key[i, a] > key[i, b]`` iff ``scores[i, a] > scores[i, b]``, or the scores are equal and ``a < b``.
    The float32 bit pattern becomes a sign-magnitude integer (monotone in the value, ``-0.0`` -> 0), and
    the expert index breaks ties.
    """
    n = scores.shape[-1]
    bits = scores.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    ordered = torch.where(bits < 0, -magnitude, magnitude)
    reverse_index = torch.arange(n - 1, -1, -1, device=scores.device)  # int64: lower index, larger key
    return torch.add(reverse_index, ordered, alpha=n)


def top_indices(keys: torch.Tensor, k: int) -> torch.Tensor:
    """[M, N] keys from ``rank_keys`` -> [M, k] int64 indices of the k largest, best first."""
    return keys.topk(k, dim=-1).indices
