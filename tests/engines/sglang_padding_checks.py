"""SGLang-side checks of CUDA-graph padding rows (run inside .venv-sglang through sglang_cpu_checks.py).

Usage (from the repository root)::

    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py padding          # prints one JSON object
    .venv-sglang/bin/python tests/engines/sglang_cpu_checks.py padding-missing  # replay hook points renamed

``padding`` loads the plugin through SGLang's own ``load_plugins()`` with ``OEA_K0=3`` and decode graphs
captured for batch sizes 4, 8 and 16, then drives:

* SGLang's real ``CPUGraphRunner`` (capture and ``execute``; its graphs run the captured forward on the
  padded batch) over a small model whose 4 MoE layers route through SGLang's real ``TopK`` (GLM-5-like:
  256 experts, top-8, sigmoid + bias, routed scaling): batches of 15, 13, 9, 13, 16, 5 requests padded to
  16, 16, 16, 16, 16, 8 rows, each inside SGLang's ``forward_context`` as ``ModelRunner._forward_raw`` does;
* an eager decode forward of 20 rows (larger than any captured size);
* the real ``DecodeCudaGraphRunner.load_batch`` (the CUDA runner's replay preparation, on a stand-in runner
  object) feeding a routing compiled once with Dynamo (fullgraph) and replayed after each load, as a CUDA
  graph is;
* SGLang's own ``num_token_non_padded`` next to OEA's count.

``padding-missing`` renames both replay hook points (an SGLang without them): serving goes on as before
(padding rows join the union), one warning names the workaround, and the doctor names the missing hook.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
from sglang_check_support import Checks, identical, logged_warnings, same, sglang_modules

E, TOP_K, K0, LAYERS = 256, 8, 3, 4
CAPTURE_BS = [4, 8, 16]
REPLAYS = (15, 13, 9, 13, 16, 5)
VOCAB = 100


def _setup() -> SimpleNamespace:
    """SGLang's modules, with a context whose CUDA-graph batch sizes are ``CAPTURE_BS``."""
    import sglang.srt.model_executor.cpu_graph_runner as cpu_graph_runner
    from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", cuda_graph_bs_decode=CAPTURE_BS)
    parse_cuda_graph_config(args)
    sg = sglang_modules(args)
    sg.__dict__.update(cpu_graph_runner=cpu_graph_runner, LogitsProcessorOutput=LogitsProcessorOutput,
                       CaptureHiddenMode=CaptureHiddenMode, ForwardBatch=ForwardBatch,
                       DecodeCudaGraphRunner=DecodeCudaGraphRunner, get_parallel=get_parallel)
    return sg


class TinyMoE:
    """``model.forward(input_ids, positions, forward_batch)``: router logits looked up per token id, routed by
    ``LAYERS`` real SGLang ``TopK`` modules; each forward's routing (all rows, padding included) is recorded."""

    shared_experts_config = None

    def __init__(self, sg: SimpleNamespace) -> None:
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(VOCAB, E, generator=gen) * 2.0
        self.bias = torch.rand(E, generator=gen) * 0.5
        self.layers = [sg.topk.TopK(top_k=TOP_K, layer_id=i, use_grouped_topk=True, num_expert_group=1, topk_group=1,
                                    renormalize=True, scoring_func="sigmoid", correction_bias=self.bias,
                                    routed_scaling_factor=2.5, apply_routed_scaling_factor_on_output=False,
                                    output_format=sg.topk.TopKOutputFormat.STANDARD) for i in range(LAYERS)]
        self.output = sg.LogitsProcessorOutput
        self.forwards: list[dict[str, Any]] = []

    def spec(self) -> Any:
        import oea

        return oea.RouterSpec(E, TOP_K, "sigmoid", True, self.bias, 1, 1, 1.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any) -> Any:
        logits = self.table[input_ids]
        routed = [layer(torch.zeros(logits.shape[0], 4), logits) for layer in self.layers]
        self.forwards.append({"logits": logits.clone(), "layers": [(r.topk_ids.clone(), r.topk_weights.clone())
                                                                  for r in routed]})
        return self.output(next_token_logits=logits)


def _model_runner(model: TinyMoE) -> SimpleNamespace:
    """The parts of SGLang's ModelRunner a CPUGraphRunner reads (no attention: the model has none)."""
    attention = SimpleNamespace(init_cpu_graph_state=lambda max_bs, max_num_token: None,
                                get_cpu_graph_seq_len_fill_value=lambda: 1,
                                init_forward_metadata_capture_cpu_graph=lambda *a, **k: None,
                                init_forward_metadata=lambda forward_batch: None)
    speculative = SimpleNamespace(is_none=lambda: True, is_eagle=lambda: False, is_standalone=lambda: False,
                                  is_dflash_family=lambda: False)
    return SimpleNamespace(device="cpu", is_draft_worker=False, model_config=SimpleNamespace(is_encoder_decoder=False),
                           spec_algorithm=speculative, attn_backend=attention, model=model,
                           req_to_token_pool=SimpleNamespace(size=64), hisparse_coordinator=None,
                           kv_index_translator=SimpleNamespace(bind_runner_slots=lambda forward_batch: None))


def _batch(sg: SimpleNamespace, rows: int, seed: int) -> Any:
    ids = torch.randint(1, VOCAB, (rows,), generator=torch.Generator().manual_seed(seed))
    return sg.ForwardBatch(forward_mode=sg.ForwardMode.DECODE, batch_size=rows, input_ids=ids,
                           req_pool_indices=torch.arange(rows), seq_lens=torch.full((rows,), 5),
                           out_cache_loc=torch.arange(rows), seq_lens_sum=5 * rows, positions=torch.full((rows,), 4),
                           return_logprob=False, capture_hidden_mode=sg.CaptureHiddenMode.NULL)


def _forward_raw(sg: SimpleNamespace, forward_batch: Any, run: Any) -> Any:
    """What ``ModelRunner._forward_raw`` wraps around every forward: SGLang's forward context with the batch."""
    with sg.fc.forward_context(sg.fc.ForwardContext(attn_backend=None), forward_batch=forward_batch):
        return run()


def _experts(ids: torch.Tensor, weights: torch.Tensor) -> set[int]:
    return set(ids[weights > 0].long().tolist())


def _vanilla(model: TinyMoE, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's own routing of these rows (outside any forward context: OEA does not touch it)."""
    out = model.layers[0](torch.zeros(logits.shape[0], 4), logits)
    return out.topk_ids.clone(), out.topk_weights.clone()


def _graph_runner_replays(sg: SimpleNamespace, model: TinyMoE, check: Checks) -> list[dict[str, Any]]:
    import oea
    from oea.integrations.sglang.state import STATE

    tp_group = SimpleNamespace(barrier=lambda: None, ca_comm=None)
    with sg.get_parallel().override(tp_group=tp_group):
        runner = sg.cpu_graph_runner.CPUGraphRunner(_model_runner(model))  # captures 16, 8, 4
    check("cpu_graph_runner_captured", sorted(runner.graphs) == CAPTURE_BS, f"graphs {sorted(runner.graphs)}")
    figures = []
    cfg = oea.OEAConfig(K0)
    for step, real in enumerate(REPLAYS):
        batch = _batch(sg, real, seed=step)
        model.forwards.clear()
        fills = STATE.padding_fills
        with sg.get_parallel().override(tp_group=tp_group):
            out = _forward_raw(sg, batch, lambda batch=batch: runner.execute(batch))
        recorded = model.forwards[-1]
        rows = recorded["logits"].shape[0]
        logits = recorded["logits"]
        expected = oea.route(logits[:real], model.spec(), cfg)
        vanilla = _vanilla(model, logits)
        joined = oea.route(logits, model.spec(), cfg)  # what OEA would do if padding rows joined the union
        padding_experts = 0
        for layer, (ids, weights) in enumerate(recorded["layers"]):
            check(f"replay{step}_real_rows_equal_oea_route:layer{layer}", *same((ids[:real], weights[:real]),
                                                                               expected))
            check(f"replay{step}_padding_rows_keep_sglang_routing:layer{layer}",
                  *identical((ids[real:], weights[real:]), (vanilla[0][real:], vanilla[1][real:])))
            padding_experts += len(_experts(ids[:real], weights[:real]) - _experts(*expected))
        check(f"replay{step}_fills", STATE.padding_fills - fills == 1,
              f"{STATE.padding_fills - fills} write(s) of the count for {LAYERS} routed layers")
        check(f"replay{step}_output_rows", out.next_token_logits.shape[0] == real,
              f"{out.next_token_logits.shape[0]} rows returned")
        figures.append({"real_rows": real, "graph_rows": rows, "padding_rows": rows - real,
                        "padding_experts_in_union": padding_experts,
                        "T_real_rows": len(_experts(*expected)),
                        "T_if_padding_joined": len(_experts(joined[0][:real], joined[1][:real]))})
    return figures


def _eager_decode(sg: SimpleNamespace, model: TinyMoE, check: Checks) -> None:
    import oea
    from oea.integrations.sglang.state import STATE

    batch = _batch(sg, 20, seed=40)  # larger than any captured size: runs without a graph
    fills = STATE.padding_fills
    model.forwards.clear()
    _forward_raw(sg, batch, lambda: model.forward(batch.input_ids, batch.positions, batch))
    recorded = model.forwards[-1]
    expected = oea.route(recorded["logits"], model.spec(), oea.OEAConfig(K0))
    for layer, routed in enumerate(recorded["layers"]):
        check(f"eager_decode_all_rows_equal_oea_route:layer{layer}", *same(routed, expected))
    check("eager_decode_fills", STATE.padding_fills - fills == 1, f"{STATE.padding_fills - fills} write(s)")


def cuda_runner_stand_in(sg: SimpleNamespace, mode: Any, capture_bs: list[int], width: int = 1) -> Any:
    """A ``DecodeCudaGraphRunner`` object whose graphs were captured for forward ``mode``, ``width`` tokens per
    request, request counts ``capture_bs``: the state its real ``load_batch`` reads (plain TP, no LoRA, no DP,
    no speculative worker), persistent input buffers, no-op attention preparation."""
    runner = object.__new__(sg.DecodeCudaGraphRunner)
    rows = max(capture_bs) * width
    buffers = SimpleNamespace(num_token_non_padded=None, input_ids=torch.zeros(rows, dtype=torch.int64),
                              positions=torch.zeros(rows, dtype=torch.int64))

    def fill_from(forward_batch: Any, *, raw_bs: int, padded_bs: int, raw_num_tokens: int, **_: Any) -> None:
        buffers.input_ids[:raw_num_tokens].copy_(forward_batch.input_ids)  # padding rows keep stale ids

    state = dict(dllm_uses_input_embeds=False, dllm_input_preparation=None, ragged_verify_mode=False,
                 deepep_adapter=SimpleNamespace(replay=lambda: None), capture_hidden_mode=sg.CaptureHiddenMode.NULL,
                 require_mlp_tp_gather=False, capture_bs=capture_bs, captured_req_width=width,
                 attention_graph_variants=None, _early_verify_metadata=None, _metadata_glue=None,
                 buffer_registry=SimpleNamespace(fill_from=fill_from), _skips_prefilled_inputs=False,
                 _prefilled_inputs=None, buffers=buffers, enable_two_batch_overlap=False,
                 _init_replay_attn_metadata=lambda *a, **k: None, _draft_metadata_glue=False,
                 _target_metadata_glue=False, record_nolora_graph=False, enable_pdmux=False,
                 capture_forward_mode=mode,
                 model_runner=SimpleNamespace(spec_algorithm=SimpleNamespace(is_dflash_family=lambda: False),
                                              is_draft_worker=False, hisparse_coordinator=None))
    for name, value in state.items():
        setattr(runner, name, value)
    return runner


def _cuda_replays(sg: SimpleNamespace, model: TinyMoE, check: Checks) -> None:
    """SGLang's real ``DecodeCudaGraphRunner.load_batch`` before each replay of a routing compiled once."""
    from torch._dynamo.utils import counters

    import oea
    from oea.integrations.sglang.state import STATE

    runner = cuda_runner_stand_in(sg, sg.ForwardMode.DECODE, CAPTURE_BS)
    layer = model.layers[0]
    logits = model.table[torch.arange(16) % VOCAB]  # rows past each batch: stale inputs
    capture_batch = SimpleNamespace(forward_mode=sg.ForwardMode.DECODE, input_ids=torch.zeros(16, dtype=torch.int64),
                                    moe_num_token_non_padded=lambda: None)

    def routing(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = layer(torch.zeros(16, 4), router_logits)
        return out.topk_ids, out.topk_weights

    vanilla = _vanilla(model, logits)
    compiled = torch.compile(routing, backend="eager", fullgraph=True)
    with sg.fc.forward_context(sg.fc.ForwardContext(attn_backend=None), forward_batch=capture_batch):
        routing(logits)  # warm-up before capture, as SGLang's graph runners do (Dynamo still off here)
        with torch._dynamo.config.patch(disable=False):
            torch._dynamo.reset()
            compiled(logits)  # the capture
            graphs = counters["stats"]["unique_graphs"]
            for step, real in enumerate((13, 15, 9, 13)):
                batch = _batch(sg, real, seed=60 + step)
                fills = STATE.padding_fills
                runner.load_batch(batch)  # SGLang's own replay preparation, hooked by the plugin
                batch.mark_forward_metadata_ready()
                runner.load_batch(batch)  # the pre-planned path: the real count is already on the device
                ids, weights = compiled(logits)  # the replay: no Python of the plugin runs
                expected = oea.route(logits[:real], model.spec(), oea.OEAConfig(K0))
                check(f"cuda_load_batch{step}_padded", (runner.raw_num_token, runner.bs) == (real, 16),
                      f"raw_num_token {runner.raw_num_token}, bs {runner.bs}")
                check(f"cuda_load_batch{step}_fills", STATE.padding_fills - fills == 1,
                      f"{STATE.padding_fills - fills} write(s) over two load_batch calls")
                check(f"cuda_replay{step}_real_rows_equal_oea_route", *same((ids[:real], weights[:real]), expected))
                check(f"cuda_replay{step}_padding_rows_keep_sglang_routing",
                      *identical((ids[real:], weights[real:]), (vanilla[0][real:], vanilla[1][real:])))
            check("cuda_replays_one_compiled_graph", counters["stats"]["unique_graphs"] == graphs,
                  f"graphs {graphs} -> {counters['stats']['unique_graphs']} (a recompile would re-run the plugin)")


def _sglang_count_wins(sg: SimpleNamespace, model: TinyMoE, check: Checks) -> None:
    import oea

    logits = model.table[torch.arange(16)]
    batch = SimpleNamespace(forward_mode=sg.ForwardMode.DECODE, input_ids=torch.zeros(16, dtype=torch.int64),
                            moe_num_token_non_padded=lambda: torch.tensor(10, dtype=torch.int32))
    with sg.fc.forward_context(sg.fc.ForwardContext(attn_backend=None), forward_batch=batch):
        out = model.layers[0](torch.zeros(16, 4), logits)
    check("sglang_count_used_where_given", *same((out.topk_ids[:10], out.topk_weights[:10]),
                                                  oea.route(logits[:10], model.spec(), oea.OEAConfig(K0))))


def run_padding() -> dict[str, Any]:
    from importlib.metadata import version

    from oea.integrations import sglang as plugin
    from oea.integrations.sglang import padding
    from oea.integrations.sglang.state import STATE

    os.environ["OEA_K0"] = str(K0)
    sg = _setup()
    sg.plugins.load_plugins()
    check = Checks()
    hooked = {target: plugin.target_hooked(target) for target in (padding.DECODE_REPLAY_TARGET,
                                                                  padding.CPU_REPLAY_TARGET)}
    check("replay_hooks_installed", all(hooked.values()), f"{hooked}")
    model = TinyMoE(sg)
    figures = {"replays": _graph_runner_replays(sg, model, check)}
    _eager_decode(sg, model, check)
    _cuda_replays(sg, model, check)
    _sglang_count_wins(sg, model, check)
    check("mechanisms_seen", {"oea", "sglang"} <= STATE.padding_mechanisms, f"{sorted(STATE.padding_mechanisms)}")
    return {"sglang_version": version("sglang"), "checks": check.records, "figures": figures}


def run_padding_missing() -> dict[str, Any]:
    import oea
    from oea.integrations import sglang as plugin
    from oea.integrations.sglang import padding

    records = logged_warnings()
    os.environ["OEA_K0"] = str(K0)
    padding.DECODE_REPLAY_TARGET += "_renamed_in_a_future_sglang"
    padding.CPU_REPLAY_TARGET += "_renamed_in_a_future_sglang"
    sg = _setup()
    check = Checks()
    try:
        sg.plugins.load_plugins()
        check("missing_replay_hook_load_plugins_survives", True, "load_plugins() returned")
    except Exception as err:  # the point of the check: report, don't crash the script
        check("missing_replay_hook_load_plugins_survives", False, f"{type(err).__name__}: {err}")
    model = TinyMoE(sg)
    tp_group = SimpleNamespace(barrier=lambda: None, ca_comm=None)
    with sg.get_parallel().override(tp_group=tp_group):
        runner = sg.cpu_graph_runner.CPUGraphRunner(_model_runner(model))
        for step, real in enumerate((15, 13)):
            batch = _batch(sg, real, seed=step)
            _forward_raw(sg, batch, lambda batch=batch: runner.execute(batch))
    recorded = model.forwards[-1]
    joined = oea.route(recorded["logits"], model.spec(), oea.OEAConfig(K0))  # today's behaviour: all 16 rows
    for layer, routed in enumerate(recorded["layers"]):
        check(f"missing_replay_hook_todays_behaviour:layer{layer}", *same(routed, joined))
    warned = [r for r in records if "replay hook point" in r]
    check("missing_replay_hook_warned_once_with_workaround", len(warned) == 1 and "--disable-cuda-graph-padding"
          in warned[0] and padding.DECODE_REPLAY_TARGET in warned[0], f"{warned}")
    doctor = {c["name"]: c for c in plugin.doctor_checks()}
    line = doctor.get("cuda-graph padding", {"ok": True, "detail": "check absent"})
    check("doctor_names_missing_replay_hook", not line["ok"] and padding.DECODE_REPLAY_TARGET in line["detail"]
          and "--disable-cuda-graph-padding" in line["detail"], line["detail"])
    return {"checks": check.records}
