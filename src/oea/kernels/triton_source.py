"""The Triton kernels of ``oea.kernels.triton_gpu`` (imported on first use only: this module imports Triton).

``phase1`` and ``phase2`` are the two launches; ``scores``, ``rank_key`` and ``take_best`` are device
functions they share. ``TRITON_INTERPRET=1`` at import makes them run in Triton's CPU interpreter.
"""

# Device functions return tuples that some callers use only in part.
# ruff: noqa: RUF059

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
KEY_MIN = tl.constexpr(-(2**63))
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
EPS = tl.constexpr(9.999999682655225e-21)  # the core's renormalising 1e-20, as float32


RUNTIME = ["k0", "topk_group", "cross", "has_bias", "pruned", "max_experts", "max_rank", "min_batch", "renorm",
           "renorm_rerouted", "M", "tiles"]  # plain values: one compiled kernel serves every setting of these


@triton.jit
def scores(x_ptr, bias_ptr, rows, cols, row_ok, col_ok, topk_group, cross, has_bias, N: tl.constexpr,
           SIGMOID: tl.constexpr, N_GROUP: tl.constexpr, GP: tl.constexpr):
    """(sel, fil, src) [BM, BN] float32: the core's select / fill scores and the weight source."""
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    neg_inf = float("-inf")
    if SIGMOID:
        src = tl.where(x != x, 0.0, x)
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)  # without a bias: any N floats, not used
        biased = src + tl.where(has_bias != 0, bias, 0.0)[None, :]
    else:
        src = tl.where(x != x, neg_inf, tl.where(x > FLOAT32_MAX, FLOAT32_MAX, x))
        biased = src
    biased = tl.where(col_ok[None, :], biased, neg_inf)
    sel = biased
    if N_GROUP > 1:
        size = N // N_GROUP
        gcols = tl.arange(0, GP)
        gscore = tl.full((biased.shape[0], GP), neg_inf, tl.float32)
        for g in tl.static_range(N_GROUP):  # group score: the sum of its two best biased scores
            inside = (cols // size == g) & col_ok
            vals = tl.where(inside[None, :], biased, neg_inf)
            first = tl.max(vals, axis=1)
            at = tl.min(tl.where(vals == first[:, None], cols[None, :], N), axis=1)
            second = tl.max(tl.where(cols[None, :] == at[:, None], neg_inf, vals), axis=1)
            gscore = tl.where(gcols[None, :] == g, (first + second)[:, None], gscore)
        allowed = tl.zeros(biased.shape, tl.int1)
        for j in tl.static_range(N_GROUP):  # the best topk_group groups, ties to the lower group
            best = tl.max(gscore, axis=1)
            gi = tl.min(tl.where(gscore == best[:, None], gcols[None, :], GP), axis=1)
            gscore = tl.where(gcols[None, :] == gi[:, None], neg_inf, gscore)
            allowed = allowed | (((cols // size)[None, :] == gi[:, None]) & (j < topk_group))
        sel = tl.where(allowed, biased, neg_inf)
    fil = tl.where(cross != 0, biased, sel)
    return sel, fil, src


@triton.jit
def rank_key(s, cols, col_ok, N: tl.constexpr):
    """[BM, BN] float32 -> int64 keys ordered as (score desc, index asc); columns past N get KEY_MIN."""
    bits = s.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    ordered = tl.where(bits < 0, -magnitude, magnitude).to(tl.int64)
    key = ordered * N + (N - 1 - cols).to(tl.int64)[None, :]
    return tl.where(col_ok[None, :], key, KEY_MIN)


@triton.jit
def take_best(key, cols, BN: tl.constexpr):
    """(index of each row's largest key, the key, the keys with it removed)."""
    best = tl.max(key, axis=1)
    at = tl.min(tl.where(key == best[:, None], cols[None, :], BN), axis=1)
    return at, best, tl.where(cols[None, :] == at[:, None], KEY_MIN, key)


@triton.jit
def tile_of(M, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """This program's tile: (its index, its BM row numbers, the BN column numbers, rows < M, columns < N)."""
    tile = tl.program_id(0)
    rows = tile * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    return tile, rows, cols, rows < M, cols < N


@triton.jit
def valid_rows(valid_ptr, rows, row_ok, HAS_VALID: tl.constexpr):
    """[BM] the real rows of the tile: inside the batch and, with a ``valid`` mask, marked in it."""
    valid = row_ok
    if HAS_VALID:
        valid = valid & (tl.load(valid_ptr + rows, mask=row_ok, other=0) != 0)
    return valid


@triton.jit(do_not_specialize=RUNTIME)
def phase1(x_ptr, bias_ptr, valid_ptr, vanilla_ptr, union_ptr, count_ptr, M, k0, topk_group, cross, has_bias,
           N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
           SIGMOID: tl.constexpr, N_GROUP: tl.constexpr, GP: tl.constexpr, HAS_VALID: tl.constexpr):
    """Per tile: vanilla top-k ids (scratch), the valid rows' top-k0 as the tile's union row, its valid count."""
    tile, rows, cols, row_ok, col_ok = tile_of(M, N, BM, BN)
    sel, fil, src = scores(x_ptr, bias_ptr, rows, cols, row_ok, col_ok, topk_group, cross, has_bias, N, SIGMOID,
                           N_GROUP, GP)
    key = rank_key(sel, cols, col_ok, N)
    slots = tl.arange(0, KP)
    vanilla = tl.zeros((BM, KP), tl.int32)
    is_base = tl.zeros((BM, BN), tl.int1)
    for j in tl.static_range(K):
        at, best, key = take_best(key, cols, BN)
        vanilla = tl.where(slots[None, :] == j, at[:, None], vanilla)
        is_base = is_base | ((cols[None, :] == at[:, None]) & (j < k0))
    tl.store(vanilla_ptr + rows[:, None] * KP + slots[None, :], vanilla, mask=row_ok[:, None])
    valid = valid_rows(valid_ptr, rows, row_ok, HAS_VALID)
    member = tl.max(tl.where(valid[:, None] & is_base, 1, 0), axis=0).to(tl.int8)
    tl.store(union_ptr + tile * BN + cols, member)
    tl.store(count_ptr + tile, tl.sum(valid.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=RUNTIME)
def phase2(x_ptr, bias_ptr, valid_ptr, vanilla_ptr, union_ptr, count_ptr, ids_ptr, w_ptr, M, tiles, scaling, k0,
           topk_group, cross, has_bias, pruned, max_experts, max_rank, min_batch, renorm, renorm_rerouted,
           N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
           SIGMOID: tl.constexpr, N_GROUP: tl.constexpr, GP: tl.constexpr, HAS_VALID: tl.constexpr):
    """Per tile: the union and valid count of every tile, each row's fill, ids and weights."""
    tile, rows, cols, row_ok, col_ok = tile_of(M, N, BM, BN)
    slots = tl.arange(0, KP)
    n_valid = tl.full((), 0, tl.int32)  # a typed loop-carried scalar
    union = tl.zeros((BN,), tl.int8)
    for t in range(tiles):
        n_valid += tl.load(count_ptr + t)
        union = tl.maximum(union, tl.load(union_ptr + t * BN + cols))
    valid = valid_rows(valid_ptr, rows, row_ok, HAS_VALID)
    rerouted = valid & (n_valid >= min_batch) & (k0 > 0)
    sel, fil, src = scores(x_ptr, bias_ptr, rows, cols, row_ok, col_ok, topk_group, cross, has_bias, N, SIGMOID,
                           N_GROUP, GP)
    ids = tl.load(vanilla_ptr + rows[:, None] * KP + slots[None, :], mask=row_ok[:, None], other=0)
    is_base = tl.zeros((BM, BN), tl.int1)
    for j in tl.static_range(K):
        at = tl.sum(tl.where(slots[None, :] == j, ids, 0), axis=1)
        is_base = is_base | ((cols[None, :] == at[:, None]) & (j < k0))
    fill_key = rank_key(fil, cols, col_ok, N)
    candidate = (union[None, :] != 0) & (fil > float("-inf")) & ~is_base & col_ok[None, :]
    if max_rank < N:  # within the row's top max_rank by fill: the max_rank-th key is the threshold
        remaining = fill_key
        threshold = tl.max(remaining, axis=1)
        for _ in range(max_rank):
            at, threshold, remaining = take_best(remaining, cols, BN)
        candidate = candidate & (fill_key >= threshold[:, None])
    cand_key = tl.where(candidate, fill_key, KEY_MIN)
    count = tl.zeros((BM,), tl.int32)
    for j in tl.static_range(K):  # slots k0, k0 + 1, ...: the best candidates in fill order
        at, best, cand_key = take_best(cand_key, cols, BN)
        active = rerouted & (pruned == 0) & (j < K - k0)
        ids = tl.where((slots[None, :] == k0 + j) & active[:, None], at[:, None], ids)
        count += (active & (best != KEY_MIN)).to(tl.int32)
    used = tl.where(rerouted, tl.where(pruned != 0, k0, tl.minimum(k0 + count, max_experts)), K)
    first = tl.sum(tl.where(slots[None, :] == 0, ids, 0), axis=1)
    ids = tl.where(slots[None, :] < used[:, None], ids, first[:, None])
    # weights: the family's weight at each used slot, in float64
    kept = slots[None, :] < used[:, None]
    raw = tl.zeros((BM, KP), tl.float64)
    if SIGMOID:
        for j in tl.static_range(K):
            at = tl.sum(tl.where(slots[None, :] == j, ids, 0), axis=1)
            value = tl.sum(tl.where(cols[None, :] == at[:, None], src, 0.0), axis=1)
            raw = tl.where(slots[None, :] == j, value.to(tl.float64)[:, None], raw)
    else:
        top = tl.max(sel, axis=1)
        finite = top > float("-inf")
        for j in tl.static_range(K):
            at = tl.sum(tl.where(slots[None, :] == j, ids, 0), axis=1)
            value = tl.sum(tl.where(cols[None, :] == at[:, None], sel, 0.0), axis=1)
            e = tl.exp((value - tl.where(finite, top, 0.0)).to(tl.float64))
            raw = tl.where(slots[None, :] == j, tl.where(finite, e, 0.0)[:, None], raw)
    raw = tl.where(kept, raw, 0.0)
    total = tl.sum(raw, axis=1)
    renormalise = tl.where(rerouted, renorm_rerouted != 0, renorm != 0)
    if SIGMOID:
        normalised = raw / (total + EPS)[:, None]
    else:
        normalised = raw / tl.where(total > 0.0, total, 1.0)[:, None]
        safe_top = tl.where(finite, top, 0.0)
        z = tl.sum(tl.where(col_ok[None, :], tl.exp((sel - safe_top[:, None]).to(tl.float64)), 0.0), axis=1)
        raw = raw / tl.where(finite, z, 1.0)[:, None]
    weights = tl.where(renormalise[:, None], normalised, raw) * scaling
    out = rows[:, None] * K + slots[None, :]
    mask = row_ok[:, None] & (slots[None, :] < K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=mask)
    tl.store(w_ptr + out, weights.to(tl.float32), mask=mask)
