"""``oea doctor transformers``: version, the router classes of the families the docs name, a self-test
on a tiny Qwen3-MoE (k0 = k leaves the logits alone, k0 = 1 uses fewer experts) and the environment."""

from __future__ import annotations

import re
from typing import Any

import torch

from oea.integrations.doctor.common import check_call
from oea.integrations.transformers.attach import attach, describe_environment
from oea.routing import OEAConfig

# Families the doctor and the docs name: (model_type, module, router class).
DOCTOR_FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter"),
    ("olmoe", "transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter"),
    ("mixtral", "transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter"),
    ("deepseek_v3", "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter"),
    ("glm4_moe", "transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeTopkRouter"),
    ("glm_moe_dsa", "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaTopkRouter"),
)

OPTIONAL_FAMILIES: frozenset[str] = frozenset({"glm_moe_dsa"})


def engine_version() -> str | None:
    """The installed transformers version, or None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


def _self_test() -> str:
    """A tiny Qwen3-MoE: k0 = k keeps the logits, k0 = 1 activates fewer experts in every layer."""
    from oea.testing import tiny_qwen3_moe

    model = tiny_qwen3_moe()
    ids = torch.randint(0, 256, (8, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        baseline = model(ids).logits
        with attach(model, OEAConfig(k0=4)) as handle:
            same = model(ids).logits
        drift = (baseline - same).abs().max().item()
        if drift > 1e-5:  # not bit-exact: the experts sum slots in a different order
            raise AssertionError(f"k0=k changed the logits by {drift:.3g}")
        if handle.rerouted_layers != [0, 1]:
            raise AssertionError(f"expected layers [0, 1] rerouted, got {handle.rerouted_layers}")
        with attach(model, OEAConfig(k0=1)) as handle:
            model(ids)
        stats = handle.stats()
    fewer = {i: (s["mean_active_experts"], s["mean_active_experts_vanilla"]) for i, s in stats.items()}
    if not all(oea < vanilla for oea, vanilla in fewer.values()):
        raise AssertionError(f"k0=1 did not reduce active experts (oea, vanilla) per layer: {fewer}")
    shown = ", ".join(f"layer {i}: {o:.0f} vs {v:.0f}" for i, (o, v) in fewer.items())
    return (
        f"tiny Qwen3-MoE (16 experts, k=4, batch 8): k0=k logits within {drift:.1g} of the model's; "
        f"k0=1 active experts (oea vs vanilla) {shown}"
    )


def _env_detail() -> str:
    try:
        return describe_environment()
    except ValueError as err:  # the message names the variable
        raise RuntimeError(str(err)) from None


def _router_class_check(model_type: str, module_name: str, cls: str) -> dict[str, Any]:
    """Whether this transformers has the family's router class (GLM-5 is optional: added in 5.x)."""
    import importlib

    optional = model_type in OPTIONAL_FAMILIES
    name = f"router class {model_type}"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        detail = f"{module_name} not importable ({err})"
        return {"name": name, "ok": optional, "detail": detail + (" (optional family)" if optional else "")}
    if not hasattr(module, cls):
        detail = f"{cls} not in {module_name}" + (" (optional family)" if optional else "")
        return {"name": name, "ok": optional, "detail": detail}
    return {"name": name, "ok": True, "detail": f"{module_name}.{cls}"}


def doctor_checks() -> list[dict[str, Any]]:
    """Checks for ``oea doctor transformers``: each ``{"name": str, "ok": bool, "detail": str}``."""
    version = engine_version()
    if version is None:
        return [{"name": "transformers version", "ok": False, "detail": "transformers is not installed "
                 "(pip install 'oea[transformers]')"}]
    major_minor = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    checks = [{
        "name": "transformers version",
        "ok": major_minor >= (5, 0) and major_minor[0] < 6,
        "detail": f"transformers {version} (supported: 5.x; unified router contract from 5.19)",
    }]
    checks.extend(_router_class_check(*family) for family in DOCTOR_FAMILIES)
    checks.append(check_call("self-test", _self_test))
    checks.append(check_call("environment", _env_detail))
    return checks
