"""What every engine's conformance child shares: reading the scenarios, a clean ``OEA_*`` environment per
scenario, collecting the adapter's warnings, and printing the outcomes on one ``RESULT`` line."""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from conformance_scenarios import Outcome, spec_fields

torch.set_num_threads(1)
WARNINGS: list[str] = []  # the adapter's log warnings in the running scenario


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        WARNINGS.append(record.getMessage())


def set_env(env: dict[str, str]) -> None:
    """This process's ``OEA_*`` / ``SGLANG_OEA_*`` variables become exactly ``env``."""
    for var in [v for v in os.environ if v.startswith(("OEA_", "SGLANG_OEA_"))]:
        del os.environ[var]
    os.environ.update(env)


def routed(ids: torch.Tensor, weights: torch.Tensor, spec: Any, replay: torch.Tensor | None = None) -> dict[str, Any]:
    """One layer's result as JSON; ``replay``: the ids the engine's routed-experts capture took for these rows
    (what a trainer replaying the routing receives)."""
    return {"ids": ids.long().tolist(), "weights": weights.float().tolist(), "spec": spec_fields(spec),
            "replay": None if replay is None else replay.long().tolist()}


def main(run: Callable[[dict[str, Any]], Outcome], loggers: tuple[str, ...]) -> None:
    """Run every scenario of ``sys.argv[1]`` (JSON) through ``run`` and print ``RESULT {name: outcome}``."""
    scenarios = json.loads(Path(sys.argv[1]).read_text())
    collect = _Collect()
    for name in loggers:
        logging.getLogger(name).addHandler(collect)
    results: dict[str, Any] = {}
    for scenario in scenarios:
        WARNINGS.clear()
        set_env(scenario["env"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outcome = run(scenario)
            except Exception:  # a harness failure is reported as such, not as the adapter's outcome
                outcome = Outcome("harness-error", traceback.format_exc(limit=6))
        outcome.warnings = [*WARNINGS, *(str(w.message) for w in caught)]
        results[scenario["name"]] = outcome.to_json()
    print("RESULT" + json.dumps(results))
