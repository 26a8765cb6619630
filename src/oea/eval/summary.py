"""The statistics of an ``oea eval`` row: intervals and the quality verdict (all from ``oea.stats``).

The unit of evaluation is the held-out document: per policy, each document's cross-entropy is the
mean over its scored tokens, and every policy decodes the same documents in the same batches. So

* ``cross_entropy`` is the mean over documents with its 95% t interval (``cross_entropy_ci``);
* ``delta_ce`` is the mean of the per-document differences policy − vanilla, with its paired
  standard error, 95% t interval and two-sided p-value;
* ``verdict`` is the paired t-test on those differences (``VERDICT_RULE``): ``"worse"`` or
  ``"better"`` when the 95% interval of the mean difference excludes 0, else
  ``"no significant difference"``. Pairing removes the document-to-document spread the two
  policies share, which is far larger than the differences themselves;
* ``verdict`` is ``"identical"`` (and ``delta_p_value`` null) when every document's cross-entropy equals
  vanilla's exactly, as for batches below ``min_batch`` or k0 = top_k, where the policy keeps the router's
  own routing: a p-value of differences that are all zero would suggest a test that never ran;
* ``paper_verdict`` is the rule of the OEA paper, kept beside it for comparison
  (``PAPER_RULE``): ``"worse"`` only when the ±1 SE intervals of the two means do not overlap.
  With per-document spread of ~0.3 nats it cannot call a +0.3-nat loss worse.

Routing figures (active experts T, experts per token) are means over decode steps with t
intervals; ``active_vs_vanilla`` is a ratio of means with a bootstrap interval paired by decode step.

An interval needs at least two items: ``evaluate`` refuses fewer than two documents, and a figure
measured on a single item (generation agreement at B = 1) has ``None`` as its ``*_ci``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from oea.stats import DEFAULT_LEVEL, mean_interval, paired_difference, ratio_of_means_interval, standard_error

VERDICT_RULE = "paired t-test on per-document ΔCE (policy − vanilla), two-sided, 95%"
PAPER_RULE = "paper's rule: worse iff CE − SE > vanilla CE + vanilla SE (SE over documents)"
REFERENCE = "reference"  # the verdict of the vanilla row itself
IDENTICAL = "identical"  # every document's CE equals vanilla's bit for bit: no test to run


def paper_verdict(mean: float, stderr: float, vanilla_mean: float, vanilla_stderr: float) -> str:
    """The OEA paper's standard-error criterion for a lower-is-better metric (cross-entropy).

    ``"worse"`` iff the intervals mean ± se do not overlap in the bad direction, i.e.
    ``mean - stderr > vanilla_mean + vanilla_stderr``; otherwise ``"no worse"``. Shown beside the
    paired ``verdict`` for comparison only: it ignores that both policies see the same documents.
    """
    return "worse" if mean - stderr > vanilla_mean + vanilla_stderr else "no worse"


def ci_or_none(values: Sequence[float], level: float = DEFAULT_LEVEL) -> list[float] | None:
    """``[low, high]`` t interval of the mean of ``values``; ``None`` for fewer than two values."""
    return mean_interval(values, level).as_list() if len(values) >= 2 else None


def quality_fields(per_document: Mapping[int, float], reference: Mapping[int, float] | None) -> dict[str, Any]:
    """Cross-entropy and verdict fields of one row from per-document CE (``{document: nats}``).

    ``reference`` is vanilla's per-document CE over the same documents (``None`` for the vanilla
    row itself). Raises ``ValueError`` for fewer than two documents.
    """
    docs = sorted(per_document)
    if len(docs) < 2:
        raise ValueError(f"an interval needs at least 2 held-out documents, got {len(docs)}")
    values = [per_document[d] for d in docs]
    ce = mean_interval(values)
    stderr = standard_error(values)
    fields: dict[str, Any] = {"cross_entropy": ce.estimate, "cross_entropy_ci": ce.as_list(), "stderr": stderr}
    if reference is None:
        return {**fields, "delta_ce": 0.0, "delta_ce_ci": [0.0, 0.0], "delta_stderr": 0.0, "delta_p_value": 1.0,
                "verdict": REFERENCE, "paper_verdict": REFERENCE, "verdict_rule": VERDICT_RULE}
    if sorted(reference) != docs:
        raise ValueError("a policy and vanilla must be evaluated on the same documents")
    control = [reference[d] for d in docs]
    vanilla_stderr = standard_error(control)
    if values == control:
        return {**fields, "delta_ce": 0.0, "delta_ce_ci": [0.0, 0.0], "delta_stderr": 0.0, "delta_p_value": None,
                "verdict": IDENTICAL, "paper_verdict": IDENTICAL, "verdict_rule": VERDICT_RULE}
    diff = paired_difference(values, control)
    return {
        **fields,
        "delta_ce": diff.mean,
        "delta_ce_ci": diff.ci.as_list(),
        "delta_stderr": diff.stderr,
        "delta_p_value": diff.p_value,
        "verdict": diff.verdict(lower_is_better=True),
        "paper_verdict": paper_verdict(ce.estimate, stderr, float(np.mean(control)), vanilla_stderr),
        "verdict_rule": VERDICT_RULE,
    }


def routing_fields(
    step_active: Sequence[float], step_per_token: Sequence[float], vanilla_active: Sequence[float], seed: int = 0,
) -> dict[str, Any]:
    """T, experts per token and T / vanilla from per-decode-step values (layer means), with intervals.

    ``vanilla_active`` is vanilla's per-step T on the same steps (paired; vanilla's own for its row).
    """
    if len(step_active) != len(vanilla_active):
        raise ValueError("a policy and vanilla must be measured on the same decode steps")
    fields: dict[str, Any] = {
        "mean_active_experts": float(np.mean(step_active)) if len(step_active) else 0.0,
        "mean_active_experts_ci": ci_or_none(step_active),
        "mean_experts_per_token": float(np.mean(step_per_token)) if len(step_per_token) else 0.0,
        "mean_experts_per_token_ci": ci_or_none(step_per_token),
        "active_vs_vanilla": None,
        "active_vs_vanilla_ci": None,
    }
    if len(vanilla_active) and np.mean(vanilla_active) > 0:
        fields["active_vs_vanilla"] = float(np.mean(step_active) / np.mean(vanilla_active))
        if len(step_active) >= 2 and min(vanilla_active) > 0:
            rng = np.random.default_rng(seed)
            fields["active_vs_vanilla_ci"] = ratio_of_means_interval(step_active, vanilla_active, rng,
                                                                     paired=True).as_list()
    return fields
