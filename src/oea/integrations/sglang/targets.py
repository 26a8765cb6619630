"""What of SGLang the plugin relies on: the supported versions, the entry point, the functions it hooks
and the parameters each hook reads (checked by ``oea doctor sglang``)."""

from __future__ import annotations

import importlib.util
import inspect
import pkgutil
import sys
from pathlib import Path

from oea.integrations.doctor.common import installed_version

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
MODEL_EXECUTOR = "sglang.srt.model_executor"
# Decode detection without a batch-carrying forward_context (0.5.12-0.5.22): the batch of every eager forward
# and graph replay, and the runner's capture_forward_mode while a graph is captured (capture runs outside
# ModelRunner.forward). One CUDA capture point per version, newest first, plus the CPU graph runner's.
MODEL_RUNNER_FORWARD_TARGET = f"{MODEL_EXECUTOR}.model_runner.ModelRunner.forward"
DECODE_GRAPH_CAPTURE_TARGET = (f"{MODEL_EXECUTOR}.runner.decode_cuda_graph_runner."
                               "DecodeCudaGraphRunner.capture_one_shape")  # 0.5.14-0.5.22
GRAPH_CAPTURE_TARGET = f"{MODEL_EXECUTOR}.cuda_graph_runner.CudaGraphRunner.capture_one_batch_size"  # 0.5.12-0.5.13
CPU_GRAPH_CAPTURE_TARGET = f"{MODEL_EXECUTOR}.cpu_graph_runner.CPUGraphRunner.capture_one_batch_size"

# Parameters each hook relies on (checked by ``oea doctor``; the hooks read them by keyword).
EXPECTED_PARAMETERS: dict[str, tuple[str, ...]] = {
    POST_PROCESS_TARGET: ("topk_ids", "topk_weights", "topk_config", "router_logits", "layer_id",
                          "num_token_non_padded"),
    SELECT_EXPERTS_TARGET: ("hidden_states", "router_logits", "topk_config", "num_token_non_padded"),
    FORWARD_CONTEXT_TARGET: ("ctx", "forward_batch"),
    MODEL_RUNNER_FORWARD_TARGET: ("self", "forward_batch"),
    DECODE_GRAPH_CAPTURE_TARGET: ("self", "size"),
    GRAPH_CAPTURE_TARGET: ("self", "bs"),
    CPU_GRAPH_CAPTURE_TARGET: ("self", "bs"),
}
# SGLang's deterministic inference (plugin.deterministic_setting): the server argument, and the variable SGLang's
# launcher sets from it before it spawns the schedulers (every release 0.5.12 - 0.5.23)
DETERMINISTIC_FLAG = "--enable-deterministic-inference"
DETERMINISTIC_VARIABLE = "SGLANG_ENABLE_DETERMINISTIC_INFERENCE"
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


def module_available(module: str) -> bool:
    """Whether ``module`` is imported or SGLang ships it, without importing it (nor its heavy parents)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    if not module.startswith(MODEL_EXECUTOR + "."):
        return module_exists(module)
    if not module_exists(MODEL_EXECUTOR):
        return False
    spec = importlib.util.find_spec(MODEL_EXECUTOR)
    parts = module[len(MODEL_EXECUTOR) + 1:].split(".")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        base = Path(root, *parts[:-1])
        if (base / f"{parts[-1]}.py").is_file() or (base / parts[-1] / "__init__.py").is_file():
            return True
    return False


def target_module(target: str) -> str:
    """The module of a ``module.Class.method`` target."""
    return target.rsplit(".", 2)[0]


def forward_context_takes_batch() -> bool:
    """Whether SGLang's ``forward_context`` receives the batch (``forward_context(ctx, *, forward_batch)``,
    0.5.23+), read from its signature. 0.5.13-0.5.22 ship ``forward_context(ctx)``: a hook there never sees
    a forward mode. False also when the module is missing (0.5.12) or cannot be imported."""
    if not module_available(FORWARD_CONTEXT_MODULE):
        return False
    try:
        parameters = inspect.signature(pkgutil.resolve_name(FORWARD_CONTEXT_TARGET)).parameters
    except Exception:  # an SGLang that cannot be imported here: the fallback's own checks report it
        return False
    return "forward_batch" in parameters


def graph_capture_targets() -> list[str]:
    """The graph-capture hook points this SGLang ships: its CUDA decode runner's and the CPU runner's."""
    cuda = [t for t in (DECODE_GRAPH_CAPTURE_TARGET, GRAPH_CAPTURE_TARGET) if module_available(target_module(t))]
    cpu = [CPU_GRAPH_CAPTURE_TARGET] if module_available(target_module(CPU_GRAPH_CAPTURE_TARGET)) else []
    return cuda[:1] + cpu


# The SGLang CUDA wheels whose source ``tests/engines/test_cuda_release_targets.py`` reads (with ``ast``, no
# import): the ends of each hook-point range the plugin handles, and the tested release.
CUDA_RELEASES = ("0.5.12", "0.5.13", "0.5.14", "0.5.22", "0.5.23")
# Read on objects SGLang hands the hooks (beyond the parameters above): attributes of the CUDA graph runner
# whose capture / replay preparation is hooked, of the forward batch, and of SGLang's expert location
# metadata (OEA_POLICY=ep); and what the rewrite relies on happening after it inside _post_process_topk_ids
# (the expert-location dispatch: logical -> physical ids).
GRAPH_RUNNER_READS = ("raw_num_token", "capture_forward_mode", "device")
FORWARD_BATCH_CLASS = f"{MODEL_EXECUTOR}.forward_batch_info.ForwardBatch"
FORWARD_BATCH_READS = ("forward_mode", "input_ids")
EXPERT_LOCATION_MODULE = "sglang.srt.eplb.expert_location"
EXPERT_LOCATION_READS = ("ExpertLocationMetadata.physical_to_logical_map_cpu",
                         "ExpertLocationMetadata.logical_to_rank_dispatch_physical_map",
                         "ExpertLocationMetadata.ep_size",
                         "ExpertLocationMetadata.num_local_physical_experts",
                         "ExpertLocationMetadata.num_logical_experts", "ExpertLocationMetadata.update")
EXPERT_LOCATION_FUNCTION = "get_global_expert_location_metadata"
# 0.5.12-0.5.13 dispatch through _biased_grouped_topk_postprocess, which calls topk_ids_logical_to_physical
POST_PROCESS_CALLS = ("topk_ids_logical_to_physical|_biased_grouped_topk_postprocess",)
