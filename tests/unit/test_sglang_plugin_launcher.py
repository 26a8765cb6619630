"""``python -m oea.launch.sglang``: its top-level hook setup must run again in spawned children.

A stand-in ``sglang.launch_server`` (written to a temp dir) does what SGLang does: it switches
multiprocessing to *spawn* and starts a child process; the child reports which module it
re-imported as ``__mp_main__`` and whether that module's top-level hook setup ran there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import CHILD_TIMEOUT_S

FAKE_LAUNCH_SERVER = '''
import json, multiprocessing as mp, sys
from sglang_child import report

if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    mp.set_start_method("spawn", force=True)
    child = mp.Process(target=report, args=(out,))
    child.start()
    child.join(60)
    sys.exit(child.exitcode)
'''

FAKE_CHILD = '''
import json, os, sys

def report(out):
    main = sys.modules["__mp_main__"]
    spec = getattr(main, "__spec__", None)
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "main_module": spec.name if spec else None,
                   "hook_setup_ran": hasattr(main, "INSTALLED_TARGETS")}, f)
'''


def _run(tmp_path: Path, args: list[str], env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OEA_", "SGLANG_"))}
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "oea.launch.sglang", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=CHILD_TIMEOUT_S)


@pytest.fixture
def fake_sglang(tmp_path: Path) -> Path:
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    (tmp_path / "sglang_child.py").write_text(FAKE_CHILD)
    return tmp_path


@pytest.mark.slow  # two Python start-ups with torch (~13 s on the shared 2-core CI machine)
def test_spawned_child_reruns_the_launcher_top_level(fake_sglang: Path) -> None:
    out = fake_sglang / "child.json"
    proc = _run(fake_sglang, ["--out", str(out)], {})
    assert proc.returncode == 0, proc.stderr
    child = json.loads(out.read_text())
    assert child["pid"] != os.getpid()
    assert child["main_module"] == "oea.launch.sglang"
    assert child["hook_setup_ran"] is True


def test_malformed_k0_stops_the_launch(fake_sglang: Path) -> None:
    out = fake_sglang / "child.json"
    proc = _run(fake_sglang, ["--out", str(out)], {"OEA_K0": "0"})
    assert proc.returncode == 2
    assert "OEA_K0 must be an integer >= 1" in proc.stderr
    assert not out.exists()


def test_without_arguments_prints_usage(tmp_path: Path) -> None:
    proc = _run(tmp_path, [], {})
    assert proc.returncode == 2 and "usage: python -m oea.launch.sglang" in proc.stderr
