"""The latency model of ``oea bench layer``: ``t = b·T + a·(B·k) + c``, fitted and written for the cost model.

b is the cost of one more active expert (its weights read from memory), a of one more used
token-expert slot (compute), c the fixed per-call overhead. The T sweep varies T at fixed B·k;
the policy rows vary B·k as well (pruned and OEA share T but not B·k), which identifies a.
The regression itself is ``oea.stats.linear_fit``.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from oea.stats import linear_fit, r_squared


def fit_latency(active: Sequence[float], slots: Sequence[float], latency_us: Sequence[float]) -> dict[str, Any]:
    """Least-squares fit of ``latency = b·T + a·(B·k) + c``.

    When the used slots do not vary (a sweep alone), there are fewer than 3 points, or a comes out
    negative, a is fixed at 0 and the fit is ``b·T + c`` (``a_identified`` False). Returns
    ``a_us``, ``b_us``, ``c_us``, ``r2``, ``points``, ``a_identified``.
    """
    t = np.asarray(active, dtype=np.float64)
    s = np.asarray(slots, dtype=np.float64)
    y = np.asarray(latency_us, dtype=np.float64)
    if not (t.size == s.size == y.size) or t.size < 2:
        raise ValueError(f"fit_latency needs >= 2 points of equal length, got {t.size}, {s.size}, {y.size}")
    a_identified = t.size >= 3 and float(np.ptp(s)) > 0
    if a_identified:
        fit = linear_fit([t, s], y)
        (b, a), c = fit.coefficients, fit.intercept
        a_identified = a >= 0
    if not a_identified:
        fit = linear_fit([t], y)
        (b,), c, a = fit.coefficients, fit.intercept, 0.0
    return {"a_us": float(a), "b_us": float(b), "c_us": float(c), "r2": fit.r2, "points": int(t.size),
            "a_identified": bool(a_identified)}


def fit_r_squared(
    fit: dict[str, Any], active: Sequence[float], slots: Sequence[float], latency_us: Sequence[float]
) -> float:
    """R² of a ``fit_latency`` result on the given points (e.g. the sweep alone)."""
    predicted = fit["b_us"] * np.asarray(active, dtype=np.float64) + fit["a_us"] * np.asarray(
        slots, dtype=np.float64) + fit["c_us"]
    return r_squared(latency_us, predicted)


def write_fit(result: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Write the fit in the format ``oea.presets.load_cpu_fit`` reads (plus provenance keys)."""
    fit = result.get("fit")
    if not fit:
        raise ValueError("--write-fit needs a fit: run with a T sweep and at least two points")
    if result.get("custom_shape") or result.get("tp", 1) != 1:
        raise ValueError("--write-fit needs a whole-expert preset run (no --tp, no custom shape)")
    payload = {
        "a_us": fit["a_us"], "b_us": fit["b_us"], "c_us": fit["c_us"], "r2": fit["r2"],
        "preset": result["preset"],
        "measured_on": result["machine"] + (f", OMP_WAIT_POLICY={result['omp_wait_policy']}"
                                            if result.get("omp_wait_policy") else ""),
        "dtype": result["dtype"], "impl": result["impl"], "batch_size": result["batch_size"],
        "repeats": result["repeats"], "r2_sweep": fit.get("r2_sweep"), "a_identified": fit["a_identified"],
        "token_slots_of_sweep": fit.get("token_slots_of_sweep"),
        "points": [{"label": r["label"], "active": r["mean_active_experts"], "token_slots": r["mean_token_slots"],
                    "latency_us_median": r["latency_us_median"]} for r in result["sweep"] + result["rows"]],
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": result.get("command", "oea bench layer --write-fit"),
    }
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
