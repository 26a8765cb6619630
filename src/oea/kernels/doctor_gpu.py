"""``oea doctor gpu``: does the fast routing path work on this machine's GPU? What a user runs first on a GPU server.

On CUDA, four checks (each ``{"name", "ok", "detail"}``, as the engine doctors'):

* ``device``: the GPU and its capability (``sm_90``), torch and Triton versions;
* ``compile``: the Triton routing kernels compiled for the local capability with Triton's own compiler
  (``oea.kernels.aot``: the slice that takes every branch of both kernels), registers, spills, shared memory.
  A GPU Triton cannot compile for is reported in one line naming its capability: ``oea.route_fast`` runs
  ``oea.route`` (PyTorch) there, and the next two checks run through that;
* ``exactness``: ``route_fast`` on the GPU against ``oea.route`` on the same logits (softmax and grouped
  sigmoid routers, bf16 / fp16 / fp32, padding rows, vanilla / OEA / pruned): ids bit-equal, weights within
  ``oea.kernels.WEIGHT_RTOL`` / ``WEIGHT_ATOL``;
* ``cuda graph``: one ``route_fast`` call captured in a CUDA graph and replayed on new logits, against eager
  ``oea.route``.

Without CUDA: one line saying so and exit status 1; with ``allow_cpu`` exit 0 and what would run. The CUDA
calls go through a ``Device`` (``CUDA``: ``torch.cuda``); the tests replace it with a stand-in on CPU.

It sits beside the kernels it checks and imports only them and ``oea.routing``; the check record (``Check``,
``check``) and ``installed_version`` are defined here, the lowest layer that reports checks, and the engine
doctors take them from here (``oea.integrations.doctor.common``).
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from oea.kernels.dispatch import route_fast
from oea.routing import OEAConfig, PrunedConfig, RouterSpec, route

FAST_PATH_FALLBACK = "oea.route (PyTorch)"
Check = dict[str, Any]


def check(name: str, ok: bool, detail: str) -> Check:
    """One check record: ``{"name", "ok", "detail"}`` (every doctor's)."""
    return {"name": name, "ok": bool(ok), "detail": detail}


def installed_version(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` that is installed (package metadata), or None."""
    for dist in distributions:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def graphed(fn: Callable[..., Any], *static_inputs: torch.Tensor) -> Callable[..., Any]:
    """Capture ``fn(*static_inputs)`` in a CUDA graph (after three warm-up calls on a side stream); the result
    copies new inputs into the static buffers, replays and returns clones of the outputs. On CPU: ``fn``."""
    if static_inputs[0].device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(*static_inputs)

    def replay(*inputs: torch.Tensor) -> Any:
        for buffer, value in zip(static_inputs, inputs, strict=True):
            buffer.copy_(value)
        graph.replay()
        if isinstance(static_out, tuple):
            return tuple(t.clone() for t in static_out)
        return static_out.clone()

    return replay


@dataclass(frozen=True)
class Device:
    """What the GPU checks need from CUDA. ``impl``: the kernel ``route_fast`` must run there."""

    available: Callable[[], bool]
    capability: Callable[[], tuple[int, int]]
    name: Callable[[], str]
    device: str
    impl: str
    capture: Callable[..., Callable[..., Any]]


CUDA = Device(torch.cuda.is_available, lambda: torch.cuda.get_device_capability(), lambda: torch.cuda.get_device_name(),
              "cuda", "triton", graphed)


def _triton_version() -> str | None:
    return installed_version("triton")


def _compile(capability: tuple[int, int], specialisations: Sequence[Any]) -> tuple[Check, bool]:
    """(the ``compile`` check, whether the Triton kernels can run here)."""
    from oea.kernels import aot

    target = aot.target_for(capability)
    results = [r for s in specialisations for r in aot.compile_specialisation(s, target)]
    failed = [r for r in results if r.error is not None]
    if failed:
        detail = (f"Triton {_triton_version()} cannot compile the routing kernels for {target.name}: "
                  f"{failed[0].error[:200]}; oea.route_fast runs {FAST_PATH_FALLBACK} on this GPU")
        return check("compile", False, detail), False
    bad = [f"{r.kernel} {r.specialisation.label}: {'; '.join(r.problems)}" for r in results if not r.ok]
    figures = (f"{len(results)} kernels for {target.name}, registers {min(r.registers for r in results)}-"
               f"{max(r.registers for r in results)}, shared memory <= {max(r.shared for r in results)} bytes "
               f"(limit {target.shared_limit}), {sum(r.seconds for r in results):.0f} s")
    if bad:
        return check("compile", False, f"{figures}; " + " | ".join(bad)), True
    return check("compile", True, f"{figures}, no spills"), True


PADDING_ROWS = 3  # per padded case: enough that a kernel counting them as real changes OEA's union


def padding_mask(rows: int, layout: str) -> torch.Tensor:
    """[rows] bool ``valid`` mask, False on the padding rows: ``"none"`` (every row real), ``"trailing"`` (the
    last ``PADDING_ROWS``, as a CUDA graph captured for a larger batch pads) or ``"scattered"`` (every fifth row
    from the third, ``PADDING_ROWS`` of them: padding between real rows, which a kernel that only trims the
    tail would get wrong). The first row is always real."""
    index = torch.arange(rows)
    if layout == "none":
        return torch.ones(rows, dtype=torch.bool)
    if layout == "trailing":
        return index < max(1, rows - PADDING_ROWS)
    if layout == "scattered":
        return ~((index % 5 == 2) & (index < 5 * PADDING_ROWS))
    raise ValueError(f"padding layout must be 'none', 'trailing' or 'scattered', got {layout!r}")


# (rows, padding layout) of each router and policy: one decode row and two padded batches (27 cases in all).
# The padded cases hold the kernels to ``oea.route``'s padding rule (padding rows keep vanilla routing and stay
# out of OEA's union and row count), which every engine's padded decode batch relies on: without them a kernel
# that counts padding rows as real passes this check.
SHAPES: tuple[tuple[int, str], ...] = ((1, "none"), (16, "scattered"), (100, "trailing"))


def _cases(device: str) -> list[tuple[str, torch.Tensor, Any, Any, torch.Tensor | None]]:
    """(label, logits, spec, cfg, valid) on ``device``: both families, three dtypes, three policies, each with
    one real row and two batches with padding rows (``SHAPES``); a padded case's label says so."""
    gen = torch.Generator().manual_seed(0)
    bias = (torch.randn(256, generator=gen) * 0.1).to(device)
    routers = {"softmax N=128 k=8": (RouterSpec(128, 8), torch.bfloat16),
               "softmax N=60 k=4": (RouterSpec(60, 4), torch.float16),
               "sigmoid-grouped N=256 k=8": (RouterSpec(256, 8, "sigmoid", correction_bias=bias, n_group=8,
                                                            topk_group=4, routed_scaling_factor=2.5), torch.float32)}
    configs = {"vanilla": None, "oea k0=3": OEAConfig(3), "pruned k0=2": PrunedConfig(2)}
    cases = []
    for router, (spec, dtype) in routers.items():
        for policy, cfg in configs.items():
            for rows, layout in SHAPES:
                logits = (torch.randn(rows, spec.num_experts, generator=gen) * 2).to(device, dtype)
                valid = padding_mask(rows, layout)
                padded = rows - int(valid.sum())
                label = f"{router} {dtype} {policy} M={rows}"
                label += f" ({padded} padding rows, {layout})" if padded else ""  # a failure names its padding
                cases.append((label, logits, spec, cfg, valid.to(device)))
    return cases


def _mismatch(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """Why two routings differ: ids not bit-equal, or weights beyond the kernels' stated tolerance."""
    from oea.kernels.dispatch import WEIGHT_ATOL, WEIGHT_RTOL

    ids, weights = got[0].cpu(), got[1].float().cpu()
    want_ids, want_weights = want[0].cpu(), want[1].float().cpu()
    if not torch.equal(ids, want_ids):
        return "ids differ"
    if not torch.allclose(weights, want_weights, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL):
        return f"weights differ by {float((weights - want_weights).abs().max()):.3g}"
    return None


def _exactness(device: Device, impl: str) -> Check:
    cases = _cases(device.device)
    bad = []
    for label, logits, spec, cfg, valid in cases:
        why = _mismatch(route_fast(logits, spec, cfg, valid, impl=impl), route(logits, spec, cfg, valid))
        if why is not None:
            bad.append(f"{label}: {why}")
    if bad:
        return check("exactness", False, f"route_fast(impl={impl!r}) differs from oea.route in {len(bad)} of "
                                         f"{len(cases)} cases: " + "; ".join(bad[:3]))
    return check("exactness", True, f"route_fast(impl={impl!r}) == oea.route in {len(cases)} cases (ids bit-equal, "
                                    "weights within the stated tolerance)")


def _graph(device: Device, impl: str) -> Check:
    gen = torch.Generator().manual_seed(1)
    spec, cfg = RouterSpec(128, 8), OEAConfig(3)
    valid = (torch.arange(32) < 28).to(device.device)
    static = torch.randn(32, 128, generator=gen).to(device.device, torch.bfloat16)
    replay = device.capture(lambda x: route_fast(x, spec, cfg, valid, impl=impl), static)
    for trial in range(3):
        logits = (torch.randn(32, 128, generator=gen) * (1 + trial)).to(device.device, torch.bfloat16)
        why = _mismatch(replay(logits), route(logits, spec, cfg, valid))
        if why is not None:
            return check("cuda graph", False, f"replay {trial} of the captured route_fast call: {why}")
    return check("cuda graph", True, f"route_fast(impl={impl!r}) captured once, 3 replays on new logits == oea.route")


def _safe(name: str, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except Exception as err:  # a CUDA or compiler error is what the check reports
        return check(name, False, " ".join(f"{type(err).__name__}: {err}".split())[:400])


def without_cuda_line(allow_cpu: bool) -> str:
    """The one line of a machine without CUDA (with ``allow_cpu``: what runs here and what would on a GPU)."""
    from oea.kernels.dispatch import choose_impl

    cuda_build = torch.version.cuda is not None
    why = "no CUDA device visible" if cuda_build else f"torch {torch.__version__} is a CPU build"
    if not allow_cpu:
        return (f"oea doctor gpu: no CUDA here ({why}); nothing to check (run it on the GPU server, or pass "
                "--allow-cpu to accept a CPU machine)")
    here = choose_impl(torch.zeros(2, 64), RouterSpec(64, 8), OEAConfig(3))
    return (f"oea doctor gpu: no CUDA here ({why}), accepted (--allow-cpu): oea.route_fast runs {here!r} on CPU "
            "tensors; on a CUDA GPU it would compile and run the Triton routing kernels (exactness against "
            "oea.route and a CUDA-graph replay are what this command checks there)")


def gpu_report(allow_cpu: bool = False, device: Device = CUDA,
               specialisations: Sequence[Any] | None = None) -> tuple[dict[str, Any], int]:
    """The report of ``oea doctor gpu`` and its exit status (0: the fast path works on this GPU, or no CUDA
    with ``allow_cpu``). ``specialisations``: what the compile check compiles (default ``aot.SLICE``)."""
    from oea.kernels import aot, triton_available

    if not device.available():
        line = without_cuda_line(allow_cpu)
        return {"ok": allow_cpu, "cuda": False, "fast_path": None, "line": line, "checks": []}, 0 if allow_cpu else 1
    capability = tuple(device.capability())
    target = aot.target_for(capability)  # type: ignore[arg-type]
    checks = [check("device", True, f"{device.name()}, capability {target.name}, torch {torch.__version__}, "
                                    f"Triton {_triton_version() or 'not installed'}")]
    runs_triton = triton_available()
    if runs_triton:
        compiled, runs_triton = _compile(capability, aot.SLICE if specialisations is None else specialisations)  # type: ignore[arg-type]
        checks.append(compiled)
    else:
        checks.append(check("compile", False, f"Triton is not installed (pip install triton): oea.route_fast runs "
                                              f"{FAST_PATH_FALLBACK} on this GPU"))
    impl = device.impl if runs_triton else "torch"
    checks.append(_safe("exactness", lambda: _exactness(device, impl)))
    checks.append(_safe("cuda graph", lambda: _graph(device, impl)))
    fast_path = "Triton" if runs_triton else FAST_PATH_FALLBACK
    if runs_triton:
        ok = all(c["ok"] for c in checks)
        line = (f"oea doctor gpu: {target.name} ({device.name()}): " +
                ("the Triton routing kernels compile, equal oea.route and replay in a CUDA graph" if ok else
                 "FAILED: " + "; ".join(f"{c['name']}: {c['detail']}" for c in checks if not c["ok"])))
    else:
        ok = all(c["ok"] for c in checks if c["name"] != "compile")
        line = (f"oea doctor gpu: {target.name} ({device.name()}): Triton cannot run the routing kernels here; "
                f"{FAST_PATH_FALLBACK} runs instead" + ("" if ok else " (and it FAILED its checks, see above)"))
    report = {"ok": ok, "cuda": True, "capability": target.name, "device_name": device.name(),
              "fast_path": fast_path, "line": line, "checks": checks}
    return report, 0 if ok else 1


def format_gpu(report: dict[str, Any]) -> str:
    """The text report: one line per check, then the summary line."""
    lines = [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['detail']}" for c in report["checks"]]
    return "\n".join([*lines, report["line"]])
