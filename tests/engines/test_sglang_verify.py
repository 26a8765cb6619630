"""SGLang's speculative verify forwards (TARGET_VERIFY) with and without ``OEA_APPLY_TO_VERIFY``, through SGLang
0.5.23's own forward context, ``TopK`` and ``DecodeCudaGraphRunner.load_batch`` on CPU (``sglang_verify_checks.py``,
run in .venv-sglang). SGLang's speculative workers themselves do not run here: their tree kernels
(``sgl_kernel.verify_tree_greedy_cpu``, ``sgl_kernel.build_tree_kernel_efficient_cpu``) need a CPU build of
``sgl_kernel`` (docs/speculative.md)."""

from __future__ import annotations

from typing import Any

import pytest
from sglang_venv import assert_every_check_passed, check, checks_fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow]

LAYERS = 4


verify = checks_fixture("verify")
unset = checks_fixture("verify-unset", "unset")


def test_apply_to_verify_routes_every_real_row_of_a_verify_forward_as_one_union(verify: dict[str, Any]) -> None:
    assert verify["apply_to_verify"]
    assert_every_check_passed(verify)
    for layer in range(LAYERS):
        assert check(verify, f"eager_verify_rows:layer{layer}")["detail"] == "equal"
    for step in range(3):
        for name in ("verify_load_batch{}_rows", "verify_load_batch{}_count_writes",
                     "verify_replay{}_real_rows_equal_oea_route", "verify_replay{}_padding_rows_keep_sglang_routing"):
            assert check(verify, name.format(step))["ok"], check(verify, name.format(step))


def test_verify_forwards_keep_sglangs_routing_without_apply_to_verify(unset: dict[str, Any]) -> None:
    assert not unset["apply_to_verify"]
    assert not [c for c in unset["checks"] if not c["ok"]]
    for layer in range(LAYERS):
        assert check(unset, f"eager_verify_rows:layer{layer}")["detail"] == "bitwise identical"
    assert check(unset, "eager_verify_count_writes")["detail"] == "0 write(s)"
    for step in range(3):
        assert check(unset, f"verify_replay{step}_sglang_routing")["detail"] == "bitwise identical"
        assert check(unset, f"verify_load_batch{step}_count_writes")["detail"] == "0 write(s)"
