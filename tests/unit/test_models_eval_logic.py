"""Pure logic of ``oea.eval``: the paper's standard-error rule (shown beside the paired verdict), document batching."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from oea.eval import paper_verdict  # noqa: E402
from oea.eval.sequences import make_batches  # noqa: E402


def test_paper_rule_uses_non_overlapping_intervals_in_the_bad_direction() -> None:
    assert paper_verdict(3.30, 0.05, 3.20, 0.04) == "worse"  # 3.25 > 3.24
    assert paper_verdict(3.28, 0.05, 3.20, 0.04) == "no worse"  # 3.23 <= 3.24: intervals overlap
    assert paper_verdict(3.00, 0.01, 3.20, 0.01) == "no worse"  # better is never worse
    assert paper_verdict(3.20, 0.0, 3.20, 0.0) == "no worse"


def _windows(lengths: list[int]) -> list[list[torch.Tensor]]:
    return [[torch.full((4,), 100 * doc + w) for w in range(n)] for doc, n in enumerate(lengths)]


def test_batches_take_different_documents_first() -> None:
    batches = make_batches(_windows([3, 1, 2, 1]), batch_size=4, num_batches=1, seed=0)
    assert sorted(batches[0].documents) == [0, 1, 2, 3]
    assert batches[0].ids.shape == (4, 4)
    two = make_batches(_windows([3, 1, 2, 1]), batch_size=3, num_batches=2, seed=1)
    assert len(set(two[0].documents)) == 3
    for batch in two:  # row b's window belongs to its recorded document
        assert [int(row[0]) // 100 for row in batch.ids] == list(batch.documents)


def test_batches_are_seeded_and_bounded() -> None:
    windows = _windows([2] * 10)
    assert make_batches(windows, 4, 2, 7)[0].documents == make_batches(windows, 4, 2, 7)[0].documents
    assert make_batches(windows, 4, 1, 7)[0].documents != make_batches(windows, 4, 1, 8)[0].documents
    with pytest.raises(ValueError, match="need 24 evaluation windows"):
        make_batches(windows, 8, 3, 0)
