"""``oea.kernels``: ``route_fast``'s dispatcher and the compiled numba kernel against the routing core.

Cases come from ``scripts/kernel_sweep.py``'s generator (families, sizes, padding, ties, bf16/fp16, NaN/±inf):
ids bit-equal to ``oea.route`` slot by slot, weights within the stated tolerance and zero where the core's
are. The 10,000-case sweep is the script itself (its figures are in docs/benchmarks.md).
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from property_cases import SWEEP, examples, seeded, with_boundaries

import oea
import oea.kernels.numba_cpu as numba_cpu
import oea.kernels.triton_gpu as triton_gpu
from oea.kernels import KernelUnavailableError, NumbaRouter, choose_impl, numba_route, plan, route_fast
from oea.routing import AdaptiveK0Config, BudgetConfig, EPOEAConfig, ExpertPlacement

torch.set_num_threads(1)


@with_boundaries()
@settings(max_examples=examples(150))
@given(st.integers(0, 2**31 - 1).map(seeded))
def test_numba_kernel_equals_route(case):
    logits, spec, cfg, valid = case.case
    assert choose_impl(logits, spec, cfg) == "numba"
    got = route_fast(logits, spec, cfg, valid, impl="numba")
    assert SWEEP.mismatch(got, oea.route(logits, spec, cfg, valid)) is None


def test_the_comparison_catches_what_it_must():
    """The sweep's rule fails on a swapped slot, a zero that is not one, and a weight off by 1e-5."""
    ids = torch.tensor([[3, 1, 3]])
    weights = torch.tensor([[0.6, 0.4, 0.0]])
    assert SWEEP.mismatch((ids, weights), (ids.clone(), weights.clone())) is None
    assert "ids differ" in SWEEP.mismatch((ids[:, [1, 0, 2]], weights), (ids, weights))
    assert "zero" in SWEEP.mismatch((ids, torch.tensor([[0.6, 0.4, 1e-30]])), (ids, weights))
    assert "beyond" in SWEEP.mismatch((ids, weights + torch.tensor([[1e-5, 0, 0]])), (ids, weights))


def test_ties_and_slot_order_on_a_hand_made_case():
    """Equal logits go to the lower index; the baseline comes first, then the fill in rank order."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0, 2.0], [3.0, 0.0, 0.0, 1.0, 2.0, 3.0]])
    spec = oea.RouterSpec(6, 3)
    ids, weights = route_fast(logits, spec, oea.OEAConfig(1, min_batch=0), impl="numba")
    assert ids.tolist() == [[1, 0, 1], [0, 1, 0]]  # union {0, 1}: row 0 -> 1 then 0; fillers repeat slot 0
    assert weights[:, 2].tolist() == [0.0, 0.0]
    want = oea.route(logits, spec, oea.OEAConfig(1, min_batch=0))
    assert SWEEP.mismatch((ids, weights), want) is None


def test_a_group_limit_on_a_softmax_router_is_ignored_as_the_core_ignores_it():
    spec = oea.RouterSpec(32, 4, "softmax", n_group=4, topk_group=2)
    logits = torch.randn(9, 32, generator=torch.Generator().manual_seed(5))
    for cfg in (None, oea.OEAConfig(2, group_fill="cross")):
        want = oea.route(logits, spec, cfg)
        assert SWEEP.mismatch(route_fast(logits, spec, cfg, impl="numba"), want) is None


def test_preallocated_int32_buffers():
    """Adapters pass their own [M, k] buffers (vLLM's CPU MoE takes int32 ids)."""
    logits = torch.randn(12, 64)
    valid = torch.arange(12) < 9
    spec = oea.RouterSpec(64, 8)
    _, params = plan(logits, spec, oea.OEAConfig(3))
    ids, weights = torch.empty(12, 8, dtype=torch.int32), torch.empty(12, 8)
    out = numba_route(logits, params, None, valid, ids, weights)
    assert out[0] is ids and out[1] is weights
    assert SWEEP.mismatch((ids.long(), weights), oea.route(logits, spec, oea.OEAConfig(3), valid)) is None


# ---------------------------------------------------------------- the dispatcher: fallbacks and errors


@pytest.mark.parametrize("cfg", [
    oea.OEAConfig(3, p=0.5),
    BudgetConfig(12),
    EPOEAConfig(3, ExpertPlacement.contiguous(64, 4)),
], ids=["oea-p<1", "budget", "ep-oea"])
def test_what_no_kernel_reproduces_falls_back_to_route(cfg, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel must not run for this config")

    monkeypatch.setattr(NumbaRouter, "__call__", refuse)
    logits = torch.randn(10, 64)
    spec = oea.RouterSpec(64, 8)
    assert choose_impl(logits, spec, cfg) == "torch"
    ids, weights = route_fast(logits, spec, cfg)
    want_ids, want_weights = oea.route(logits, spec, cfg)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    with pytest.raises(KernelUnavailableError, match=r"cannot reproduce oea\.route"):
        route_fast(logits, spec, cfg, impl="numba")


def test_a_bias_with_non_finite_values_falls_back():
    bias = torch.zeros(16)
    spec = oea.RouterSpec(16, 4, "sigmoid", correction_bias=bias)  # RouterSpec refuses a NaN bias it can read ...
    bias[3] = float("nan")  # ... but an engine's bias buffer may change in place after the spec was built
    logits = torch.randn(5, 16)
    assert choose_impl(logits, spec, oea.OEAConfig(2)) == "torch"
    assert choose_impl(logits, oea.RouterSpec(16, 4, "sigmoid", correction_bias=torch.zeros(16)),
                       oea.OEAConfig(2)) == "numba"


def test_without_numba_auto_falls_back_and_a_named_kernel_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.setattr(numba_cpu, "_NUMBA", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, spec = torch.randn(6, 32), oea.RouterSpec(32, 4)
    assert choose_impl(logits, spec, oea.OEAConfig(2)) == "torch"
    assert torch.equal(route_fast(logits, spec, oea.OEAConfig(2))[0], oea.route(logits, spec, oea.OEAConfig(2))[0])
    with pytest.raises(KernelUnavailableError, match="numba is not installed"):
        route_fast(logits, spec, oea.OEAConfig(2), impl="numba")


def test_triton_on_cpu_without_the_interpreter_or_without_triton(monkeypatch):
    logits, spec = torch.randn(6, 32), oea.RouterSpec(32, 4)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(KernelUnavailableError, match=r"CUDA tensors.*TRITON_INTERPRET=1"):
        route_fast(logits, spec, None, impl="triton")
    monkeypatch.setattr(triton_gpu, "_TRITON", {"available": False})
    with pytest.raises(KernelUnavailableError, match="Triton is not installed"):
        route_fast(logits, spec, None, impl="triton")


def test_bad_impl_and_bad_arguments_are_route_s_errors():
    logits, spec = torch.randn(6, 32), oea.RouterSpec(32, 4)
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'numba', 'triton', 'torch'\)"):
        route_fast(logits, spec, None, impl="cuda")
    for call in (lambda f: f(torch.randn(6, 31), spec), lambda f: f(logits, spec, oea.OEAConfig(5)),
                 lambda f: f(logits, spec, None, torch.ones(5, dtype=torch.bool))):
        with pytest.raises(ValueError) as fast_error:
            call(route_fast)
        with pytest.raises(ValueError) as core_error:
            call(oea.route)
        assert str(fast_error.value) == str(core_error.value)


def test_route_fast_is_exported_and_forced_torch_is_route():
    assert oea.route_fast is route_fast and "route_fast" in oea.__all__
    logits, spec = torch.randn(6, 32), oea.RouterSpec(32, 4)
    ids, weights = oea.route_fast(logits, spec, oea.OEAConfig(2), impl="torch")
    want = oea.route(logits, spec, oea.OEAConfig(2))
    assert torch.equal(ids, want[0]) and torch.equal(weights, want[1])


def test_adaptive_k0_with_one_spec_uses_each_batch_sizes_own_k0():
    """One ``RouterSpec`` object called again and again at batch sizes in different k0 ranges: every call
    routes with its own batch size's k0 (plans are cached per spec, never handed to another batch size).
    The reference is ``oea.route`` with the plain ``OEAConfig`` of that size's k0."""
    spec = oea.RouterSpec(64, 8)
    cfg = AdaptiveK0Config(((4, 8), (16, 1), (64, 4)), min_batch=0)
    gen = torch.Generator().manual_seed(11)
    for rows, k0 in ((3, 8), (12, 1), (40, 4), (3, 8), (12, 1), (4, 8), (16, 1), (17, 4), (12, 1)):
        logits = torch.randn(rows, 64, generator=gen) * 2
        assert choose_impl(logits, spec, cfg) == "numba"
        ids, weights = route_fast(logits, spec, cfg)
        want = oea.route(logits, spec, oea.OEAConfig(k0, min_batch=0))
        assert SWEEP.mismatch((ids, weights), want) is None, f"{rows} rows must route with k0={k0}"
