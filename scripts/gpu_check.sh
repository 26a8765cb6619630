#!/usr/bin/env bash
# GPU check of the fast routing kernel, `oea bench layer` and `oea bench decode` (<= 10 minutes on one
# H100/H200, no network needed; torch with CUDA, Triton and transformers, no vLLM/SGLang):
#   0. oea.route_fast's Triton kernel == oea.route on ids (10,000 generated cases, CUDA-graph replays), and its
#      time per layer call in a CUDA graph against stock top-k routing and oea.route (scripts/gpu_check_routing.py);
#   1. oea.route captured in a CUDA graph == eager (vanilla, OEA, pruned; padding rows via `valid`),
#      and route + MoE layer captured == eager;
#   2. the MoE-layer benchmark on CUDA (CUDA-graph replays of routing + layer) for Qwen3-30B-A3B at
#      B=16 on the bundled Qwen3 trace, OLMoE, and a GLM-5 TP-8 slice; a short table each;
#   3. `oea bench decode` on CUDA: the embedded model inflated in memory to Qwen3-30B-A3B's expert size,
#      B in {1,16,64}, OEA off vs k0=3 and 5, decode steps as CUDA graphs.
# Results: $OUT/gpu_check.json when OUT is set. Extra arguments go to scripts/gpu_check.py
# (e.g. --repeats 500; --device cpu --dry-run for a CPU smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=".venv/bin/python"
if [ ! -x "$PY" ]; then
  PY="python3"
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import torch, numpy, rich, safetensors, transformers" || {
  echo "gpu_check: needs torch (CUDA build), numpy, rich, safetensors, transformers in $PY" >&2; exit 2; }
exec timeout 590 "$PY" scripts/gpu_check.py "$@"
