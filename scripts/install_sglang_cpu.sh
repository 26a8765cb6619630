#!/usr/bin/env bash
# Create or refresh .venv-sglang: SGLang's Python package on CPU, minimal install (no CUDA stack).
#
# Why not `pip install sglang`: it pins a CUDA torch and pulls ~11 GB (sglang-kernel, flashinfer,
# nvidia-* libraries) that cannot run here. The routing module (sglang.srt.layers.moe.topk) needs
# only the packages below; sglang itself goes in with --no-deps. torch is pinned to the CPU build
# through constraints.txt.
#
# torchvision: `import sglang.srt.layers.moe.topk` imports torchvision.transforms (moe/utils.py ->
# srt/configs/__init__ -> nano_nemotron_vl -> multimodal/internvl_utils, for InternVL's image
# preprocessing); SGLang offers no switch around it. torchvision 0.28.0 is the release made for
# torch 2.13, but its only Linux x86_64 wheel has C++ ops (_C.so, image.so) linked against the CUDA
# torch (libtorch_cuda.so), which cannot load next to the CPU torch, and no torchvision source is on
# PyPI to build them. The Python part (transforms: all SGLang touches here) needs no compiled ops,
# yet `import torchvision` fails ("operator torchvision::nms does not exist", pytorch/vision#9337):
# _meta_registrations.py registers two fake kernels without the `_has_ops()` check its other
# registrations have. guard_torchvision_fake_kernels adds that check (the fix proposed upstream);
# torchvision then imports, and its compiled ops (nms, roi_align, decode_jpeg, ...) raise
# torchvision's own "Couldn't load custom C++ ops" if called.
#
# numba: oea.kernels.route_fast's compiled CPU kernel (without it every rewritten routing call runs oea.route's
# torch ops, ~120 us more per call on CPU: docs/benchmarks-serving.md); the version pyproject's dev extra pins.
#
# openai, partial-json-parser: the graph runners the plugin hooks to keep CUDA-graph padding rows out of
# the OEA union (sglang.srt.model_executor.runner.decode_cuda_graph_runner, cpu_graph_runner) import them
# (through sglang.srt.parser); openai at the version sglang 0.5.23 pins.
#
# SERVER_REQUIREMENTS: what `python -m sglang.launch_server` imports beyond the routing module (its HTTP server,
# tokenizer manager, scheduler and grammar backends), pinned; installed under constraints.txt like the rest, so
# no second torch can come in. The tests start real CPU servers with them (tests/engines/test_sglang_server*.py,
# docs/sglang.md "Run a real SGLang server on CPU"). SGLang's C++ kernel package sgl_kernel has no CPU build on
# the package index: the tests put oea's test-support stand-in (tests/support/sgl_kernel_stand_in) on the
# server's PYTHONPATH instead; nothing of it is installed here.
#
# Idempotent: a stamp file records a hash of this script, pyproject.toml and constraints.txt;
# nothing is reinstalled while they are unchanged. Usage: bash scripts/install_sglang_cpu.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OEA_SGLANG_VENV:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION="0.5.23"
REQUIREMENTS=(
    "torch==2.13.0" "transformers==5.24.0" "triton==3.9.0" "numpy==2.4.6" "orjson==3.13.0"
    "psutil==7.2.2" "pybase64==1.5.1" "requests==2.34.2" "packaging==26.4" "pillow==13.0.0"
    "starlette==1.10.0" "msgspec==0.22.0" "pydantic==2.14.4" "pyzmq==27.3.0" "tqdm==4.70.1"
    "ipython==9.18.1" "aiohttp==3.14.5" "dill==0.4.1" "apache-tvm-ffi==0.1.11"
    "sentencepiece==0.2.3" "einops==0.8.2" "compressed-tensors==0.20.1" "gguf==0.19.0"
    "torchvision==0.28.0" "openai==2.8.0" "partial-json-parser==0.2.1.1.post7" "numba==0.68.1"
)
SERVER_REQUIREMENTS=(
    "fastapi==0.165.0" "uvicorn==0.54.0" "uvloop==0.23.0" "setproctitle==1.3.8" "python-multipart==0.0.34"
    "xgrammar==0.2.7" "jsonschema==4.26.0" "prometheus-client==0.26.0" "interegular==0.3.3" "soundfile==0.13.1"
    "datasets==5.2.0"  # SGLang's own client (python -m sglang.bench_serving) imports it for its dataset loaders
)

fingerprint="$(cat "${BASH_SOURCE[0]}" "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -c1-16)"
stamp="$VENV/.installed-$fingerprint"
if [[ -f "$stamp" && -x "$VENV/bin/python" ]]; then
    echo "install_sglang_cpu: $VENV is up to date (sglang $SGLANG_VERSION)"
    exit 0
fi

echo "install_sglang_cpu: installing sglang $SGLANG_VERSION (minimal CPU recipe) into $VENV"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
pip_install() {
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/constraints.txt" "$@"
}
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -U pip
pip_install "${REQUIREMENTS[@]}" "${SERVER_REQUIREMENTS[@]}"
guard_torchvision_fake_kernels() {
    "$VENV/bin/python" - <<'PY'
import importlib.util
import sys
from pathlib import Path

path = Path(importlib.util.find_spec("torchvision").origin).with_name("_meta_registrations.py")
text = original = path.read_text()
for op in ("nms", "qnms"):
    line = f'@torch.library.register_fake("torchvision::{op}")\n'
    guarded = f'@(torch.library.register_fake("torchvision::{op}") if torchvision.extension._has_ops() else (lambda fn: fn))\n'
    if guarded not in text:
        if text.count(line) != 1:
            sys.exit(f"install_sglang_cpu: {path} has no single {line.strip()!r}: not the torchvision 0.28.0 "
                     "this script knows; look at its fake-kernel registrations again")
        text = text.replace(line, guarded)
if "@torch.library.register_fake(" in text:
    sys.exit(f"install_sglang_cpu: {path} still registers an unguarded fake kernel")
if text != original:
    path.write_text(text)
    print(f"install_sglang_cpu: guarded torchvision's nms/qnms fake kernels in {path}")
PY
}
guard_torchvision_fake_kernels
# pip cannot say --no-deps for one requirement of a list, hence the separate call.
pip_install --no-deps "sglang==$SGLANG_VERSION"
# with oea[lab]: the engine tests run oea's evidence tools (traces, replay scripts) in this environment too; under
# the editable-install lock (make test installs .venv and both engine venvs at once, and each editable build
# writes src/oea.egg-info)
mkdir -p "$ROOT/.cache"
(
    flock 9
    pip_install -e "$ROOT/packages/oea-lab-data" -e "$ROOT[lab]"
) 9> "$ROOT/.cache/editable-install.lock"

"$VENV/bin/python" -W ignore - <<'PY'
from importlib.metadata import entry_points, version

import sglang.srt.layers.moe.topk  # noqa: F401  (the import chain the OEA hooks need, torchvision included)
import sglang.srt.model_executor.cpu_graph_runner  # noqa: F401  (replay hooks: openai, partial-json-parser)
import sglang.srt.model_executor.runner.decode_cuda_graph_runner  # noqa: F401
import torchvision.extension
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: F401

from oea.kernels import numba_available

assert numba_available(), "numba missing: oea.route_fast would run oea.route's torch ops on every routing call"

names = [ep.value for ep in entry_points(group="sglang.srt.plugins")]
assert "oea.integrations.sglang:register" in names, f"oea plugin entry point missing: {names}"
print(f"install_sglang_cpu: sglang {version('sglang')}, torch {version('torch')}, torchvision "
      f"{version('torchvision')} (compiled ops loaded: {torchvision.extension._has_ops()}), entry points {names}")
PY
# The server's own import chain, in a fresh process as a CPU server sees it (is_cpu() is read at import time):
# SGLang's CPU engine and the sgl_kernel stand-in on PYTHONPATH, as the tests and docs/sglang.md start it.
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$ROOT/tests/support/sgl_kernel_stand_in${PYTHONPATH:+:$PYTHONPATH}" \
    "$VENV/bin/python" -W ignore - <<'PY'
from importlib.metadata import distributions

import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.managers.scheduler  # noqa: F401
import sgl_kernel
import sglang.benchmark.serving  # noqa: F401  (SGLang's own client: python -m sglang.bench_serving)

assert getattr(sgl_kernel, "STAND_IN", False), f"a real sgl_kernel shadows the stand-in: {sgl_kernel.__file__}"
torches = sorted(f"{d.version} ({d.locate_file('')})" for d in distributions() if d.metadata["Name"] == "torch")
assert len(torches) == 1, f"more than one torch installed: {torches}"
print(f"install_sglang_cpu: the server imports (sglang.srt.entrypoints.http_server, managers.scheduler) with "
      f"SGLANG_USE_CPU_ENGINE=1 and the sgl_kernel stand-in; torch {torches[0]}")
PY
rm -f "$VENV"/.installed-*
touch "$stamp"
