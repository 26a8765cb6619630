"""Device time of ``scripts/gpu_check.sh`` estimated from its own step counts, before anything runs on the GPU.

Each step's counts come from the settings it will run (the generated cases of step 0 and the Triton
specialisations they compile, ``gpu_check.bench_configs``, ``gpu_check.decode_configs``, the repeats); the
cost of one unit is an assumption for one H100/H200 (``UNIT_COSTS``, not measured: each is chosen on the slow
side of what such a GPU and its host do, so the estimate errs long). The
estimate must fit ``BUDGET_S`` (8 minutes) at the default settings (tested). A GPU run records each step's
wall time in the JSON (``steps``), next to its estimate, so the assumptions can be checked there.
"""

from __future__ import annotations

from typing import Any

BUDGET_S = 480.0
UNIT_COSTS: dict[str, float] = {
    "triton_compile_s": 2.0,  # one kernel, Triton's passes + ptxas on the host: 1.3 s of CPU time on average here
    # (tests/unit/test_kernels_aot.py's 24 kernels: 30 s user time on this 2-core machine, N <= 512)
    "eager_case_s": 3e-3,  # one generated case: route_fast + oea.route eagerly (~60 launches) + compare
    "capture_s": 0.1,  # one CUDA-graph capture (3 warm-up calls + capture)
    "routing_replay_s": 60e-6,  # one timed routing replay with its CUDA events
    "layer_replay_s": 600e-6,  # one timed MoE layer replay (routing + grouped experts, B = 16) with events
    "layer_setup_s": 20.0,  # one layer benchmark's setup: trace, random weights, variants
    "decode_model_s": 60.0,  # the embedded model inflated to Qwen3-30B-A3B's expert size (4.8 GB bf16)
    "decode_step_s": 10e-3,  # one decode step (or prefill forward) of that model (48 MoE layers)
    "decode_capture_s": 5.0,  # one decode-step graph capture (or torch.compile) per batch size and variant
    "doctor_s": 40.0,  # oea doctor gpu: 8 kernels compiled, 27 exactness cases, one graph
}


def step0_counts(cases: int, repeats: int, dry_run: bool, routing: Any) -> dict[str, int]:
    """Step 0 (``gpu_check_routing``): generated cases, distinct Triton specialisations, graph replays."""
    from oea.kernels.aot import specialisation_of

    sweep = routing._load("kernel_sweep")
    keys = set()
    for seed in range(cases):
        logits, spec, _, valid = sweep.random_case(seed, sizes=routing.GPU_SIZES, top_ks=(8,))
        found = specialisation_of(spec, logits.dtype, valid is not None)
        if found is not None:
            keys.add(found)
    batches = (1, 16) if dry_run else (1, 16, 64, 256)
    import torch

    routers = len(routing.routers("cpu", torch.Generator()))
    variants = routers * len(batches) * 3
    return {"cases": cases, "specialisations": len(keys) + routers, "captures": variants + routers,
            "replays": variants * (max(1, repeats // 10) * 10 + 1) + 3 * routers}


def estimate(args: Any, gpu_check: Any, routing: Any) -> dict[str, Any]:
    """``{"steps": {name: {"counts", "seconds"}}, "total_s", "budget_s", "fits", "unit_costs"}`` for ``args``
    (``gpu_check.parse_args``'s namespace)."""
    from oea.bench.layer.inputs import SWEEP_POINTS

    cost = UNIT_COSTS
    cases = args.fast_cases if args.fast_cases is not None else (50 if args.dry_run else 10000)
    s0 = step0_counts(cases, args.repeats, args.dry_run, routing)
    steps: dict[str, dict[str, Any]] = {"doctor": {"counts": {}, "seconds": cost["doctor_s"]}}
    steps["0 fast routing"] = {"counts": s0, "seconds": 2 * s0["specialisations"] * cost["triton_compile_s"]
                               + s0["cases"] * cost["eager_case_s"] + s0["captures"] * cost["capture_s"]
                               + s0["replays"] * cost["routing_replay_s"]}
    steps["1 graph vs eager"] = {"counts": {"captures": 8, "eager_calls": 20},
                                 "seconds": 8 * cost["capture_s"] + 20 * cost["eager_case_s"]}
    layer_calls = layer_variants = 0
    configs = gpu_check.bench_configs("cuda", args.dry_run, args.repeats, args.threads)
    for _, config in configs:
        sweep = len(config.t_sweep) if config.t_sweep is not None else SWEEP_POINTS
        variants = 1 + 2 * len(config.k0s) + sweep  # vanilla, pruned and oea per k0, the T sweep
        layer_variants += variants
        layer_calls += variants * (config.repeats + config.warmup)
    steps["2 layer benchmark"] = {"counts": {"runs": len(configs), "variants": layer_variants, "calls": layer_calls},
                                  "seconds": len(configs) * cost["layer_setup_s"] + layer_variants * cost["capture_s"]
                                  + layer_calls * cost["layer_replay_s"]}
    decode_steps = captures = 0
    decode = [] if args.skip_decode else gpu_check.decode_configs("cuda", args.dry_run, args.threads)
    for _, config in decode:
        variants = 1 + len(config.k0s) * len(config.policies) + int(config.check_identity)
        per_round = 1 + config.new_tokens  # one prefill forward, then the decode steps
        decode_steps += len(config.batch_sizes) * variants * (config.rounds + 1) * per_round  # + eager comparison
        captures += len(config.batch_sizes) * variants
    steps["3 decode benchmark"] = {"counts": {"steps": decode_steps, "captures": captures},
                                   "seconds": (cost["decode_model_s"] if decode else 0.0)
                                   + decode_steps * cost["decode_step_s"] + captures * cost["decode_capture_s"]}
    total = sum(step["seconds"] for step in steps.values())
    return {"steps": steps, "total_s": total, "budget_s": BUDGET_S, "fits": total <= BUDGET_S,
            "unit_costs": dict(cost)}


def summary_line(result: dict[str, Any]) -> str:
    parts = ", ".join(f"{name} {step['seconds']:.0f} s" for name, step in result["steps"].items())
    verdict = "fits" if result["fits"] else "EXCEEDS"
    return (f"estimated device time at these settings: {result['total_s']:.0f} s ({parts}); {verdict} the "
            f"{result['budget_s']:.0f} s budget on one H100/H200 (assumed unit costs: gpu_check_budget.UNIT_COSTS)")
