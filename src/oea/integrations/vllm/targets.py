"""What of vLLM the plugin relies on: the router classes it wraps and every other vLLM name it patches, calls
or reads, with the parameters it expects. ``plugin.py`` wraps ``ROUTER_CLASSES``; ``TARGETS`` is checked
against the released CUDA wheel's source (``tests/engines/test_cuda_release_targets.py``, ``ast``, no import)
and ``tests/unit/test_cuda_release_declarations.py`` fails when a plugin module names a vLLM module or
function missing here."""

from __future__ import annotations

from oea.integrations.hook_targets import HookTarget

ROUTER_MODULE = "vllm.model_executor.layers.fused_moe.router"
# class name -> module (under ROUTER_MODULE) of the routers whose _compute_routing is wrapped.
ROUTER_CLASSES: dict[str, str] = {
    "CPURouter": "cpu_router",
    "FusedTopKRouter": "fused_topk_router",
    "FusedTopKBiasRouter": "fused_topk_bias_router",
    "GroupedTopKRouter": "grouped_topk_router",
}
# vLLM's batch-invariant mode, read as vLLM reads it (plugin.batch_invariant_setting: vllm.envs)
BATCH_INVARIANT_VARIABLE = "VLLM_BATCH_INVARIANT"
CUDA_RELEASE = "0.33.0"  # the CUDA `vllm` wheel whose source the targets are checked against
COMPUTE_ROUTING = ("self", "hidden_states", "router_logits", "indices_type")
# router attributes plugin.router_spec reads (class -> attributes; the rest it reads with a default)
ROUTER_READS: dict[str, tuple[str, ...]] = {
    "FusedTopKRouter": ("global_num_experts", "top_k", "renormalize", "scoring_func"),
    "FusedTopKBiasRouter": ("global_num_experts", "top_k", "renormalize", "scoring_func", "e_score_correction_bias",
                            "routed_scaling_factor", "eplb_state"),
    "GroupedTopKRouter": ("global_num_experts", "top_k", "renormalize", "scoring_func", "e_score_correction_bias",
                          "num_expert_group", "topk_group", "routed_scaling_factor", "eplb_state"),
}
_ROUTERS = f"{ROUTER_MODULE}.fused_moe_router"
_EXPERT_MAP = "vllm.model_executor.layers.fused_moe.expert_map_manager"

TARGETS: tuple[HookTarget, ...] = (
    *(HookTarget(f"{ROUTER_MODULE}.{module}", f"{name}._compute_routing", leading=COMPUTE_ROUTING,
                 parameters=("input_ids",), why="wrapped: OEA after vLLM's own routing")
      for name, module in ROUTER_CLASSES.items()),
    *(HookTarget(f"{ROUTER_MODULE}.{ROUTER_CLASSES[name]}", f"{name}.{attribute}", kind="attribute",
                 why="read by plugin.router_spec")
      for name, attributes in ROUTER_READS.items() for attribute in attributes),
    HookTarget(f"{ROUTER_MODULE}.base_router", "BaseRouter", kind="class", why="isinstance test at model load"),
    HookTarget(_ROUTERS, "FusedMoERouter.supports_monolithic_kernels",
               why="patched to False: monolithic kernels route inside themselves"),
    HookTarget("vllm.v1.worker.worker_base", "WorkerWrapperBase.execute_model", leading=("self", "scheduler_output"),
               why="wrapped: the decode flag per engine step"),
    HookTarget("vllm.v1.worker.gpu_worker", "Worker.load_model", leading=("self",),
               why="wrapped: routers numbered, decode flag allocated"),
    HookTarget("vllm.v1.worker.gpu_worker", "Worker.model_runner", kind="attribute", why="read after load_model"),
    HookTarget("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model", leading=("self",),
               why="the model whose routers are numbered"),
    # Model Runner V2 (vllm.v1.worker.gpu: the default on CUDA in 0.33 unless a feature it lacks is on)
    HookTarget("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.get_model", leading=("self",),
               why="the model whose routers are numbered (Model Runner V2)"),
    HookTarget("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.vllm_config", kind="attribute",
               why="recording: max_num_seqs (Model Runner V2)"),
    HookTarget("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.input_batch", kind="attribute",
               why="recording: rows of a step"),
    HookTarget("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.vllm_config", kind="attribute",
               why="recording: max_num_seqs"),
    *(HookTarget("vllm.v1.worker.gpu_input_batch", f"InputBatch.{attribute}", kind="attribute",
                 why="recording: request ids and positions")
      for attribute in ("req_ids", "num_reqs", "num_computed_tokens_cpu")),
    *(HookTarget("vllm.v1.core.sched.output", f"SchedulerOutput.{field}", kind="attribute",
                 why="decode detection (steps.is_decode_step)")
      for field in ("num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_spec_decode_tokens")),
    HookTarget("vllm.config.vllm", "VllmConfig.speculative_config", kind="attribute",
               why="speculative.read_speculation: speculation on or off"),
    *(HookTarget("vllm.config.speculative", f"SpeculativeConfig.{field}", kind="attribute",
                 why="speculative.read_speculation: draft tokens per request (recording buffer, load log)")
      for field in ("num_speculative_tokens", "method")),
    HookTarget("vllm.forward_context", "get_forward_context", why="padding rows, DP metadata"),
    HookTarget("vllm.forward_context", "is_forward_context_available"),
    HookTarget("vllm.forward_context", "ForwardContext.is_padding", kind="attribute",
               why="padding rows stay out of the union"),
    HookTarget("vllm.forward_context", "ForwardContext.dp_metadata", kind="attribute",
               why="logits gathered across DP ranks keep vLLM's routing"),
    HookTarget("vllm.forward_context", "DPMetadata.num_tokens_across_dp_cpu", kind="attribute"),
    HookTarget(_EXPERT_MAP, "determine_expert_map", leading=("ep_size", "ep_rank", "global_num_experts"),
               parameters=("expert_placement_strategy",), why="OEA_POLICY=ep: which rank holds each slot"),
    *(HookTarget(_EXPERT_MAP, f"ExpertMapManager.{attribute}", kind="attribute", why="OEA_POLICY=ep")
      for attribute in ("ep_size", "use_ep", "moe_parallel_config", "global_num_experts", "placement_strategy")),
    HookTarget("vllm.model_executor.layers.fused_moe.config", "FusedMoEParallelConfig", kind="class",
               why="oea doctor vllm: an EP = 8 expert map built by vLLM itself"),
    HookTarget("vllm.plugins", "load_general_plugins",
               why="oea doctor vllm: the router classes as a server process holds them (router bypass)"),
    HookTarget("vllm.distributed.eplb.eplb_state", "EplbState.rearrange", leading=("self",),
               why="wrapped: placements reread after an EPLB rebalance"),
    HookTarget("vllm.distributed.eplb.eplb_state", "EplbState.update_mapping", leading=("self",)),
    HookTarget("vllm.distributed.eplb.eplb_state", "EplbModelState.logical_to_physical_map", kind="attribute",
               why="OEA_POLICY=ep with EPLB"),
)

# Names the plugin reads that the CUDA release lacks (the check asserts they are still missing, so a release
# that adds them moves them into TARGETS): recording (OEA_TRACE_FILE) reads the step's rows from the model
# runner's persistent batch, which Model Runner V2 does not keep as ``input_batch``; there the recording warns
# once ("cannot read the step's requests") and records nothing, while routing is unaffected.
KNOWN_GAPS: tuple[HookTarget, ...] = (
    HookTarget("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.input_batch", kind="attribute",
               why="recording: rows of a step (Model Runner V2 has no persistent input_batch)"),
)
