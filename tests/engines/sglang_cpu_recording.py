"""Recording decode forwards (``OEA_TRACE_FILE``) through SGLang's real routing code, run inside .venv-sglang.

Usage (from the repository root; prints one JSON object)::

    .venv-sglang/bin/python tests/engines/sglang_cpu_recording.py observe TRACE.safetensors
    .venv-sglang/bin/python tests/engines/sglang_cpu_recording.py oea TRACE.safetensors      # OEA_K0=3 too

SGLang's own ``load_plugins()`` loads the plugin with ``OEA_TRACE_FILE`` set (and ``OEA_K0`` unset, or 3).
Then six forwards run through SGLang's ``forward_context`` and ``select_experts`` on CPU, three MoE layers
each (a Qwen3-like softmax router, 128 experts, top-8): decode forwards of 6, 8, 8, 5 and 8 requests and,
between them, one EXTEND forward that must not be recorded. Every routing call's output is kept; the
recorder is closed as the process would close it at exit, and the JSON holds what went in (logits per
forward and layer, request ids, sequence lengths) and what SGLang's routing produced, for the pytest side
(tests/engines/test_sglang_recording.py) to compare with the trace file.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch
from sglang_check_support import select, sglang_modules

E, TOP_K, LAYERS = 128, 8, 3
FORWARDS = [("DECODE", 6), ("DECODE", 8), ("EXTEND", 7), ("DECODE", 8), ("DECODE", 5), ("DECODE", 8)]


def main(mode: str, path: str) -> dict:
    from oea.integrations.sglang import recording

    sg = sglang_modules()
    topk, fc, plugins, ForwardMode = sg.topk, sg.fc, sg.plugins, sg.ForwardMode
    os.environ["OEA_TRACE_FILE"] = path
    if mode == "oea":
        os.environ["OEA_K0"] = "3"
    plugins.load_plugins()
    config = topk.TopKConfig(top_k=TOP_K, renormalize=True, torch_native=True)
    gen = torch.Generator().manual_seed(0)
    forwards = []
    position_base = 20
    for index, (mode_name, rows) in enumerate(FORWARDS):
        rids = [f"req-{(index + r) % 10}" for r in range(rows)]
        seq_lens = torch.tensor([position_base + 3 * r + index for r in range(rows)])
        batch = SimpleNamespace(forward_mode=getattr(ForwardMode, mode_name), rids=rids, batch_size=rows,
                                seq_lens_cpu=seq_lens, seq_lens=seq_lens, input_ids=torch.zeros(rows, dtype=torch.long),
                                moe_num_token_non_padded=None)
        logits = [torch.randn(rows, E, generator=gen) * 2 for _ in range(LAYERS)]
        routed = []
        with fc.forward_context(fc.ForwardContext(attn_backend=None), forward_batch=batch):
            for layer, x in enumerate(logits):
                ids, weights = select(sg, config, x, layer)
                routed.append({"ids": ids.tolist(), "weights": weights.tolist()})
        forwards.append({"mode": mode_name, "rids": rids, "seq_lens": seq_lens.tolist(),
                         "logits": [x.tolist() for x in logits], "routed": routed})
    recorder = recording.TRACE.recorder
    written = None if recorder is None else recorder.close()
    return {"forwards": forwards, "written": None if written is None else str(written),
            "recorder": recorder is not None, "rewrites": __import__("oea.integrations.sglang",
                                                                     fromlist=["x"]).rewrite_count()}


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("observe", "oea"):
        print("usage: sglang_cpu_recording.py observe|oea TRACE.safetensors", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
