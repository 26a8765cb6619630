"""``OEA_POLICY=ep`` through SGLang's real routing code and expert-location metadata (sglang 0.5.23, CPU).

Usage (from the repository root, in .venv-sglang; prints one JSON object)::

    .venv-sglang/bin/python tests/engines/sglang_cpu_placement.py

A GLM-5-like router (256 experts, top-8, sigmoid with correction bias, one group, routed scaling 2.5) at
TP = 8 with EP = 8: SGLang's own ``ExpertLocationMetadata`` (``_init_raw``, static dispatch for rank 0) with
three layers: the trivial layout plus 8 redundant slots (264 slots, 33 per rank), an EPLB-like permutation,
and a map that misses experts 9 and 13 (written into SGLang's CPU copy: SGLang cannot build one itself). The
plugin is loaded by SGLang's ``load_plugins()`` with ``OEA_K0=3 OEA_POLICY=ep``; SGLang's real
``select_experts`` is driven in DECODE and EXTEND. Then: a rebalance (``ExpertLocationMetadata.update``),
TP = 8 without EP (warned, plain OEA), and the bundled Qwen3 trace at EP = 8 (the pytest side compares its
busiest device with ``oea simulate``).
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

import torch
from sglang_check_support import (
    Checks,
    identical,
    in_mode,
    logged_warnings,
    publish_test_context,
    same,
    select,
    sglang_modules,
)

E, TOP_K, EP = 256, 8, 8  # GLM-5's routed experts and top-k; expert-parallel ranks


def _publish(ep_size: int) -> SimpleNamespace:
    import sglang.srt.eplb.expert_location as location

    sg = sglang_modules(tp_size=8, ep_size=ep_size, ep_dispatch_algorithm="static")
    sg.location = location
    return sg


def _metadata(sg: SimpleNamespace, slot_to_logical: torch.Tensor, num_logical: int, ep_size: int) -> Any:
    """SGLang's own metadata for [layers, slots] (``_init_raw``: static dispatch map of EP rank 0)."""
    everything = sg.location._compute_logical_to_all_physical_map(
        physical_to_logical_map=slot_to_logical, num_logical_experts=num_logical, ep_size=ep_size, moe_ep_rank=0)
    return sg.location.ExpertLocationMetadata._init_raw(ep_size=ep_size, physical_to_logical_map=slot_to_logical,
                                                        logical_to_all_physical_map=everything, moe_ep_rank=0)


def run() -> dict[str, Any]:
    import oea
    from oea.integrations.sglang import placement
    from oea.routing import EPOEAConfig, ExpertPlacement, max_device_active_experts

    warnings = logged_warnings()
    check = Checks()
    figures: dict[str, Any] = {}

    sg = _publish(EP)
    gen = torch.Generator().manual_seed(3)
    permutation = torch.randperm(E, generator=gen)  # layer 1: logical permutation[s] sits in slot s
    trivial = torch.cat([torch.arange(E), torch.arange(8)])
    permuted = torch.cat([permutation, permutation[:8]])
    holes = torch.cat([torch.tensor([0 if e in (9, 13) else e for e in range(E)]), torch.arange(8)])
    meta = _metadata(sg, torch.stack([trivial, permuted, trivial]), E, EP)
    meta.physical_to_logical_map_cpu[2] = holes  # a map SGLang itself cannot dispatch: experts 9 and 13 unplaced
    sg.location.set_global_expert_location_metadata(meta)
    # Written out by hand: slot s lives on rank s // 33; rank 0's static dispatch uses the replica on its own
    # device when it has one (experts 0..7 of the trivial layout), else the logical expert's only slot.
    slot_of = {int(e): s for s, e in enumerate(permutation.tolist())}
    expected = {0: [e // 33 for e in range(E)], 1: [slot_of[e] // 33 for e in range(E)]}

    bias = torch.rand(E, generator=gen) * 0.5
    config = sg.topk.TopKConfig(top_k=TOP_K, use_grouped_topk=True, num_expert_group=1, topk_group=1,
                                renormalize=True, correction_bias=bias, scoring_func="sigmoid",
                                routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=False)
    spec = oea.RouterSpec(E, TOP_K, "sigmoid", True, bias, 1, 1, 1.0)
    logits = torch.randn(16, E, generator=gen) * 2.0
    stock = select(sg, config, logits, 0)

    os.environ.update({"OEA_K0": "3", "OEA_POLICY": "ep"})
    sg.plugins.load_plugins()
    for layer_id, device in expected.items():
        with in_mode(sg, "DECODE"):
            routed = select(sg, config, logits, layer_id)
        cfg = EPOEAConfig(3, ExpertPlacement(torch.tensor(device), EP))
        check(f"decode_equals_ep_route:layer{layer_id}", *same(routed, oea.route(logits, spec, cfg)))
        got = placement.CONFIGS.configs[layer_id].placement.device_of_expert.tolist()
        check(f"placement_read:layer{layer_id}", got == device, placement.CONFIGS.details[layer_id])
        plain = oea.route(logits, spec, oea.OEAConfig(3))
        busiest = {"ep": int(max_device_active_experts(routed[0].long(), routed[1], cfg.placement)),
                   "plain": int(max_device_active_experts(plain[0], plain[1], cfg.placement)),
                   "T_ep": int(oea.active_experts(routed[0].long(), routed[1])),
                   "T_plain": int(oea.active_experts(*plain))}
        figures[f"glm5_layer{layer_id}"] = busiest
        check(f"busiest_not_raised:layer{layer_id}", busiest["ep"] <= busiest["plain"], str(busiest))
        with in_mode(sg, "EXTEND"):
            check(f"extend_untouched:layer{layer_id}", *identical(select(sg, config, logits, layer_id), stock))
    with in_mode(sg, "DECODE"):
        routed = select(sg, config, logits, 2)
    check("missing_experts_plain_oea", *same(routed, oea.route(logits, spec, oea.OEAConfig(3))))
    named = [w for w in warnings if "missing experts [9, 13]" in w and "layer 2 keeps plain OEA" in w]
    check("missing_experts_warned", len(named) == 1, named[0] if named else str(warnings[-3:]))

    # EPLB rebalances layer 0 to the permuted layout: the plugin rereads it into the same tensor.
    before = placement.CONFIGS.configs[0].placement.device_of_expert
    meta.update(_metadata(sg, torch.stack([permuted, permuted, trivial]), E, EP), update_layer_ids=[0])
    after = placement.CONFIGS.configs[0].placement.device_of_expert
    check("rebalance_refreshes_in_place", after is before and after.tolist() == expected[1], str(after[:8].tolist()))
    with in_mode(sg, "DECODE"):
        routed = select(sg, config, logits, 0)
    cfg = EPOEAConfig(3, ExpertPlacement(torch.tensor(expected[1]), EP))
    check("decode_after_rebalance", *same(routed, oea.route(logits, spec, cfg)))

    # TP = 8 without expert parallelism: EP-aware OEA asked for, plain OEA with one warning.
    sg.location.set_global_expert_location_metadata(_metadata(sg, trivial[:E].repeat(3, 1), E, 1), allow_overwrite=True)
    with in_mode(sg, "DECODE"):
        routed = select(sg, config, logits, 0)
    check("tp8_without_ep_plain_oea", *same(routed, oea.route(logits, spec, oea.OEAConfig(3))))
    check("tp8_without_ep_warned", any("without expert parallelism" in w for w in warnings), str(warnings[-2:]))

    # DP attention with an all-to-all MoE backend: each DP rank routes its own rows, so EP-aware OEA per rank
    # would fill the same idle EP ranks; plain OEA with one warning.
    publish_test_context(dp_rank=0, tp_size=8, ep_size=8, dp_size=2, enable_dp_attention=True,
                         moe_a2a_backend="deepep", ep_dispatch_algorithm="static")
    sg.location.set_global_expert_location_metadata(_metadata(sg, trivial.repeat(3, 1), E, EP), allow_overwrite=True)
    with in_mode(sg, "DECODE"):
        routed = select(sg, config, logits, 0)
    check("dp_attention_a2a_plain_oea", *same(routed, oea.route(logits, spec, oea.OEAConfig(3))))
    named = [w for w in warnings if "DP-attention ranks route their own rows (moe_a2a_backend=deepep)" in w]
    check("dp_attention_a2a_warned", len(named) == 1, named[0] if named else str(warnings[-2:]))
    _publish(EP)

    # The bundled Qwen3-30B-A3B trace at EP = 8 (128 experts, 16 per rank): per-batch busiest device.
    from oea.sim.simulate import make_batches, router_inputs
    from oea.traces import load_trace

    trace = load_trace("qwen3-30b-a3b")
    x, qspec, _ = router_inputs(trace, 0)
    sg.location.set_global_expert_location_metadata(_metadata(sg, torch.arange(128).repeat(1, 1), 128, EP),
                                                    allow_overwrite=True)
    qconfig = sg.topk.TopKConfig(top_k=8, renormalize=True, torch_native=True)
    busiest = []
    for batch in make_batches(trace, 16, "mixed", 24, torch.Generator().manual_seed(5)):
        with in_mode(sg, "DECODE"):
            ids, weights = select(sg, qconfig, x[batch], 0)
        busiest.append(int(max_device_active_experts(ids.long(), weights, placement.CONFIGS.configs[0].placement)))
    figures["qwen3_ep8_layer0"] = sum(busiest) / len(busiest)
    return {"checks": check.records, "figures": figures, "spec_k": qspec.top_k}


if __name__ == "__main__":
    print(json.dumps(run()))
