"""SGLang-side checks of the OEA plugin, run inside .venv-sglang (real SGLang routing code on CPU).

Usage (from the repository root)::

    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py routing   # prints one JSON object
    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py fallbacks # a hook target missing; direct patching
    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py bad-env   # load_plugins() with a bad OEA_K0
    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py padding   # CUDA-graph padding (sglang_padding_checks.py)
    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py verify    # speculative verify (sglang_verify_checks.py)

``routing`` loads the plugin through SGLang's own ``load_plugins()`` twice in one process: first
with OEA off (nothing may change), then with ``OEA_K0=3`` (hooks applied by SGLang's HookRegistry),
and drives SGLang's real ``select_experts`` / ``TopK`` on CPU tensors. The JSON holds one record
per check (``name``, ``ok``, ``detail``) plus measured active-expert counts; the pytest side
(tests/engines/test_sglang_routing.py) asserts on it. Nothing is stubbed: SGLang imports its real
dependencies (torchvision included) as installed by scripts/install_sglang_cpu.sh.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch
from sglang_check_support import Checks, identical, in_mode, logged_warnings, same, select, sglang_modules

K0 = 3
E_GLM, E_QWEN, TOP_K = 256, 128, 8


def _sglang() -> SimpleNamespace:
    from sglang.srt.configs.shared_experts import SharedExpertsConfig

    sg = sglang_modules()
    sg.SharedExpertsConfig = SharedExpertsConfig
    return sg


def _logits(m: int, e: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, e, generator=gen) * 2.0


def _cases(sg: SimpleNamespace) -> dict[str, dict[str, Any]]:
    """name -> {"config": TopKConfig, "logits", "spec": reference RouterSpec (written independently)}."""
    import oea

    TopKConfig = sg.topk.TopKConfig
    gen = torch.Generator().manual_seed(7)
    bias = torch.rand(E_GLM, generator=gen) * 0.5

    def grouped_sigmoid(groups: int, topk_group: int, scale_on_output: bool, top_k: int = TOP_K,
                        **extra: Any) -> Any:
        """SGLang's grouped sigmoid top-k over E_GLM experts: renormalised, the correction bias above and a
        routed scaling factor of 2.5, applied by the model (``scale_on_output``) or folded into the weights."""
        return TopKConfig(top_k=top_k, use_grouped_topk=True, num_expert_group=groups, topk_group=topk_group,
                          renormalize=True, correction_bias=bias, scoring_func="sigmoid", routed_scaling_factor=2.5,
                          apply_routed_scaling_factor_on_output=scale_on_output, **extra)

    cases = {
        # GLM-5: 256 experts, top-8, sigmoid + e_score_correction_bias, n_group = topk_group = 1; the
        # routed scaling factor is applied by the model (not folded into the top-k weights).
        "glm5_sigmoid_ngroup1": dict(
            config=grouped_sigmoid(1, 1, scale_on_output=False),
            logits=_logits(16, E_GLM, 1),
            spec=oea.RouterSpec(E_GLM, TOP_K, "sigmoid", True, bias, 1, 1, 1.0)),
        # DeepSeek-V3-like grouped variant: 8 groups, best 4 kept, scale folded into the weights.
        "grouped_sigmoid_8x4_scaled": dict(
            config=grouped_sigmoid(8, 4, scale_on_output=True),
            logits=_logits(16, E_GLM, 2),
            spec=oea.RouterSpec(E_GLM, TOP_K, "sigmoid", True, bias, 8, 4, 2.5)),
        # Qwen3-MoE through SGLang's torch-native softmax path.
        "qwen3_softmax_native": dict(
            config=TopKConfig(top_k=TOP_K, renormalize=True, torch_native=True),
            logits=_logits(16, E_QWEN, 3),
            spec=oea.RouterSpec(E_QWEN, TOP_K, "softmax", True)),
        # OLMoE-like: softmax without renormalisation.
        "softmax_native_no_renorm": dict(
            config=TopKConfig(top_k=TOP_K, renormalize=False, torch_native=True),
            logits=_logits(16, E_QWEN, 4),
            spec=oea.RouterSpec(E_QWEN, TOP_K, "softmax", False)),
        # One fused shared expert appended by the router (GLM without --disable-shared-experts-fusion).
        "glm5_fused_shared_slot": dict(
            config=grouped_sigmoid(1, 1, scale_on_output=False, top_k=TOP_K + 1,
                                   shared_experts=sg.SharedExpertsConfig(num_fused_shared_experts=1)),
            logits=_logits(16, E_GLM, 5),
            spec=oea.RouterSpec(E_GLM, TOP_K, "sigmoid", True, bias, 1, 1, 1.0)),
    }
    return cases


def _select(sg: SimpleNamespace, case: dict[str, Any], logits: torch.Tensor | None = None,
            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return select(sg, case["config"], case["logits"] if logits is None else logits, **kwargs)


def _active(ids: torch.Tensor, weights: torch.Tensor) -> int:
    import oea

    return int(oea.active_experts(ids.long().clamp(min=0), weights.float(), valid=(ids >= 0).all(dim=1)))


def run_routing() -> dict[str, Any]:
    import oea
    from oea.integrations import sglang as plugin

    os.environ.pop("OEA_K0", None)
    os.environ.pop("SGLANG_OEA_K0", None)
    sg = _sglang()
    check = Checks()
    figures: dict[str, Any] = {}

    # SGLang's MoE import chain reached the installed torchvision (moe/utils -> configs -> internvl_utils),
    # not a stand-in: the transforms it bound are torchvision's own classes.
    internvl = sys.modules.get("sglang.srt.multimodal.internvl_utils")
    compose = getattr(getattr(internvl, "T", None), "Compose", None)
    check("real_import_chain", isinstance(compose, type) and compose.__module__.startswith("torchvision.transforms")
          and str(getattr(sys.modules.get("torchvision"), "__file__", "")).endswith("torchvision/__init__.py"),
          f"internvl_utils.T.Compose = {compose!r}; torchvision = {sys.modules.get('torchvision')!r}")

    cases = _cases(sg)
    baseline = {name: _select(sg, case) for name, case in cases.items()}
    padded_logits = _logits(12, E_GLM, 11)
    non_padded = torch.tensor(8, dtype=torch.int32)
    baseline_padded = _select(sg, cases["glm5_sigmoid_ngroup1"], padded_logits, num_token_non_padded=non_padded)
    one_row = cases["glm5_sigmoid_ngroup1"]["logits"][:1]
    baseline_one_row = _select(sg, cases["glm5_sigmoid_ngroup1"], one_row)

    # -- phase 1: OEA off. SGLang's loader runs the plugin, which must install nothing.
    sg.plugins.load_plugins()
    hooked = {target: plugin.target_hooked(target) for target, _, _ in plugin.hook_plan()}
    check("off_no_hooks", not any(hooked.values()), f"hooked targets with OEA_K0 unset: {hooked}")
    for name, case in cases.items():
        if name == "glm5_fused_shared_slot":
            continue
        with in_mode(sg, "DECODE"):
            out = _select(sg, case)
        check(f"off_identical:{name}", *identical(out, baseline[name]))
        # The translation oracle: SGLang's vanilla routing == oea's vanilla routing for this spec.
        check(f"vanilla_matches_oea:{name}", *same(baseline[name], oea.route(case["logits"], case["spec"])))

    # -- phase 2: OEA on. Re-run SGLang's plugin loader (its once-per-process guard reset).
    os.environ["OEA_K0"] = str(K0)
    sg.plugins._plugins_loaded = False
    sg.plugins.load_plugins()
    status = plugin.hooks_status()
    check("on_hooks_installed", all(status.values()) and len(status) >= 2, f"{status}")
    cfg = oea.OEAConfig(K0)
    for name, case in cases.items():
        spec = case["spec"]
        with in_mode(sg, "DECODE"):
            decode = _select(sg, case)
        with in_mode(sg, "EXTEND"):
            extend = _select(sg, case)
        outside = _select(sg, case)
        expected = oea.route(case["logits"], spec, cfg)
        routed = (decode[0][:, :TOP_K], decode[1][:, :TOP_K])
        check(f"decode_equals_oea_route:{name}", *same(routed, expected))
        check(f"decode_dtypes:{name}", decode[0].dtype == baseline[name][0].dtype
              and decode[1].dtype == torch.float32,
              f"ids {decode[0].dtype} (SGLang: {baseline[name][0].dtype}), weights {decode[1].dtype}")
        if name == "glm5_fused_shared_slot":
            shared_same = torch.equal(decode[0][:, TOP_K:], baseline[name][0][:, TOP_K:]) and torch.equal(
                decode[1][:, TOP_K:], baseline[name][1][:, TOP_K:])
            check("shared_slot_untouched", shared_same and decode[0].shape == baseline[name][0].shape,
                  f"shared column ids {decode[0][:3, TOP_K:].flatten().tolist()}")
            check(f"extend_untouched:{name}", *same(extend, baseline[name]))
        else:
            check(f"extend_untouched:{name}", *identical(extend, baseline[name]))
            check(f"no_forward_context_untouched:{name}", *identical(outside, baseline[name]))
        figures[name] = {"T_vanilla": _active(*baseline[name][:2]) if name != "glm5_fused_shared_slot"
                         else _active(baseline[name][0][:, :TOP_K], baseline[name][1][:, :TOP_K]),
                         "T_oea": _active(*routed), "rows": int(case["logits"].shape[0])}
        check(f"oea_reduces_T:{name}", figures[name]["T_oea"] < figures[name]["T_vanilla"],
              f"T {figures[name]['T_vanilla']} -> {figures[name]['T_oea']}")

    # Padding rows: excluded from the union, returned as SGLang produced them.
    glm = cases["glm5_sigmoid_ngroup1"]
    with in_mode(sg, "DECODE"):
        padded = _select(sg, glm, padded_logits, num_token_non_padded=non_padded)
    real_only = oea.route(padded_logits[:8], glm["spec"], cfg)
    check("padding_valid_rows_as_if_alone", *same((padded[0][:8], padded[1][:8]), real_only))
    check("padding_rows_keep_sglang_output", *identical((padded[0][8:], padded[1][8:]),
                                                         (baseline_padded[0][8:], baseline_padded[1][8:])))
    with_padding_in_union = oea.route(padded_logits, glm["spec"], cfg)
    figures["padding"] = {"T_valid_rows": _active(padded[0][:8], padded[1][:8]),
                          "T_if_padding_joined_union": _active(with_padding_in_union[0][:8],
                                                               with_padding_in_union[1][:8])}

    # Padding count through the forward context (TopK module path, as in a CUDA-graph decode).
    tk_qwen = sg.topk.TopK(top_k=TOP_K, layer_id=1, renormalize=True,
                           output_format=sg.topk.TopKOutputFormat.STANDARD)
    qwen = cases["qwen3_softmax_native"]
    with in_mode(sg, "DECODE", non_padded=torch.tensor(10, dtype=torch.int32)):
        out = tk_qwen(torch.zeros(16, 4), qwen["logits"])
    check("topk_module_context_padding", *same((out.topk_ids[:10], out.topk_weights[:10]),
                                                        oea.route(qwen["logits"][:10], qwen["spec"], cfg)))
    tk_glm = sg.topk.TopK(top_k=TOP_K, layer_id=2, use_grouped_topk=True, num_expert_group=1, topk_group=1,
                          renormalize=True, scoring_func="sigmoid", correction_bias=glm["config"].correction_bias,
                          routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=False,
                          output_format=sg.topk.TopKOutputFormat.STANDARD)
    with in_mode(sg, "DECODE"):
        out = tk_glm(torch.zeros(16, 4), glm["logits"])
    check("topk_module_glm5", *same((out.topk_ids, out.topk_weights),
                                             oea.route(glm["logits"], glm["spec"], cfg)))

    # Below OEA_MIN_BATCH (2): a single decode row keeps SGLang's routing.
    with in_mode(sg, "DECODE"):
        single = _select(sg, glm, one_row)
    check("min_batch_single_row_untouched", *identical(single, baseline_one_row))

    # Routing replay: SGLang's routed-experts capturer pins its host buffer with cudaHostRegister, so a CPU server
    # started with --enable-return-routed-experts stops at start-up (docs/sglang.md, "Using OEA with routing
    # replay"); the day this allocation works, the CPU server can return the ids and the live test is due.
    from sglang.srt.state_capturer.base import BaseHostCache

    try:
        BaseHostCache(4, 2, TOP_K, "routed_experts", "cpu")
        check("routed_experts_cpu_host_buffer_fails", False, "allocated: a CPU server can now return routed experts")
    except (AssertionError, RuntimeError) as err:
        check("routed_experts_cpu_host_buffer_fails", "CUDA" in str(err), f"{type(err).__name__}: {err}")

    from importlib.metadata import version

    return {"sglang_version": version("sglang"), "k0": K0, "rewrites": plugin.rewrite_count(),
            "checks": check.records, "figures": figures}


def run_fallbacks() -> dict[str, Any]:
    """A hook target missing (a renamed SGLang function): serving goes on unmodified, loudly; the
    doctor names the target; the launcher's direct patching (SGLang < 0.5.12 path) then works."""
    import oea
    import oea.integrations.sglang.targets as targets  # the names the hooks and the doctor read at call time
    from oea.config import settings_from_env
    from oea.integrations import sglang as plugin

    records = logged_warnings()
    sg = _sglang()
    check = Checks()

    case = _cases(sg)["glm5_sigmoid_ngroup1"]
    baseline = _select(sg, case)
    real_target = targets.POST_PROCESS_TARGET
    renamed = real_target + "_renamed_in_a_future_sglang"
    targets.POST_PROCESS_TARGET = renamed
    targets.EXPECTED_PARAMETERS[renamed] = targets.EXPECTED_PARAMETERS[real_target]
    os.environ["OEA_K0"] = str(K0)
    try:
        sg.plugins.load_plugins()
        check("missing_target_load_plugins_survives", True, "load_plugins() returned")
    except Exception as err:  # the point of the check: report, don't crash the script
        check("missing_target_load_plugins_survives", False, f"{type(err).__name__}: {err}")
    with in_mode(sg, "DECODE"):
        out = _select(sg, case)
    check("missing_target_serving_unmodified", *identical(out, baseline))
    logged = [r for r in records if "routing hook is not installed" in r and renamed in r]
    check("missing_target_logged", bool(logged), logged[0] if logged else f"log records: {records[-5:]}")
    doctor = {c["name"]: c for c in plugin.doctor_checks()}
    target_check = doctor.get(f"hook target {renamed}", {"ok": True, "detail": "check absent"})
    check("doctor_names_missing_target", not target_check["ok"] and renamed in target_check["detail"]
          and "supported SGLang versions" in target_check["detail"], target_check["detail"])

    targets.POST_PROCESS_TARGET = real_target
    patched = plugin.install_without_registry(settings_from_env())
    with in_mode(sg, "DECODE"):
        out = _select(sg, case)
    check("direct_patch_targets", real_target in patched, f"{patched}")
    check("direct_patch_decode_equals_oea_route",
          *same(out, oea.route(case["logits"], case["spec"], oea.OEAConfig(K0))))
    with in_mode(sg, "EXTEND"):
        out = _select(sg, case)
    check("direct_patch_extend_untouched", *identical(out, baseline))
    return {"checks": check.records}


def main(argv: list[str]) -> int:
    if argv[:1] == ["routing"]:
        print(json.dumps(run_routing()))
        return 0
    if argv[:1] == ["fallbacks"]:
        print(json.dumps(run_fallbacks()))
        return 0
    if argv[:1] in (["padding"], ["padding-missing"]):  # CUDA-graph padding rows: sglang_padding_checks.py
        from sglang_padding_checks import run_padding, run_padding_missing

        print(json.dumps(run_padding() if argv[0] == "padding" else run_padding_missing()))
        return 0
    if argv[:1] in (["verify"], ["verify-unset"]):  # speculative verify forwards: sglang_verify_checks.py
        from sglang_verify_checks import run_verify

        print(json.dumps(run_verify(apply=argv[0] == "verify")))
        return 0
    if argv[:1] == ["bad-env"]:  # SGLang's own loader with a malformed OEA_K0: must stop the process
        import sglang.srt.plugins as plugins

        plugins.load_plugins()
        print(json.dumps({"started": True}))
        return 0
    print("usage: sglang_cpu_checks.py routing|fallbacks|padding|padding-missing|verify|verify-unset|bad-env",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
