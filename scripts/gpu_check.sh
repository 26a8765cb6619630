#!/usr/bin/env bash
# GPU check of the fast routing kernel, `oea bench layer` and `oea bench decode` (one H100/H200, no network;
# torch with CUDA, Triton and transformers, no vLLM/SGLang). Its device time at the default settings is
# estimated from its own step counts before anything runs, and printed (budget: 8 minutes; gpu_check_budget.py):
#   doctor. `oea doctor gpu`: the Triton kernels compiled for this GPU, exactness, one CUDA-graph replay;
#   0. oea.route_fast's Triton kernel == oea.route on ids (10,000 generated cases, CUDA-graph replays), and its
#      time per layer call in a CUDA graph against stock top-k routing and oea.route (scripts/gpu_check_routing.py);
#   1. oea.route captured in a CUDA graph == eager (vanilla, OEA, pruned; padding rows via `valid`),
#      and route + MoE layer captured == eager;
#   2. the MoE-layer benchmark on CUDA (CUDA-graph replays of routing + layer) for Qwen3-30B-A3B at
#      B=16 on the bundled Qwen3 trace, OLMoE, and a GLM-5 TP-8 slice; a short table each;
#   3. `oea bench decode` on CUDA: the embedded model inflated in memory to Qwen3-30B-A3B's expert size,
#      B in {1,16,64}, OEA off vs k0=3 and 5, decode steps as CUDA graphs.
# Results: every figure in one JSON, $OUT/gpu_check.json when OUT is set (fields: scripts/gpu_check.py
# JSON_FIELDS, docs/benchmarks.md). Exit status non-zero naming the failing step. Extra arguments go to
# scripts/gpu_check.py (e.g. --repeats 500; --device cpu --dry-run for a CPU smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=".venv/bin/python"
[ -x "$PY" ] || PY="python3"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's oea, whatever the venv points at
"$PY" -c "import torch, numpy, rich, safetensors, transformers" || {
  echo "gpu_check: FAILED step setup: needs torch (CUDA build), numpy, rich, safetensors, transformers in $PY" >&2
  exit 2; }
doctor_args=()
for arg in "$@"; do
  [ "$arg" = "cpu" ] && doctor_args=(--allow-cpu)  # --device cpu (a dry run): no CUDA is expected
done
doctor_json="$(mktemp "${TMPDIR:-/tmp}/oea-doctor-gpu.XXXXXX.json")"
trap 'rm -f "$doctor_json"' EXIT
status=0
timeout 300 "$PY" -m oea doctor gpu --json "${doctor_args[@]}" > "$doctor_json" || status=$?
"$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['line'])" "$doctor_json" 2>/dev/null || true
if [ "$status" -ne 0 ]; then
  echo "gpu_check: FAILED step doctor: oea doctor gpu exited $status (its report: python -m oea doctor gpu)" >&2
  exit "$status"
fi
timeout 590 "$PY" scripts/gpu_check.py --doctor-json "$doctor_json" "$@"
