"""SGLang's own top-k (``select_experts`` on CPU, torch-native, the plugin not loaded) on a recorded trace's logits,
run inside .venv-sglang.

Usage (from the repository root; prints one JSON object ``{"active": {step: [T per layer]}}``)::

    .venv-sglang/bin/python tests/engines/sglang_topk_replay.py TRACE.safetensors

Each recorded step's rows go through ``select_experts`` with the trace's router (top-k, renormalize) as one call
per layer; T is the distinct experts of SGLang's ids with non-zero weight (``oea.active_experts``). For
tests/engines/test_sglang_server_recording.py, which compares it with the live server's ``active_stock``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)

import torch

torch.set_num_threads(1)
torch._dynamo.config.disable = True


def main(path: str) -> dict:
    for name in [n for n in os.environ if n.startswith("OEA_")]:  # SGLang's own routing (no plugin settings)
        del os.environ[name]
    import sglang.srt.layers.moe.topk as topk

    import oea
    from oea.traces import load_trace

    trace = load_trace(path)
    spec = trace.spec
    config = topk.TopKConfig(top_k=spec.top_k, renormalize=spec.renormalize, torch_native=True)
    active = {}
    for step in sorted(set(trace.step_ids.tolist())):
        rows = trace.step_ids == step
        counts = []
        for layer in range(trace.num_layers):
            logits = trace.logits[rows, layer]
            out = topk.select_experts(hidden_states=torch.zeros(logits.shape[0], 4), router_logits=logits,
                                      topk_config=config, layer_id=layer)
            counts.append(int(oea.active_experts(out.topk_ids.long(), out.topk_weights)))
        active[int(step)] = counts
    return {"active": active}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: sglang_topk_replay.py TRACE.safetensors", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(main(sys.argv[1])))
