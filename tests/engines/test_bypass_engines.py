"""Substituted routers against the real engines (issue 38, item 3), in .venv-vllm and .venv-sglang, no server: each
doctor's ``router bypass`` check passes on the stock router classes (vLLM's wrapped by the plugin too) and fails,
naming the class, once a stand-in for a platform's substituted router (a subclass of the engine's own class that
overrides the method OEA's hook runs through) exists; the unit tests (``tests/unit/test_bypass_detection.py``)
cover the same with engine stand-ins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sglang_venv import run_script_json
from vllm_env import checks_fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow]

VLLM_CHECKS = r'''
import json, os
for var in ("OEA_K0", "OEA_METRICS_FILE", "OEA_TIMING", "OEA_TRACE_FILE"):
    os.environ.pop(var, None)
import oea.integrations.vllm.doctor as doctor
import oea.integrations.vllm.plugin as plugin
from oea.integrations import bypass
from oea.integrations.vllm.state import STATE
from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

out = {"stock": bypass.doctor_check(doctor._bypasses_as_served)}
STATE.mode = "oea"
plugin.install_hooks()  # the real classes wrapped: the wrapper is recognised as OEA's hook
out["wrapped"] = [b.router for b in plugin.router_bypasses()[0]]

class NPUFusedTopKRouter(FusedTopKRouter):
    """Stands in for a platform's substituted router: routes with its own kernel."""
    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        return None

out["substituted"] = bypass.doctor_check(doctor._bypasses_as_served)
print("RESULT" + json.dumps(out))
'''

SGLANG_CHECKS = r'''
import json
import oea.integrations.sglang.doctor as doctor
from oea.integrations import bypass
from sglang.srt.layers.moe.topk import TopK

out = {"stock": bypass.doctor_check(doctor._bypasses_as_served)}

class NPUTopK(TopK):
    """Stands in for a platform's substituted router: its CUDA forward runs its own kernel."""
    def forward_cuda(self, *args, **kwargs):
        return None

out["substituted"] = bypass.doctor_check(doctor._bypasses_as_served)
print(json.dumps(out))
'''

result = checks_fixture(VLLM_CHECKS)


def test_vllm_stock_routers_pass_and_a_substituted_one_fails(result: dict[str, Any]) -> None:
    assert result["stock"]["ok"] and "FusedTopKRouter (+0 subclasses)" in result["stock"]["detail"], result
    assert result["wrapped"] == []
    substituted = result["substituted"]
    assert not substituted["ok"] and "__main__.NPUFusedTopKRouter bypasses OEA: its _compute_routing" in \
        substituted["detail"], substituted


def test_sglang_stock_topk_passes_and_a_substituted_one_fails(tmp_path: Path) -> None:
    script = tmp_path / "bypass_checks.py"
    script.write_text(SGLANG_CHECKS)
    proc, report = run_script_json(script, [])
    assert report is not None, proc.stderr[-3000:]
    assert report["stock"]["ok"] and "TopK (+0 subclasses)" in report["stock"]["detail"], report
    substituted = report["substituted"]
    assert not substituted["ok"] and "__main__.NPUTopK bypasses OEA: its forward_cuda" in substituted["detail"], \
        substituted
