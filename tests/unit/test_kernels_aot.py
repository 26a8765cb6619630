"""The Triton routing kernels compiled ahead of time for sm_80 / sm_90 / sm_100 / sm_120 (``oea.kernels.aot``).

Triton's own compiler and the ptxas it ships compile real cubins here, without a GPU. ``make test`` compiles
the representative slice (``aot.SLICE``: every branch of both kernels) spread over the four targets
(``TEST_SLICE``: 20 of the slice's 32 compilations, about a third of its compile time); ``scripts/aot_compile.py
--slice`` compiles the whole slice for every target, ``scripts/aot_compile.py`` the full matrix (its table is
in docs/benchmarks.md). The matrix must cover every specialisation the adapters can ask for: the simulator's
model presets turned into routers the way the vLLM and SGLang plugins do it (stand-in router objects with the
attributes the plugins read).
"""

from __future__ import annotations

import os
import types
import warnings

import pytest
import torch
from project_scripts import load_script

import oea
import oea.kernels.dispatch as dispatch
import oea.kernels.triton_gpu as triton_gpu
from oea.kernels import aot, route_fast
from oea.kernels.triton_gpu import triton_available

needs_compiler = pytest.mark.skipif(not triton_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                                    reason="the project's dev extra installs Triton; the interpreter cannot compile")


# ---------------------------------------------------------------- real compilation for every target


# What make test compiles per target: the slice's two softmax specialisations (bf16 / fp16 loads, ``valid``, N padded
# or not) on every target, and each of its two costly ones (~85% of the slice's compile time) on one target: the
# N = 512 float32 tile (it spilled on sm_90 at 16 warps) and the grouped sigmoid router (it spilled on every
# target). Together: every branch of both kernels and every target, each compiled at least once.
COSTLY = {"sm_90": aot.Specialisation(512, 10, "softmax", 1, "float32", False),
          "sm_100": aot.Specialisation(256, 8, "sigmoid", 8, "float32", True)}
EVERY_TARGET = tuple(s for s in aot.SLICE if s not in COSTLY.values())
TEST_SLICE = {t.name: EVERY_TARGET + ((COSTLY[t.name],) if t.name in COSTLY else ()) for t in aot.TARGETS}


@needs_compiler
@pytest.mark.parametrize("target", aot.TARGETS, ids=lambda t: f"aot-{t.name}")
def test_aot_slice_compiles_without_spills_for(target: aot.Target) -> None:
    results = load_script("aot_compile").run(TEST_SLICE[target.name], [target])
    assert len(results) == len(TEST_SLICE[target.name]) * len(aot.KERNELS)
    bad = [f"{r.kernel} {r.specialisation.label}: {'; '.join(r.problems)}" for r in results if not r.ok]
    assert not bad, f"{target.name}: " + " | ".join(bad)
    assert all(0 < r.registers <= 255 and r.num_warps >= 1 and r.shared > 0 for r in results)
    script = load_script("aot_compile")
    table = script.markdown(results)
    assert table.count("\n") == 1 + len(results) and "| phase2 |" in table
    assert script.markdown(script.from_rows([r.row() for r in results])) == table  # --merge reads --json rows


def test_aot_slice_takes_every_branch_of_the_kernels() -> None:
    """Each constexpr branch (family, group limit, valid, load dtype, padded N and k, tile height) both ways."""
    shapes = [s.launches()[1].kwargs for s in aot.SLICE]
    dtypes = {str(s.launches()[1].args[0].dtype) for s in aot.SLICE}
    assert {s["SIGMOID"] for s in shapes} == {False, True}
    assert {s["N_GROUP"] > 1 for s in shapes} == {False, True}
    assert {s["HAS_VALID"] for s in shapes} == {False, True}
    assert dtypes == {"torch.bfloat16", "torch.float16", "torch.float32"}
    assert {s["BN"] != s["N"] for s in shapes} == {False, True}
    assert {s["KP"] != s["K"] for s in shapes} == {False, True}
    assert {s["BM"] == 16 for s in shapes} == {False, True}
    assert {s.key() for s in aot.SLICE} <= {s.key() for s in aot.matrix()}
    # make test's spread of the slice over the targets compiles all of it, the costly two on one target each
    assert set(COSTLY.values()) <= set(aot.SLICE) and set(TEST_SLICE) == {t.name for t in aot.TARGETS}
    assert {s for per_target in TEST_SLICE.values() for s in per_target} == set(aot.SLICE)
    assert sum(len(per_target) for per_target in TEST_SLICE.values()) == 2 * len(aot.TARGETS) + len(COSTLY) == 10


@needs_compiler
def test_aot_a_target_triton_cannot_compile_for_is_a_failed_result() -> None:
    """sm_35 (Tesla K80): the ptxas Triton ships has no such target; Triton's own error comes back, not raised."""
    results = aot.compile_specialisation(aot.SLICE[0], aot.Target(35, "Tesla K80", 48 * 1024))
    assert [r.kernel for r in results] == ["phase1", "phase2"]
    for result in results:
        assert not result.ok and result.problems[0].startswith("did not compile: PTXASError")
        assert "'sm_35' is not defined" in result.error


def test_aot_spills_and_shared_memory_over_the_limit_fail_naming_why() -> None:
    target = aot.TARGETS[-1]
    base = aot.CompileResult("phase2", target, aot.SLICE[0], registers=96, shared=512)
    assert base.ok
    spilled = aot.CompileResult("phase2", target, aot.SLICE[0], registers=255, spill_stores=8, spill_loads=8)
    assert spilled.problems == ["spills (8 bytes stored, 8 loaded)"]
    over = aot.CompileResult("phase1", target, aot.SLICE[0], registers=40, shared=target.shared_limit + 1)
    assert over.problems == [f"shared memory {target.shared_limit + 1} bytes > the sm_120 limit 101376"]
    assert load_script("aot_compile").summary([base, spilled, over], 1.0).endswith(
        "0 compile failures, 1 with spills, 1 over the shared-memory limit; max registers 255")


def test_aot_ptxas_figures_are_read_from_its_log() -> None:
    log = ("ptxas info    : Compiling entry function 'phase2' for 'sm_90a'\nptxas info    : Function properties for "
           "phase2\n    416 bytes stack frame, 468 bytes spill stores, 476 bytes spill loads\nptxas info    : Used 255 "
           "registers, used 1 barriers, 416 bytes cumulative stack size\n")
    assert aot._ptxas_figures(log) == {"registers": 255, "spill_stores": 468, "spill_loads": 476, "stack": 416}
    with pytest.raises(RuntimeError, match="no ptxas -v figures"):
        aot._ptxas_figures("")


def test_aot_unknown_target_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_script("aot_compile").main(["--slice", "--targets", "sm_75"]) == 2
    assert "unknown ['sm_75']; allowed: ['sm_100', 'sm_120', 'sm_80', 'sm_90']" in capsys.readouterr().err


# ---------------------------------------------------------------- the matrix covers what the adapters ask for


def _vllm_router(n: int, k: int, scoring: str, n_group: int) -> object:
    """Stand-in for a vLLM router object: the attributes ``oea.integrations.vllm.plugin.router_spec`` reads."""
    name = "FusedTopKBiasRouter" if scoring == "sigmoid" else "FusedTopKRouter"
    name = "GroupedTopKRouter" if n_group > 1 else name
    router = type(name, (), {})()
    router.__dict__.update(global_num_experts=n, top_k=k, scoring_func=scoring, renormalize=True,
                           e_score_correction_bias=torch.zeros(n) if scoring == "sigmoid" else None,
                           use_grouped_topk=n_group > 1, num_expert_group=n_group, topk_group=max(1, n_group // 2))
    return router


def _sglang_topk_config(n: int, k: int, scoring: str, n_group: int) -> object:
    """Stand-in for SGLang's ``TopKConfig``: the fields ``router_spec_from_topk_config`` reads."""
    return types.SimpleNamespace(top_k=k, renormalize=True, scoring_func=scoring, use_grouped_topk=n_group > 1,
                                 correction_bias=torch.zeros(n) if scoring == "sigmoid" else None,
                                 num_expert_group=n_group if n_group > 1 else None,
                                 topk_group=max(1, n_group // 2) if n_group > 1 else None, routed_scaling_factor=1.0,
                                 apply_routed_scaling_factor_on_output=False, output_format=None,
                                 custom_routing_function=None, num_shared_topk_slots=0)


def _asked_for(models: dict[str, tuple[int, int, str, int]]) -> dict[str, aot.Specialisation]:
    """Every specialisation the two plugins' router translations ask ``route_fast`` for: label -> model."""
    from oea.integrations.sglang.specs import router_spec_from_topk_config
    from oea.integrations.vllm.plugin import router_spec

    asked = {}
    for model, (n, k, scoring, n_group) in models.items():
        specs = [router_spec(_vllm_router(n, k, scoring, n_group))[0],
                 router_spec_from_topk_config(_sglang_topk_config(n, k, scoring, n_group), n)]
        for spec in specs:
            assert spec is not None, model
            for dtype in aot.DTYPES:
                for has_valid in (False, True):
                    found = aot.specialisation_of(spec, dtype, has_valid)
                    assert found is not None, model
                    asked[f"{model}: {found.label}"] = found
    return asked


def _uncovered(models: dict[str, tuple[int, int, str, int]]) -> list[str]:
    covered = {s.key() for s in aot.matrix()}
    return sorted(name for name, s in _asked_for(models).items() if s.key() not in covered)


def _preset_routers() -> dict[str, tuple[int, int, str, int]]:
    from oea.presets import MODEL_PRESETS

    return {name: (p.num_experts, p.top_k, p.scoring, p.n_group or 1) for name, p in MODEL_PRESETS.items()}


def test_aot_matrix_covers_every_specialisation_the_adapters_ask_for() -> None:
    assert _uncovered(_preset_routers()) == []
    assert _uncovered(aot.SERVED_ROUTERS) == []
    counts = {(n, k) for n, k, _, _ in aot.SERVED_ROUTERS.values()}
    assert {n for n, _ in counts} >= {60, 64, 128, 160, 256, 384, 512} and {k for _, k in counts} >= {4, 6, 8, 10}


def test_aot_a_router_the_matrix_lacks_is_named() -> None:
    assert _uncovered({"a 96-expert model": (96, 6, "softmax", 1)}) == [
        f"a 96-expert model: N=96 k=6 softmax {dtype}{valid}" for dtype in ("bfloat16", "float16", "float32")
        for valid in ("", " valid")]


def test_aot_sigmoid_routers_compile_one_float32_kernel_whatever_the_logits_dtype() -> None:
    spec = aot.Specialisation(256, 8, "sigmoid", 8, "bfloat16", False).router()
    found = {aot.specialisation_of(spec, dtype, True) for dtype in aot.DTYPES}
    assert found == {aot.Specialisation(256, 8, "sigmoid", 8, "float32", True)}


# ---------------------------------------------------------------- a kernel that cannot compile: oea.route, said once


class _Kernel:
    """Stand-in for a Triton kernel: its launch fails like a compile failure (``fail``) or succeeds."""

    def __init__(self, name: str, calls: list[str], fail: list[bool]) -> None:
        self.name, self.calls, self.fail = name, calls, fail

    def __getitem__(self, grid: tuple[int]):
        def launch(*args, **kwargs):
            self.calls.append(self.name)
            if self.fail[0]:
                raise RuntimeError("PTXASError: ptxas fatal : Value 'sm_61' is not defined for option 'gpu-name'")
        return launch


@pytest.fixture
def stand_in_kernels(monkeypatch: pytest.MonkeyPatch):
    calls: list[str] = []
    fail = [True]
    fake = types.SimpleNamespace(phase1=_Kernel("phase1", calls, fail), phase2=_Kernel("phase2", calls, fail))
    monkeypatch.setitem(triton_gpu._TRITON, "source", fake)
    monkeypatch.setitem(triton_gpu._TRITON, "available", True)
    monkeypatch.setattr(triton_gpu, "FAILED", {})
    monkeypatch.setattr(triton_gpu, "_LAUNCHED", set())
    monkeypatch.setattr(dispatch, "_requested", lambda impl, device: None)  # as on a CUDA device
    return calls, fail


def test_aot_a_kernel_that_cannot_compile_runs_route_and_says_so_once(stand_in_kernels) -> None:
    calls, _ = stand_in_kernels
    logits, spec, cfg = torch.randn(12, 64), oea.RouterSpec(64, 8), oea.OEAConfig(3)
    with pytest.warns(RuntimeWarning, match=r"N=64 K=8 \(softmax, torch.float32\) cannot be compiled for cpu: "
                                            r"RuntimeError: PTXASError.*these calls run oea.route instead"):
        ids, weights = route_fast(logits, spec, cfg, impl="triton")
    want = oea.route(logits, spec, cfg)
    assert torch.equal(ids, want[0]) and torch.equal(weights, want[1]) and calls == ["phase1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = route_fast(logits * 2, spec, cfg, impl="triton")  # no second warning, no second compile
    assert torch.equal(again[0], oea.route(logits * 2, spec, cfg)[0]) and calls == ["phase1"]
    assert next(iter(triton_gpu.FAILED.values())).startswith("RuntimeError: PTXASError")
    with pytest.warns(RuntimeWarning, match="torch.bfloat16"):  # another specialisation tries its own compile
        route_fast(torch.randn(12, 64, dtype=torch.bfloat16), spec, cfg, impl="triton")
    assert calls == ["phase1", "phase1"]


def test_aot_an_error_after_a_kernel_has_run_is_not_taken_for_a_compile_failure(stand_in_kernels) -> None:
    calls, fail = stand_in_kernels
    fail[0] = False
    logits, spec = torch.randn(4, 32), oea.RouterSpec(32, 4)
    route_fast(logits, spec, oea.OEAConfig(2), impl="triton")
    fail[0] = True
    with pytest.raises(RuntimeError, match="PTXASError"):
        route_fast(logits, spec, oea.OEAConfig(2), impl="triton")
    assert calls == ["phase1", "phase2", "phase1"] and not triton_gpu.FAILED
