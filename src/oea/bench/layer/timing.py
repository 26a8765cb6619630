"""Timing of ``oea bench layer``: rotated round-robin rounds, CPU wall clock or CUDA-graph replays."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

import oea
from oea.bench.layer.inputs import Variant
from oea.bench.layer.moe import MoEWeights, moe_forward


class _Call:
    """One variant's timed call on one weight copy, reading its inputs from static buffers."""

    def __init__(self, variant: Variant, experts: MoEWeights, hidden: torch.Tensor, impl: str, device: str):
        self.variant, self.experts, self.hidden, self.impl = variant, experts, hidden, impl
        if variant.kind == "policy":
            self.logits = variant.logits[0].to(device).clone()
        else:
            self.ids = variant.ids[0].to(device).clone()
            self.weights = variant.weights[0].to(device).clone()

    def load(self, index: int) -> None:
        """Copy input batch ``index`` into the static buffers (untimed)."""
        v = self.variant
        if v.kind == "policy":
            self.logits.copy_(v.logits[index])
        else:
            self.ids.copy_(v.ids[index])
            self.weights.copy_(v.weights[index])

    def __call__(self) -> torch.Tensor:
        if self.variant.kind == "policy":
            ids, weights = oea.route(self.logits, self.variant.spec, self.variant.cfg)
        else:
            ids, weights = self.ids, self.weights
        return moe_forward(self.hidden, ids, weights, self.experts, self.impl)  # type: ignore[arg-type]


class _CpuTimer:
    def prepare(self, call: _Call) -> Callable[[], object]:
        return call

    def time(self, fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class _CudaGraphTimer:
    """Captures each call in a CUDA graph once; times ``replay()`` with CUDA events."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def prepare(self, call: _Call) -> Callable[[], object]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        return graph.replay

    def time(self, fn: Callable[[], object]) -> float:
        torch.cuda.synchronize()
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def measure(
    variants: Sequence[Variant], copies: Sequence[MoEWeights], hidden: Sequence[torch.Tensor], impl: str,
    device: str, repeats: int, warmup: int, progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[tuple[float, int, int]]]:
    """Time every variant ``repeats`` times: -> {label: [(seconds, T, used slots), ...]}.

    Round r times the variants in round-robin order starting at variant r mod V and gives each its
    routing batch r mod (its batches) (so policy variants are paired round by round); the c-th call
    uses weight copy c mod len(copies); each (variant, copy) pair reads its own activation batch from
    ``hidden``. On CUDA each (variant, copy) call is captured once as a CUDA graph and replayed.
    """
    timer: _CpuTimer | _CudaGraphTimer = _CudaGraphTimer() if device == "cuda" else _CpuTimer()
    calls = {(v.label, c): _Call(v, copies[c], hidden[(i + c) % len(hidden)], impl, device)
             for i, v in enumerate(variants) for c in range(len(copies))}
    runners = {key: timer.prepare(call) for key, call in calls.items()}
    samples: dict[str, list[tuple[float, int, int]]] = {v.label: [] for v in variants}
    count = 0
    rounds = warmup + repeats
    for r in range(rounds):
        start = r % len(variants)
        for v in list(variants[start:]) + list(variants[:start]):
            key = (v.label, count % len(copies))
            batch = r % len(v.ids)
            calls[key].load(batch)
            seconds = timer.time(runners[key])
            count += 1
            if r >= warmup:
                samples[v.label].append((seconds, v.active[batch], v.slots[batch]))
        if progress is not None:
            progress(r + 1, rounds)
    return samples
