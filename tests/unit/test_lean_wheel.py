"""The ``oea`` wheel installed where only torch is (docs/architecture.md, "The lean package"): it holds no test
support and no model or trace files, its requirements are torch, numpy and safetensors, and with nothing else
installed ``import oea``, ``oea.route``, both engines' entry points and ``oea doctor`` work while a tool command and
the embedded model name ``oea[lab]``. The tools' data wheel (``oea-lab-data``, built from ``packages/oea-lab-data``)
holds the embedded model and the bundled traces, and installed beside it, oea finds them there.

Offline and without touching any shared environment: the wheel is built from a copy of the sources, and the fresh
venv sees torch, numpy and safetensors (and what they need) through a ``.pth`` folder of links into this
interpreter's site-packages, so ``pip install --no-index`` of the wheel finds every requirement already installed
and nothing else (no scipy, rich, matplotlib, httpx).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from hang_guard import CHILD_TIMEOUT_S

from oea.cli import LAB_DEPENDENCIES, LAB_INSTALL
from oea.traces import bundled_trace_names

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LAB_DATA = ROOT / "packages" / "oea-lab-data"
LEAN_REQUIREMENTS = ("torch", "numpy", "safetensors")
TEST_SUPPORT = re.compile(r"sgl_kernel|tiny_moe\.py|tiny_checkpoint\.py|oea/models/(export|stats)\.py|tests/")
# The embedded model's and the bundled traces' files: the oea wheel holds none of them.
DATA_FILES = re.compile(r"\.safetensors$|/(MODEL_CARD|SOURCES)\.md$|/(heldout_files|tokenizer)\.json$|LICENSE\.nvmoe")
# The oea wheel without the data weighed 0.54 MB (2026-12-05); with it, 20.7 MB. Room for code, none for a model.
MAX_WHEEL_BYTES = 2_000_000
IGNORED = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")


def _build_wheel(source_tree: Path, tmp: Path, pattern: str) -> Path:
    """The wheel of ``source_tree`` (a copy: building writes build/ and egg-info folders), built offline."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(source_tree)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp / "dist").glob(pattern)
    return wheel


def _oea_wheel(tmp: Path) -> Path:
    source = tmp / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=IGNORED)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    return _build_wheel(source, tmp, "oea-*.whl")


@pytest.fixture(scope="module")
def oea_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _oea_wheel(tmp_path_factory.mktemp("oea-wheel"))


def _requirement_closure(names: tuple[str, ...]) -> list[md.Distribution]:
    """The installed distributions ``names`` need, transitively (requirements not installed here are skipped: they
    are platform-specific, e.g. CUDA libraries; extras are not followed)."""
    found: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.split(r"[\s<>=!~;\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        found[name] = dist
        todo += [req for req in dist.requires or () if "extra ==" not in req]
    return list(found.values())


def _alone() -> dict[str, str]:
    """This process's environment without what would put other code or settings before the venv's: PYTHONPATH
    (``scripts/mutation_check.py`` points it at a copy of src/) and OEA_* variables."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("OEA_", "SGLANG_OEA_"))}


def _lean_venv(tmp: Path) -> Path:
    """A venv without pip whose only packages are torch, numpy, safetensors and their requirements (links)."""
    env = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    linked = tmp / "torch-only"
    linked.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for dist in _requirement_closure(LEAN_REQUIREMENTS):
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            if (here / top).exists() and not (linked / top).exists():
                (linked / top).symlink_to(here / top)
    (site / "torch_only.pth").write_text(f"{linked}\n")
    return python


def test_the_wheel_installs_beside_torch_alone_and_serves_the_plugins_doctor_and_serve(oea_wheel: Path,
                                                                                       tmp_path: Path) -> None:
    wheel = oea_wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if TEST_SUPPORT.search(n)], "test support in the wheel"
    assert not [n for n in names if DATA_FILES.search(n)], "model or trace files in the oea wheel"
    assert wheel.stat().st_size < MAX_WHEEL_BYTES, f"the oea wheel weighs {wheel.stat().st_size:,} bytes"
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    required = {line.split(":", 1)[1].strip().split(";")[0] for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert {re.split(r"[<>=!~ ]", req)[0] for req in required} == {*LEAN_REQUIREMENTS, "tomli"}

    python = _lean_venv(tmp_path)
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "-q", "--no-index", "--disable-pip-version-check", str(wheel)], check=True,
                   capture_output=True, timeout=600)
    show = subprocess.run([*pip, "show", "oea"], check=True, capture_output=True, text=True).stdout
    requires = next(line for line in show.splitlines() if line.startswith("Requires:"))
    assert sorted(requires.split(":", 1)[1].replace(" ", "").split(",")) == sorted(LEAN_REQUIREMENTS), requires

    checks = subprocess.run([str(python), "-c", (
        "import importlib.metadata as md, importlib.util as u, json, torch, oea\n"
        "ids, _ = oea.route(torch.randn(6, 8), oea.RouterSpec(num_experts=8, top_k=2), oea.OEAConfig(k0=1))\n"
        "eps = [ep for group in ('vllm.general_plugins', 'sglang.srt.plugins')\n"
        "       for ep in md.entry_points(group=group) if ep.value.startswith('oea.')]\n"
        "from oea.models import embedded_model_dir\n"
        "try:\n"
        "    model = str(embedded_model_dir())\n"
        "except ModuleNotFoundError as err:\n"
        "    model = str(err)\n"
        "print(json.dumps({'file': oea.__file__, 'ids': list(ids.shape), 'model': model,\n"
        "                  'entry_points': sorted(ep.value for ep in eps if callable(ep.load())),\n"
        f"                  'lab': [m for m in {sorted(LAB_DEPENDENCIES)!r} if u.find_spec(m)]}}))\n")],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path, env=_alone())
    assert checks.returncode == 0, checks.stderr
    seen = json.loads(checks.stdout)
    assert seen["file"].startswith(str(tmp_path / "venv")) and seen["ids"] == [6, 2] and seen["lab"] == []
    assert seen["entry_points"] == ["oea.integrations.sglang:register", "oea.integrations.vllm:register"]
    assert seen["model"].endswith(f": {LAB_INSTALL}") and "oea_lab_data" in seen["model"], seen["model"]

    oea = str(python.parent / "oea")
    doctor = subprocess.run([oea, "doctor"], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path,
                            env=_alone())
    assert doctor.returncode == 0 and "Traceback" not in doctor.stderr, doctor.stdout + doctor.stderr
    assert "environment (OEA_* variables)" in doctor.stdout
    tool = subprocess.run([oea, "report", "--quick", "--out", str(tmp_path / "report")], capture_output=True,
                          text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path, env=_alone())
    assert tool.returncode == 2 and tool.stderr.count("\n") == 1 and tool.stderr.strip().endswith(LAB_INSTALL), \
        tool.stderr


def test_the_data_wheel_holds_the_model_and_the_traces_and_the_installed_oea_finds_them(oea_wheel: Path,
                                                                                       tmp_path: Path) -> None:
    shutil.copytree(LAB_DATA, tmp_path / "oea-lab-data", ignore=IGNORED)
    wheel = _build_wheel(tmp_path / "oea-lab-data", tmp_path, "oea_lab_data-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"oea_lab_data/embedded/model.safetensors", "oea_lab_data/embedded/config.json",
            "oea_lab_data/embedded/MODEL_CARD.md", "oea_lab_data/traces/SOURCES.md",
            "oea_lab_data/traces/LICENSE.nvmoe-MIT.txt"} <= names
    bundled = bundled_trace_names()  # this checkout's data
    assert {f"oea_lab_data/traces/{name}{suffix}" for name in bundled for suffix in (".safetensors", ".json")} <= names

    python = _lean_venv(tmp_path)
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "-q", "--no-index", "--disable-pip-version-check", str(oea_wheel), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    found = subprocess.run([str(python), "-c", (
        "import json, sysconfig\n"
        "from oea.models import embedded_model_dir\n"
        "from oea.traces import bundled_trace_dir, bundled_trace_names, load_trace\n"
        "print(json.dumps({'site': sysconfig.get_paths()['purelib'], 'model': str(embedded_model_dir()),\n"
        "                  'traces': str(bundled_trace_dir()), 'names': bundled_trace_names(),\n"
        "                  'qwen3': list(load_trace('qwen3-30b-a3b').ids.shape),\n"
        "                  'config': (embedded_model_dir() / 'config.json').is_file()}))\n")],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=tmp_path, env=_alone())
    assert found.returncode == 0, found.stderr
    seen = json.loads(found.stdout)
    assert seen["model"] == str(Path(seen["site"]) / "oea_lab_data" / "embedded") and seen["config"]
    assert seen["traces"] == str(Path(seen["site"]) / "oea_lab_data" / "traces")
    assert seen["names"] == bundled and seen["qwen3"] == [4130, 48, 8]
