"""``OEA_METRICS_FILE`` through SGLang's real routing code, run inside .venv-sglang.

Usage (from the repository root; prints one JSON object)::

    .venv-sglang/bin/python tests/engines/sglang_cpu_metrics.py observe|oea METRICS.jsonl [cut]

SGLang's own ``load_plugins()`` loads the plugin with ``OEA_METRICS_FILE`` and ``OEA_TIMING=1`` set (``OEA_K0``
unset, or 3 with ``OEA_MIN_BATCH=2``). Then forwards run through SGLang's ``forward_context`` and
``select_experts`` on CPU, three MoE layers each (a Qwen3-like softmax router, 128 experts, top-8): DECODE
forwards of 6 and 8 requests, an EXTEND forward of 3 requests (7 tokens), a DECODE forward of 8 rows of which 5
are real (SGLang's ``num_token_non_padded``), a DECODE forward of 1 request (below ``OEA_MIN_BATCH``), one
routing call outside any forward (a warm-up pass: ``outside_rows``) and a last DECODE forward of 8. The writer
is flushed as at exit, and its rows read back. With ``cut`` the file's folder is then removed and the forwards
run twice more, each time flushed: the first write fails (one warning), the second has nothing to write. The
JSON holds what went in and what SGLang's routing produced (for tests/engines/test_sglang_metrics.py to compare
with the file's rows), and the rows.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)

import torch

torch.set_num_threads(1)
torch._dynamo.config.disable = True

E, TOP_K, LAYERS = 128, 8, 3
# (mode, rows, real rows or None, extend lengths or None)
FORWARDS = [("DECODE", 6, None, None), ("DECODE", 8, None, None), ("EXTEND", 7, None, [2, 4, 1]),
            ("DECODE", 8, 5, None), ("DECODE", 1, None, None), ("OUTSIDE", 4, None, None),
            ("DECODE", 8, None, None)]


def _forwards(topk, fc, ForwardMode, config, gen: torch.Generator) -> list[dict]:
    forwards = []
    for mode_name, rows, real, lengths in FORWARDS:
        size = rows if lengths is None else len(lengths)
        batch = SimpleNamespace(forward_mode=getattr(ForwardMode, "DECODE" if mode_name == "OUTSIDE" else mode_name),
                                batch_size=size, rids=[f"r{i}" for i in range(size)], seq_lens_cpu=None,
                                seq_lens=torch.full((size,), 9), extend_seq_lens_cpu=lengths,
                                input_ids=torch.zeros(rows, dtype=torch.long), moe_num_token_non_padded=None)
        logits = [torch.randn(rows, E, generator=gen) * 2 for _ in range(LAYERS)]
        routed = []

        def route(x: torch.Tensor, layer: int, real: int | None = real, rows: int = rows) -> dict:
            bound = None if real is None else torch.tensor(real, dtype=torch.int32)
            out = topk.select_experts(hidden_states=torch.zeros(rows, 4), router_logits=x, topk_config=config,
                                      layer_id=layer, num_token_non_padded=bound)
            return {"ids": out.topk_ids.tolist(), "weights": out.topk_weights.tolist()}

        if mode_name == "OUTSIDE":
            routed = [route(x, layer) for layer, x in enumerate(logits)]
        else:
            with fc.forward_context(fc.ForwardContext(attn_backend=None), forward_batch=batch):
                routed = [route(x, layer) for layer, x in enumerate(logits)]
        forwards.append({"mode": mode_name, "rows": rows, "real": real, "lengths": lengths,
                         "logits": [x.tolist() for x in logits], "routed": routed})
    return forwards


def main(mode: str, path: str, cut: bool) -> dict:
    import sglang.srt.layers.moe.topk as topk
    import sglang.srt.model_executor.forward_context as fc
    import sglang.srt.plugins as plugins
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    from oea.integrations.sglang import metrics

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    os.environ.update({"OEA_METRICS_FILE": path, "OEA_TIMING": "1", "OEA_METRICS_FLUSH_S": "3600"})
    if mode == "oea":
        os.environ.update({"OEA_K0": "3", "OEA_MIN_BATCH": "2"})
    plugins.load_plugins()
    config = topk.TopKConfig(top_k=TOP_K, renormalize=True, torch_native=True)
    gen = torch.Generator().manual_seed(0)
    forwards = _forwards(topk, fc, ForwardMode, config, gen)
    writer = metrics.METRICS.writer
    if writer is not None:
        writer.flush()
    lines = Path(path).read_text().splitlines() if Path(path).exists() else []
    if cut and writer is not None:
        shutil.rmtree(Path(path).parent)
        forwards += _forwards(topk, fc, ForwardMode, config, gen)
        writer.flush()
        forwards += _forwards(topk, fc, ForwardMode, config, gen)  # serving goes on; nothing more is buffered
        writer.flush()
    return {"forwards": forwards, "rows": [json.loads(line) for line in lines], "pid": os.getpid(),
            "writer": writer is not None, "failed": None if writer is None else writer.failed,
            "pending": 0 if writer is None else len(writer._pending)}


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in ("observe", "oea") or sys.argv[3:] not in ([], ["cut"]):
        print("usage: sglang_cpu_metrics.py observe|oea METRICS.jsonl [cut]", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["cut"])))
