"""The SGLang adapter's eager CPU call: the layer's numba kernel writes new tensors by address
(``NumbaRouter.route_new``) and says whether a row of its ids holds an id twice; where every row is real and
SGLang's output has exactly OEA's shape and dtypes, neither the splice nor the host fillers run for a call without
such a row. Every call gives the ids and weights of the general path (``oea.route``'s kernel through the splice,
then ``distinct_fillers``), padding rows and appended shared columns SGLang's."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
import torch
from sglang_stand_ins import FakeMode, topk_config, topk_module

import oea
import oea.integrations.sglang.routing as plugin_routing
from oea.config import settings_from_env
from oea.integrations import sglang as plugin
from oea.integrations.sglang.fillers import distinct_fillers
from oea.integrations.sglang.state import STATE
from oea.kernels import NumbaRouter, numba_available, plan
from oea.routing import RouterSpec

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed")

SOFTMAX = RouterSpec(num_experts=64, top_k=8, scoring="softmax", renormalize=True)
SIGMOID = RouterSpec(num_experts=64, top_k=6, scoring="sigmoid", renormalize=True,
                     correction_bias=torch.linspace(-0.5, 0.5, 64), n_group=8, topk_group=3,
                     routed_scaling_factor=2.5)


def _repeats(ids: torch.Tensor) -> bool:
    """The literal rule: some row holds an id twice."""
    return any(len(set(row)) < len(row) for row in ids.tolist())


def _kernel(spec: RouterSpec, logits: torch.Tensor, cfg: Any) -> NumbaRouter:
    impl, params = plan(logits, spec, cfg)
    assert impl == "numba" and params is not None
    return NumbaRouter(params, spec.correction_bias, spec.num_experts)


@pytest.mark.parametrize("spec", [SOFTMAX, SIGMOID], ids=["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("rows", "k0", "real"), [(16, 3, None), (2, 1, None), (8, 2, 5), (3, 1, 1)])
def test_route_new_writes_a_kernel_calls_ids_and_weights_and_finds_the_rows_that_repeat(
    spec: RouterSpec, dtype: torch.dtype, id_dtype: torch.dtype, rows: int, k0: int, real: int | None
) -> None:
    gen = torch.Generator().manual_seed(rows * 10 + k0)
    logits = (torch.randn(rows, 2 * spec.num_experts, generator=gen) * 2.0).to(dtype)[:, ::2]  # not contiguous
    cfg = oea.OEAConfig(k0, min_batch=2)
    kernel = _kernel(spec, logits, cfg)
    valid = None if real is None else torch.arange(rows) < real
    ids, weights = kernel(logits, valid, torch.empty((rows, spec.top_k), dtype=id_dtype))
    new_ids, new_weights, repeats = kernel.route_new(logits, valid, id_dtype)
    assert new_ids.dtype == id_dtype and new_weights.dtype == torch.float32
    assert torch.equal(new_ids, ids) and torch.equal(new_weights, weights)
    assert repeats == _repeats(ids)
    assert new_ids.is_contiguous() and new_weights.is_contiguous()


def test_route_new_finds_a_repeat_in_any_row_and_slot_and_handles_no_rows() -> None:
    logits = torch.randn(4, 64)
    kernel = _kernel(SOFTMAX, logits, oea.OEAConfig(8))  # k0 = k: every row its own distinct top-8
    assert kernel.route_new(logits)[2] is False
    empty_ids, empty_weights, repeats = kernel.route_new(logits[:0], None, torch.int32)
    assert empty_ids.shape == (0, 8) and empty_ids.dtype == torch.int32 and empty_weights.shape == (0, 8)
    assert repeats is False
    with pytest.raises(ValueError, match="int32 or int64"):
        kernel.route_new(logits, None, torch.int16)
    from oea.kernels.numba_kernels import any_row_repeats  # imports numba: only where it is installed

    for row in range(3):
        for i, j in ((0, 1), (0, 7), (6, 7), (2, 5)):
            ids = np.arange(24, dtype=np.int64).reshape(3, 8)
            ids[row, j] = ids[row, i]
            assert any_row_repeats(ids) and any_row_repeats(ids.astype(np.int32))
    assert not any_row_repeats(np.arange(24, dtype=np.int64).reshape(3, 8))


@pytest.fixture
def fake_topk_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    monkeypatch.setattr(STATE, "routers", {})
    monkeypatch.setattr(STATE, "warned", set())
    return topk_module(monkeypatch)


def _general(kwargs: dict[str, Any], spec: RouterSpec, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The general path: ``rewrite_topk`` without the layer's kernel (``route_fast``, the splice), then
    ``distinct_fillers``' graph-safe torch version."""
    ids, weights = plugin_routing.rewrite_topk(kwargs["topk_ids"], kwargs["topk_weights"], kwargs["router_logits"],
                                               spec, cfg, kwargs["num_token_non_padded"])
    return distinct_fillers(ids, weights, spec.top_k, spec.num_experts)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("rows", "k0", "real", "shared", "fast", "repeats"), [
    (16, 3, None, 0, True, False),  # the usual decode call: a union of at least k experts
    (2, 1, None, 0, True, True),  # a union of 2 < 8: each row repeats its fillers, renamed on the host
    (16, 3, 12, 0, False, False),  # padding rows: spliced (SGLang's), then checked on the host
    (16, 3, None, 1, False, False),  # an appended shared column: spliced
    (3, 1, 3, 0, False, True),  # SGLang's count of real rows given, all real: spliced, then renamed
])
def test_a_cpu_decode_call_skips_only_the_steps_that_would_change_nothing(
    fake_topk_module: types.ModuleType, monkeypatch: pytest.MonkeyPatch, id_dtype: torch.dtype, rows: int, k0: int,
    real: int | None, shared: int, fast: bool, repeats: bool
) -> None:
    STATE.settings = settings_from_env({"OEA_K0": str(k0), "OEA_MIN_BATCH": "1"})
    config = topk_config(top_k=8 + shared, num_shared_topk_slots=shared)
    spec = plugin.router_spec_from_topk_config(config, 64)
    gen = torch.Generator().manual_seed(rows + k0)
    logits = (torch.randn(rows, 64, generator=gen) * 2.0).bfloat16()
    ids, weights = oea.route(logits, spec)
    if shared:
        ids = torch.cat([ids, torch.full((rows, shared), 64)], dim=1)
        weights = torch.cat([weights, torch.ones(rows, shared)], dim=1)
    kwargs = dict(topk_ids=ids.to(id_dtype), topk_weights=weights, topk_config=config, router_logits=logits,
                  layer_id=3, num_token_non_padded=None if real is None else torch.tensor(real),
                  expert_location_dispatch_info=None)
    before = {name: kwargs[name].clone() for name in ("topk_ids", "topk_weights")}
    calls = {"splice": 0, "host fillers": 0}

    def counted(name: str, original: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            calls[name] += 1
            return original(*args, **kw)
        return wrapper

    monkeypatch.setattr(plugin_routing, "splice_routed_columns",
                        counted("splice", plugin_routing.splice_routed_columns))
    monkeypatch.setattr(plugin_routing, "distinct_fillers_on_host",
                        counted("host fillers", plugin_routing.distinct_fillers_on_host))
    with plugin.forward_mode(FakeMode.DECODE):
        for _ in range(2):  # the layer's first call prepares its kernel; the second is the usual one
            calls.update({"splice": 0, "host fillers": 0})
            _, new = plugin_routing.post_process_before(**kwargs)
    assert isinstance(STATE.routers[3].kernel, NumbaRouter)
    assert calls == {"splice": 0 if fast else 1, "host fillers": 0 if fast and not repeats else 1}
    monkeypatch.undo()
    expected_ids, expected_weights = _general(kwargs, spec, oea.OEAConfig(k0, min_batch=1))
    assert new["topk_ids"].dtype == id_dtype and new["topk_weights"].dtype == torch.float32
    assert torch.equal(new["topk_ids"], expected_ids) and torch.equal(new["topk_weights"], expected_weights)
    assert _repeats(oea.route(logits, spec, oea.OEAConfig(k0, min_batch=1))[0]) == repeats
    assert not _repeats(new["topk_ids"][:, :8]), "SGLang's native MoE gets distinct ids in every row"
    assert all(torch.equal(kwargs[name], before[name]) for name in before), "SGLang's tensors are not written"
    if real is not None:
        assert torch.equal(new["topk_ids"][real:], kwargs["topk_ids"][real:]), "padding rows keep SGLang's ids"
