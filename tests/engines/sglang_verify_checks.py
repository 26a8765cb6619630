"""SGLang-side checks of speculative verify forwards (TARGET_VERIFY), run inside .venv-sglang through
sglang_cpu_checks.py; they print one JSON object::

    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py verify           # OEA_K0=3 OEA_APPLY_TO_VERIFY=1
    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py verify-unset     # OEA_K0=3 only

SGLang's speculative workers cannot run on this CPU (their tree kernels ``sgl_kernel.verify_tree_greedy_cpu`` /
``build_tree_kernel_efficient_cpu`` need a CPU build of ``sgl_kernel``, which no package index has), so the
verify forwards are driven directly through SGLang's own pieces with its own ``ForwardMode.TARGET_VERIFY``:

* an eager verify forward of 3 requests x 4 tokens (the last token and 3 drafts each) inside SGLang's
  ``forward_context``, routed by SGLang's real ``TopK`` (GLM-5-like, 4 layers);
* the real ``DecodeCudaGraphRunner.load_batch`` of a runner whose graphs were captured for TARGET_VERIFY with
  4 tokens per request (``captured_req_width``), before each replay of a routing compiled once with Dynamo: a
  batch of 3 or 2 requests replayed in the graph of 4 requests (16 rows) has 12 or 8 real rows.

With ``OEA_APPLY_TO_VERIFY=1`` every real row of a verify forward joins one union (``oea.route`` over them) and
padding rows keep SGLang's routing; without it verify forwards are SGLang's routing bit for bit and no padding
count is written for them.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
from sglang_check_support import Checks, identical, same
from sglang_padding_checks import K0, VOCAB, TinyMoE, _setup, _vanilla, cuda_runner_stand_in

WIDTH = 4  # tokens per request in a verify forward: the last sampled token and 3 drafts
CAPTURE_BS = [1, 4]  # 2 and 3 requests replay in the graph of 4


def _verify_batch(sg: SimpleNamespace, requests: int, seed: int) -> Any:
    rows = requests * WIDTH
    ids = torch.randint(1, VOCAB, (rows,), generator=torch.Generator().manual_seed(seed))
    return sg.ForwardBatch(forward_mode=sg.ForwardMode.TARGET_VERIFY, batch_size=requests, input_ids=ids,
                           req_pool_indices=torch.arange(requests), seq_lens=torch.full((requests,), 9),
                           out_cache_loc=torch.arange(rows), seq_lens_sum=9 * requests,
                           positions=(torch.arange(WIDTH) + 5).repeat(requests), return_logprob=False,
                           capture_hidden_mode=sg.CaptureHiddenMode.NULL)


def _eager_verify(sg: SimpleNamespace, model: TinyMoE, check: Checks, apply: bool) -> None:
    import oea
    from oea.integrations.sglang.state import STATE

    batch = _verify_batch(sg, 3, seed=70)
    fills = STATE.padding_fills
    model.forwards.clear()
    with sg.fc.forward_context(sg.fc.ForwardContext(attn_backend=None), forward_batch=batch):
        model.forward(batch.input_ids, batch.positions, batch)
    recorded = model.forwards[-1]
    expected = oea.route(recorded["logits"], model.spec(), oea.OEAConfig(K0)) if apply else \
        _vanilla(model, recorded["logits"])
    compare = same if apply else identical
    for layer, routed in enumerate(recorded["layers"]):
        check(f"eager_verify_rows:layer{layer}", *compare(routed, expected))
    check("eager_verify_count_writes", STATE.padding_fills - fills == (1 if apply else 0),
          f"{STATE.padding_fills - fills} write(s)")


def _graph_verify_replays(sg: SimpleNamespace, model: TinyMoE, check: Checks, apply: bool) -> None:
    """SGLang's real ``load_batch`` of a verify graph runner, then a replay of the routing compiled once."""
    import oea
    from oea.integrations.sglang.state import STATE

    runner = cuda_runner_stand_in(sg, sg.ForwardMode.TARGET_VERIFY, CAPTURE_BS, WIDTH)
    rows = max(CAPTURE_BS) * WIDTH
    layer = model.layers[0]
    logits = model.table[torch.arange(rows) % VOCAB]  # rows past each batch: stale inputs
    capture_batch = SimpleNamespace(forward_mode=sg.ForwardMode.TARGET_VERIFY, moe_num_token_non_padded=lambda: None,
                                    input_ids=torch.zeros(rows, dtype=torch.int64))

    def routing(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = layer(torch.zeros(rows, 4), router_logits)
        return out.topk_ids, out.topk_weights

    vanilla = _vanilla(model, logits)
    compiled = torch.compile(routing, backend="eager", fullgraph=True)
    with sg.fc.forward_context(sg.fc.ForwardContext(attn_backend=None), forward_batch=capture_batch):
        routing(logits)  # warm-up before capture, as SGLang's graph runners do
        with torch._dynamo.config.patch(disable=False):
            torch._dynamo.reset()
            compiled(logits)  # the capture of a TARGET_VERIFY graph of 4 requests x 4 tokens
            for step, requests in enumerate((3, 2, 3)):
                real = requests * WIDTH
                fills = STATE.padding_fills
                runner.load_batch(_verify_batch(sg, requests, seed=80 + step))
                ids, weights = compiled(logits)  # the replay: no Python of the plugin runs
                check(f"verify_load_batch{step}_rows", (runner.raw_num_token, runner.bs) == (real, 4),
                      f"raw_num_token {runner.raw_num_token}, bs {runner.bs}")
                check(f"verify_load_batch{step}_count_writes", STATE.padding_fills - fills == (1 if apply else 0),
                      f"{STATE.padding_fills - fills} write(s)")
                if apply:
                    expected = oea.route(logits[:real], model.spec(), oea.OEAConfig(K0))
                    check(f"verify_replay{step}_real_rows_equal_oea_route", *same((ids[:real], weights[:real]),
                                                                                   expected))
                    check(f"verify_replay{step}_padding_rows_keep_sglang_routing",
                          *identical((ids[real:], weights[real:]), (vanilla[0][real:], vanilla[1][real:])))
                else:
                    check(f"verify_replay{step}_sglang_routing", *identical((ids, weights), vanilla))


def run_verify(apply: bool) -> dict[str, Any]:
    from importlib.metadata import version

    os.environ["OEA_K0"] = str(K0)
    if apply:
        os.environ["OEA_APPLY_TO_VERIFY"] = "1"
    else:
        os.environ.pop("OEA_APPLY_TO_VERIFY", None)
    sg = _setup()
    sg.plugins.load_plugins()
    check = Checks()
    model = TinyMoE(sg)
    _eager_verify(sg, model, check, apply)
    _graph_verify_replays(sg, model, check, apply)
    return {"sglang_version": version("sglang"), "apply_to_verify": apply, "checks": check.records}
