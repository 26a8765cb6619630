"""``oea.kernels``: the fast routing kernels against the routing core (``oea.route``).

The numba kernel runs here as plain Python (a stand-in ``numba`` whose ``njit`` returns the function);
the compiled kernel is checked the same way in .venv-vllm (tests/engines/test_vllm_plugin_hooks.py).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import oea.kernels.numba_cpu as numba_cpu
from oea.kernels import fast_softmax_oea, numba_available, numba_softmax_oea
from oea.routing import OEAConfig, RouterSpec, active_experts, route

torch.set_num_threads(1)
N, K = 64, 8


def _dense(ids: torch.Tensor, weights: torch.Tensor, num_experts: int = N) -> torch.Tensor:
    """[M, N] weight per expert (filler slots add 0)."""
    return torch.zeros(ids.shape[0], num_experts).scatter_add(1, ids.long(), weights.float())


def _tie_free_logits(rows: int, seed: int) -> torch.Tensor:
    """A random permutation per row: no ties, so the expert choice is unique."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(N, generator=gen) for _ in range(rows)]).float() / 8


@pytest.fixture
def python_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``numba`` whose ``njit`` returns the function itself: the kernels run as plain Python."""
    numba = types.ModuleType("numba")
    numba.njit = lambda *args, **kwargs: (lambda fn: fn)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "numba", numba)
    monkeypatch.setattr(numba_cpu, "_NUMBA", {})


# ---------------------------------------------------------------- fast_softmax_oea (PyTorch ops)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k0", [1, 3, 8])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_fast_path_matches_core_route(renormalize: bool, k0: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * 10 + k0)
    logits = torch.randn(rows, 64, generator=gen) * 2
    spec = RouterSpec(64, 8, "softmax", renormalize)
    ref_ids, ref_w = route(logits, spec, OEAConfig(k0=k0, min_batch=0))
    weights, ids = fast_softmax_oea(logits, 8, k0, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (rows, 8)
    torch.testing.assert_close(_dense(ids, weights), _dense(ref_ids, ref_w), atol=1e-6, rtol=1e-5)
    assert int(active_experts(ids.long(), weights)) == int(active_experts(ref_ids, ref_w))
    # Filler slots (weight 0) repeat one of the row's own used experts, never an extra one.
    used = _dense(ids, weights) > 0
    assert bool(used.gather(1, ids.long()).all())


def test_fast_path_with_padding_rows() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 64, generator=gen) * 3
    valid = torch.tensor([True, True, False, True, False, True])
    spec = RouterSpec(64, 8, "softmax", True)
    ref_ids, ref_w = route(logits, spec, OEAConfig(k0=2, min_batch=0), valid)
    weights, ids = fast_softmax_oea(logits, 8, 2, True, valid)
    torch.testing.assert_close(_dense(ids, weights), _dense(ref_ids, ref_w), atol=1e-6, rtol=1e-5)
    # Padding rows keep their stock top-8.
    stock = logits.topk(8).indices.sort(dim=1).values
    assert torch.equal(ids[~valid].long().sort(dim=1).values, stock[~valid])


def test_fast_path_bf16_logits() -> None:
    logits = (torch.randn(8, 64, generator=torch.Generator().manual_seed(2)) * 4).bfloat16()
    weights, ids = fast_softmax_oea(logits, 8, 3, True)
    ref_ids, ref_w = route(logits, RouterSpec(64, 8, "softmax", True), OEAConfig(k0=3, min_batch=0))
    torch.testing.assert_close(_dense(ids, weights), _dense(ref_ids, ref_w), atol=1e-2, rtol=1e-2)
    assert torch.allclose(weights.sum(dim=1), torch.ones(8), atol=1e-5)


# ---------------------------------------------------------------- numba_softmax_oea (compiled CPU kernel)

CASES = [  # (rows, padding rows, k0, renormalize, dtype)
    (6, [1, 4], 2, True, torch.float32),
    (9, [0, 3, 7, 8], 1, True, torch.float32),
    (8, [2, 3, 4, 5, 6], 3, False, torch.float32),
    (7, [0, 5, 6], 2, True, torch.bfloat16),
    (5, [], 8, False, torch.float32),
]


@pytest.mark.usefixtures("python_numba")
@pytest.mark.parametrize(("rows", "padding", "k0", "renormalize", "dtype"), CASES)
def test_numba_kernel_logic_with_several_padding_rows(rows: int, padding: list[int], k0: int, renormalize: bool,
                                                      dtype: torch.dtype) -> None:
    """The kernel's Python body (numba stand-in: njit = identity) against the routing core."""
    logits = (_tie_free_logits(rows, seed=rows * 10 + k0) - 4).to(dtype)
    valid = torch.ones(rows, dtype=torch.bool)
    valid[padding] = False
    out = numba_softmax_oea(logits, K, k0, renormalize, valid)
    assert out is not None
    weights, ids = out
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (rows, K)
    ref_ids, ref_w = route(logits, RouterSpec(N, K, "softmax", renormalize), OEAConfig(k0, min_batch=0), valid)
    torch.testing.assert_close(_dense(ids, weights), _dense(ref_ids, ref_w), atol=1e-6, rtol=1e-5)
    used = _dense(ids, weights) > 0
    assert bool(used.gather(1, ids.long()).all()), "filler slots must repeat one of the row's own experts"


@pytest.mark.usefixtures("python_numba")
def test_numba_kernel_declines_what_it_cannot_take() -> None:
    """A non-contiguous view is not handed to the kernel: None tells the caller to take the PyTorch path."""
    logits = _tie_free_logits(6, seed=3)
    assert numba_available()
    assert numba_softmax_oea(logits.t().contiguous().t(), K, 2, True) is None
    assert numba_softmax_oea(logits, K, 2, True) is not None


def test_without_numba_the_kernel_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.setattr(numba_cpu, "_NUMBA", {})
    assert not numba_available()
    assert numba_softmax_oea(_tie_free_logits(4, seed=0), K, 2, True) is None
