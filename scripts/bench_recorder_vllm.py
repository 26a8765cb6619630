"""Recording (``OEA_TRACE_FILE``) on / off in vLLM's offline engine with full decode batches: prints figures.

Serving benchmarks on a small machine measure the API server and the client as much as the engine (they
share its cores and decide how many requests each step holds). Here one process per run generates every
prompt at once with vLLM's ``LLM`` (no API server, no client), so each decode step holds ``--max-num-seqs``
rows; runs alternate observe mode (``OEA_METRICS_FILE`` only) and recording (``OEA_TRACE_SAMPLE=1.0``), and
the paired ratios of decode throughput and of the engine's median decode-step period are printed with 95%
CIs (``oea.stats``), with the writer thread's CPU time from each trace's sidecar.

    python scripts/bench_recorder_vllm.py --python .venv-vllm/bin/python [--pairs 6] [--prompts 128]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from oea.bench.serve.ab import engine_summary
from oea.bench.serve.client import load_rows
from oea.models import embedded_model_dir
from oea.stats import ratio_of_medians_interval

CHILD = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

model, prompts, input_len, output_len, rows = sys.argv[1], *map(int, sys.argv[2:6])
llm = LLM(model=model, dtype="bfloat16", max_model_len=512, max_num_seqs=rows, seed=0)
vocab = llm.get_tokenizer().vocab_size
batch = [TokensPrompt(prompt_token_ids=[(7 + 31 * i + 17 * j) % (vocab - 10) + 5 for j in range(input_len)])
         for i in range(prompts)]
llm.generate(batch[:rows], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
started = time.time()
out = llm.generate(batch, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0), use_tqdm=False)
ended = time.time()
print("OEA-RESULT " + json.dumps({"start": started, "end": ended,
                                   "tokens": sum(len(o.outputs[0].token_ids) for o in out)}))
"""


def _run(python: str, arm: str, folder: Path, index: int, args: argparse.Namespace) -> dict:
    metrics = folder / f"metrics-{arm}-{index}.jsonl"
    env = {**os.environ, "OEA_METRICS_FILE": str(metrics), "VLLM_CPU_KVCACHE_SPACE": "1"}
    trace = folder / f"trace-{index}.safetensors"
    if arm == "rec":
        env.update({"OEA_TRACE_FILE": str(trace), "OEA_TRACE_SAMPLE": "1.0"})
    proc = subprocess.run([python, "-c", CHILD, args.model, str(args.prompts), str(args.input_len),
                           str(args.output_len), str(args.rows)], env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("OEA-RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{arm} run {index} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(line.removeprefix("OEA-RESULT "))
    time.sleep(1.0)  # the worker's last metrics flush
    result.update(engine_summary(load_rows(metrics), result["start"], result["end"]))
    result["tok_s"] = result["tokens"] / (result["end"] - result["start"])
    if arm == "rec":
        sidecar = json.loads(trace.with_suffix(".json").read_text())
        result["writer_cpu_s"] = sidecar["writer_cpu_s"]
        result["steps_recorded"] = sidecar["steps_recorded"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the interpreter of the vLLM environment")
    parser.add_argument("--model", default=str(embedded_model_dir()))
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=16, help="max_num_seqs: the rows of every decode step")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"observe": [], "rec": []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.pairs):
            for arm in (("observe", "rec") if index % 2 == 0 else ("rec", "observe")):
                result = _run(args.python, arm, Path(tmp), index, args)
                results[arm].append(result)
                print(f"pair {index} {arm:>7}: {result['tok_s']:.1f} tok/s, decode step "
                      f"{result.get('engine_step_ms_median', float('nan')):.3f} ms, "
                      f"{result['engine_mean_decode_rows']:.1f} rows/step, load {os.getloadavg()[0]:.1f}"
                      + (f", writer CPU {result['writer_cpu_s']:.3f} s for {result['steps_recorded']} steps"
                         if arm == "rec" else ""), flush=True)
    rng = np.random.default_rng(0)
    for key, label in (("tok_s", "decode throughput"), ("engine_step_ms_median", "decode step period")):
        on, off = [r[key] for r in results["rec"]], [r[key] for r in results["observe"]]
        ratio = ratio_of_medians_interval(on, off, rng, paired=True)
        print(f"{label}: observe {np.median(off):.3f}, recording {np.median(on):.3f}; recording / observe "
              f"{ratio.estimate:.3f} [{ratio.low:.3f}-{ratio.high:.3f}] ({args.pairs} pairs)")
    cpu = sum(r["writer_cpu_s"] for r in results["rec"]) / sum(r["steps_recorded"] for r in results["rec"])
    print(f"writer thread CPU per recorded step: {cpu * 1e6:.1f} us")


if __name__ == "__main__":
    sys.exit(main())
