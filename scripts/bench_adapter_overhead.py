"""What OEA adds to one routing call of an engine, in-process (no server): the engine's own routing entry
point as OEA hooks it, OEA k0 = K0 against the same entry point unhooked, on the same logits, in paired rounds.

Run inside an engine's venv, from the repository root, one engine per process (the two venvs differ)::

    nice -n 19 .venv-sglang/bin/python scripts/bench_adapter_overhead.py sglang --rounds 40 --json out-sglang.json
    nice -n 19 .venv-vllm/bin/python scripts/bench_adapter_overhead.py vllm --rounds 40 --json out-vllm.json

The span timed is one whole call of the routing entry point a MoE layer makes, stock or hooked:

* SGLang: ``TopK.forward`` of a Qwen3-MoE-shaped ``TopK`` inside a DECODE ``forward_context`` (stock: SGLang's
  ``select_experts`` and ``_post_process_topk_ids`` unhooked; OEA: both as the plugin's hooks wrap them after
  SGLang's own ``load_plugins()`` with ``OEA_K0``);
* vLLM: ``CPURouter._compute_routing`` (stock: vLLM's; OEA: the plugin's ``cpu_wrapper`` with the custom op
  ``oea::cpu_route`` in a decode step, eager: the op's Python body runs the same way inside vLLM's compiled graph).

Metrics and timing (``OEA_METRICS_FILE``, ``OEA_TIMING``) are off: the serving path. Each round times ``--calls``
calls of each arm (arm order alternating per round: A B, then B A) and keeps each arm's median call; the added
cost is the per-round difference (``oea.stats.paired_difference``), the ratio ``ratio_of_medians_interval``
(paired). One torch thread. Shapes default to the embedded / inflated model's router: 16 decode rows, 128 experts,
top-8, softmax with renormalisation, bf16 logits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"
for _name in ("OEA_K0", "SGLANG_OEA_K0", "OEA_METRICS_FILE", "OEA_TIMING", "OEA_TRACE_FILE", "SGLANG_USE_CPU_ENGINE"):
    os.environ.pop(_name, None)

import numpy as np  # noqa: E402  (after the thread settings above, as torch reads them at import)
import torch  # noqa: E402

torch.set_num_threads(1)
torch._dynamo.config.disable = True  # SGLang's grouped top-k helpers are @torch.compile'd; eager, as the checks

Call = Callable[[], Any]


def _sglang_arms(logits: torch.Tensor, k0: int, top_k: int) -> tuple[Call, Call, Callable[[bool], Any]]:
    """(stock call, OEA call, context(oea) entering a DECODE forward) for SGLang's ``TopK``."""
    from types import SimpleNamespace

    import sglang.srt.layers.moe.topk as topk
    import sglang.srt.model_executor.forward_context as fc
    import sglang.srt.plugins as plugins
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy", device="cpu"), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    names = ("select_experts", "_post_process_topk_ids")
    stock = {name: getattr(topk, name) for name in names}
    stock_context = fc.forward_context
    os.environ["OEA_K0"] = str(k0)
    plugins.load_plugins()
    hooked = {name: getattr(topk, name) for name in names}
    hooked_context = fc.forward_context
    if any(hooked[name] is stock[name] for name in names):
        raise SystemExit("the OEA plugin did not hook SGLang's routing (is oea installed in this venv?)")
    layer = topk.TopK(top_k=top_k, renormalize=True, use_grouped_topk=False, layer_id=0)
    hidden = torch.zeros(logits.shape[0], 4)

    def use(oea: bool) -> Any:
        for name in names:
            setattr(topk, name, (hooked if oea else stock)[name])
        context = hooked_context if oea else stock_context
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, moe_num_token_non_padded=None,
                                input_ids=torch.zeros(logits.shape[0], dtype=torch.long))
        return context(fc.ForwardContext(attn_backend=None), forward_batch=batch)

    def call() -> Any:
        return layer(hidden, logits)

    return call, call, use


def _vllm_arms(logits: torch.Tensor, k0: int, top_k: int) -> tuple[Call, Call, Callable[[bool], Any]]:
    """(stock call, OEA call, context(oea)) for vLLM's ``CPURouter._compute_routing``, set up as ``register`` and
    model load leave it (the state tests/engines/test_vllm_plugin_hooks.py builds)."""
    import contextlib

    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    import oea.integrations.vllm as plugin
    import oea.integrations.vllm.routing as plugin_routing
    from oea.config import settings_from_env
    from oea.integrations.vllm.state import STATE

    original = CPURouter.__dict__["_compute_routing"]
    STATE.settings = settings_from_env({"OEA_K0": str(k0)})
    STATE.mode, STATE.decode, STATE.timing = "oea", True, False
    STATE.originals["CPURouter"] = original
    plugin_routing.define_cpu_op()
    router = CPURouter(top_k=top_k, global_num_experts=logits.shape[1], renormalize=True)
    router._oea_router_id = 0
    STATE.routers.append(router)
    STATE.specs.append(plugin.router_spec(router)[0])
    wrapped = plugin_routing.cpu_wrapper(original)

    def stock() -> Any:
        return original(router, None, logits, None)

    def oea() -> Any:
        return wrapped(router, None, logits, None)

    return stock, oea, lambda _oea: contextlib.nullcontext()


def _median_call_us(call: Call, calls: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def run(engine: str, rounds: int, calls: int, rows: int, experts: int, top_k: int, k0: int,
        seed: int) -> dict[str, Any]:
    """Paired rounds of the engine's stock and OEA routing calls; per-round medians and their comparison."""
    from oea.stats import median_interval, paired_difference, ratio_of_medians_interval

    load_before = os.getloadavg()  # the machine is shared: its load when the rounds start and (main) after them
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, experts, generator=gen) * 2.0).bfloat16()
    stock, oea, context = (_sglang_arms if engine == "sglang" else _vllm_arms)(logits, k0, top_k)
    from oea.routing import active_experts

    active = {}
    for arm, call in (("stock", stock), ("oea", oea)):
        with context(arm == "oea"):
            out = call()
        ids, weights = (out.topk_ids, out.topk_weights) if engine == "sglang" else (out[1], out[0])
        active[arm] = int(active_experts(ids.long(), weights.float()))
    if active["oea"] >= active["stock"]:
        raise SystemExit(f"OEA did not rewrite the routing (active experts {active})")
    medians: dict[str, list[float]] = {"stock": [], "oea": []}
    for r in range(rounds):
        order = ("stock", "oea") if r % 2 == 0 else ("oea", "stock")
        for arm in order:
            with context(arm == "oea"):
                medians[arm].append(_median_call_us(oea if arm == "oea" else stock, calls, warmup=5))
    rng = np.random.default_rng(seed)
    added = paired_difference(medians["oea"], medians["stock"])
    return {
        "engine": engine, "rounds": rounds, "calls_per_round": calls, "rows": rows, "experts": experts,
        "top_k": top_k, "k0": k0, "dtype": "bfloat16", "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus", "load_before": load_before,
        "stock_us": _interval(median_interval(medians["stock"], rng)),
        "oea_us": _interval(median_interval(medians["oea"], rng)),
        "added_us": {"mean": added.mean, "low": added.ci.low, "high": added.ci.high, "p_value": added.p_value},
        "added_us_median": _interval(median_interval(
            [a - b for a, b in zip(medians["oea"], medians["stock"], strict=True)], rng)),
        "oea_over_stock": _interval(ratio_of_medians_interval(medians["oea"], medians["stock"], rng, paired=True)),
        "active_experts": active, "per_round": medians,
    }


def _interval(interval: Any) -> dict[str, float]:
    return {"estimate": interval.estimate, "low": interval.low, "high": interval.high}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("engine", choices=("sglang", "vllm"))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200, help="timed calls per arm and round")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--k0", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    result = run(args.engine, args.rounds, args.calls, args.rows, args.experts, args.top_k, args.k0, args.seed)
    result["load_after"] = os.getloadavg()
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    summary = {key: result[key] for key in ("engine", "stock_us", "oea_us", "added_us", "oea_over_stock")}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
