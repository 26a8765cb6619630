"""What a server's ``OEA_METRICS_FILE`` says about OEA while it served: ``oea doctor --metrics-file FILE``.

The doctor's other checks run in its own interpreter: they prove the hooks *can* engage. Only the server
knows whether they *did*. Its metrics file (one JSON line per decode or prefill forward per scheduler /
worker process: ``decode``, ``oea``, ``rows``, ``active``, ``active_stock``, ``padding_rows``, ...; the format
of ``docs/vllm.md`` / ``docs/sglang.md``) answers the questions a user with a ~0% gain has:

* did OEA rewrite the decode forwards it should have (``rows`` >= min_batch)? "OEA engaged in N of M";
* how many experts did those forwards load per layer, against the engine's own routing of the same logits
  (``active`` vs ``active_stock``), each mean with its 95% interval;
* how many decode forwards carried CUDA-graph padding rows (``padding_rows``): those rows keep the engine's
  own ids, which its MoE kernel loads although no real token needs them.

Engine-free: it reads the file only.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from oea.integrations.doctor.common import Check, check
from oea.integrations.doctor.judge import Served, served_verdicts
from oea.stats import mean_interval

REQUIRED_FIELDS: tuple[str, ...] = ("decode", "oea", "rows", "active")


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; ``ValueError`` naming the file, the line and what is wrong."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise ValueError(f"--metrics-file {path} is a directory; give the server's OEA_METRICS_FILE (a JSONL file)")
    if not path.is_file():
        raise ValueError(f"--metrics-file {path}: no such file (the server writes it at OEA_METRICS_FILE once it "
                         "has served a forward)")
    rows = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and rows:  # a server still writing may leave its last line cut short
                continue
            if number == len(lines):
                raise ValueError(f"--metrics-file {path}: its only line ({number}) is cut short (not JSON: {err.msg}): "
                                 "the file is truncated; read it again after the server's next flush") from None
            raise ValueError(f"--metrics-file {path}: line {number} is not JSON ({err.msg})") from None
        missing = [name for name in REQUIRED_FIELDS if not isinstance(row, dict) or name not in row]
        if missing:
            raise ValueError(f"--metrics-file {path}: line {number} lacks {missing} (an OEA_METRICS_FILE line has "
                             f"{list(REQUIRED_FIELDS)})")
        rows.append(row)
    return rows


def _mean(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1 or len(set(values)) == 1:
        return f"{values[0]:.1f} (n={len(values)})"
    found = mean_interval(values)
    return f"{found.estimate:.1f} [{found.low:.1f}, {found.high:.1f}]"


def engagement(rows: list[dict[str, Any]], min_batch: int) -> dict[str, Any]:
    """Counts and means over the decode rows: ``decode_forwards``, ``eligible`` (>= ``min_batch`` real rows),
    ``engaged`` (eligible and rewritten), per-layer-and-forward ``active`` / ``active_stock`` of the engaged
    forwards (of the eligible ones while none engaged), ``padded`` forwards and their mean padding rows."""
    decode = [r for r in rows if r["decode"]]
    eligible = [r for r in decode if r["rows"] >= min_batch]
    engaged = [r for r in eligible if r["oea"]]
    counted = engaged or eligible
    padded = [r for r in decode if r.get("padding_rows", 0) > 0]
    return {
        "decode_forwards": len(decode), "eligible": len(eligible), "engaged": len(engaged),
        "ranks": sorted({r.get("rank", 0) for r in decode}),
        "active": [float(a) for r in counted for a in r["active"]],
        "active_stock": [float(a) for r in counted for a in r.get("active_stock", [])],
        "padded": len(padded),
        "padding_rows": [float(r["padding_rows"]) for r in padded],
    }


def served_checks(path: str | pathlib.Path, min_batch: int) -> list[Check]:
    """The doctor's ``served`` block for one metrics file (fields in the module docstring; the verdicts:
    ``oea.integrations.doctor.judge``, shared with ``--metrics-url``)."""
    try:
        rows = read_metrics(path)
    except ValueError as err:
        return [check("metrics file", False, str(err))]
    found = engagement(rows, min_batch)
    stock = found["active_stock"]
    return served_verdicts(Served(
        source=f"{path}: {len(rows)} forwards", forwards=len(rows), decode=found["decode_forwards"],
        ranks=found["ranks"], eligible=found["eligible"], engaged=found["engaged"],
        min_batch=min_batch, active=_mean(found["active"]), stock=_mean(stock),
        ratio=sum(found["active"]) / sum(stock) if stock and sum(stock) else None,
        padded=found["padded"], padding=_mean(found["padding_rows"])))
