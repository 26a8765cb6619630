"""Test support: an engine wheel's Python source read with ``ast`` straight from the ``.whl`` (a zip), without
installing or importing it, and ``HookTarget`` checks against it (``oea.integrations.hook_targets``).

Names are resolved as Python would find them statically: a class or function defined in the module or
imported into it with ``from ... import`` (followed), methods and attributes in the class or its base
classes (followed the same way).
"""

from __future__ import annotations

import ast
import zipfile
from functools import cache
from pathlib import Path

from oea.integrations.hook_targets import HookTarget

Found = tuple[str, ast.AST]  # (module, node)


class WheelSource:
    """The ``.py`` files of one wheel."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path)
        self._files = {name for name in self._zip.namelist() if name.endswith(".py")}
        self._trees: dict[str, ast.Module] = {}

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if name in self._files:
                return name
        return None

    def has_module(self, module: str) -> bool:
        return self.module_file(module) is not None

    def tree(self, module: str) -> ast.Module | None:
        name = self.module_file(module)
        if name is None:
            return None
        if name not in self._trees:
            self._trees[name] = ast.parse(self._zip.read(name).decode("utf-8"), filename=name)
        return self._trees[name]

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.module_file(module) and self.module_file(module).endswith("__init__.py") \
            else module.rsplit(".", 1)[0]
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        return f"{base}.{node.module}" if node.module else base

    def lookup(self, module: str, name: str, depth: int = 0) -> Found | None:
        """The class / function / assignment ``name`` of ``module`` (following ``from ... import``)."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        for node in _top_level(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _assigned_names(node):
                return module, node
        for node in _top_level(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = self._absolute(module, node)
                        found = self.lookup(source, alias.name, depth + 1)
                        if found is None and self.has_module(f"{source}.{alias.name}"):
                            return f"{source}.{alias.name}", self.tree(f"{source}.{alias.name}")  # type: ignore[return-value]
                        if found is not None:
                            return found
        return None

    def classes(self, module: str, name: str, depth: int = 0) -> list[Found]:
        """Class ``name`` of ``module`` and its base classes (as far as they resolve), nearest first."""
        found = self.lookup(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef) or depth > 8:
            return []
        owner, cls = found
        out = [found]
        for base in cls.bases:
            if isinstance(base, ast.Name):
                out += self.classes(owner, base.id, depth + 1)
        return out

    def member(self, module: str, qualname: str, kind: str) -> Found | None:
        """``Class.member`` (a method, property or attribute of the class or a base) or a module-level name."""
        if "." not in qualname:
            return self.lookup(module, qualname)
        cls_name, attr = qualname.split(".", 1)
        for owner, cls in self.classes(module, cls_name):
            for node in cls.body:  # type: ignore[attr-defined]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
                    return owner, node
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and attr in _assigned_names(node):
                    return owner, node
            if kind == "attribute":
                for node in ast.walk(cls):
                    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and attr in _self_attributes(node):
                        return owner, node
        return None

    def check(self, target: HookTarget) -> str | None:
        """Why ``target`` is not in this wheel as the plugin expects it (None: it is)."""
        where = f"{target.path} ({self.path.name})"
        if not self.has_module(target.module):
            return f"{where}: module {target.module} is missing"
        found = self.member(target.module, target.name, target.kind)
        if found is None:
            return f"{where}: {target.name} not found in {target.module}"
        node = found[1]
        if target.kind == "class":
            return None if isinstance(node, ast.ClassDef) else f"{where}: not a class"
        if target.kind == "attribute":
            return None
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{where}: not a function ({type(node).__name__})"
        args = node.args
        positional = [a.arg for a in (*args.posonlyargs, *args.args)]
        names = {*positional, *(a.arg for a in args.kwonlyargs)}
        if tuple(positional[: len(target.leading)]) != target.leading:
            return f"{where}: leading parameters {tuple(positional)}, expected {target.leading}"
        missing = [p for p in target.parameters if p not in names]
        if missing:
            return f"{where}: lacks parameter(s) {missing} (has {sorted(names)})"
        called = {_call_name(n) for n in ast.walk(node) if isinstance(n, ast.Call)}
        not_called = [c for c in target.calls if not called & set(c.split("|"))]
        if not_called:
            return f"{where}: does not call {not_called}"
        return None


@cache
def wheel(path: Path) -> WheelSource:
    return WheelSource(path)


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Module statements, including those under ``if`` / ``try`` at the top level."""
    out: list[ast.stmt] = []
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        out.append(node)
        if isinstance(node, ast.If):
            stack[:0] = [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            stack[:0] = [*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)]
    return out


def _assigned_names(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _self_attributes(node: ast.Assign | ast.AnnAssign | ast.AugAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    out = set()
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                out.add(sub.attr)
    return out


def _call_name(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
