"""What of SGLang the plugin relies on: the supported versions, the entry point, the functions it hooks
and the parameters each hook reads (checked by ``oea doctor sglang``)."""

from __future__ import annotations

import importlib.util

from oea.integrations.doctor_common import installed_version

SUPPORTED_VERSIONS = "0.5.12 to 0.5.23 (plugin); older: python -m oea.launch.sglang"
TESTED_VERSION = "0.5.23"
PLUGIN_VERSION_MIN = (0, 5, 12)
ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_VALUE = "oea.integrations.sglang:register"

TOPK_MODULE = "sglang.srt.layers.moe.topk"
POST_PROCESS_TARGET = f"{TOPK_MODULE}._post_process_topk_ids"
SELECT_EXPERTS_TARGET = f"{TOPK_MODULE}.select_experts"
FORWARD_CONTEXT_MODULE = "sglang.srt.model_executor.forward_context"
FORWARD_CONTEXT_TARGET = f"{FORWARD_CONTEXT_MODULE}.forward_context"
MODEL_RUNNER_FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
GRAPH_CAPTURE_TARGET = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner.capture_one_batch_size"

# Parameters each hook relies on (checked by ``oea doctor``; the hooks read them by keyword).
EXPECTED_PARAMETERS: dict[str, tuple[str, ...]] = {
    POST_PROCESS_TARGET: ("topk_ids", "topk_weights", "topk_config", "router_logits", "layer_id",
                          "num_token_non_padded"),
    SELECT_EXPERTS_TARGET: ("hidden_states", "router_logits", "topk_config", "num_token_non_padded"),
    FORWARD_CONTEXT_TARGET: ("ctx", "forward_batch"),
    MODEL_RUNNER_FORWARD_TARGET: ("self", "forward_batch"),
    GRAPH_CAPTURE_TARGET: ("self",),
}
SIMULATION_VARIABLES = ("SGLANG_SIMULATE_UNIFORM_EXPERTS", "SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS")


def engine_version() -> str | None:
    """Installed SGLang version, or ``None`` when SGLang is not installed in this interpreter."""
    return installed_version("sglang")


def module_exists(name: str) -> bool:
    """Whether ``name`` can be imported (False also when a parent package is missing)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):
        return False
