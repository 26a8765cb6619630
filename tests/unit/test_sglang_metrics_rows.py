"""The SGLang plugin's ``OEA_METRICS_FILE`` rows and ``OEA_TRACE_FILE`` steps, driven as SGLang drives them: the
plugin's ``register`` (the ``sglang.srt.plugins`` entry point) with a stand-in ``HookRegistry``, then the hooks it
registered, called the way SGLang calls them: the forward-context AROUND hook around each forward, the
``_post_process_topk_ids`` BEFORE hook for each MoE layer's routing call.

Held here: a forward that routed nothing writes no row; a step OEA left to SGLang (below ``OEA_MIN_BATCH``,
k0 >= top_k, a layer it cannot rewrite) is never marked rewritten; an appended shared-expert column is not an
active expert; rows routed outside any forward are counted once per pass, not once per layer; a verify forward
is recorded only with ``OEA_APPLY_TO_VERIFY=1``; a forward context nested in another is the same trace step."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_stand_ins import FakeMode, fresh_state, topk_config, topk_module

import oea
import oea.integrations.sglang.metrics as sglang_metrics
import oea.integrations.sglang.plugin as plugin_entry
import oea.integrations.sglang.recording as sglang_recording
from oea.integrations import sglang as plugin
from oea.integrations.metrics import MetricsWriter
from oea.integrations.recording.recorder import TraceRecorder

REAL_HOOK_PLAN = plugin.hook_plan
EXPERTS = 64


def _fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every per-process object of the plugin's metrics and recording modules as new (restored after)."""
    for module in (sglang_metrics, sglang_recording):
        for value in list(vars(module).values()):
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                for field in dataclasses.fields(value):
                    monkeypatch.setattr(value, field.name, getattr(type(value)(), field.name))


@dataclasses.dataclass
class Server:
    """The hooks ``register`` gave SGLang, and what the metrics writer and the trace recorder were handed."""

    hooks: dict[str, Any]
    writers: list[MetricsWriter]
    steps: list[tuple[int, int]]  # (trace step, rows) submitted to the trace recorder

    @contextlib.contextmanager
    def forward(self, mode: FakeMode, rows: int) -> Iterator[None]:
        """One forward of ``rows`` requests in ``mode``, as SGLang's ``forward_context(ctx, forward_batch=...)``."""
        lens = torch.arange(rows) + 5
        batch = SimpleNamespace(forward_mode=mode, batch_size=rows, rids=[f"r{i}" for i in range(rows)],
                                seq_lens=lens, seq_lens_cpu=lens, input_ids=torch.zeros(rows))

        @contextlib.contextmanager
        def sglang_forward_context(_ctx: Any, *, forward_batch: Any = None) -> Iterator[None]:
            yield

        with self.hooks[plugin.FORWARD_CONTEXT_TARGET](sglang_forward_context, None, forward_batch=batch):
            yield

    def route(self, layer: int, rows: int, cfg: SimpleNamespace | None = None, shared: int = 0, seed: int = 0
              ) -> None:
        """One MoE layer's routing call: SGLang's top-k of ``rows`` rows, ``shared`` shared-expert columns
        (expert id ``EXPERTS``) appended, through the post-process BEFORE hook."""
        cfg = cfg or topk_config(top_k=8 + shared, num_shared_topk_slots=shared)
        logits = torch.randn(rows, EXPERTS, generator=torch.Generator().manual_seed(seed + layer))
        ids, weights = oea.route(logits, oea.RouterSpec(EXPERTS, 8), oea.OEAConfig(8))
        ids = torch.cat([ids.int(), torch.full((rows, shared), EXPERTS, dtype=torch.int32)], dim=1)
        weights = torch.cat([weights, torch.full((rows, shared), 0.5)], dim=1)
        self.hooks[plugin.POST_PROCESS_TARGET](topk_ids=ids, topk_weights=weights, topk_config=cfg,
                                               router_logits=logits, layer_id=layer, num_token_non_padded=None,
                                               expert_location_dispatch_info=None)

    def rows(self) -> list[dict[str, Any]]:
        for writer in self.writers:
            writer.flush()
        paths = {w.path for w in self.writers}
        return [json.loads(line) for p in paths for line in Path(p).read_text().splitlines()]


@pytest.fixture
def start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``start(**env)``: the plugin registered in a stand-in SGLang process with ``env`` (``OEA_METRICS_FILE``
    in ``tmp_path`` unless given); returns the ``Server``."""
    fresh_state(monkeypatch)
    _fresh_process_state(monkeypatch)
    topk_module(monkeypatch)
    registered: dict[str, Any] = {}
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookType = enum.Enum("HookType", "BEFORE AFTER AROUND REPLACE")
    registry.HookRegistry = SimpleNamespace(register=lambda target, hook, _kind: registered.__setitem__(target, hook))
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", registry)
    monkeypatch.setattr(plugin_entry, "hook_plan", lambda phase_via_forward_context=None: REAL_HOOK_PLAN(True))
    writers: list[MetricsWriter] = []
    steps: list[tuple[int, int]] = []
    add, submit = MetricsWriter.add, TraceRecorder.submit_step

    def remembered(self: MetricsWriter, step: int, record: Any) -> None:
        if self not in writers:
            writers.append(self)
        add(self, step, record)

    def submitted(self: TraceRecorder, step_id: int, rows: int, *args: Any) -> None:
        steps.append((step_id, rows))
        submit(self, step_id, rows, *args)

    monkeypatch.setattr(MetricsWriter, "add", remembered)
    monkeypatch.setattr(TraceRecorder, "submit_step", submitted)

    def go(**env: str) -> Server:
        env.setdefault("OEA_METRICS_FILE", str(tmp_path / "m.jsonl"))
        for name in ("OEA_APPLY_TO_VERIFY", "OEA_TIMING", "OEA_METRICS_FILE", "OEA_TRACE_FILE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        plugin.register()
        return Server(registered, writers, steps)

    return go


# -- metrics rows ------------------------------------------------------------------------------------------------

def test_a_forward_that_routed_nothing_writes_no_row(start: Any) -> None:
    server = start(OEA_K0="2")
    with server.forward(FakeMode.DECODE, 4):
        pass  # an idle batch: no MoE layer ran
    with server.forward(FakeMode.DECODE, 4):
        for layer in (0, 1):
            server.route(layer, 4)
    rows = server.rows()
    assert [(r["rows"], r["layers"], r["oea"]) for r in rows] == [(4, 2, True)], rows


@pytest.mark.parametrize(("env", "why"), [({"OEA_K0": "2", "OEA_MIN_BATCH": "5"}, "below OEA_MIN_BATCH"),
                                          ({"OEA_K0": "8"}, "k0 = top_k"), ({"OEA_K0": "9"}, "k0 > top_k")])
def test_a_step_left_to_sglang_is_never_marked_rewritten(start: Any, env: dict[str, str], why: str) -> None:
    server = start(**env)
    with server.forward(FakeMode.DECODE, 4):
        for layer in (0, 1):
            server.route(layer, 4)
    (row,) = server.rows()
    assert row["decode"] and not row["oea"], why
    assert row["active"] == row["active_stock"], "SGLang's own routing was kept"


def test_a_step_with_one_layer_oea_could_not_rewrite_is_not_marked_rewritten(start: Any) -> None:
    server = start(OEA_K0="2")
    unsupported = topk_config(custom_routing_function=lambda *a: None)  # a routing OEA leaves to SGLang
    with server.forward(FakeMode.DECODE, 4):
        server.route(0, 4)
        server.route(1, 4, cfg=unsupported)
    with server.forward(FakeMode.DECODE, 4):
        server.route(0, 4)
        server.route(1, 4)
    first, second = server.rows()
    assert not first["oea"] and first["active"][1] == first["active_stock"][1]
    assert second["oea"], "a step whose every layer was rewritten is"


def test_the_shared_expert_column_is_not_an_active_expert(start: Any) -> None:
    server = start(OEA_K0="8")
    with server.forward(FakeMode.EXTEND, 3):
        server.route(0, 3, shared=1)
    with server.forward(FakeMode.EXTEND, 3):
        server.route(0, 3, shared=0)
    with_shared, without = server.rows()
    assert with_shared["active"] == without["active"] and with_shared["active"][0] <= EXPERTS
    assert with_shared["active_stock"] == without["active_stock"]


def test_rows_outside_a_forward_are_counted_once_per_pass_not_per_layer(start: Any) -> None:
    server = start(OEA_K0="2")
    with server.forward(FakeMode.DECODE, 4):
        for layer in (0, 1, 2):
            server.route(layer, 4)
    for layer in (0, 1, 2):  # a pass outside any forward (a warm-up, a DP dummy batch): 3 rows, 3 layers
        server.route(layer, 3)
    with server.forward(FakeMode.DECODE, 4):
        for layer in (0, 1, 2):
            server.route(layer, 4)
    assert [r["outside_rows"] for r in server.rows()] == [0, 3]


# -- trace steps -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("apply_to_verify", "recorded"), [("", [1, 3]), ("1", [1, 2, 3])])
def test_a_verify_forward_is_recorded_only_with_apply_to_verify(start: Any, tmp_path: Path, apply_to_verify: str,
                                                                recorded: list[int]) -> None:
    env = {"OEA_K0": "2", "OEA_TRACE_FILE": str(tmp_path / "t.safetensors")}
    server = start(**env, **({"OEA_APPLY_TO_VERIFY": apply_to_verify} if apply_to_verify else {}))
    modes = [FakeMode.DECODE, FakeMode.TARGET_VERIFY, FakeMode.DECODE]
    for index, mode in enumerate(modes):
        with server.forward(mode, 2 + index):
            server.route(0, 2 + index)
    assert [rows for _, rows in server.steps] == [2 + i for i in range(3) if i + 1 in recorded]
    assert len(server.steps) == len(recorded)


def test_a_nested_forward_context_is_the_same_trace_step(start: Any, tmp_path: Path) -> None:
    server = start(OEA_K0="2", OEA_TRACE_FILE=str(tmp_path / "t.safetensors"))
    with server.forward(FakeMode.DECODE, 3):
        with server.forward(FakeMode.DECODE, 3):  # SGLang nests forward contexts (graph capture, sub-batches)
            server.route(0, 3)
        server.route(1, 3)
    with server.forward(FakeMode.DECODE, 2):
        server.route(0, 2)
        server.route(1, 2)
    assert server.steps == [(1, 3), (2, 2)]
    rows = server.rows()
    assert [(r["step"], r["rows"], r["layers"]) for r in rows] == [(1, 3, 2), (2, 2, 2)]
