#!/usr/bin/env bash
# Download (once) the CUDA release wheels whose source the plugins' hook targets are checked against:
# `vllm` at oea.integrations.vllm.targets.CUDA_RELEASE and `sglang` at each of
# oea.integrations.sglang.targets.CUDA_RELEASES. `pip download --no-deps`: nothing is installed or imported,
# tests/engines/test_cuda_release_targets.py reads the .py files inside the wheels with `ast`.
#
# Cache: $OEA_CUDA_WHEELS (default .cache/cuda-wheels, gitignored), about 540 MB. Idempotent: a wheel already
# in the cache is not downloaded again. Usage: bash scripts/install_cuda_wheels.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${OEA_CUDA_WHEELS:-$ROOT/.cache/cuda-wheels}"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY="${PYTHON:-python3}"
mkdir -p "$CACHE"

# The versions, read from the plugins' own declarations (ast: no import of oea needed).
mapfile -t WANTED < <("$PY" - "$ROOT" <<'PY'
import ast
import sys
from pathlib import Path

root = Path(sys.argv[1]) / "src" / "oea" / "integrations"

def constant(path, name):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    sys.exit(f"install_cuda_wheels: {name} not found in {path}")

print(f"vllm=={constant(root / 'vllm' / 'targets.py', 'CUDA_RELEASE')}")
for version in constant(root / "sglang" / "targets.py", "CUDA_RELEASES"):
    print(f"sglang=={version}")
PY
)

for requirement in "${WANTED[@]}"; do
    name="${requirement%%==*}"
    version="${requirement##*==}"
    if compgen -G "$CACHE/$name-$version-*.whl" > /dev/null; then
        continue
    fi
    echo "install_cuda_wheels: downloading $requirement into $CACHE"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$CACHE" "$requirement"
done
echo "install_cuda_wheels: $CACHE has ${WANTED[*]}"
