"""``oea doctor gpu`` (``oea.kernels.doctor_gpu``) on this CPU-only machine.

What is real here: the compile check (Triton's own compiler and ptxas build real cubins for the capability
the stand-in reports: sm_90 compiles, sm_35 is refused by ptxas), the exactness comparison and its failure
rule, the report, the exit codes and the command line. What is a stand-in: the CUDA device (``_stand_in``:
``torch.cuda`` replaced by a CPU ``Device`` with a fake name and capability; ``route_fast`` then runs numba,
not Triton) and the CUDA graph (replaying means calling the function again on the new inputs). The CUDA run
itself is `oea doctor gpu` on a GPU (``scripts/gpu_check.sh`` runs it first).
"""

from __future__ import annotations

import json

import pytest
import torch

import oea
import oea.kernels.doctor_gpu as doctor_gpu
from oea.cli import main
from oea.kernels import aot, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="the project's dev extra installs Triton")


def _stand_in(capability: tuple[int, int] = (9, 0), capture=None) -> doctor_gpu.Device:
    """A CPU stand-in for a CUDA GPU of ``capability`` (``capture``: the CUDA-graph stand-in)."""
    return doctor_gpu.Device(available=lambda: True, capability=lambda: capability, name=lambda: "stand-in GPU",
                             device="cpu", impl="auto", capture=capture or doctor_gpu.graphed)


def _run(device: doctor_gpu.Device, allow_cpu: bool = False):
    return doctor_gpu.gpu_report(allow_cpu, device, specialisations=aot.SLICE[:1])


def test_without_cuda_one_line_and_exit_1_unless_allowed(monkeypatch, capsys) -> None:
    monkeypatch.setattr(doctor_gpu, "CUDA", doctor_gpu.Device(lambda: False, lambda: (0, 0), lambda: "", "cuda",
                                                              "triton", doctor_gpu.graphed))
    monkeypatch.setattr(doctor_gpu.gpu_report, "__defaults__", (False, doctor_gpu.CUDA, None))
    assert main(["doctor", "gpu"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("oea doctor gpu: no CUDA here") and "--allow-cpu" in out[0]
    assert main(["doctor", "gpu", "--allow-cpu"]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    assert "accepted (--allow-cpu)" in line and "oea.route_fast runs" in line and "Triton routing kernels" in line
    assert main(["doctor", "gpu", "--allow-cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["cuda"] is False and report["checks"] == []
    assert main(["doctor", "vllm", "--allow-cpu"]) == 2
    assert "--allow-cpu applies to `oea doctor gpu` only" in capsys.readouterr().err


@needs_triton
def test_a_gpu_triton_compiles_for_passes_every_check() -> None:
    report, code = _run(_stand_in((9, 0)))
    assert code == 0 and report["ok"] and report["fast_path"] == "Triton" and report["capability"] == "sm_90"
    assert [c["name"] for c in report["checks"]] == ["device", "compile", "exactness", "cuda graph"]
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    compiled = report["checks"][1]["detail"]
    assert compiled.startswith("2 kernels for sm_90, registers ") and "no spills" in compiled
    assert "== oea.route in 27 cases" in report["checks"][2]["detail"]
    assert report["line"].endswith("the Triton routing kernels compile, equal oea.route and replay in a CUDA graph")


@needs_triton
def test_a_gpu_triton_cannot_target_is_one_line_naming_it_and_oea_route_runs() -> None:
    report, code = _run(_stand_in((3, 5)))  # Tesla K80: the ptxas Triton ships has no sm_35
    assert code == 0 and report["fast_path"] == "oea.route (PyTorch)"
    compiled = report["checks"][1]
    assert not compiled["ok"] and "cannot compile the routing kernels for sm_35" in compiled["detail"]
    assert report["line"] == ("oea doctor gpu: sm_35 (stand-in GPU): Triton cannot run the routing kernels here; "
                              "oea.route (PyTorch) runs instead")
    assert "route_fast(impl='torch')" in report["checks"][2]["detail"] and report["checks"][3]["ok"]


def test_without_triton_oea_route_runs(monkeypatch) -> None:
    monkeypatch.setattr("oea.kernels.triton_available", lambda: False)
    report, code = _run(_stand_in())
    assert code == 0 and report["fast_path"] == "oea.route (PyTorch)"
    assert "Triton is not installed" in report["checks"][1]["detail"]


@needs_triton
def test_a_kernel_that_differs_from_route_fails(monkeypatch) -> None:
    real = oea.route_fast

    def swapped(logits, spec, cfg=None, valid=None, *, impl="auto"):
        ids, weights = real(logits, spec, cfg, valid, impl=impl)
        return ids.flip(1), weights.flip(1)

    monkeypatch.setattr(doctor_gpu, "route_fast", swapped)
    report, code = _run(_stand_in())
    exact = report["checks"][2]
    assert code == 1 and not report["ok"] and not exact["ok"]
    assert "differs from oea.route in 27 of 27 cases" in exact["detail"] and "ids differ" in exact["detail"]
    assert "FAILED: exactness: " in report["line"]


@needs_triton
def test_a_graph_that_replays_stale_results_fails() -> None:
    def frozen(fn, *static):  # a "graph" that ignores its new inputs
        out = fn(*static)
        return lambda *inputs: out

    report, code = _run(_stand_in(capture=frozen))
    graph = report["checks"][3]
    assert code == 1 and not graph["ok"] and graph["detail"].startswith("replay 0 of the captured route_fast call")


def test_an_error_inside_a_check_is_a_failed_check(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr("oea.kernels.triton_available", lambda: False)
    monkeypatch.setattr(doctor_gpu, "route_fast", broken)
    report, code = _run(_stand_in())
    assert code == 1
    assert report["checks"][2] == {"name": "exactness", "ok": False,
                                   "detail": "RuntimeError: CUDA error: an illegal memory access was encountered"}


def test_graphed_is_the_function_itself_on_cpu() -> None:
    def fn(x):
        return x + 1

    assert doctor_gpu.graphed(fn, torch.zeros(2)) is fn
