"""Routing replay (``oea.integrations.replay``): the filler rule a trainer applies to the ids an engine returns
(``routed_experts``), and SGLang's capture taking OEA's ids while its native MoE runs distinct fillers
(``oea.integrations.sglang.fillers.capture_replay_ids``). Engine-free: SGLang's capturer module is a stand-in."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import oea.integrations.sglang.fillers as fillers
from oea.integrations.replay import ReplayIds, filler_slots, real_slots
from oea.integrations.sglang.fillers import capture_replay_ids, distinct_fillers
from oea.routing import OEAConfig, RouterSpec, route


def test_routed_experts_filler_slots_are_the_repeats_of_an_earlier_id_of_the_row() -> None:
    ids = torch.tensor([[[4, 9, 4, 4], [1, 2, 3, 0]], [[7, 7, 7, 7], [5, 6, 5, 6]]])  # [tokens, layers, k]
    assert filler_slots(ids).tolist() == [[[False, False, True, True], [False] * 4],
                                          [[False, True, True, True], [False, False, True, True]]]
    assert torch.equal(real_slots(ids), ~filler_slots(ids))
    as_vllm = np.array([[3, 255, 3]], dtype=np.uint8)  # vLLM returns uint8 ids for <= 256 experts
    assert filler_slots(as_vllm).tolist() == [[False, False, True]]


@pytest.mark.parametrize("seed", range(4))
def test_routed_experts_of_oea_routing_replay_exactly_the_experts_with_a_weight(seed: int) -> None:
    """The rule on ``oea.route``'s own output: the real slots by the ids alone are the slots with a weight."""
    spec = RouterSpec(num_experts=32, top_k=8, scoring="softmax", renormalize=True)
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed))
    ids, weights = route(logits, spec, OEAConfig(2, min_batch=1))  # a union of <= 6: every row has fillers
    assert bool(filler_slots(ids).any())
    assert torch.equal(real_slots(ids), weights != 0)


def test_routed_experts_replay_ids_swap_once_for_the_noted_tensor_only() -> None:
    replay = ReplayIds()
    kernel, oea_ids, other = torch.tensor([[1, 2]]), torch.tensor([[1, 1]]), torch.tensor([[1, 2]])
    replay.note(kernel, oea_ids)
    assert replay.swap(other) is other  # equal values, another tensor: not the routing call's
    assert replay.swap(kernel) is oea_ids
    assert replay.swap(kernel) is kernel  # once
    replay.note(kernel, kernel)
    assert replay.swap(kernel) is kernel


class _Capturer:
    """SGLang's capturer as ``_post_process_topk_ids`` calls it: ``capture(layer_id=..., topk_indices=...)``."""

    def __init__(self) -> None:
        self.captured: list[torch.Tensor] = []

    def capture(self, layer_id: int, topk_indices: torch.Tensor) -> None:
        self.captured.append(topk_indices.clone())


@pytest.fixture
def capturer(monkeypatch: pytest.MonkeyPatch) -> _Capturer:
    held = _Capturer()
    module = types.ModuleType(fillers.CAPTURER_MODULE)
    module.get_global_experts_capturer = lambda: held  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fillers.CAPTURER_MODULE, module)
    return held


def test_routed_experts_sglang_capture_gets_oea_fillers_while_the_kernel_gets_distinct_ones(capturer: _Capturer
                                                                                           ) -> None:
    spec = RouterSpec(num_experts=16, top_k=4, scoring="softmax", renormalize=True)
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    ids, weights = route(logits, spec, OEAConfig(1, min_batch=1))  # 2 rows x k0 = 1: a union of <= 2 experts
    kernel_ids, _ = distinct_fillers(ids, weights, 4, 16)
    capture_replay_ids(kernel_ids, ids)
    capturer.capture(layer_id=0, topk_indices=kernel_ids)  # what SGLang does with the rewritten ids
    capturer.capture(0, kernel_ids)  # a second capture of the same tensor is not swapped again
    assert torch.equal(capturer.captured[0], ids)
    assert torch.equal(filler_slots(capturer.captured[0]), weights == 0) and bool((weights == 0).any())
    assert torch.equal(capturer.captured[1], kernel_ids) and not bool(filler_slots(kernel_ids).any())


def test_routed_experts_without_sglang_capture_nothing_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType(fillers.CAPTURER_MODULE)
    module.get_global_experts_capturer = lambda: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fillers.CAPTURER_MODULE, module)
    kernel = torch.tensor([[1, 2]])
    capture_replay_ids(kernel, torch.tensor([[1, 1]]))
    assert fillers.REPLAY.swap(kernel) is kernel


def test_routed_experts_sglang_hook_rewrite_hands_its_fillers_to_the_capture(monkeypatch: pytest.MonkeyPatch,
                                                                             capturer: _Capturer) -> None:
    """Through the plugin's ``_post_process_topk_ids`` hook in a DECODE forward (SGLang stand-ins): the ids it hands
    on (the kernel's) have distinct fillers, and SGLang capturing those ids captures OEA's repeats instead."""
    from sglang_stand_ins import FakeMode, fresh_state, topk_config, topk_module

    import oea.integrations.sglang.routing as plugin_routing
    from oea.config import settings_from_env
    from oea.integrations import sglang as plugin
    from oea.integrations.sglang.state import STATE

    fresh_state(monkeypatch)
    topk_module(monkeypatch)
    STATE.settings = settings_from_env({"OEA_K0": "2"})
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))  # 2 rows x k0 = 2: a union of <= 4
    spec = plugin.router_spec_from_topk_config(topk_config(), 64)
    ids, weights = route(logits, spec)
    kwargs = dict(topk_ids=ids.to(torch.int32), topk_weights=weights, topk_config=topk_config(), router_logits=logits,
                  layer_id=5, num_token_non_padded=None, expert_location_dispatch_info=None)
    with plugin.forward_mode(FakeMode.DECODE):
        _, new = plugin_routing.post_process_before(**kwargs)
    kernel_ids = new["topk_ids"]
    assert not bool(filler_slots(kernel_ids).any())  # SGLang's native MoE gets distinct ids
    capturer.capture(layer_id=5, topk_indices=kernel_ids)  # what _post_process_topk_ids does next
    want_ids, want_weights = route(logits, spec, OEAConfig(2))
    assert torch.equal(capturer.captured[0].long(), want_ids) and capturer.captured[0].dtype == torch.int32
    assert torch.equal(real_slots(capturer.captured[0]), want_weights != 0)


def test_routed_experts_capture_lookup_compiles_without_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture swap runs inside torch.compile'd forwards (SGLang's compiled and graph-captured decode): it only
    looks the capturer's module up, so Dynamo traces it with no import, and an SGLang that never imported the
    module has no capturer to wrap."""
    monkeypatch.delitem(sys.modules, fillers.CAPTURER_MODULE, raising=False)
    kernel, replay = torch.tensor([[1, 2]]), torch.tensor([[1, 1]])

    @torch.compile(fullgraph=True, backend="eager")
    def rewrite(ids: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
        capture_replay_ids(ids, repeats)
        return ids + 0

    torch._dynamo.reset()
    assert torch.equal(rewrite(kernel, replay), kernel)
    assert fillers.CAPTURER_MODULE not in sys.modules


def test_routed_experts_filler_mask_made_while_compiling_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mask made inside a compiled region stays out of the cache an eager call reads later."""
    monkeypatch.setattr(fillers, "_EARLIER", {})

    @torch.compile(fullgraph=True, backend="eager")
    def mask(x: torch.Tensor) -> torch.Tensor:
        return fillers._earlier(3, x.device) & x

    torch._dynamo.reset()
    assert torch.equal(mask(torch.ones(3, 3, dtype=torch.bool)), torch.ones(3, 3, dtype=torch.bool).tril(-1))
    assert fillers._EARLIER == {}
    assert torch.equal(fillers._earlier(3, torch.device("cpu")), torch.ones(3, 3, dtype=torch.bool).tril(-1))
    assert list(fillers._EARLIER) == [(3, "cpu")]
