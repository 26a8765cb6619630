"""Ahead-of-time compilation of the Triton routing kernels for CUDA targets, on a machine without a GPU.

Triton's own compiler (``triton.compile(ASTSource(...), target=GPUTarget("cuda", capability, 32))``, with the
``ptxas`` Triton ships) turns each launch ``triton_gpu.launches`` makes into PTX and a cubin for a named
target, and ``ptxas -v`` reports registers, spills and stack per kernel; Triton's metadata gives the shared
memory. The signature, constexprs and alignment attributes are the ones Triton's JIT derives from the launch
arguments (its own binder), so what is compiled here is what a GPU would compile at the first decode step.

* ``TARGETS``: sm_80 (A100), sm_90 (H100/H200), sm_100 (B200), sm_120 (RTX PRO 6000 Blackwell), each with
  its shared-memory limit per block;
* ``Specialisation``: what makes Triton compile a new kernel (N, k, family, groups, logits dtype, ``valid``
  or not); ``specialisation_of`` is the one a ``RouterSpec`` asks for, read from the launch code itself;
* ``SERVED_ROUTERS`` and ``matrix()``: every specialisation of the routers the adapters serve;
  ``SLICE``: a few specialisations that together take every branch of the kernels (``make test``);
* ``compile_specialisation`` -> ``CompileResult`` per kernel (``ok``: compiled, no spill, shared memory
  within the target's limit).

Triton is imported inside functions only; ``TRITON_INTERPRET=1`` must not be set (the interpreter replaces
the kernels by Python functions, which cannot be compiled).
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from oea.kernels.params import kernel_params
from oea.kernels.triton_gpu import Launch, launches, specialisation_key
from oea.routing import OEAConfig, RouterSpec


@dataclass(frozen=True)
class Target:
    """One CUDA compile target: capability (80 = sm_80), the GPUs it is, max shared memory per block (bytes,
    the opt-in limit ``cudaDevAttrMaxSharedMemoryPerBlockOptin``)."""

    capability: int
    gpus: str
    shared_limit: int

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"


TARGETS: tuple[Target, ...] = (
    Target(80, "A100", 163 * 1024),
    Target(90, "H100 / H200", 227 * 1024),
    Target(100, "B200", 227 * 1024),
    Target(120, "RTX PRO 6000 Blackwell", 99 * 1024),
)
KERNELS = ("phase1", "phase2")
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Specialisation:
    """One compiled variant of the kernels. ``dtype``: the logits dtype the kernels read (sigmoid routers
    always read float32: torch's sigmoid runs first); ``n_group`` 1: no group limit."""

    num_experts: int
    top_k: int
    scoring: str
    n_group: int
    dtype: str
    has_valid: bool

    @property
    def label(self) -> str:
        groups = f" {self.n_group} groups" if self.n_group > 1 else ""
        return (f"N={self.num_experts} k={self.top_k} {self.scoring}{groups} {self.dtype}"
                f"{' valid' if self.has_valid else ''}")

    def router(self) -> RouterSpec:
        """A router that asks for this specialisation (sigmoid ones with a correction bias)."""
        n, k = self.num_experts, self.top_k
        if self.scoring == "softmax":
            return RouterSpec(n, k, "softmax")
        groups = (self.n_group, max(1, self.n_group // 2)) if self.n_group > 1 else (None, None)
        return RouterSpec(n, k, "sigmoid", correction_bias=torch.zeros(n), n_group=groups[0], topk_group=groups[1])

    def launches(self) -> tuple[Launch, ...]:
        """The launches ``triton_route`` makes for this specialisation (two rows of zeros, on CPU)."""
        spec = self.router()
        params = kernel_params(spec, OEAConfig(1), 2)
        assert not isinstance(params, str), params
        logits = torch.zeros(2, spec.num_experts, dtype=getattr(torch, self.dtype))
        valid = torch.ones(2, dtype=torch.bool) if self.has_valid else None
        return launches(logits, params, spec.correction_bias, valid)[0]

    def key(self) -> tuple[Any, ...]:
        return specialisation_key(self.launches()[1])


def specialisation_of(spec: RouterSpec, dtype: torch.dtype, has_valid: bool) -> Specialisation | None:
    """The specialisation ``route_fast`` compiles for ``spec`` with ``dtype`` logits (None: no kernel runs it,
    e.g. a correction bias the kernels cannot take), read from the launch ``triton_gpu.launches`` makes."""
    params = kernel_params(spec, OEAConfig(1), 2)
    if isinstance(params, str):
        return None
    logits = torch.zeros(2, spec.num_experts, dtype=dtype)
    valid = torch.ones(2, dtype=torch.bool) if has_valid else None
    second = launches(logits, params, spec.correction_bias, valid)[0][1]
    shape = second.kwargs
    return Specialisation(shape["N"], shape["K"], "sigmoid" if shape["SIGMOID"] else "softmax", shape["N_GROUP"],
                          str(second.args[0].dtype).removeprefix("torch."), bool(shape["HAS_VALID"]))


# The routers of the models the adapters serve: (N, k, scoring, n_group), by model. The simulator's presets
# are among them (tests/unit/test_kernels_aot.py checks that each is covered).
SERVED_ROUTERS: dict[str, tuple[int, int, str, int]] = {
    "mixtral-8x7b": (8, 2, "softmax", 1),
    "qwen1.5-moe-a2.7b": (60, 4, "softmax", 1),
    "olmoe-1b-7b / deepseek-v2-lite": (64, 8, "softmax", 1),
    "qwen3-30b-a3b / qwen3-235b-a22b / embedded": (128, 8, "softmax", 1),
    "gpt-oss-120b": (128, 4, "softmax", 1),
    "deepseek-v2 (N=160, k=6)": (160, 6, "softmax", 1),
    "qwen3-next-80b-a3b": (512, 10, "softmax", 1),
    "glm-4.5-air": (128, 8, "sigmoid", 1),
    "glm-5": (256, 8, "sigmoid", 1),
    "deepseek-v3 / r1": (256, 8, "sigmoid", 8),
    "kimi-k2": (384, 8, "sigmoid", 1),
}


def matrix(routers: dict[str, tuple[int, int, str, int]] | None = None) -> list[Specialisation]:
    """Every specialisation of ``routers`` (default ``SERVED_ROUTERS``): each logits dtype, with and without
    ``valid``; specialisations that compile to the same kernel are listed once."""
    found: dict[tuple[Any, ...], Specialisation] = {}
    for n, k, scoring, n_group in (routers or SERVED_ROUTERS).values():
        for dtype in DTYPES:
            for has_valid in (False, True):
                spec = Specialisation(n, k, scoring, n_group, str(dtype).removeprefix("torch."), has_valid)
                spec = specialisation_of(spec.router(), dtype, has_valid) or spec
                found.setdefault(spec.key(), spec)
    return list(found.values())


# Every branch of the kernels: softmax and sigmoid, with and without a group limit and ``valid``, bf16 / fp16 /
# fp32 loads, N a power of two or not, k a power of two or not, full (16-row) and narrower tiles.
# The widest softmax tile in float32 (N = 512) is the one that spilled at 16 warps.
SLICE: tuple[Specialisation, ...] = (
    Specialisation(60, 4, "softmax", 1, "bfloat16", True),
    Specialisation(128, 8, "softmax", 1, "float16", True),
    Specialisation(512, 10, "softmax", 1, "float32", False),
    Specialisation(256, 8, "sigmoid", 8, "float32", True),
)


@dataclass(frozen=True)
class CompileResult:
    """One kernel of one specialisation compiled for one target (sizes in bytes; ``error``: why it did not)."""

    kernel: str
    target: Target
    specialisation: Specialisation
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0
    num_warps: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def problems(self) -> list[str]:
        """What is wrong: a compile error, spills, shared memory above the target's limit."""
        if self.error is not None:
            return [f"did not compile: {self.error}"]
        out = []
        if self.spill_stores or self.spill_loads:
            out.append(f"spills ({self.spill_stores} bytes stored, {self.spill_loads} loaded)")
        if self.shared > self.target.shared_limit:
            out.append(f"shared memory {self.shared} bytes > the {self.target.name} limit {self.target.shared_limit}")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems

    def row(self) -> dict[str, Any]:
        """A flat record (JSON, the docs table)."""
        return {"kernel": self.kernel, "target": self.target.name, "specialisation": self.specialisation.label,
                "registers": self.registers, "spill_stores": self.spill_stores, "spill_loads": self.spill_loads,
                "stack": self.stack, "shared": self.shared, "num_warps": self.num_warps,
                "seconds": round(self.seconds, 2), "error": self.error, "ok": self.ok}


def _ptxas_figures(log: str) -> dict[str, int]:
    """Registers, spills and stack from a ``ptxas -v`` log (the last function reported)."""
    def last(pattern: str) -> int:
        found = re.findall(pattern, log)
        return int(found[-1]) if found else 0

    if not re.search(r"Used \d+ registers", log):
        raise RuntimeError(f"no ptxas -v figures in Triton's log: {log[-300:]!r}")
    return {"registers": last(r"Used (\d+) registers"), "spill_stores": last(r"(\d+) bytes spill stores"),
            "spill_loads": last(r"(\d+) bytes spill loads"), "stack": last(r"(\d+) bytes stack frame")}


def compile_launch(launch: Launch, target: Target, specialisation: Specialisation) -> CompileResult:
    """Compile one launch for ``target`` with Triton's compiler and report what ptxas and Triton say."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from oea.kernels.triton_gpu import _compile

    kernel = getattr(_compile(), launch.kernel)
    if not isinstance(kernel, JITFunction):
        raise RuntimeError("TRITON_INTERPRET=1 replaced the kernels by interpreted functions; unset it to compile")
    gpu = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    kwargs = {**launch.kwargs, "debug": kernel.debug or knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode,
              "fpsan_homomorphic_casts": knobs.compilation.fpsan_homomorphic_casts}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    log = io.StringIO()
    saved = (knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile)
    started = time.perf_counter()
    try:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True  # ptxas runs, its log printed
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=gpu,
                                      options=options.__dict__)
        figures = _ptxas_figures(log.getvalue())
    except Exception as err:
        message = " ".join(f"{type(err).__name__}: {err}".split())
        return CompileResult(launch.kernel, target, specialisation, seconds=time.perf_counter() - started,
                             error=message[:400])
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    return CompileResult(launch.kernel, target, specialisation, shared=int(compiled.metadata.shared),
                         num_warps=int(compiled.metadata.num_warps), seconds=time.perf_counter() - started,
                         **figures)


def compile_specialisation(specialisation: Specialisation, target: Target) -> list[CompileResult]:
    """Both kernels of ``specialisation`` compiled for ``target``."""
    return [compile_launch(launch, target, specialisation) for launch in specialisation.launches()]


def target_for(capability: tuple[int, int]) -> Target:
    """The ``Target`` of a device capability (``torch.cuda.get_device_capability()``); one not in ``TARGETS``
    gets the smallest listed shared-memory limit."""
    number = capability[0] * 10 + capability[1]
    for target in TARGETS:
        if target.capability == number:
            return target
    return Target(number, f"sm_{number}", min(t.shared_limit for t in TARGETS))
