"""CUDA-graph padding rows out of the OEA union, through SGLang's real graph runners (sglang 0.5.23, CPU).

The SGLang side lives in ``sglang_padding_checks.py`` (run by ``sglang_cpu_checks.py padding`` in
.venv-sglang; it prints JSON); these tests assert on it. SGLang's ``CPUGraphRunner`` is driven for real
(capture, then padded replays 15/13/9/13 -> 16 and 5 -> 8 rows); the CUDA runner's replay preparation
(``DecodeCudaGraphRunner.load_batch``) is SGLang's own method on a stand-in runner object, feeding a routing
compiled once and replayed, as a CUDA graph is.
"""

from __future__ import annotations

from typing import Any

import pytest
from sglang_venv import assert_every_check_passed, check, checks_fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow]

LAYERS = 4


padding = checks_fixture("padding")
missing = checks_fixture("padding-missing", "missing")


def test_every_check_passes(padding: dict[str, Any]) -> None:
    assert_every_check_passed(padding)
    assert check(padding, "replay_hooks_installed")["ok"]


def test_padded_replays_keep_padding_rows_out_of_the_union(padding: dict[str, Any]) -> None:
    assert check(padding, "cpu_graph_runner_captured")["ok"]
    replays = padding["figures"]["replays"]
    assert [(r["real_rows"], r["graph_rows"]) for r in replays] == [(15, 16), (13, 16), (9, 16), (13, 16), (16, 16),
                                                                    (5, 8)]
    for step, replay in enumerate(replays):
        for layer in range(LAYERS):
            assert check(padding, f"replay{step}_real_rows_equal_oea_route:layer{layer}")["ok"], (step, layer)
            assert check(padding, f"replay{step}_padding_rows_keep_sglang_routing:layer{layer}")["ok"], (step, layer)
        assert replay["padding_experts_in_union"] == 0, replay
    # the target is meaningful: had the padding rows joined, T would have grown in these batches
    assert any(r["T_if_padding_joined"] > r["T_real_rows"] for r in replays if r["padding_rows"]), replays


def test_one_count_write_per_decode_step_not_per_layer(padding: dict[str, Any]) -> None:
    for step in range(6):
        assert check(padding, f"replay{step}_fills")["ok"], check(padding, f"replay{step}_fills")
    for step in range(4):
        assert check(padding, f"cuda_load_batch{step}_fills")["ok"], check(padding, f"cuda_load_batch{step}_fills")
    assert check(padding, "eager_decode_fills")["ok"]


def test_cuda_runner_replay_preparation_feeds_the_captured_routing(padding: dict[str, Any]) -> None:
    for step in range(4):
        for name in ("cuda_load_batch{}_padded", "cuda_replay{}_real_rows_equal_oea_route",
                     "cuda_replay{}_padding_rows_keep_sglang_routing"):
            assert check(padding, name.format(step))["ok"], check(padding, name.format(step))
    assert check(padding, "cuda_replays_one_compiled_graph")["ok"], check(padding, "cuda_replays_one_compiled_graph")


def test_eager_decode_and_sglangs_own_count(padding: dict[str, Any]) -> None:
    for layer in range(LAYERS):
        assert check(padding, f"eager_decode_all_rows_equal_oea_route:layer{layer}")["ok"]
    assert check(padding, "sglang_count_used_where_given")["ok"]
    assert check(padding, "mechanisms_seen")["ok"], check(padding, "mechanisms_seen")


def test_missing_replay_hook_point_keeps_todays_behaviour_and_says_so(missing: dict[str, Any]) -> None:
    failed = [c for c in missing["checks"] if not c["ok"]]
    assert not failed, failed
    for name in ("missing_replay_hook_load_plugins_survives", "missing_replay_hook_warned_once_with_workaround",
                 "doctor_names_missing_replay_hook"):
        assert check(missing, name)["ok"], check(missing, name)
    for layer in range(LAYERS):
        assert check(missing, f"missing_replay_hook_todays_behaviour:layer{layer}")["ok"]
