"""``scripts/sglang_padding_union.py``: the experts a MoE kernel loads for a padded decode batch under each
treatment of the padding rows, on a batch small enough to work out by hand."""

from __future__ import annotations

import json

import torch
from project_scripts import load_script

import oea

padding_union = load_script("sglang_padding_union")


def test_each_treatment_counts_the_union_the_kernel_loads() -> None:
    """8 experts, top-2, k0 = 1; rows 0 and 1 real (top experts 0,1 and 0,2), row 2 padding (top 6,7).
    stock: {0,1,2,6,7}; OEA joined: top-1s {0,6}, each row fills from them; padding keeping stock ids:
    OEA's {0} plus 6 and 7; real rows only: {0}."""
    logits = torch.full((3, 8), -5.0)
    logits[0, [0, 1]] = torch.tensor([3.0, 2.0])
    logits[1, [0, 2]] = torch.tensor([3.0, 2.0])
    logits[2, [6, 7]] = torch.tensor([3.0, 2.0])
    logits[:, 6] = torch.maximum(logits[:, 6], torch.tensor(-1.0))  # 6 ranks third for the real rows
    found = padding_union.padded_union(logits, oea.RouterSpec(8, 2), k0=1, real=2)
    assert found == {"stock": 5, "joined": 2, "stock_padding": 3, "real_only": 1}


def test_the_command_prints_every_treatment_with_an_interval(capsys) -> None:
    assert padding_union.main(["--real", "3", "--graph", "4", "--num-batches", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for name in padding_union.TREATMENTS:
        low, high = out[f"{name}_ci"]
        assert low <= out[name] <= high
    assert out["real_only"] <= out["stock_padding"] <= out["stock"] and out["joined"] <= out["stock"]
