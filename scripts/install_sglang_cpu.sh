#!/usr/bin/env bash
# Create or refresh .venv-sglang: SGLang's Python package on CPU, minimal install (no CUDA stack).
#
# Why not `pip install sglang`: it pins a CUDA torch and pulls ~11 GB (sglang-kernel, flashinfer,
# nvidia-* libraries) that cannot run here. The routing module (sglang.srt.layers.moe.topk) needs
# only the packages below; sglang itself goes in with --no-deps. torch is pinned to the CPU build
# through constraints.txt. torchvision is deliberately absent: the PyPI build breaks next to the
# CPU torch; the tests install an import stub instead (tests/engines/sglang_cpu_stubs.py).
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
pip_install "${REQUIREMENTS[@]}"
# pip cannot say --no-deps for one requirement of a list, hence the separate call.
pip_install --no-deps "sglang==$SGLANG_VERSION"
pip_install -e "$ROOT"

"$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points, version
names = [ep.value for ep in entry_points(group="sglang.srt.plugins")]
assert "oea.integrations.sglang:register" in names, f"oea plugin entry point missing: {names}"
print(f"install_sglang_cpu: sglang {version('sglang')}, torch {version('torch')}, entry points {names}")
PY
rm -f "$VENV"/.installed-*
touch "$stamp"
