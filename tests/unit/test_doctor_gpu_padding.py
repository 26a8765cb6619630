"""``oea doctor gpu``'s exactness cases include padding rows (issue 36), checked on CPU.

A served decode batch has padding rows (a CUDA graph captured for a larger batch, vLLM's ``is_padding``): they
keep vanilla routing and stay out of OEA's union and its row count. The exactness check can only hold the GPU
kernels to that rule if its cases have such rows, in places a kernel could get wrong (between real rows as
well as at the tail), and in cases where counting them as real changes the answer. Held here without a GPU:
the case construction (``_cases``), and the check itself, with ``route_fast`` replaced by a kernel that
ignores the ``valid`` mask: it must fail, naming padded cases only.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

import oea.kernels.doctor_gpu as doctor_gpu
from oea.routing import OEAConfig, PrunedConfig, route

CPU = doctor_gpu.Device(available=lambda: True, capability=lambda: (9, 0), name=lambda: "stand-in GPU",
                        device="cpu", impl="numba", capture=doctor_gpu.graphed)


def _group(spec: Any, cfg: Any) -> tuple[int, int, str, str]:
    """A (router, policy) of the cases: the spec's shape and scoring, the config's type."""
    return spec.num_experts, spec.top_k, spec.scoring, type(cfg).__name__


def _padded(valid: torch.Tensor | None) -> bool:
    return valid is not None and not bool(valid.all())


def test_every_router_and_policy_has_cases_with_padding_rows_inside_and_at_the_tail() -> None:
    cases = doctor_gpu._cases("cpu")
    layouts: dict[tuple[int, int, str, str], set[str]] = defaultdict(set)
    for label, logits, spec, cfg, valid in cases:
        if not _padded(valid):
            continue
        assert valid is not None and valid.shape == (logits.shape[0],) and valid.dtype == torch.bool
        assert bool(valid.any()), f"{label}: a padded case keeps real rows"
        real = valid.nonzero().flatten()
        padding = (~valid).nonzero().flatten()
        layouts[_group(spec, cfg)].add("inside" if int(padding.min()) < int(real.max()) else "tail")
        assert "padding rows" in label, f"{label}: the label (what a failure names) says the case is padded"
    groups = {_group(spec, cfg) for _, _, spec, cfg, _ in cases}
    assert len(groups) == 9, "three routers, three policies"
    for group in groups:
        assert layouts[group] == {"inside", "tail"}, f"{group}: padding rows between real rows and at the tail"


def test_counting_padding_rows_as_real_changes_the_answer_of_every_rerouting_router() -> None:
    """For OEA and pruned routing, padding rows change the answer (OEA's union, the pruned override) in at least
    one padded case of each router, so a kernel that counts them as real cannot pass by luck."""
    decisive: dict[tuple[int, int, str, str], int] = defaultdict(int)
    for _label, logits, spec, cfg, valid in doctor_gpu._cases("cpu"):
        if not _padded(valid) or not isinstance(cfg, (OEAConfig, PrunedConfig)):
            continue
        differs = doctor_gpu._mismatch(route(logits, spec, cfg, None), route(logits, spec, cfg, valid))
        decisive[_group(spec, cfg)] += differs is not None
    assert len(decisive) == 6, "three routers, OEA and pruned"
    assert all(decisive.values()), dict(decisive)


def test_a_kernel_that_ignores_padding_rows_fails_the_exactness_check(monkeypatch: pytest.MonkeyPatch) -> None:
    real = doctor_gpu.route_fast
    seen: list[bool] = []

    def ignores_valid(logits: torch.Tensor, spec: Any, cfg: Any = None, valid: torch.Tensor | None = None, *,
                      impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(_padded(valid))
        return real(logits, spec, cfg, None, impl=impl)  # every row counted as real

    monkeypatch.setattr(doctor_gpu, "route_fast", ignores_valid)
    exact = doctor_gpu._exactness(CPU, "numba")
    assert any(seen), "the check hands padded masks to the kernel"
    assert not exact["ok"], exact["detail"]
    cases = doctor_gpu._cases("cpu")
    expected = sum(doctor_gpu._mismatch(route(x, spec, cfg, None), route(x, spec, cfg, valid)) is not None
                   for _, x, spec, cfg, valid in cases)
    assert expected >= 6 and f"differs from oea.route in {expected} of {len(cases)} cases" in exact["detail"]
    named = exact["detail"].split(" cases: ", 1)[1].split("; ")
    assert named and all("padding rows" in part for part in named), "only padded cases can differ"


def test_the_cpu_kernel_equals_oea_route_on_every_case_padding_included() -> None:
    exact = doctor_gpu._exactness(CPU, "numba")
    assert exact["ok"], exact["detail"]
    assert f"in {len(doctor_gpu._cases('cpu'))} cases" in exact["detail"]


@pytest.mark.parametrize(("layout", "padding"), [("none", []), ("trailing", [13, 14, 15]), ("scattered", [2, 7, 12])])
def test_padding_mask_layouts(layout: str, padding: list[int]) -> None:
    valid = doctor_gpu.padding_mask(16, layout)
    assert (~valid).nonzero().flatten().tolist() == padding
    assert doctor_gpu.padding_mask(1, "trailing").tolist() == [True], "one row is always real"


def test_padding_mask_refuses_an_unknown_layout() -> None:
    with pytest.raises(ValueError, match="padding layout must be 'none', 'trailing' or 'scattered', got 'middle'"):
        doctor_gpu.padding_mask(16, "middle")
