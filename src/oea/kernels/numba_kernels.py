"""The numba kernels of ``oea.kernels.numba_cpu`` (this module imports numba: import it only on first use).

They are module-level functions on purpose. numba keys a cached function by its code and, for a closure,
by the pickled contents of its cells; a kernel defined inside a factory closes over other dispatchers, whose
pickles differ from process to process, so every process missed the on-disk cache and compiled again
(50-110 s). Here the helpers are globals, frozen as constants at compile time, and a second process loads
the machine code ``cache=True`` wrote (``__pycache__`` beside this file, or ``NUMBA_CACHE_DIR``).
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numba.core.cgutils
import numba.extending
import numpy as np

f32 = np.float32
neg_inf = f32(-np.inf)
f32_max = f32(np.finfo(np.float32).max)
eps = float(f32(1e-20))  # the core's renormalising epsilon, as float32
jit = numba.njit(cache=True, nogil=True)  # module-level functions: numba's on-disk cache finds them again


@jit
def insert(s: Any, m: int, buf: Any, count: int, size: int, e: int) -> int:
    """Keep buf[:size] = the best entries of row m of s seen so far (entries arrive in index order,
    so an equal score never displaces an earlier, lower index)."""
    v = s[m, e]
    if count < size:
        j = count
        count += 1
    elif v > s[m, buf[size - 1]]:
        j = size - 1
    else:
        return count
    while j > 0 and s[m, buf[j - 1]] < v:
        buf[j] = buf[j - 1]
        j -= 1
    buf[j] = e
    return count


@jit
def family_scores(x: Any, bias: Any, p: Any, sel: Any, fil: Any) -> None:
    """sel / fil [M, N] float32: the core's ``RouterScores.select`` / ``fill``."""
    rows, n = x.shape
    sigmoid, n_group, topk_group, cross = p[8], p[9], p[10], p[11]
    size = n // n_group
    group_score = np.empty((1, n_group), np.float32)
    best = np.empty(max(topk_group, 1), np.int64)
    allowed = np.zeros(n_group, np.bool_)
    for m in range(rows):
        for e in range(n):
            v = x[m, e]
            if sigmoid:
                if v != v:  # sigmoid(NaN): the core's NaN -> -inf gives 0
                    v = f32(0.0)
                v = v + bias[e]
            elif v != v:
                v = neg_inf
            elif v > f32_max:
                v = f32_max
            sel[m, e] = v
            fil[m, e] = v
        if n_group == 1:
            continue
        for g in range(n_group):  # group score: the sum of its two best biased scores
            first = neg_inf
            second = neg_inf
            for e in range(g * size, (g + 1) * size):
                v = fil[m, e]
                if v > first:
                    second = first
                    first = v
                elif v > second:
                    second = v
            group_score[0, g] = first + second
        count = 0
        for g in range(n_group):
            count = insert(group_score, 0, best, count, topk_group, g)
        allowed[:] = False
        for j in range(topk_group):
            allowed[best[j]] = True
        for e in range(n):
            if not allowed[e // size]:
                sel[m, e] = neg_inf
                if not cross:
                    fil[m, e] = neg_inf


@jit
def row_weights(x: Any, sel: Any, m: int, top_id: int, ids: Any, used: int, p: Any, renorm: bool,
                scaling: float, w: Any, out_w: Any) -> None:
    """out_w[m, :used] from the family's weights at ids[:used] (w: float64 scratch [k]); the rest 0."""
    k = ids.shape[0]
    n = x.shape[1]
    total = 0.0
    if p[8]:  # sigmoid: the unbiased sigmoid (torch's float32), NaN -> 0
        for j in range(used):
            v = x[m, ids[j]]
            w[j] = 0.0 if v != v else float(v)
            total += w[j]
    else:  # softmax of the sanitised logits (sel holds them: softmax routers have no group limit)
        top = sel[m, top_id]  # the row's largest logit: its first vanilla expert
        for j in range(used):  # exp of the float32 difference, as torch computes it
            w[j] = 0.0 if top == neg_inf else math.exp(float(sel[m, ids[j]] - top))
            total += w[j]
        if not renorm and top != neg_inf:  # raw probabilities: divide by the whole row's sum
            z = 0.0
            for e in range(n):
                z += math.exp(float(sel[m, e] - top))
            for j in range(used):
                w[j] = w[j] / z
    for j in range(used):
        value = w[j]
        if renorm:
            value = value / (total + eps) if p[8] else (value / total if total > 0.0 else 0.0)
        out_w[m, j] = value * scaling
    for j in range(used, k):
        out_w[m, j] = 0.0


@jit
def route_scores(x: Any, bias: Any, valid: Any, p: Any, scaling: float, out_ids: Any, out_w: Any) -> None:
    rows, n = x.shape
    k, k0, pruned, max_experts, max_rank, min_batch = p[0], p[1], p[2], p[3], p[4], p[5]
    sel = np.empty((rows, n), np.float32)
    fil = np.empty((rows, n), np.float32)
    family_scores(x, bias, p, sel, fil)
    vanilla = np.empty((rows, k), np.int64)
    for m in range(rows):
        count = 0
        for e in range(n):
            count = insert(sel, m, vanilla[m], count, k, e)
    n_valid = 0
    for m in range(rows):
        if valid[m]:
            n_valid += 1
    reroute = k0 > 0 and n_valid >= min_batch
    union = np.zeros(n, np.bool_)
    if reroute and not pruned:
        for m in range(rows):
            if valid[m]:
                for j in range(k0):
                    union[vanilla[m, j]] = True
    members = np.empty(n, np.int64)
    size = 0
    for e in range(n):
        if union[e]:
            members[size] = e
            size += 1
    ids = np.empty(k, np.int64)
    extra = np.empty(max(k - k0, 1), np.int64)
    scratch = np.empty(k, np.float64)
    for m in range(rows):
        for j in range(k):
            ids[j] = vanilla[m, j]
        used = k
        rerouted = reroute and valid[m]
        if rerouted and pruned:
            used = k0
        elif rerouted and k > k0:
            threshold = -1
            if max_rank < n:  # the max_rank-th expert of the fill order (stable: ties to the lower index)
                threshold = np.argsort(-fil[m], kind="mergesort")[max_rank - 1]
            count = 0
            room = k - k0
            for t in range(size):
                e = members[t]
                v = fil[m, e]
                if v == neg_inf or (count == room and not v > fil[m, extra[room - 1]]):
                    continue  # (members come in index order: an equal score never displaces a lower index)
                if threshold >= 0:
                    limit = fil[m, threshold]
                    if v < limit or (v == limit and e > threshold):
                        continue
                own = False
                for j in range(k0):
                    own = own or vanilla[m, j] == e
                if not own:
                    count = insert(fil, m, extra, count, room, e)
            for j in range(count):
                ids[k0 + j] = extra[j]
            used = min(k0 + count, max_experts)
        elif rerouted:
            used = min(k0, max_experts)
        for j in range(used, k):
            ids[j] = ids[0]
        for j in range(k):
            out_ids[m, j] = ids[j]
        row_weights(x, sel, m, vanilla[m, 0], ids, used, p, bool(p[7]) if rerouted else bool(p[6]), scaling,
                    scratch, out_w)


@jit
def route_bf16(bits: Any, bias: Any, valid: Any, p: Any, scaling: float, out_ids: Any, out_w: Any) -> None:
    x = np.empty(bits.shape, np.float32)
    as_int = x.view(np.int32)
    for m in range(bits.shape[0]):
        for e in range(bits.shape[1]):
            as_int[m, e] = (np.int32(bits[m, e]) & 0xFFFF) << 16
    route_scores(x, bias, valid, p, scaling, out_ids, out_w)


@numba.extending.intrinsic
def _at(typingctx: Any, address: Any) -> Any:
    """An integer address (``torch.Tensor.data_ptr()``) as the void pointer ``numba.carray`` views."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], numba.core.cgutils.voidptr_t)

    return numba.types.voidptr(address), codegen


@jit
def any_row_repeats(ids: Any) -> bool:
    """Whether some row of ids [M, k] holds an id twice."""
    for m in range(ids.shape[0]):
        for j in range(1, ids.shape[1]):
            for i in range(j):
                if ids[m, i] == ids[m, j]:
                    return True
    return False


@jit
def route_at(x_at: int, bf16: bool, rows: int, n: int, bias: Any, valid: Any, p: Any, scaling: float, ids_at: int,
             ids64: bool, w_at: int) -> bool:
    """``route_bf16`` (``bf16``: the logits' bits as int16) or ``route_scores`` (float32 scores) over C-contiguous
    CPU tensors given by address (``NumbaRouter.route_new``: no numpy view of them made per call): [rows, n] in;
    [rows, k] ids (int64 when ``ids64``, else int32) and float32 weights out. Returns whether some row of the ids
    written holds an id twice (``any_row_repeats``: what the SGLang adapter's fillers rename)."""
    k = p[0]
    w = numba.carray(_at(w_at), (rows, k), np.float32)
    if ids64:
        ids = numba.carray(_at(ids_at), (rows, k), np.int64)
        return _route_into(x_at, bf16, rows, n, bias, valid, p, scaling, ids, w)
    ids32 = numba.carray(_at(ids_at), (rows, k), np.int32)
    return _route_into(x_at, bf16, rows, n, bias, valid, p, scaling, ids32, w)


@jit
def _route_into(x_at: int, bf16: bool, rows: int, n: int, bias: Any, valid: Any, p: Any, scaling: float, ids: Any,
                w: Any) -> bool:
    """``route_at``'s routing into ``ids`` (int64 or int32: one compiled version each) and ``w``."""
    if bf16:
        route_bf16(numba.carray(_at(x_at), (rows, n), np.int16), bias, valid, p, scaling, ids, w)
    else:
        route_scores(numba.carray(_at(x_at), (rows, n), np.float32), bias, valid, p, scaling, ids, w)
    return any_row_repeats(ids)
