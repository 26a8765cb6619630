"""The conformance table through the SGLang plugin's real entry points (run in .venv-sglang): SGLang's own
``load_plugins()`` registers the hooks once; each scenario then runs the entry point ``register()`` with its
environment and routes SGLang's ``select_experts`` (its ``_post_process_topk_ids`` hook rewrites the routed
columns) inside SGLang's ``forward_context`` of a DECODE batch. Padding rows are SGLang's
``num_token_non_padded``.

Routed-experts capture (``--enable-return-routed-experts``): SGLang's own ``RoutedExpertsCapturer`` is the global
capturer, so ``_post_process_topk_ids`` captures each layer's ids as the server's would; its device buffer is set
up directly (``__init__`` also pins a host buffer with ``cudaHostRegister``, which fails without CUDA: the reason a
CPU server cannot return routed experts)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from conformance_child import WARNINGS, main, routed, set_env
from conformance_scenarios import LAYERS, TOP_K, Outcome, bias, logits

torch._dynamo.config.disable = True  # SGLang's grouped top-k helpers are compiled; Inductor costs ~20 s per shape

import sglang.srt.layers.moe.topk as topk  # noqa: E402
import sglang.srt.model_executor.forward_context as fc  # noqa: E402
import sglang.srt.plugins as plugins  # noqa: E402
import sglang.srt.state_capturer.routed_experts as routed_experts  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.state_capturer.base import BaseDeviceCache  # noqa: E402

import oea.integrations.sglang as plugin  # noqa: E402
from oea.integrations.sglang.state import STATE  # noqa: E402

reset_context()
publish(ServerArgs(model_path="dummy", device="cpu"), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
set_env({"OEA_K0": "2"})
plugins.load_plugins()  # SGLang's loader: the plugin registers its hooks with SGLang's HookRegistry
MAX_ROWS = 64
CAPTURER = routed_experts.RoutedExpertsCapturer.__new__(routed_experts.RoutedExpertsCapturer)
CAPTURER.num_fused_shared_experts = 0
CAPTURER.device_cache = BaseDeviceCache(MAX_ROWS, LAYERS, TOP_K, "cpu", "routed_experts")
routed_experts.set_global_experts_capturer(CAPTURER)


def _config(family: str) -> Any:
    if family == "sigmoid-grouped":
        return topk.TopKConfig(top_k=TOP_K, use_grouped_topk=True, num_expert_group=4, topk_group=2, renormalize=True,
                               correction_bias=bias(), scoring_func="sigmoid", routed_scaling_factor=2.5,
                               apply_routed_scaling_factor_on_output=True)
    return topk.TopKConfig(top_k=TOP_K, renormalize=family == "softmax-renorm", torch_native=True)


def run(scenario: dict[str, Any]) -> Outcome:
    STATE.settings = None
    STATE.warned.clear()
    try:
        plugin.register()
    except SystemExit as stop:
        return Outcome("error", str(stop))
    rows, padding = scenario["rows"], scenario["padding"]
    config = _config(scenario["family"])
    non_padded = torch.tensor(rows - padding, dtype=torch.int32) if padding else None
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, moe_num_token_non_padded=None)
    layers, rewrites = [], plugin.rewrite_count()
    captured = CAPTURER.device_cache.buffer
    captured.fill_(-1)
    with fc.forward_context(fc.ForwardContext(attn_backend=None), forward_batch=batch):
        for layer in range(LAYERS):
            out = topk.select_experts(hidden_states=torch.zeros(rows, 4), router_logits=logits(rows, layer),
                                      topk_config=config, layer_id=layer, num_token_non_padded=non_padded)
            state = STATE.routers.get(layer)
            spec = state.spec if state is not None else None
            layers.append(routed(out.topk_ids, out.topk_weights, spec, captured[:rows, layer].clone()))
    if plugin.rewrite_count() == rewrites and any("keeps the engine's own routing" in m for m in WARNINGS):
        return Outcome("stock", layers=layers)
    return Outcome("routed", layers=layers)


if __name__ == "__main__":
    main(run, ("oea.integrations.sglang",))
