"""Test-support switch for the chaos tests (tests/engines/test_vllm_soak.py): makes OEA's routing raise in one
MoE layer of a real vLLM server, to show that a failing hook never takes the server down.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, so with this folder on it every vLLM process
runs this file. When ``TEST_OEA_RAISE_IN_ROUTER`` holds a router id (the plugin numbers the model's MoE routers
0, 1, ... at model load), ``oea.integrations.vllm.routing.oea_route_for`` (looked up by name on every call)
raises ``RuntimeError`` for that router. It is not part of the library: nothing in ``src/oea`` reads the
variable, and without this folder on ``PYTHONPATH`` it does nothing.
"""

from __future__ import annotations

import os

_ROUTER = os.environ.get("TEST_OEA_RAISE_IN_ROUTER")


def _install(router: int) -> None:
    import oea.integrations.vllm.routing as routing

    original = routing.oea_route_for

    def raising(spec, router_logits, valid, router_id=None, **kwargs):  # type: ignore[no-untyped-def]
        if router_id == router:
            raise RuntimeError(f"test-support: OEA's routing of router {router} raises (TEST_OEA_RAISE_IN_ROUTER)")
        return original(spec, router_logits, valid, router_id, **kwargs)

    routing.oea_route_for = raising


if _ROUTER:
    _install(int(_ROUTER))
