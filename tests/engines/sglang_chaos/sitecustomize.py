"""Test-support switch for the chaos tests (tests/engines/test_sglang_soak.py): makes OEA's routing raise in one
MoE layer of a real SGLang server, to show that a failing hook never takes the server down.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, so with this folder on it every SGLang process
runs this file. When ``TEST_OEA_RAISE_IN_LAYER`` holds a layer id (SGLang's ``layer_id`` of the MoE layer),
``oea.integrations.sglang.routing.rewrite_topk`` (OEA's routing of one layer call, looked up by name on every
call of the plugin's BEFORE hook) raises ``RuntimeError`` in that layer; the layer is the ``layer_id`` of the
hook's own call (``routing._rewrite``, the caller). It is not part of the library: nothing in ``src/oea`` reads
the variable, and without this folder on ``PYTHONPATH`` it does nothing.
"""

from __future__ import annotations

import os
import sys

_LAYER = os.environ.get("TEST_OEA_RAISE_IN_LAYER")


def _install(layer: int) -> None:
    import oea.integrations.sglang.routing as routing

    original = routing.rewrite_topk

    def raising(*args, **kwargs):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_locals.get("layer_id") == layer:
            raise RuntimeError(f"test-support: OEA's routing of layer {layer} raises (TEST_OEA_RAISE_IN_LAYER)")
        return original(*args, **kwargs)

    routing.rewrite_topk = raising


if _LAYER:
    _install(int(_LAYER))
