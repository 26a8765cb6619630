"""``oea.eval.evaluate``'s statistics with exact expected values: the cross-entropy standard error is over
documents (not batches or windows) and ``delta_stderr`` is paired per document.

The model's decoding is replaced by known per-token losses (``_run_policy``) and the held-out text by
synthetic documents, so the figures below follow from the definitions alone.
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import oea.integrations.transformers as hf
from oea.eval import evaluate
from oea.eval.decode import DecodeCounts
from oea.routing import RouterSpec

evaluate_module = importlib.import_module("oea.eval.evaluate")  # the package re-exports the function
POSITIONS = 4
# Six documents; each yields two windows, so with B = 4 and 3 batches every document is seen twice.
DOC_CE = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # vanilla per-document cross-entropy (nats)
DOC_DELTA = [0.10, 0.30, 0.20, 0.40, 0.10, 0.10]  # what OEA adds to each document


class _Tokenizer:
    """Token ids 3, 4, ... (one per character); BOS = 1."""

    bos_token_id, eos_token_id = 1, 2

    def __call__(self, text: str, add_special_tokens: bool = False, verbose: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [3 + i for i in range(len(text))]}


def _fake_run(model: Any, cfg: object | None, batches: list, generate_tokens: int,
              step_tokens: int = 1) -> dict[str, Any]:
    """Per-token losses: window r of document d costs DOC_CE[d] (+ DOC_DELTA[d] under OEA) on average,
    with +-0.5 between its two windows and +-0.25 between positions, so only per-document means are exact."""
    seen: dict[int, int] = {}
    losses = []
    for batch in batches:
        rows = []
        for doc in batch.documents:
            window = seen.get(doc, 0)
            seen[doc] = window + 1
            level = DOC_CE[doc] + (DOC_DELTA[doc] if cfg is not None else 0.0) + (0.5 if window == 0 else -0.5)
            rows.append([level + (0.25 if t % 2 == 0 else -0.25) for t in range(POSITIONS)])
        losses.append(torch.tensor(rows, dtype=torch.float32))
    steps = len(batches) * POSITIONS
    counts = DecodeCounts(layer_steps=1, rows=4, active_total=8.0 if cfg is None else 5.0, slots_total=32.0,
                          step_active=[8.0 if cfg is None else 5.0] * steps, step_experts_per_token=[8.0] * steps)
    return {"losses": losses, "counts": counts, "generated": None}


@pytest.fixture
def rows(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    monkeypatch.setattr(evaluate_module, "_run_policy", _fake_run)
    monkeypatch.setattr(evaluate_module, "_documents", lambda model_dir: [(f"d{i}", "x" * 30) for i in range(6)])
    monkeypatch.setattr(hf, "find_moe_layers", lambda model: [SimpleNamespace(spec=RouterSpec(16, 4))])
    model = SimpleNamespace(name_or_path="")
    return evaluate(model, tokenizer=_Tokenizer(), batch_sizes=(4,), k0s=(2,), policies=("vanilla", "oea"),
                    num_batches=3, positions=POSITIONS, generate_tokens=0)


def _sample_stderr(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def test_cross_entropy_and_its_stderr_are_over_documents(rows: list[dict[str, Any]]) -> None:
    vanilla, oea_row = rows
    assert (vanilla["policy"], oea_row["policy"], oea_row["k0"]) == ("vanilla", "oea", 2)
    assert vanilla["documents"] == 6 and vanilla["tokens"] == 3 * 4 * POSITIONS
    assert vanilla["cross_entropy"] == pytest.approx(3.5, abs=1e-6)
    # sample variance of 1..6 is 3.5: se = sqrt(3.5 / 6)
    assert vanilla["stderr"] == pytest.approx(math.sqrt(3.5 / 6), abs=1e-6)
    assert vanilla["stderr"] == pytest.approx(_sample_stderr(DOC_CE), abs=1e-6)
    assert oea_row["cross_entropy"] == pytest.approx(3.5 + 0.2, abs=1e-6)
    assert oea_row["stderr"] == pytest.approx(_sample_stderr([c + d for c, d in zip(DOC_CE, DOC_DELTA,
                                                                                    strict=True)]), abs=1e-6)


def test_delta_stderr_is_paired_per_document(rows: list[dict[str, Any]]) -> None:
    vanilla, oea_row = rows
    assert vanilla["delta_ce"] == 0.0 and vanilla["delta_stderr"] == 0.0
    assert oea_row["delta_ce"] == pytest.approx(0.2, abs=1e-6)
    # per-document differences 0.1 0.3 0.2 0.4 0.1 0.1: mean 0.2, sample variance 0.016 -> se = sqrt(0.016 / 6)
    assert oea_row["delta_stderr"] == pytest.approx(math.sqrt(0.016 / 6), abs=1e-6)
    unpaired = math.hypot(vanilla["stderr"], oea_row["stderr"])
    assert oea_row["delta_stderr"] < unpaired / 10  # what an unpaired error would wrongly report
    # the paper's criterion compares the two intervals (overlapping here): not worse; the paired t-test
    # (t = 0.2 / sqrt(0.016 / 6) = 3.87, 5 degrees of freedom, p = 0.0117) calls it worse
    assert oea_row["paper_verdict"] == "no worse"
    assert oea_row["verdict"] == "worse" and oea_row["delta_p_value"] == pytest.approx(0.01174, abs=1e-4)
    assert oea_row["active_vs_vanilla"] == pytest.approx(5.0 / 8.0)
