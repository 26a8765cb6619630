"""The generated mutants of ``oea/integrations/sglang/metrics.py`` and ``routing.py`` that only a second device
tells apart (docs/testing.md, "Generated mutants"), killed on the CPU with two stand-ins for an accelerator:

* ``torch.device("meta")``: tensors with a device, shape and dtype but no values. A tensor made on the CPU for
  them makes the op that mixes them raise, as on CUDA, and so does any host synchronisation (``int()``,
  ``.item()``): what a graph-safe path must never do;
* PyTorch's lazy-tensor TorchScript backend (``torch._lazy.ts_backend``, device ``lazy``): tensors with values,
  computed on the CPU, that refuse to mix with CPU tensors (``Input tensor is not a lazy tensor``) and can be read
  on the host, as CUDA ones can: it stands in where the code reads values on the host (an ``ExpertPlacement``
  checks its own, the metrics count rows). Skipped where a PyTorch build lacks it.

What is checked:

* ``rewrite_topk`` (graph-safe): the padding mask of a call with ``num_token_non_padded`` is made on the logits'
  device, so meta logits give meta ids and weights;
* ``_rewrite``: an eager rewrite of logits that are not on the CPU is counted (only the calls Dynamo traces are
  not);
* ``_route`` under ``OEA_POLICY=ep``: the layer's placement is kept on the logits' device (what captured graphs
  read without a host copy), the call rewritten there as on the CPU;
* ``metrics.layer_routed``: the padding mask is made on the ids' device: a padded call on the lazy device is
  counted over its real rows, and so is a CPU one while the process's default device is another one
  (``with torch.device("meta")``; a mask made without naming the ids' device lands on the default device, which is
  the CPU while SGLang's ids are on CUDA).
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

import pytest
import torch
from sglang_stand_ins import FakeMode, fresh_state, topk_config, topk_module
from test_ep_layer_file_adapters import _location_module

import oea
import oea.integrations.sglang.metrics as sglang_metrics
import oea.integrations.sglang.routing as plugin_routing
from oea.config import settings_from_env
from oea.integrations import sglang as plugin
from oea.integrations.metrics import StepRecord, routed_hash
from oea.integrations.sglang.state import PHASE, STATE
from oea.routing import active_experts

torch.set_num_threads(1)
META, CPU = torch.device("meta"), torch.device("cpu")
N, K = 64, 8
LOGGER = "oea.integrations.sglang"


@functools.cache
def _lazy_backend() -> str | None:
    """Start PyTorch's lazy TorchScript backend once per process (None), or why it cannot run here."""
    try:
        torch.zeros(1, device="lazy")
        return None  # already started (by an earlier test of this process, or before a fork)
    except Exception:  # the backend is not started yet
        pass
    try:
        import torch._lazy.ts_backend as ts_backend

        ts_backend.init()
        torch.zeros(1, device="lazy")
    except Exception as err:  # a build without it
        return f"no lazy TorchScript backend in this PyTorch ({type(err).__name__}: {err})"
    return None


@pytest.fixture
def lazy() -> torch.device:
    """The lazy device: an accelerator stand-in whose tensors hold values."""
    why = _lazy_backend()
    if why is not None:
        pytest.skip(why)
    return torch.device("lazy", 0)


@pytest.fixture(autouse=True)
def topk(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    fresh_state(monkeypatch)
    monkeypatch.setattr(PHASE, "dynamic_bias", False)
    STATE.phase_hook_seen = True
    return topk_module(monkeypatch)


def _call(rows: int = 6, non_padded: Any = None, device: torch.device | None = None,
          layer_id: int = 0) -> dict[str, Any]:
    """``_post_process_topk_ids``' keyword arguments: SGLang's top-8 of ``rows`` rows of 64 experts on ``device``."""
    logits = torch.randn(rows, N, generator=torch.Generator().manual_seed(5)) * 2.0
    ids, weights = oea.route(logits, oea.RouterSpec(N, K))
    call = dict(topk_ids=ids.to(torch.int32), topk_weights=weights, topk_config=topk_config(), router_logits=logits,
                layer_id=layer_id, num_token_non_padded=non_padded, expert_location_dispatch_info=None)
    if device is not None:
        call.update({name: call[name].to(device) for name in ("topk_ids", "topk_weights", "router_logits")})
    return call


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# == routing.py: rewrite_topk ======================================================================================

@pytest.mark.parametrize("non_padded", [4, "tensor"], ids=["int", "device-count"])
def test_rewrite_topk_of_padded_logits_on_another_device_stays_there(non_padded: Any) -> None:
    """Meta logits (an accelerator's) with 4 of 6 rows real, as SGLang's count or OEA's persistent 0-dim count on
    that device: the padding mask is made where the logits are, and the call (graph-safe) returns ids and weights
    there in SGLang's dtypes and shapes, without raising. (A mask made on the CPU: ``Tensor on device cpu is not on
    the expected device meta``.)"""
    count = torch.tensor(4, dtype=torch.int32, device=META) if non_padded == "tensor" else non_padded
    call = _call(device=META)
    spec, cfg = oea.RouterSpec(N, K), oea.OEAConfig(2, min_batch=2)
    result = plugin.rewrite_topk(call["topk_ids"], call["topk_weights"], call["router_logits"], spec, cfg, count)
    assert result is not None
    ids, weights = result
    assert (ids.device, ids.dtype, ids.shape) == (META, torch.int32, torch.Size([6, K]))
    assert (weights.device, weights.dtype, weights.shape) == (META, torch.float32, torch.Size([6, K]))


def test_rewrite_topk_of_padded_logits_on_another_device_equals_the_cpus(lazy: torch.device) -> None:
    """The same on the lazy device (values): OEA over the 4 real rows there equals the CPU's, the 2 padding rows
    keep SGLang's ids."""
    spec, cfg = oea.RouterSpec(N, K), oea.OEAConfig(2, min_batch=2)
    host, device = _call(), _call(device=lazy)
    want = plugin.rewrite_topk(host["topk_ids"], host["topk_weights"], host["router_logits"], spec, cfg, 4)
    got = plugin.rewrite_topk(device["topk_ids"], device["topk_weights"], device["router_logits"], spec, cfg,
                              torch.tensor(4, device=lazy))
    assert want is not None and got is not None
    assert got[0].device == lazy and torch.equal(got[0].cpu(), want[0])
    assert torch.allclose(got[1].cpu(), want[1], atol=1e-6)
    assert torch.equal(want[0][4:], host["topk_ids"][4:]) and not torch.equal(want[0][:4], host["topk_ids"][:4])


# == routing.py: _rewrite / _route =================================================================================

@pytest.mark.parametrize("non_padded", [None, 4], ids=["every-row-real", "padded"])
def test_an_eager_rewrite_on_another_device_is_counted(non_padded: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An eager DECODE call whose logits are on an accelerator (meta) is rewritten on that device and counted in
    ``rewrite_count`` (only the calls Dynamo traces are left uncounted, not every call off the CPU)."""
    STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_MIN_BATCH": "1"})
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        for step in (1, 2):
            changed, why = plugin_routing._rewrite((), _call(non_padded=non_padded, device=META))
            assert why is None and changed is not None
            assert changed[1]["topk_ids"].device == META and changed[1]["topk_weights"].device == META
            assert plugin.rewrite_count() == step
    assert STATE.routers[0].kernel is None and not STATE.routers[0].failed  # no host kernel for device logits
    assert _warnings(caplog) == []


def test_ep_placement_is_read_onto_the_logits_device(lazy: torch.device, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """``OEA_POLICY=ep`` with SGLang's EP layout (stand-in ``expert_location``: EP 4, expert e on rank e mod 4): a
    layer first met with logits on an accelerator (lazy) keeps its placement there, where captured graphs read it
    without a host copy; the call is rewritten on that device as the same call on the CPU is (whose layer keeps
    its placement on the CPU), counted, and neither layer fails."""
    _location_module(monkeypatch)
    STATE.settings = settings_from_env({"OEA_K0": "2", "OEA_MIN_BATCH": "1", "OEA_POLICY": "ep"})
    with caplog.at_level(logging.WARNING, logger=LOGGER), plugin.forward_mode(FakeMode.DECODE):
        on_device, why = plugin_routing._rewrite((), _call(device=lazy, layer_id=1))
        on_host, host_why = plugin_routing._rewrite((), _call(layer_id=2))
    assert why is None and on_device is not None and host_why is None and on_host is not None
    assert on_device[1]["topk_ids"].device == lazy
    assert torch.equal(on_device[1]["topk_ids"].cpu(), on_host[1]["topk_ids"])
    for layer, device in ((1, lazy), (2, CPU)):
        state = STATE.routers[layer]
        assert state.ep is not None and not state.failed
        placement = state.ep.placement
        assert placement.device_of_expert.device == device and placement.num_devices == 4
        assert torch.equal(placement.device_of_expert.cpu(), torch.arange(N) % 4)
    assert plugin.rewrite_count() == 2
    assert not [w for w in _warnings(caplog) if "passing through" in w or "plain OEA" in w]


# == metrics.py: layer_routed ======================================================================================

def _count(monkeypatch: pytest.MonkeyPatch, call: dict[str, Any], default: torch.device | None = None) -> StepRecord:
    """``layer_routed`` of one call SGLang kept, in an open decode forward with ``OEA_K0`` set (so ``active_stock``
    is counted too), with ``default`` as the process's default device; the forward's record."""
    record = StepRecord(decode=True, oea=True)
    monkeypatch.setattr(sglang_metrics.METRICS, "record", record)
    monkeypatch.setattr(sglang_metrics.METRICS, "oea", True)
    monkeypatch.setattr(sglang_metrics.METRICS, "timing", False)
    if default is None:
        sglang_metrics.layer_routed(call, None, 0.0)
    else:
        with torch.device(default):
            assert torch.empty(1).device == default
            sglang_metrics.layer_routed(call, None, 0.0)
    return record


def _assert_real_rows_counted(record: StepRecord, call: dict[str, Any]) -> None:
    """3 real rows of 5: their row count, hash and distinct experts, 2 padding rows."""
    ids, weights = call["topk_ids"].cpu(), call["topk_weights"].cpu()
    real = torch.arange(5) < 3
    assert (record.rows, record.padding_rows) == (3, 2)
    assert record.routed[0] == routed_hash(ids, weights, real) != routed_hash(ids, weights, None)
    assert int(record.active[0]) == int(record.active_stock[0]) == int(active_experts(ids, weights, real))
    assert int(record.active[0]) != int(active_experts(ids, weights, None))  # the padding rows would change it


@pytest.mark.parametrize("non_padded", ["tensor", 3], ids=["device-count", "int"])
def test_a_padded_call_on_another_device_is_counted_over_its_real_rows(
        non_padded: Any, lazy: torch.device, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """5 rows on an accelerator (lazy) of which SGLang says 3 are real (its count on that device, or an int): the
    padding mask is made there, and the row holds the 3 real rows' count, hash and distinct experts, with 2 padding
    rows, and no warning. (A mask made on the CPU: the call is not counted, one warning.)"""
    count = torch.tensor(3, device=lazy) if non_padded == "tensor" else non_padded
    call = _call(rows=5, non_padded=count, device=lazy)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        record = _count(monkeypatch, call)
    assert _warnings(caplog) == []
    _assert_real_rows_counted(record, call)


@pytest.mark.parametrize("non_padded", [torch.tensor(3), 3], ids=["tensor", "int"])
def test_a_padded_call_is_counted_whatever_the_default_device(non_padded: Any, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """5 CPU rows of which SGLang says 3 are real, counted while the process's default device is another one (meta):
    the padding mask follows the ids, so the row is that of the 3 real rows, and no warning."""
    call = _call(rows=5, non_padded=non_padded)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        record = _count(monkeypatch, call, default=META)
    assert _warnings(caplog) == []
    _assert_real_rows_counted(record, call)
