"""``oea eval serve``'s summary: each arm against the baseline arm, paired per item (``oea.stats.compare_items``).

From the item and cell rows of a run (``oea.eval.serve_run``; the same rows ``--summarize`` reads back), one
summary row per (task, metric, max_concurrency, round, arm), and with several rounds one more per (task, metric,
max_concurrency, arm) with ``round`` ``"all"`` (each item's score averaged over the rounds, then compared as a
graded score). The pairing keeps the items every arm of the cell answered: an item that errored or timed out in
one arm is dropped from every arm (``dropped_items``), and each arm's own failures are counted (``errors``).

Fields (contract names of issue 34): ``arm``, ``task``, ``max_concurrency``, ``round``, ``n_items``, ``score``,
``score_ci``, ``delta``, ``delta_ci``, ``p_value``, ``verdict``, ``agreement``, ``min_detectable_delta``,
``decode_steps``, ``rewritten_steps``, ``active_experts_ratio``; besides them ``metric``, ``baseline``, ``test``,
``paired_verdict``, ``agreement_ci``, ``first_difference_token``, ``errors``, ``dropped_items``, ``oea_rewrote``.

``verdict`` is the paired test's (worse / no significant difference / better), except for an arm whose metrics
show OEA never rewrote a decode step (``rewritten_steps`` 0): it reads ``NOT_TESTED``, since such an arm ran the
engine's stock routing and says nothing about OEA's cost (``paired_verdict`` keeps the test's word).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

NOT_TESTED = "not a test of OEA: it rewrote no decode step"
BASELINE = "baseline"
TOO_FEW = "too few items"


def _arms(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["arm"] for r in rows))


def check_baseline(rows: Sequence[dict[str, Any]], baseline: str | None) -> str:
    """The baseline arm: ``baseline`` or the first arm; ``ValueError`` naming ``--baseline-arm`` if not an arm."""
    arms = _arms(rows)
    if not arms:
        raise ValueError("no item rows to summarise")
    if baseline is None:
        return arms[0]
    if baseline not in arms:
        raise ValueError(f"--baseline-arm must be one of the arms ({', '.join(arms)}), got {baseline!r}")
    return baseline


def _cell_oea(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """OEA counts summed over cells (``decode_steps``, ``rewritten_steps``) and the ratio of mean active experts
    to the stock routing's (None where no metrics file was read)."""
    seen = [c for c in cells if c.get("decode_steps") is not None]
    if not seen:
        return {"decode_steps": None, "rewritten_steps": None, "active_experts_ratio": None}
    active = [c["active_experts"] for c in seen if c.get("active_experts") is not None]
    stock = [c["active_experts_stock"] for c in seen if c.get("active_experts_stock")]
    ratio = (sum(active) / len(active)) / (sum(stock) / len(stock)) if active and stock else None
    return {"decode_steps": sum(c["decode_steps"] for c in seen),
            "rewritten_steps": sum(c["rewritten_steps"] for c in seen), "active_experts_ratio": ratio}


def _compare(where: dict[str, Any], arm: str, baseline: str, scores: dict[str, list[float]],
             outputs: dict[str, list[Any]], tokens: dict[str, list[Any]], oea: dict[str, Any]) -> dict[str, Any]:
    from oea.stats import compare_items, output_agreement

    row: dict[str, Any] = {"arm": arm, **where, "baseline": baseline, "n_items": len(scores[arm]), **oea}
    empty = {"score": None, "score_ci": None, "delta": None, "delta_ci": None, "p_value": None, "test": None,
             "paired_verdict": None, "verdict": TOO_FEW, "agreement": None, "agreement_ci": None,
             "first_difference_token": None, "min_detectable_delta": None}
    row.update(empty)
    if len(scores[arm]) < 2:
        return row
    result = compare_items(scores[arm], scores[baseline])
    row.update({"score": result.score.estimate, "score_ci": result.score.as_list()})
    if outputs.get(arm) is not None:
        agree = output_agreement(outputs[arm], outputs[baseline], tokens[arm], tokens[baseline])
        row.update({"agreement": agree.share.estimate, "agreement_ci": agree.share.as_list(),
                    "first_difference_token": agree.first_difference})
    if arm == baseline:
        row["verdict"] = BASELINE
        return row
    row.update({"delta": result.delta.estimate, "delta_ci": result.delta.as_list(), "p_value": result.p_value,
                "test": result.test, "paired_verdict": result.verdict, "verdict": result.verdict,
                "min_detectable_delta": result.min_detectable_delta})
    row["oea_rewrote"] = None if oea["rewritten_steps"] is None else oea["rewritten_steps"] > 0
    if row["oea_rewrote"] is False:
        row["verdict"] = NOT_TESTED
    return row


def summary_rows(rows: Sequence[dict[str, Any]], baseline: str | None = None) -> list[dict[str, Any]]:
    """The summary rows (module docstring) of a run's rows, baseline first in each group."""
    items = [r for r in rows if r.get("kind") == "item"]
    cells = [r for r in rows if r.get("kind") == "cell"]
    baseline = check_baseline(items, baseline)
    arms = _arms(items)
    out: list[dict[str, Any]] = []
    groups = sorted({(r["task"], int(r["max_concurrency"])) for r in items}, key=lambda g: (g[0], g[1]))
    for task, concurrency in groups:
        group = [r for r in items if r["task"] == task and int(r["max_concurrency"]) == concurrency]
        rounds = sorted({int(r["round"]) for r in group})
        for rnd in rounds:
            out += _group_rows(task, concurrency, rnd, [r for r in group if int(r["round"]) == rnd],
                               [c for c in cells if c["task"] == task and int(c["max_concurrency"]) == concurrency
                                and int(c["round"]) == rnd], arms, baseline)
        if len(rounds) > 1:
            out += _group_rows(task, concurrency, "all", group,
                               [c for c in cells if c["task"] == task and int(c["max_concurrency"]) == concurrency],
                               arms, baseline)
    return out


def _group_rows(task: str, concurrency: int, rnd: int | str, group: list[dict[str, Any]],
                cells: list[dict[str, Any]], all_arms: list[str], baseline: str) -> list[dict[str, Any]]:
    arms = [a for a in all_arms if any(r["arm"] == a for r in group)]
    if baseline not in arms:
        return []
    arms = [baseline] + [a for a in arms if a != baseline]
    errors = {a: sum(1 for r in group if r["arm"] == a and r.get("error")) for a in arms}
    item_ids = list(dict.fromkeys(r["item"] for r in group))
    answered = {a: {r["item"]: r for r in group if r["arm"] == a and not r.get("error")} for a in arms}
    failed = {r["item"] for r in group if r.get("error")}  # in any arm and round: dropped from every arm
    kept = [i for i in item_ids if i not in failed and all(i in answered[a] for a in arms)]
    pooled = rnd == "all"
    metrics = sorted({m for r in group if not r.get("error") for m in r.get("scores", {})})
    out = []
    for metric in metrics:
        where = {"task": task, "metric": metric, "max_concurrency": concurrency, "round": rnd}
        scores = {a: [_score(group, a, i, metric) if pooled else answered[a][i]["scores"][metric] for i in kept]
                  for a in arms}
        outputs: dict[str, Any] = {a: None if pooled else [answered[a][i]["output"] for i in kept] for a in arms}
        tokens = {a: None if pooled else [answered[a][i].get("tokens") for i in kept] for a in arms}
        for arm in arms:
            row = _compare(where, arm, baseline, scores, outputs, tokens,
                           _cell_oea([c for c in cells if c["arm"] == arm]))
            row.update({"errors": errors[arm], "dropped_items": len(item_ids) - len(kept)})
            out.append(row)
    return out


def _score(group: list[dict[str, Any]], arm: str, item: str, metric: str) -> float:
    """The item's mean score over the rounds in which the arm answered it."""
    values = [r["scores"][metric] for r in group if r["arm"] == arm and r["item"] == item and not r.get("error")]
    return sum(values) / len(values) if values else math.nan
