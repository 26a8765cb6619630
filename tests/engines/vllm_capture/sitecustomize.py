"""Test harness for tests/engines/test_vllm_parallel.py: records what the OEA plugin routes in each vLLM process.

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, so with this folder on it every vLLM process
(API server, engine core, each spawned worker) runs this file. When ``TEST_ROUTING_CAPTURE_DIR`` is set it wraps
``oea.integrations.vllm.routing.cpu_route_body`` (the body of the plugin's ``oea::cpu_route`` op, looked up by
name on every call) and appends one pickle per routing call made inside an engine step to
``<dir>/capture-<pid>.pkl``: the worker's rank, the step, the router, the logits the plugin saw, its real-row
mask, vLLM's own routing and the plugin's output. Nothing here changes what the plugin returns.
"""

from __future__ import annotations

import os
import pickle

_DIR = os.environ.get("TEST_ROUTING_CAPTURE_DIR")


def _install() -> None:
    import torch

    import oea.integrations.vllm.routing as routing
    from oea.integrations.vllm.state import STATE

    original = routing.cpu_route_body
    path = os.path.join(_DIR, f"capture-{os.getpid()}.pkl")

    def captured(router_logits, stock_weights, stock_ids, router_id):  # type: ignore[no-untyped-def]
        weights, ids = original(router_logits, stock_weights, stock_ids, router_id)
        if STATE.record is not None:  # inside an engine step (metrics on)
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            valid = routing.step_rows(router_logits.shape[0])[0]
            entry = {"rank": rank, "step": STATE.step, "router": router_id, "decode": STATE.decode,
                     "logits": router_logits.detach().clone(), "valid": None if valid is None else valid.clone(),
                     "stock": (stock_weights.clone(), stock_ids.clone()), "out": (weights.clone(), ids.clone())}
            with open(path, "ab") as f:
                pickle.dump(entry, f)
        return weights, ids

    routing.cpu_route_body = captured


if _DIR:
    _install()
