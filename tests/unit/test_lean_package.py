"""The lean ``oea`` (docs/architecture.md, "The lean package"): ``pip install oea`` brings routing, the kernels, config,
the engine plugins, ``oea doctor`` and ``oea serve`` on torch, numpy and safetensors; the evidence tools' dependencies
come with ``oea[lab]``, and a tool command run without them says in one line what to install (exit 2).

Checked three ways: statically (the import closure of the plugins, the doctor and the serve command line, read with
``ast``), in a subprocess whose import system refuses the lab modules to oea's own code (a ``sys.meta_path`` blocker,
never an uninstall), and on the CLI's guard itself.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys
from collections.abc import Iterable, Iterator

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

from oea.cli import COMMAND_MODULES, LAB_DEPENDENCIES, LAB_INSTALL, main
from oea.models.lab_data import LAB_DATA_MODULE

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
# The tools' data distribution (oea-lab-data), and names of its files that the oea package must not hold.
LAB_DATA = ROOT / "packages" / "oea-lab-data"
LAB_DATA_FILES = frozenset({"MODEL_CARD.md", "SOURCES.md", "heldout_files.json", "tokenizer.json"})
# What pip installs for the plugins, the doctor and ``oea serve``: the engines' entry points (pyproject.toml), the
# ``oea`` facade, and the two command lines.
LEAN_ROOTS = ("oea", "oea.integrations.vllm", "oea.integrations.sglang", "oea.integrations.doctor.cli",
              "oea.launch.cli")
# Lab modules the lean closure reaches only inside functions that the lean commands do not call, each with why.
LAB_ON_USE: dict[tuple[str, str], str] = {
    ("oea.console", "rich"): "tables and progress bars of the tools; the doctor takes only its argparse types",
    ("oea.stats.intervals", "scipy"): "t and bootstrap intervals: `oea doctor --metrics-file` summarises a "
                                      "served metrics file with them (the CLI guard names oea[lab] there)",
    ("oea.stats.proportions", "scipy"): "Wilson intervals, reached through oea.stats as above",
    ("oea.stats.paired_items", "scipy"): "exact McNemar and normal quantiles of oea eval serve, reached through "
                                         "oea.stats as above",
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((SRC / "oea").rglob("*.py"))}


def _resolve(name: str) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(module: str) -> Iterator[tuple[str, bool]]:
    """``(imported name, lazy)`` for each import in ``module`` (lazy: inside a function body)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST, lazy: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                yield from ((alias.name, lazy) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parts, *([child.module] if child.module else [])])
                yield (base, lazy)
                yield from ((f"{base}.{alias.name}", lazy) for alias in child.names)
            elif isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                continue  # never runs
            else:
                yield from visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.Lambda)))

    yield from visit(ast.parse(path.read_text()), False)


def _closure(roots: tuple[str, ...], follow_lazy: bool) -> dict[tuple[str, str], bool]:
    """``{(module, third-party top-level name): lazy}`` over every project module ``roots`` reach (through lazy
    imports too when ``follow_lazy``)."""
    seen: set[str] = set()
    found: dict[tuple[str, str], bool] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name, lazy in _imports(module):
            target = _resolve(name)
            if target is not None:
                if follow_lazy or not lazy:
                    todo.append(target)
            elif not name.startswith("oea"):
                key = (module, name.split(".")[0])
                found[key] = found.get(key, True) and lazy
    return found


def test_the_lab_extra_and_the_clis_list_of_lab_modules_agree_and_the_core_needs_only_torch_numpy_safetensors(
) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lab = {req.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_")
           for req in project["optional-dependencies"]["lab"]}
    assert lab == set(LAB_DEPENDENCIES)
    core = {req.split(">")[0].split("=")[0].split(";")[0].strip() for req in project["dependencies"]}
    assert core == {"torch", "numpy", "safetensors", "tomli"}


def test_the_lab_extra_pins_the_data_distribution_built_here_and_the_oea_package_holds_no_data() -> None:
    data = tomllib.loads((LAB_DATA / "pyproject.toml").read_text())["project"]
    lab = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    assert f"{data['name']}=={data['version']}" in lab
    assert data["name"].replace("-", "_") == LAB_DATA_MODULE
    data_files = sorted(str(p.relative_to(SRC)) for p in (SRC / "oea").rglob("*")
                        if p.suffix == ".safetensors" or p.name in LAB_DATA_FILES)
    assert not data_files, f"model or trace files in the oea package (they belong to {LAB_DATA}): {data_files}"


def test_the_embedded_model_and_the_bundled_traces_are_read_from_this_checkouts_data_package() -> None:
    # Found through the installed oea_lab_data, which make install makes an editable install of LAB_DATA: a path
    # elsewhere is a stale copy (or a folder inside src/oea that the wheel would ship again).
    import oea_lab_data

    from oea.models import embedded_model_dir
    from oea.traces import bundled_trace_dir, bundled_trace_names

    package = pathlib.Path(oea_lab_data.__file__).parent
    assert package == LAB_DATA / "src" / LAB_DATA_MODULE
    assert embedded_model_dir() == package / "embedded" and (package / "embedded" / "model.safetensors").is_file()
    assert bundled_trace_dir() == package / "traces" and (package / "traces" / "SOURCES.md").is_file()
    assert {"qwen3-30b-a3b", "embedded"} <= set(bundled_trace_names())


def test_without_the_data_package_its_loaders_name_the_extra_and_a_trace_file_still_loads(
        tmp_path: pathlib.Path) -> None:
    proc = _without_lab(
        "import json\n"
        "from oea.models import embedded_model_dir\n"
        "from oea.traces import bundled_trace_names, load_trace, save_trace\n"
        "import oea.traces.cli\n"
        "out = {}\n"
        "for name, call in (('model', embedded_model_dir), ('names', bundled_trace_names),\n"
        "                   ('bundled', lambda: load_trace('qwen3-30b-a3b'))):\n"
        "    try:\n"
        "        call()\n"
        "    except (ModuleNotFoundError, ValueError) as err:\n"
        "        out[name] = [type(err).__name__, getattr(err, 'name', None), str(err)]\n"
        "import torch\n"
        "from oea.routing import RouterSpec\n"
        "from oea.traces import Trace\n"
        "ids = torch.zeros(3, 1, 2, dtype=torch.int64); ids[:, 0, 1] = 1\n"
        f"path = save_trace(Trace(RouterSpec(4, 2), ids=ids), {str(tmp_path / 't.safetensors')!r})\n"
        "out['file'] = load_trace(str(path)).num_tokens\n"
        "print(json.dumps(out))\n", modules=(LAB_DATA_MODULE,))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = f"No module named '{LAB_DATA_MODULE}', which holds the embedded model and the bundled traces: " \
              f"{LAB_INSTALL}"
    assert out["model"] == out["names"] == ["ModuleNotFoundError", LAB_DATA_MODULE, missing]
    assert out["bundled"][0] == "ValueError" and f"(none installed: {LAB_INSTALL})" in out["bundled"][2]
    assert out["file"] == 3


@pytest.mark.parametrize(("argv", "words"), [
    (["traces"], f"this tool needs the lab extra (No module named '{LAB_DATA_MODULE}', which holds the embedded "
                 f"model and the bundled traces): {LAB_INSTALL}"),
    (["traces", "qwen3-30b-a3b"], f"trace must be one of the bundled traces (none installed: {LAB_INSTALL})"),
])
def test_a_command_without_the_data_package_says_in_one_line_what_to_install(argv: list[str], words: str) -> None:
    proc = _without_lab(f"import sys\nfrom oea.cli import main\nsys.exit(main({argv!r}))\n",
                        modules=(LAB_DATA_MODULE,))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"oea traces: error: {words}") and lines[0].count(LAB_INSTALL) == 1, lines[0]


def test_nothing_the_plugins_the_doctor_or_the_cli_parser_import_at_module_level_needs_the_lab_extra() -> None:
    # oea.cli builds every command's parser (the COMMAND_MODULES' module level) before running any command.
    found = _closure((*LEAN_ROOTS, "oea.cli", *COMMAND_MODULES), follow_lazy=False)
    at_import = sorted(key for key, lazy in found.items() if key[1] in LAB_DEPENDENCIES and not lazy)
    assert not at_import, f"imported at module level, so `pip install oea` cannot load these: {at_import}"


def test_the_plugins_doctor_and_serve_reach_lab_modules_only_where_listed_and_only_inside_functions() -> None:
    found = _closure(LEAN_ROOTS, follow_lazy=True)
    lab = {key: lazy for key, lazy in found.items() if key[1] in LAB_DEPENDENCIES}
    assert set(lab) == set(LAB_ON_USE), f"lab imports reached from the lean commands: {sorted(lab)}"
    assert all(lab.values()), f"not inside a function: {sorted(k for k, lazy in lab.items() if not lazy)}"


# A subprocess prelude: refuses every lab module to an import made by oea's own code (the nearest frame outside the
# import system belongs to an ``oea`` module); third-party packages (transformers imports rich) still get them.
BLOCKER = r"""
import importlib.abc, sys
LAB = set(sys.argv.pop(1).split(","))
class NoLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in LAB:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        if frame is not None and str(frame.f_globals.get("__name__", "")).startswith("oea"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoLab())
"""


def _without_lab(code: str, timeout: float = 300, modules: Iterable[str] = LAB_DEPENDENCIES,
                 ) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter where oea's own imports of ``modules`` (default: every lab module)
    fail as if they were not installed."""
    return subprocess.run([sys.executable, "-c", BLOCKER + code, ",".join(sorted(modules))],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_without_the_lab_modules_the_package_the_entry_points_and_oea_serve_load() -> None:
    proc = _without_lab(
        "import importlib.metadata as md, json, oea, torch\n"
        "spec = oea.RouterSpec(num_experts=8, top_k=2)\n"
        "ids, _ = oea.route(torch.randn(4, 8), spec, oea.OEAConfig(k0=1))\n"
        "eps = [ep for group in ('vllm.general_plugins', 'sglang.srt.plugins')\n"
        "       for ep in md.entry_points(group=group) if ep.value.startswith('oea.')]\n"
        "assert len(eps) == 2 and all(callable(ep.load()) for ep in eps), eps\n"
        "from oea.cli import main\n"
        "assert main(['serve', '--json']) == 0\n"
        "print(json.dumps({'ids': list(ids.shape), 'lab': sorted(m for m in sys.modules\n"
        "      if m.split('.')[0] in ('scipy', 'rich', 'matplotlib', 'httpx'))}))\n")
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == {"ids": [4, 2], "lab": []}


@pytest.mark.slow
def test_oea_doctor_runs_without_the_lab_modules() -> None:
    proc = _without_lab("import sys\nfrom oea.cli import main\nsys.exit(main(['doctor']))\n", timeout=600)
    assert "Traceback" not in proc.stderr and LAB_INSTALL not in proc.stderr + proc.stdout, proc.stderr
    assert "environment (OEA_* variables)" in proc.stdout and proc.returncode in (0, 1), proc.stdout + proc.stderr


def test_a_tool_command_without_the_lab_modules_says_in_one_line_what_to_install(tmp_path: pathlib.Path) -> None:
    proc = _without_lab("import sys\nfrom oea.cli import main\n"
                        f"sys.exit(main(['report', '--quick', '--out', {str(tmp_path / 'report')!r}]))\n")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("oea report: error: this tool needs the lab extra"), lines
    assert lines[0].endswith(f": {LAB_INSTALL}") and "No module named" in lines[0]
    assert not (tmp_path / "report").exists()


def test_the_guard_names_the_extra_only_for_a_lab_module(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def missing(name: str):
        def handler(_args: object) -> int:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return handler

    import argparse

    parser = argparse.ArgumentParser()
    monkeypatch.setattr("oea.cli.build_parser", lambda: parser)
    parser.set_defaults(handler=missing("matplotlib.pyplot"), command="simulate")
    assert main([]) == 2
    assert capsys.readouterr().err == (f"oea simulate: error: this tool needs the lab extra (No module named "
                                       f"'matplotlib.pyplot'): {LAB_INSTALL}\n")
    parser.set_defaults(handler=missing("not_a_lab_module"))
    with pytest.raises(ModuleNotFoundError, match="not_a_lab_module"):  # a real bug is not hidden behind the hint
        main([])
