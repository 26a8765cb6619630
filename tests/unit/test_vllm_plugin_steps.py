"""The vLLM plugin step by step, with stand-ins for vLLM's forward context and numba (no vLLM needed):
which steps it reroutes, which rows count, and what it hands back to vLLM."""

from __future__ import annotations

import pytest
import torch
from vllm_stand_ins import (
    CPURouter,
    dense,
    fresh_state,
    install_vllm,
    scheduler_output,
)

import oea.integrations.metrics as plugin_metrics
import oea.integrations.vllm.routing as plugin_routing
import oea.integrations.vllm.steps as plugin_steps
from oea.routing import OEAConfig, route

torch.set_num_threads(1)
N, K = 64, 8
FLAGS_IN_STEP: list[tuple[bool, bool]] = []  # (Python flag, device flag) seen by each step's routing call


def _logits(rows: int, seed: int) -> torch.Tensor:
    """Tie-free logits (a random permutation per row)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(N, generator=gen) for _ in range(rows)]).float() / 8


def _oea(logits: torch.Tensor, k0: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    ids, weights = route(logits, CPURouter().spec(), OEAConfig(k0, min_batch=0), valid)
    return dense(weights, ids, N)


def _step(router: CPURouter, tokens_per_request: list[int], logits: torch.Tensor
          ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """One engine step through the plugin's worker hook and CPU op: (plugin output, stock routing)."""
    stock = router.route_stock(logits)
    plugin_steps.begin_step(scheduler_output(tokens_per_request))
    try:
        out = plugin_routing.cpu_route_body(logits, stock[0], stock[1], 0)
        state = plugin_routing.STATE
        FLAGS_IN_STEP.append((state.decode, bool(state.decode_flag)))
    finally:
        plugin_steps.end_step()
    return out, stock


def _assert_stock(out: tuple[torch.Tensor, torch.Tensor], stock: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(out[0], stock[0]) and torch.equal(out[1], stock[1])


def test_prefill_steps_after_decode_steps_keep_stock_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    install_vllm(monkeypatch)
    router = CPURouter()
    state = fresh_state(monkeypatch, {"OEA_K0": "2"}, router)
    steps = [[5], [1, 1, 1, 1], [1, 1, 1, 1], [7], [3, 1], [1, 1, 1, 1], [6]]  # prefill / decode / mixed
    for n, tokens in enumerate(steps):
        logits = _logits(sum(tokens), seed=n)
        out, stock = _step(router, tokens, logits)
        decode = all(t == 1 for t in tokens)
        assert FLAGS_IN_STEP[-1] == (decode, decode), f"step {n}: flag not set per step"
        assert not state.decode and not bool(state.decode_flag), f"step {n}: flag not cleared after the step"
        if decode:
            torch.testing.assert_close(dense(*out, N), _oea(logits, 2))
            assert not torch.equal(dense(*out, N), dense(*stock, N))
        else:
            _assert_stock(out, stock)


@pytest.mark.parametrize("min_batch", [2, 3, 5])
def test_decode_steps_reroute_from_exactly_min_batch_real_rows(monkeypatch: pytest.MonkeyPatch,
                                                              min_batch: int) -> None:
    context = install_vllm(monkeypatch)
    router = CPURouter()
    fresh_state(monkeypatch, {"OEA_K0": "1", "OEA_MIN_BATCH": str(min_batch)}, router)
    logits = _logits(min_batch + 3, seed=min_batch)

    exact = logits[:min_batch]  # no padding: exactly min_batch rows are rerouted, one fewer are not
    out, _ = _step(router, [1] * min_batch, exact)
    torch.testing.assert_close(dense(*out, N), _oea(exact, 1))
    out, stock = _step(router, [1] * (min_batch - 1), logits[: min_batch - 1])
    _assert_stock(out, stock)

    # 3 padding rows: exactly min_batch real rows are rerouted as if alone, padding rows stay stock
    context.is_padding = torch.arange(min_batch + 3) >= min_batch
    out, stock = _step(router, [1] * min_batch, logits)
    torch.testing.assert_close(dense(out[0][:min_batch], out[1][:min_batch], N), _oea(exact, 1))
    torch.testing.assert_close(dense(out[0][min_batch:], out[1][min_batch:], N),  # same experts and weights;
                               dense(stock[0][min_batch:], stock[1][min_batch:], N))  # slot order may differ
    context.is_padding = torch.arange(min_batch + 3) >= min_batch - 1  # one real row fewer: all stock
    out, stock = _step(router, [1] * (min_batch - 1), logits)
    _assert_stock(out, stock)


def test_padding_rows_anywhere_in_the_batch_leave_the_union(monkeypatch: pytest.MonkeyPatch) -> None:
    context = install_vllm(monkeypatch)
    router = CPURouter()
    fresh_state(monkeypatch, {"OEA_K0": "2"}, router)
    logits = _logits(7, seed=11)
    padding = torch.tensor([False, True, False, True, True, False, False])
    context.is_padding = torch.cat([padding, torch.ones(3, dtype=torch.bool)])  # longer than the step: sliced
    out, stock = _step(router, [1, 1, 1, 1], logits)
    real = ~padding
    torch.testing.assert_close(dense(out[0][real], out[1][real], N), _oea(logits[real], 2))
    torch.testing.assert_close(dense(out[0][padding], out[1][padding], N),
                               dense(stock[0][padding], stock[1][padding], N))
    context.available = False  # no forward context (e.g. a profiling run): every row counts as real
    out, _ = _step(router, [1] * 7, logits)
    torch.testing.assert_close(dense(*out, N), _oea(logits, 2))


def test_metrics_record_what_each_step_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    install_vllm(monkeypatch)
    router = CPURouter()
    state = fresh_state(monkeypatch, {"OEA_K0": "1"}, router)
    added: list[plugin_metrics.StepRecord] = []
    state.metrics = type("Sink", (), {"add": lambda self, step, record: added.append(record), "outside_rows": 0})()
    for n, tokens in enumerate([[4], [1, 1, 1], [1], [5]]):
        _step(router, tokens, _logits(sum(tokens), seed=20 + n))
    plugin_steps.begin_step(scheduler_output([1, 1]))  # a step that ran no MoE layer writes no row
    plugin_steps.end_step()
    prefill, decode, single, prefill_again = added
    assert (decode.decode, decode.oea) == (True, True) and decode.rows == 3
    assert int(decode.active[0]) < int(decode.active_stock[0])
    for record in (prefill, single, prefill_again):  # not rewritten: the counts are the stock counts
        assert not record.oea
        assert int(record.active[0]) == int(record.active_stock[0])
    assert (prefill.rows, single.rows, prefill_again.rows) == (4, 1, 5)
    assert all(r.padding_rows == 0 and len(r.routed[0]) == 16 for r in added)
    assert decode.routed[0] == plugin_metrics.routed_hash(*reversed(_step(router, [1, 1, 1], _logits(3, 21))[0]),
                                                          None), "the hash is of the routed ids and weights"


def test_forwards_outside_a_step_keep_stock_routing_and_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DP rank's dummy batch or a warm-up run calls the router outside ``execute_model``: after a decode step
    the flag is cleared, so it routes as vLLM does; its rows go into the next step's ``outside_rows``."""
    install_vllm(monkeypatch)
    router = CPURouter()
    state = fresh_state(monkeypatch, {"OEA_K0": "1"}, router)
    added: list[plugin_metrics.StepRecord] = []
    state.metrics = type("Sink", (), {"add": lambda self, step, record: added.append(record), "outside_rows": 0})()
    _step(router, [1, 1, 1, 1], _logits(4, seed=30))  # a rerouted decode step
    logits = _logits(3, seed=31)
    stock = router.route_stock(logits)
    _assert_stock(plugin_routing.cpu_route_body(logits, stock[0], stock[1], 0), stock)  # a dummy batch
    _step(router, [1, 1], _logits(2, seed=32))
    assert added[0].oea and added[0].outside_rows == 0
    assert added[1].outside_rows == 3 and state.metrics.outside_rows == 0


def test_graph_wrapper_keeps_appended_shared_expert_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    install_vllm(monkeypatch)
    router = CPURouter()
    state = fresh_state(monkeypatch, {"OEA_K0": "2"}, router)
    logits = _logits(6, seed=3)
    shared_w, shared_ids = torch.full((6, 1), 0.25), torch.full((6, 1), N, dtype=torch.int32)

    def stock_with_shared(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        weights, ids = self.route_stock(router_logits)
        return torch.cat([weights, shared_w], dim=1), torch.cat([ids, shared_ids], dim=1)

    wrapped = plugin_routing.graph_wrapper(stock_with_shared)
    state.decode = False  # eager prefill: stock output, untouched
    weights, ids = wrapped(router, None, logits, None)
    assert ids.shape == (6, K + 1) and torch.equal(ids[:, :K], router.route_stock(logits)[1])
    state.decode = True
    weights, ids = wrapped(router, None, logits, None)
    assert weights.shape == ids.shape == (6, K + 1), "the shared-expert column must survive the rewrite"
    assert torch.equal(ids[:, K:], shared_ids) and torch.equal(weights[:, K:], shared_w)
    torch.testing.assert_close(dense(weights[:, :K], ids[:, :K], N), _oea(logits, 2))


def _stock_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
    return self.route_stock(router_logits)


def test_graph_wrapper_keeps_stock_routing_below_min_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU routers (eager decode): fewer than OEA_MIN_BATCH real rows keep vLLM's routing, as on CPU."""
    context = install_vllm(monkeypatch)
    router = CPURouter()
    state = fresh_state(monkeypatch, {"OEA_K0": "1", "OEA_MIN_BATCH": "3"}, router)
    state.decode = True
    wrapped = plugin_routing.graph_wrapper(_stock_routing)
    logits = _logits(5, seed=8)
    for rows in (1, 2):  # no padding, below min_batch
        weights, ids = wrapped(router, None, logits[:rows], None)
        _assert_stock((weights, ids), router.route_stock(logits[:rows]))
    weights, ids = wrapped(router, None, logits[:3], None)  # exactly min_batch
    torch.testing.assert_close(dense(weights, ids, N), _oea(logits[:3], 1))
    context.is_padding = torch.tensor([False, False, True, True, True])  # 2 real rows + 3 padding rows
    weights, ids = wrapped(router, None, logits, None)
    torch.testing.assert_close(dense(weights, ids, N), dense(*router.route_stock(logits), N))
    context.is_padding = torch.tensor([False, False, False, True, True])  # 3 real rows
    weights, ids = wrapped(router, None, logits, None)
    torch.testing.assert_close(dense(weights[:3], ids[:3], N), _oea(logits[:3], 1))


@pytest.mark.slow
def test_graph_wrapper_min_batch_and_decode_flag_inside_a_compiled_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traced (as for CUDA graphs): the real-row count and the decode flag are device values read at run time."""
    torch._dynamo.reset()
    context = install_vllm(monkeypatch)
    router = CPURouter()
    state = fresh_state(monkeypatch, {"OEA_K0": "1", "OEA_MIN_BATCH": "3"}, router)
    wrapped = plugin_routing.graph_wrapper(_stock_routing)
    compiled = torch.compile(lambda x: wrapped(router, None, x, None), fullgraph=True, dynamic=False)
    logits = _logits(5, seed=9)
    stock = dense(*router.route_stock(logits), N)
    context.is_padding = torch.zeros(5, dtype=torch.bool)
    for real, decode in ((5, True), (2, True), (5, False), (3, True)):
        context.is_padding.copy_(torch.arange(5) >= real)  # in place, as vLLM's persistent buffer
        state.decode_flag.fill_(decode)
        weights, ids = compiled(logits)
        if decode and real >= 3:
            torch.testing.assert_close(dense(weights[:real], ids[:real], N), _oea(logits[:real], 1))
        else:
            torch.testing.assert_close(dense(weights, ids, N), stock)


def test_k0_top_k_keeps_vllms_own_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """k0 = top_k keeps every token's top-k: vLLM's routing is handed back as it is (slot order, weights)."""
    install_vllm(monkeypatch)
    router = CPURouter()
    state = fresh_state(monkeypatch, {"OEA_K0": str(K)}, router)
    added: list[plugin_metrics.StepRecord] = []
    state.metrics = type("Sink", (), {"add": lambda self, step, record: added.append(record), "outside_rows": 0})()
    out, stock = _step(router, [1, 1, 1, 1], _logits(4, seed=40))
    _assert_stock(out, stock)
    assert added[0].decode and not added[0].oea


def test_logits_gathered_across_dp_ranks_keep_stock_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A routing call holding more rows than the largest DP rank's batch has other ranks' rows (vLLM's naive
    DP dispatch gathers them before routing): ranks may be in different phases there, so stock routing."""
    from types import SimpleNamespace

    context = install_vllm(monkeypatch)
    router = CPURouter()
    fresh_state(monkeypatch, {"OEA_K0": "2"}, router)
    context.dp_metadata = SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([3, 5]))
    out, stock = _step(router, [1] * 8, _logits(8, seed=41))  # 3 + 5 gathered rows
    _assert_stock(out, stock)
    out, stock = _step(router, [1] * 5, _logits(5, seed=42))  # this rank's own 5 rows
    torch.testing.assert_close(dense(*out, N), _oea(_logits(5, seed=42), 2))


def test_the_metrics_files_routed_hash_is_of_the_real_rows_alone(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``OEA_METRICS_FILE``: the same 5 real rows routed once alone and once with 3 padding rows between them
    (a padded graph batch) give the same ``routed`` hash per layer, which is BLAKE2b over the real rows' ids
    (int64) and weights (float32) only: ranks that route the same rows compare equal."""
    import hashlib
    import json

    import oea.integrations.vllm.plugin as plugin_hooks

    class MoELayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = CPURouter()

    context = install_vllm(monkeypatch)
    path = tmp_path / "metrics.jsonl"
    state = fresh_state(monkeypatch, {"OEA_K0": "2", "OEA_METRICS_FILE": str(path)})
    plugin_hooks._after_load(torch.nn.Sequential(MoELayer(), MoELayer()))
    real = _logits(5, seed=30)
    padding = torch.tensor([False, True, False, False, True, False, False, True])
    padded = torch.empty(8, N)
    padded[~padding], padded[padding] = real, _logits(3, seed=31)
    outputs = []
    for logits, mask in ((real, None), (padded, padding)):
        context.is_padding = mask
        plugin_steps.begin_step(scheduler_output([1] * 5))
        try:
            outputs.append([plugin_routing.cpu_route_body(logits, *state.routers[i].route_stock(logits), i)
                            for i in range(2)])
        finally:
            plugin_steps.end_step()
    state.metrics.flush()
    alone, with_padding = (json.loads(line) for line in path.read_text().splitlines())
    assert (with_padding["rows"], with_padding["padding_rows"], with_padding["oea"]) == (5, 3, True)
    assert len(with_padding["routed"]) == 2 and with_padding["routed"] == alone["routed"]
    for layer, (weights, ids) in enumerate(outputs[1]):
        digest = hashlib.blake2b(ids[~padding].to(torch.int64).numpy().tobytes(), digest_size=8)
        digest.update(weights[~padding].to(torch.float32).numpy().tobytes())
        assert with_padding["routed"][layer] == digest.hexdigest()
