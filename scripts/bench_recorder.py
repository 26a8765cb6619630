"""What recording (``OEA_TRACE_FILE``) costs a decode step, without an engine: prints figures, asserts nothing.

A stand-in engine step (Python-heavy small torch ops, like a small MoE model's decode step on CPU) runs with
and without a ``TraceRecorder`` attached, alternating in blocks; each recorded step stages every layer's
router logits and is submitted as the vLLM and SGLang adapters do. Printed: the engine-side cost of the
recording per step (staging + submit), the writer thread's CPU time per step, and the stand-in step's median
with / without recording with the ratio's 95% CI over paired blocks (``oea.stats``).

    python scripts/bench_recorder.py [--rows 16] [--layers 4] [--experts 128] [--blocks 10] [--steps 200] [--repeats 8]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from oea.config import TraceSettings
from oea.integrations.recording.recorder import StepStaging, open_recorder
from oea.routing import RouterSpec
from oea.stats import ratio_of_medians_interval


def _thread_cpu_s(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))  # type: ignore[arg-type]


def _engine_step(x: torch.Tensor, weights: list[torch.Tensor], layers: int, logits: torch.Tensor,
                 repeats: int) -> torch.Tensor:
    """A stand-in decode step: per layer small matmuls and Python bookkeeping (``repeats`` times)."""
    for layer in range(layers):
        for _ in range(repeats):
            for w in weights:
                x = torch.tanh(x @ w)
            _ = [i * 2 for i in range(200)]  # interpreter work between ops, as in an engine's model code
        logits[layer].copy_(x[:, : logits.shape[-1]])
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=10, help="paired blocks (recording off, then on)")
    parser.add_argument("--steps", type=int, default=200, help="engine steps per block")
    parser.add_argument("--repeats", type=int, default=8, help="work per layer of the stand-in step "
                        "(8: about 4 ms, a decode step of the embedded model in the vLLM CPU server)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m, n, layers = args.rows, args.experts, args.layers
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(256, 256, generator=gen) / 16 for _ in range(6)]
    x0 = torch.randn(m, 256, generator=gen)
    logits = torch.zeros(layers, m, n, dtype=torch.bfloat16)
    requests, positions = [f"req-{i}" for i in range(m)], list(range(100, 100 + m))
    log = logging.getLogger("bench_recorder")

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "rec.safetensors")
        staging = StepStaging(m, n, "cpu", num_layers=layers)
        recorder = open_recorder(TraceSettings(path, max_bytes=2**40), path, RouterSpec(n, args.top_k), staging,
                                 {"model": "bench"}, log)
        assert recorder is not None
        step_off: list[float] = []
        step_on: list[float] = []
        engine_side: list[float] = []
        writer_cpu = 0.0
        recorded_steps = 0
        step_id = 0
        for block in range(-1, args.blocks):  # block -1 warms up (the writer's first step opens the file)
            for recording in (False, True):
                times = []
                cpu_before = _thread_cpu_s(recorder._thread)
                for _ in range(args.steps):
                    started = time.perf_counter()
                    _engine_step(x0, weights, layers, logits, args.repeats)
                    if recording:
                        staged = time.perf_counter()
                        for layer in range(layers):
                            staging.stage(layer, logits[layer])
                        recorder.submit_step(step_id, m, requests, positions)
                        engine_side.append(time.perf_counter() - staged)
                        step_id += 1
                    times.append(time.perf_counter() - started)
                if recording:  # the writer finishes this block's steps before the next block is timed
                    deadline = time.monotonic() + 30
                    while recorder.steps + recorder.dropped < step_id and time.monotonic() < deadline:
                        time.sleep(0.01)
                    writer_cpu += _thread_cpu_s(recorder._thread) - cpu_before
                    recorded_steps += args.steps
                if block < 0:
                    engine_side.clear()
                    writer_cpu = recorded_steps = 0
                    continue
                (step_on if recording else step_off).append(statistics.median(times))
        recorder.close()
    ratio = ratio_of_medians_interval(step_on, step_off, np.random.default_rng(0), paired=True)
    print(f"rows {m}, layers {layers}, experts {n}, {args.blocks} blocks x {args.steps} steps, "
          f"torch threads {args.threads}; steps dropped {recorder.dropped}")
    print(f"engine side per recorded step (stage + submit): median {statistics.median(engine_side) * 1e6:.1f} us")
    print(f"writer thread CPU per recorded step: {writer_cpu / recorded_steps * 1e6:.1f} us")
    print(f"stand-in step median: off {statistics.median(step_off) * 1e3:.3f} ms, "
          f"recording {statistics.median(step_on) * 1e3:.3f} ms; "
          f"ratio {ratio.estimate:.3f} [{ratio.low:.3f}-{ratio.high:.3f}]")


if __name__ == "__main__":
    main()
