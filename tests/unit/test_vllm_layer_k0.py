"""``OEA_LAYER_K0_FILE`` in the vLLM plugin, with stand-ins for vLLM (no vLLM needed): each router routes with its
layer's k0 (and, with ``batch_k0``, the k0 of the call's batch size) in the CPU op (numba kernel) and in the
GPU-side graph wrapper, eager and compiled; a file for another model stops model load naming it."""

from __future__ import annotations

import pathlib

import pytest
import torch
from vllm_stand_ins import CPURouter, dense, loaded_state, scheduler_output

import oea.integrations.vllm.layers as layers
import oea.integrations.vllm.routing as plugin_routing
import oea.integrations.vllm.steps as plugin_steps
from oea.config import write_layer_k0_file
from oea.routing import EPOEAConfig, ExpertPlacement, LayerK0Schedule, OEAConfig, active_experts, route

torch.set_num_threads(1)


N, K, LAYERS = 64, 8, 3


def _file(tmp_path: pathlib.Path, k0: tuple[int, ...], batch_k0=None, min_batch: int = 2, layers_: int = LAYERS) -> str:
    path = tmp_path / "k0.json"
    write_layer_k0_file(LayerK0Schedule(N, K, layers_, k0, min_batch=min_batch, batch_k0=batch_k0), path)
    return str(path)


def _state(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]):
    return loaded_state(monkeypatch, env, LAYERS, N, K)


def _logits(rows: int, seed: int) -> torch.Tensor:
    """Tie-free logits (a random permutation per row)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(N, generator=gen) for _ in range(rows)]).float() / 8


def _cpu_step(state, rows: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A decode step of ``rows`` rows through every router's CPU op: (logits, weights, ids) per router."""
    plugin_steps.begin_step(scheduler_output([1] * rows))
    try:
        out = []
        for i, router in enumerate(state.routers):
            x = _logits(rows, seed + i)
            stock = router.route_stock(x)
            out.append((x, *plugin_routing.cpu_route_body(x, stock[0], stock[1], i)))
        return out
    finally:
        plugin_steps.end_step()


def _expected(x: torch.Tensor, k0: int, min_batch: int = 2) -> torch.Tensor:
    ids, weights = route(x, CPURouter(num_experts=N, top_k=K).spec(), OEAConfig(k0, min_batch=min_batch))
    return dense(weights, ids, N)


def test_each_layer_routes_with_its_own_k0_in_the_cpu_op(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: pathlib.Path) -> None:
    state = _state(monkeypatch, {"OEA_K0": "2", "OEA_LAYER_K0_FILE": _file(tmp_path, (1, 3, 8))})
    for layer, (x, weights, ids) in enumerate(_cpu_step(state, 12, seed=10)):
        torch.testing.assert_close(dense(weights, ids, N), _expected(x, (1, 3, 8)[layer]))
    t = [int(active_experts(ids.long(), w)) for _, w, ids in _cpu_step(state, 12, seed=20)]
    assert t[0] < t[1] < t[2], f"k0 1 < 3 < 8 must load fewer experts, got {t}"


def test_batch_size_ranges_pick_the_k0_from_the_call_rows(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: pathlib.Path) -> None:
    """batch_k0: up to 4 rows every layer keeps k0 = 8 (vanilla), up to 16 rows k0 = (1, 2, 4), beyond: (2, 2, 2).
    One router sees all three sizes in turn, so its kernel is prepared per k0, not once."""
    batch_k0 = ((4, (8, 8, 8)), (16, (1, 2, 4)), (64, (2, 2, 2)))
    state = _state(monkeypatch, {"OEA_K0": "3", "OEA_LAYER_K0_FILE": _file(tmp_path, (8, 8, 8), batch_k0)})
    for rows, k0s in ((3, (8, 8, 8)), (10, (1, 2, 4)), (20, (2, 2, 2)), (4, (8, 8, 8)), (16, (1, 2, 4))):
        for layer, (x, weights, ids) in enumerate(_cpu_step(state, rows, seed=rows)):
            torch.testing.assert_close(dense(weights, ids, N), _expected(x, k0s[layer]), msg=f"{rows} rows")


def test_the_files_min_batch_applies_unless_oea_min_batch_is_set(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: pathlib.Path) -> None:
    path = _file(tmp_path, (1, 1, 1), min_batch=4)
    state = _state(monkeypatch, {"OEA_K0": "2", "OEA_LAYER_K0_FILE": path})
    x, weights, ids = _cpu_step(state, 3, seed=1)[0]
    assert torch.equal(dense(weights, ids, N), dense(*state.routers[0].route_stock(x), N)), "3 rows < min_batch 4"
    state = _state(monkeypatch, {"OEA_K0": "2", "OEA_MIN_BATCH": "2", "OEA_LAYER_K0_FILE": path})
    x, weights, ids = _cpu_step(state, 3, seed=1)[0]
    torch.testing.assert_close(dense(weights, ids, N), _expected(x, 1))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.usefixtures("fresh_dynamo")
def test_graph_wrapper_uses_the_layer_and_batch_size_k0(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                                       compiled: bool) -> None:
    """GPU-side routers: the k0 follows the call's (static) row count, as for one captured graph per size."""
    batch_k0 = ((4, (8, 1, 8)), (64, (2, 1, 5)))
    state = _state(monkeypatch, {"OEA_K0": "3", "OEA_LAYER_K0_FILE": _file(tmp_path, (8, 1, 8), batch_k0)})
    state.decode = True
    state.decode_flag.fill_(True)

    def stock(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        return self.route_stock(router_logits)

    wrapped = plugin_routing.graph_wrapper(stock)
    for layer, router in enumerate(state.routers):
        call = (lambda r: lambda x: wrapped(r, None, x, None))(router)
        if compiled:
            call = torch.compile(call, fullgraph=True, dynamic=False)
        for rows, k0s in ((4, (8, 1, 8)), (9, (2, 1, 5))):
            x = _logits(rows, seed=100 * layer + rows)
            weights, ids = call(x)
            torch.testing.assert_close(dense(weights, ids, N), _expected(x, k0s[layer]), msg=f"layer {layer}")


def test_a_file_for_another_model_stops_model_load_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: pathlib.Path) -> None:
    path = _file(tmp_path, (1, 2), layers_=2)
    with pytest.raises(ValueError, match=r"OEA_LAYER_K0_FILE=.*k0\.json.*num_layers: file has 2, model has 3"):
        _state(monkeypatch, {"OEA_K0": "2", "OEA_LAYER_K0_FILE": path})
    with pytest.raises(ValueError, match=r"OEA_LAYER_K0_FILE=.*OEA_MAX_EXPERTS=2"):
        _state(monkeypatch, {"OEA_K0": "2", "OEA_MAX_EXPERTS": "2", "OEA_LAYER_K0_FILE": _file(tmp_path, (1, 3, 2))})


def test_without_oea_k0_or_without_the_file_nothing_changes(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: pathlib.Path) -> None:
    state = _state(monkeypatch, {"OEA_LAYER_K0_FILE": _file(tmp_path, (1, 1, 1))})
    assert state.layers is None and layers.layer_config(0, 8, None) is None
    state = _state(monkeypatch, {"OEA_K0": "2"})
    assert state.layers.schedule is None and layers.layer_config(0, 8, state.settings.oea) is state.settings.oea


def test_another_policy_with_a_k0_gets_the_layers_k0(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """EP-aware OEA (OEA_POLICY=ep) keeps its placement and takes each layer's k0 and min_batch."""
    _state(monkeypatch, {"OEA_K0": "2", "OEA_LAYER_K0_FILE": _file(tmp_path, (1, 3, 6), min_batch=3)})
    ep = EPOEAConfig(2, ExpertPlacement.contiguous(N, 4), boost_rank=4)
    got = [layers.layer_config(layer, 8, ep) for layer in range(LAYERS)]
    assert [(c.k0, c.min_batch, c.boost_rank) for c in got] == [(1, 3, 4), (3, 3, 4), (6, 3, 6)]
    assert all(c.placement is ep.placement for c in got)
    assert layers.layer_config(1, 8, ep) is got[1], "built once per (router, k0)"


def test_a_replaced_default_policy_rebuilds_every_layers_config(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: pathlib.Path) -> None:
    """OEA_POLICY=ep with a per-layer k0 file: when each router's EP-aware config is replaced between steps (EPLB
    rebalanced onto another placement, or a reload hands the layer a new policy), the next step routes every
    layer with the new placement and the layer's own k0, never with a config cached from the old one."""
    from oea.integrations.vllm.router_state import router_state

    state = _state(monkeypatch, {"OEA_K0": "2", "OEA_POLICY": "ep",
                                 "OEA_LAYER_K0_FILE": _file(tmp_path, (1, 3, 6), min_batch=2)})
    contiguous = ExpertPlacement.contiguous(N, 4)
    interleaved = ExpertPlacement(torch.arange(N) % 4, 4)  # expert e on device e mod 4
    for placement_now in (contiguous, interleaved, contiguous):
        for i in range(LAYERS):
            router_state(i).ep = EPOEAConfig(2, placement_now)  # what placement.CONFIGS builds and refreshes
        for layer, (x, weights, ids) in enumerate(_cpu_step(state, 12, seed=40)):
            want = route(x, CPURouter(num_experts=N, top_k=K).spec(),
                         EPOEAConfig((1, 3, 6)[layer], placement_now, min_batch=2))
            where = placement_now.device_of_expert[:5].tolist()
            torch.testing.assert_close(dense(weights, ids, N), dense(want[1], want[0], N),
                                       msg=f"layer {layer}, placement starting {where}")
    x = _logits(12, seed=41)  # layer 1's input: the two placements route it differently
    spec = CPURouter(num_experts=N, top_k=K).spec()
    assert not torch.equal(*(dense(*reversed(route(x, spec, EPOEAConfig(3, p))), N) for p in (contiguous, interleaved)))
