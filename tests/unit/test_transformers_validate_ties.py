"""``oea.routing.routing_difference`` (what ``oea.attach``'s k0 = k self-check uses): ties broken another way are not a
mismatch."""

from __future__ import annotations

import torch

from oea.routing import routing_difference


def test_a_tie_broken_the_other_way_is_not_a_mismatch_but_a_real_difference_is():
    select = torch.tensor([[3.0, 1.0, 1.0, 0.0]])  # experts 1 and 2 tie for the second slot
    own_ids, own_w = torch.tensor([[0, 2]]), torch.tensor([[0.7, 0.3]])
    assert routing_difference(own_ids, own_w, torch.tensor([[0, 1]]), torch.tensor([[0.7, 0.3]]), select) is None
    assert routing_difference(own_ids, own_w, torch.tensor([[0, 3]]), torch.tensor([[0.7, 0.3]]), select) == (
        "expert ids differ in 1 of 1 rows")
    assert "expert ids differ" in routing_difference(own_ids, own_w, torch.tensor([[0, 1]]), own_w)  # no scores
    assert "weights differ" in routing_difference(own_ids, own_w, torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]]),
                                                 select)
