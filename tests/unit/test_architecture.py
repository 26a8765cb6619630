"""The import rules of ``docs/architecture.md``, checked on the source with ``ast`` (no module is imported).

Every ``import`` in ``src/oea`` (and every ``importlib.import_module("literal")``) is read with its
place: at module level (runs on import) or inside a function (lazy). Imports under
``if TYPE_CHECKING:`` never run: only the cycle rule counts them (a type named across two modules
still ties them together). Temporary exceptions are named below with the
work that removes them; an exception that no longer applies fails the test, so the lists only shrink.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hang_guard import CHILD_TIMEOUT_S

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "oea"
MAX_LINES = 450

ENGINES = frozenset({"vllm", "sglang", "transformers", "lm_eval"})
FILE_IO_MODULES = frozenset({"os", "io", "pathlib", "shutil", "tempfile", "glob", "subprocess", "socket", "urllib",
                             "http", "sqlite3", "pickle", "shelve"})
TOOLS = ("oea.traces", "oea.sim", "oea.eval", "oea.bench", "oea.tuning", "oea.launch", "oea.report", "oea.soak")
TOP_CLI = frozenset({"oea.cli", "oea.__main__"})
# The foundation: modules (or packages) that import nothing of the project outside themselves.
FOUNDATION = ("oea.stats", "oea.console", "oea.testing", "oea.presets", "oea.trace_schema")
# What the engine adapters may import of the project besides their own package and the ``oea`` facade.
ADAPTER_MAY_IMPORT = ("oea.routing", "oea.kernels", "oea.config", *FOUNDATION)
# Import paths user code has (module -> where its names live); nothing in the project imports them.
KEPT_PATHS = {"oea.sim.presets": "oea.presets", "oea.models.testing": "oea.testing"}
# Third-party modules the kernels may import, and only inside functions (torch may be imported anywhere).
KERNEL_LAZY_IMPORTS = frozenset({"numba", "numpy", "triton"})

# Files over MAX_LINES, each until the named work splits it.
SIZE_ALLOWANCES: dict[str, str] = {}
# (importer, imported CLI module): imports of a CLI module by something other than the top CLI.
CLI_IMPORT_ALLOWANCES: dict[tuple[str, str], str] = {}
# (routing module, file-I/O module it imports).
ROUTING_IO_ALLOWANCES: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement's target as written (``name``) and resolved to a project module (``module``)."""

    importer: str
    name: str
    module: str | None  # the oea module it loads (None: outside the project)
    line: int
    lazy: bool  # inside a function body


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, pathlib.Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The deepest project module that ``name`` loads (``oea.routing.spec.RouterSpec`` -> ``oea.routing.spec``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(module: str, path: pathlib.Path) -> tuple[list[Import], list[int], list[Import]]:
    """Runtime imports of one file, the lines where it calls the builtin ``open``, and its type-only imports."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []
    opens: list[int] = []
    typing_only: list[Import] = []

    def add(name: str, line: int, lazy: bool) -> None:
        found.append(Import(module, name, _resolve(name) if name.split(".")[0] == "oea" else None, line, lazy))

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.orelse:
                    visit(stmt, lazy)
                before = len(found)
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), lazy)
                typing_only.extend(found[before:])
                del found[before:]
                continue
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child.lineno, lazy)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                add(base, child.lineno, lazy)
                for alias in child.names:
                    if f"{base}.{alias.name}" in MODULES:  # a submodule, not a name inside the module
                        add(f"{base}.{alias.name}", child.lineno, lazy)
            elif isinstance(child, ast.Call):
                func = child.func
                if isinstance(func, ast.Name) and func.id == "open":
                    opens.append(child.lineno)
                literal = child.args[0] if child.args and isinstance(child.args[0], ast.Constant) else None
                if (isinstance(func, ast.Attribute) and func.attr == "import_module" and literal is not None
                        and isinstance(literal.value, str)):
                    add(literal.value, child.lineno, lazy)
            visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), False)
    return found, opens, typing_only


IMPORTS: dict[str, list[Import]] = {}
OPEN_CALLS: dict[str, list[int]] = {}
TYPE_IMPORTS: dict[str, list[Import]] = {}
for _name, _path in MODULES.items():
    IMPORTS[_name], OPEN_CALLS[_name], TYPE_IMPORTS[_name] = _imports_of(_name, _path)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _is_cli(module: str) -> bool:
    last = module.rpartition(".")[2]
    return module in TOP_CLI or last == "cli" or last.endswith("_cli")


def _where(imp: Import) -> str:
    return f"{MODULES[imp.importer].relative_to(SRC)}:{imp.line} imports {imp.name}"


def _project_edges(lazy: bool, typing_only: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, imports in IMPORTS.items():
        for imp in [*imports, *(TYPE_IMPORTS[name] if typing_only else ())]:
            if imp.module is not None and imp.module != name and (lazy or not imp.lazy):
                graph[name].add(imp.module)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return cycles


# ---------------------------------------------------------------- the rules


def test_the_scan_sees_the_package():
    assert {"oea", "oea.cli", "oea.routing.policies", "oea.stats", "oea.report.build"} <= set(MODULES)
    names = {imp.name for imp in IMPORTS["oea.report.build"]}
    assert "oea.report.sections" in names and not any(imp.lazy for imp in IMPORTS["oea.report.build"]
                                                       if imp.name == "oea.report.sections")
    assert any(imp.lazy and imp.module == "oea.bench.layer.run" for imp in IMPORTS["oea.bench.layer.cli"])


def _imports_within(package: str) -> Iterator[tuple[str, Import, str]]:
    """(module, import, top-level name imported) for every import of every module of ``package``."""
    for name, imports in IMPORTS.items():
        if _within(name, package):
            for imp in imports:
                yield name, imp, imp.name.split(".")[0]


def test_routing_core_imports_no_other_project_module_no_engine_and_no_file_io():
    problems = []
    for name, imp, top in _imports_within("oea.routing"):
        if imp.module is not None and not _within(imp.module, "oea.routing"):
            problems.append(f"{_where(imp)} (the core imports nothing else of oea)")
        elif top in ENGINES:
            problems.append(f"{_where(imp)} (no engine in the core)")
        elif top in FILE_IO_MODULES and (name, top) not in ROUTING_IO_ALLOWANCES:
            problems.append(f"{_where(imp)} (no file I/O in the core)")
        elif top not in sys.stdlib_module_names and top not in {"torch", "oea"}:
            problems.append(f"{_where(imp)} (the core needs only torch)")
    problems += [f"{MODULES[name].relative_to(SRC)}:{line} calls open() (no file I/O in the core)"
                 for name in MODULES if _within(name, "oea.routing") for line in OPEN_CALLS[name]]
    assert not problems, "\n".join(problems)


def _imported_lazily_only(module: str) -> bool:
    """Whether every project import of ``module`` is inside a function (it loads on first use only)."""
    found = [imp for imports in IMPORTS.values() for imp in imports if imp.module == module]
    return bool(found) and all(imp.lazy for imp in found)


def test_kernels_import_only_the_core_and_load_numba_or_triton_lazily():
    problems = []
    for name, imp, top in _imports_within("oea.kernels"):
        if imp.module is not None and not any(_within(imp.module, ok) for ok in ("oea.routing", "oea.kernels")):
            problems.append(f"{_where(imp)} (kernels import only oea.routing)")
        elif top in ENGINES:
            problems.append(f"{_where(imp)} (no engine in the kernels)")
        elif top in KERNEL_LAZY_IMPORTS and not imp.lazy and not _imported_lazily_only(name):
            problems.append(f"{_where(imp)} ({top} is imported inside functions only, or by a module "
                            f"that the project itself imports only inside functions)")
        elif top not in sys.stdlib_module_names and top not in KERNEL_LAZY_IMPORTS | {"torch", "oea"}:
            problems.append(f"{_where(imp)} (kernels need only torch, numba, numpy, triton)")
    assert not problems, "\n".join(problems)


def test_foundation_modules_import_nothing_of_the_project():
    for package in FOUNDATION:  # a package's files may import each other
        for name in (m for m in MODULES if _within(m, package)):
            project = [_where(imp) for imp in IMPORTS[name] if imp.module is not None
                       and not _within(imp.module, package)]
            assert not project, f"{name} must stay importable on its own: " + "; ".join(project)


def test_adapters_import_no_tool_and_no_cli():
    problems = []
    for name, imports in IMPORTS.items():
        if not _within(name, "oea.integrations") or _is_cli(name):
            continue
        for imp in imports:
            if imp.module is None or _within(imp.module, "oea.integrations"):
                continue
            if imp.module != "oea" and not any(_within(imp.module, ok) for ok in ADAPTER_MAY_IMPORT):
                problems.append(f"{_where(imp)} (adapters may import only oea, {', '.join(ADAPTER_MAY_IMPORT)})")
    assert not problems, "\n".join(problems)


def _same_area_cli(importer: str, imported: str) -> bool:
    """One area's CLI split over files: a CLI module importing a CLI module of its own package."""
    return _is_cli(importer) and importer.rpartition(".")[0] == imported.rpartition(".")[0]


def test_only_the_top_cli_imports_cli_modules():
    seen, problems = set(), []
    for name, imports in IMPORTS.items():
        for imp in imports:
            if imp.module is None or imp.module == name or not _is_cli(imp.module) or name in TOP_CLI:
                continue
            if _same_area_cli(name, imp.module):
                continue
            if (name, imp.module) in CLI_IMPORT_ALLOWANCES:
                seen.add((name, imp.module))
            else:
                problems.append(f"{_where(imp)} (only oea.cli, oea.__main__ and the CLI modules of the same "
                                f"package import a CLI module)")
    assert not problems, "\n".join(problems)
    stale = sorted(set(CLI_IMPORT_ALLOWANCES) - seen)
    assert not stale, f"these CLI imports are gone: remove them from CLI_IMPORT_ALLOWANCES: {stale}"


def test_the_top_cli_registers_only_cli_modules():
    from oea.cli import COMMAND_MODULES

    assert all(_is_cli(name) and name in MODULES for name in COMMAND_MODULES), COMMAND_MODULES


def test_no_tool_imports_the_report():
    problems = [_where(imp) for name, imports in IMPORTS.items()
                if not _within(name, "oea.report") and not _is_cli(name)
                for imp in imports if imp.module is not None and _within(imp.module, "oea.report")]
    assert not problems, "the report sits on top; nothing below it imports it:\n" + "\n".join(problems)


def test_core_config_and_facade_import_only_downwards():
    below_tools = {"oea.config": ("oea.routing", "oea.config"),
                   "oea": ("oea.routing", "oea.kernels", "oea.integrations")}
    problems = []
    for name, allowed in below_tools.items():
        for imp in [imp for module in IMPORTS if _within(module, name) and (name != "oea" or module == "oea")
                    for imp in IMPORTS[module]]:
            if imp.module is not None and not any(_within(imp.module, ok) for ok in allowed):
                problems.append(f"{_where(imp)} (allowed: {list(allowed)})")
            if name == "oea" and imp.module is not None and _within(imp.module, "oea.integrations") and not imp.lazy:
                problems.append(f"{_where(imp)} (the facade imports the transformers adapter lazily)")
    assert not problems, "\n".join(problems)


def test_no_engine_is_imported_at_module_level():
    problems = [_where(imp) for imports in IMPORTS.values() for imp in imports
                if not imp.lazy and imp.name.split(".")[0] in ENGINES]
    assert not problems, "engines are imported inside functions only:\n" + "\n".join(problems)


def test_importing_oea_and_building_the_cli_loads_no_engine():
    code = ("import sys, oea, oea.cli; oea.cli.build_parser(); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(ENGINES)!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize(("lazy", "typing_only"), [(False, False), (True, False), (True, True)],
                         ids=["module-level imports", "all imports", "all imports and type-only imports"])
def test_no_import_cycles(lazy, typing_only):
    cycles = find_cycles(_project_edges(lazy, typing_only))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_file_in_the_package_is_over_the_line_limit():
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    over = sorted(f"{name} ({lines} lines)" for name, lines in sizes.items()
                  if lines > MAX_LINES and name not in SIZE_ALLOWANCES)
    assert not over, f"split these files (limit {MAX_LINES} lines): {over}"
    stale = sorted(name for name in SIZE_ALLOWANCES if sizes.get(name, 0) <= MAX_LINES)
    assert not stale, f"these files are gone or small enough now: remove them from SIZE_ALLOWANCES: {stale}"


def _only_re_exports(node: ast.stmt, home: str) -> bool:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
        return True
    if isinstance(node, ast.ImportFrom):
        return node.module == home
    return isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]


def test_kept_import_paths_only_re_export_and_nothing_in_the_project_imports_them():
    problems = []
    for kept, home in KEPT_PATHS.items():
        if not all(_only_re_exports(node, home) for node in ast.parse(MODULES[kept].read_text()).body):
            problems.append(f"{kept} must only re-export {home}'s names")
        problems += [f"{_where(imp)} (import {home} instead)" for imports in IMPORTS.values() for imp in imports
                     if imp.module == kept and imp.importer != kept]
    assert not problems, "\n".join(problems)


def test_the_trace_format_is_declared_once():
    """The format's names and field lists are written in ``oea.trace_schema`` only; ``oea.traces`` and the
    engines' recorder import them (a literal copy elsewhere could drift from the format)."""
    import oea.trace_schema as schema

    strings = {schema.FORMAT_NAME, schema.PAD_PREFIX}
    lists = {schema.SPEC_FIELDS, schema.TENSOR_NAMES, schema.INTEGER_NAMES, schema.FORMAT_KEYS}
    problems = []
    for module, path in MODULES.items():
        if module == "oea.trace_schema":
            continue
        tree = ast.parse(path.read_text())
        names = {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "name"}  # a thread's
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in strings and id(node) not in names:
                problems.append(f"{path.relative_to(SRC)}:{node.lineno} writes {node.value!r}")
            elif isinstance(node, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) for e in node.elts):
                values = tuple(e.value for e in node.elts)
                if values in lists:
                    problems.append(f"{path.relative_to(SRC)}:{node.lineno} writes {values}")
    assert not problems, "use the names of oea.trace_schema:\n" + "\n".join(problems)


def _code_names(tree: ast.AST) -> set[str]:
    """Identifiers, attributes and string constants of a module's code (docstrings left out)."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
    return names


def test_the_per_batch_size_rule_is_read_in_the_core_only():
    """``batch_k0`` (a layer file's k0 by batch size) is resolved by ``oea.routing.LayerConfigs``: no adapter
    reads it, so every engine routes a batch size the same way."""
    found = [str(MODULES[name].relative_to(SRC)) for name in MODULES if _within(name, "oea.integrations")
             and "batch_k0" in _code_names(ast.parse(MODULES[name].read_text()))]
    assert not found, f"batch_k0 is read in the core (oea.routing) only, not in: {found}"


@pytest.mark.parametrize("package", ["oea.integrations", "oea.integrations.vllm", "oea.integrations.sglang",
                                     "oea.integrations.doctor", "oea.integrations.recording",
                                     "oea.integrations.transformers", "oea.launch"])
def test_each_adapter_package_docstring_lists_its_modules(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    members = sorted({name.split(".")[len(package.split("."))] for name in MODULES
                      if name.startswith(package + ".")} - {"__main__"})
    missing = [m for m in members if f"``{m}``" not in doc and f"``{m}.py``" not in doc
               and f"``{package}.{m}``" not in doc]
    assert not missing, f"{package}'s docstring does not name {missing}"


def _empty_containers_at_module_level(tree: ast.Module) -> list[int]:
    """Lines of module-level assignments of an empty dict, list or set (a process-global cache starts empty)."""
    lines = []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        empty_literal = (isinstance(value, ast.Dict) and not value.keys) or \
            (isinstance(value, (ast.List, ast.Set)) and not value.elts)
        empty_call = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and not value.args and \
            not value.keywords and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict")
        if empty_literal or empty_call:
            lines.append(node.lineno)
    return lines


def test_the_vllm_adapter_keeps_per_router_facts_in_its_one_state():
    """No process-global map keyed by router id beside the one per-process ``STATE`` (``vllm/state.py``) and each
    router's ``RouterState``: a module-level empty dict, list or set in the vLLM adapter is such a cache."""
    found = [f"{MODULES[name].relative_to(SRC)}:{line}" for name in MODULES if _within(name, "oea.integrations.vllm")
             and name != "oea.integrations.vllm.state"
             for line in _empty_containers_at_module_level(ast.parse(MODULES[name].read_text()))]
    assert not found, f"per-router or per-step caches belong on STATE or the router's RouterState: {found}"
