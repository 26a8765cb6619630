"""The test-support ``sgl_kernel`` stand-in (``tests/support/sgl_kernel_stand_in``): SGLang's one CPU kernel on its
native path in torch, a clear error for every other name, and no ``torch.ops.sgl_kernel`` op (so SGLang's
capability checks keep its torch-native paths); and ``oea.launch.sglang_server`` puts it on a server's
``PYTHONPATH`` only when asked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from oea.launch.sglang_server import STAND_IN_DIR, server_env


def _stand_in():
    spec = importlib.util.spec_from_file_location("oea_test_sgl_kernel", STAND_IN_DIR / "sgl_kernel" / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_assign_req_to_token_pool_cpu_writes_each_requests_slots_in_batch_order() -> None:
    kernel = _stand_in()
    req_to_token = torch.zeros(3, 6, dtype=torch.int32)
    kernel.assign_req_to_token_pool_cpu(torch.tensor([2, 0, 1]), req_to_token, torch.tensor([1, 0, 4]),
                                        torch.tensor([3, 1, 4]), torch.tensor([7, 8, 9]), 6)
    assert req_to_token.tolist() == [[9, 0, 0, 0, 0, 0], [0] * 6, [0, 7, 8, 0, 0, 0]]


def test_other_kernels_import_but_raise_naming_the_stand_in_and_no_op_is_registered() -> None:
    kernel = _stand_in()
    from_import = kernel.copy_all_layer_kv_cache_cpu  # what `from sgl_kernel import X` reads
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.copy_all_layer_kv_cache_cpu .*stand-in"):
        from_import()
    with pytest.raises(AttributeError):
        kernel.__wrapped__  # noqa: B018 - dunders are not invented
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")  # cpu_has_amx_support() stays False


def test_the_stand_in_reaches_a_server_only_when_asked() -> None:
    args = ["--model-path", "m", "--device", "cpu"]
    plain = server_env(args, {"PYTHONPATH": "/src"})
    assert plain["PYTHONPATH"] == "/src" and plain["SGLANG_USE_CPU_ENGINE"] == "1"
    asked = server_env(args, {"PYTHONPATH": "/src"}, stand_in=True)
    assert asked["PYTHONPATH"].split(":") == [str(STAND_IN_DIR), "/src"]
    assert "SGLANG_USE_CPU_ENGINE" not in server_env(["--model-path", "m"], {})  # a GPU server: untouched
    assert server_env(args, {"SGLANG_USE_CPU_ENGINE": "0"})["SGLANG_USE_CPU_ENGINE"] == "0"


def test_the_stand_in_lives_in_the_source_trees_test_support_not_in_the_package() -> None:
    assert STAND_IN_DIR.parts[-3:] == ("tests", "support", "sgl_kernel_stand_in")
    assert (STAND_IN_DIR / "sgl_kernel" / "__init__.py").is_file()


def test_asking_for_the_stand_in_where_it_is_absent_names_the_flag(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    monkeypatch.setattr("oea.launch.sglang_server.STAND_IN_DIR", tmp_path / "absent")  # as in a wheel install
    with pytest.raises(ValueError, match=r"^--sgl-kernel-stand-in: .* does not exist in this installation"):
        server_env(["--device", "cpu"], {}, stand_in=True)
    assert "PYTHONPATH" not in server_env(["--device", "cpu"], {})  # not asked: nothing to find
