"""``oea eval serve`` on live SGLang CPU servers with the embedded model, on the servers ``conftest.sglang_servers``
already runs (none of its own): OEA off, ``OEA_K0`` = top_k, and ``SGLANG_OEA_K0=3`` (``alias_3``, with its
``OEA_METRICS_FILE``), at concurrency 1 and 16 (``eval_serve_live``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import eval_serve_live as live
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def eval_serve(sglang_servers: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    arms = {name: sglang_servers[name].url for name in ("off", "k0_top_k", "alias_3")}
    metrics = {"alias_3": Path(sglang_servers["alias_3"].arm.env["OEA_METRICS_FILE"])}
    result = live.run_eval_serve(arms, metrics, tmp_path_factory.mktemp("eval_serve"), "sglang")
    assert result["code"] == 0, result["stdout"]
    return result


def test_eval_serve_sglang_k0_top_k_is_identical_to_off(eval_serve: dict[str, Any]) -> None:
    live.check_identical(eval_serve, "k0_top_k", "off", live.CONCURRENCIES)


def test_eval_serve_sglang_embedded_model_scores_well_above_zero(eval_serve: dict[str, Any]) -> None:
    live.check_scores_well_above_zero(eval_serve, "off")


def test_eval_serve_sglang_concurrency_1_is_identical_to_off(eval_serve: dict[str, Any]) -> None:
    live.check_identical(eval_serve, "alias_3", "off", (1,))
    live.check_untouched_below_min_batch(eval_serve, "alias_3")


def test_eval_serve_sglang_k0_3_differs_and_its_verdict_follows_from_the_items(eval_serve: dict[str, Any]) -> None:
    live.check_low_k0(eval_serve, "alias_3", "off")
