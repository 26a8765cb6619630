"""Is SGLang's piecewise-graph forward context ever set during a decode forward? A static read of released source.

The reference deployment gated OEA on ``sglang.srt.compilation.piecewise_context_manager.get_forward_context()``
holding a ``forward_batch`` in decode mode. For each SGLang source tree (an unpacked wheel, an installed
``site-packages``, or a wheel file) this prints, from the source alone (nothing is imported):

* whether ``sglang/srt/compilation/piecewise_context_manager.py`` exists;
* every call of that module's ``set_forward_context``, with file, line and enclosing ``Class.function``;
* every call of ``self.piecewise_cuda_graph_runner.<method>`` (the runners that set it), with the same;
* where ``ModelRunner._forward_raw`` sends a DECODE batch and an EXTEND batch;
* the verdict: decode never enters the context when no call site lies in ``forward_decode`` or in a decode
  graph runner (``cuda_graph_runner.py``, ``decode_cuda_graph_runner.py``, ``cpu_graph_runner.py``) and every
  piecewise-runner call comes from ``ModelRunner.forward_extend``.

Usage::

    python scripts/sglang_piecewise_audit.py TREE_OR_WHEEL ...            # Markdown table on stdout
    python scripts/sglang_piecewise_audit.py --download 0.5.9 0.5.13      # pip download --no-deps into a temp dir
    python scripts/sglang_piecewise_audit.py --json TREE ...

A static read: it follows the names above, not every possible call path (a context entered through another
name would be missed); the table says which lines it read, so each finding can be checked by eye.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from typing import Any

PCM = "sglang/srt/compilation/piecewise_context_manager.py"
DECODE_GRAPH_FILES = ("cuda_graph_runner.py", "decode_cuda_graph_runner.py", "cpu_graph_runner.py")
_IMPORTS_PCM = re.compile(r"from sglang\.srt\.compilation\.piecewise_context_manager import[^)]*?set_forward_context",
                          re.S)


def _calls(tree: ast.AST) -> list[tuple[ast.Call, str]]:
    """Every call in ``tree`` with the dotted name of its enclosing classes and functions."""
    found: list[tuple[ast.Call, str]] = []

    def visit(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            scope = [*where, child.name] if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                ast.ClassDef)) else where
            if isinstance(child, ast.Call):
                found.append((child, ".".join(where)))
            visit(child, scope)

    visit(tree, [])
    return found


def _dispatch(source: str, tree: ast.AST) -> dict[str, str]:
    """``{"decode": line, "extend": line}``: the calls ``ModelRunner._forward_raw`` makes for each mode."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_forward_raw":
            for branch in ast.walk(node):
                if not isinstance(branch, ast.If):
                    continue
                test = ast.get_source_segment(source, branch.test) or ""
                body = ast.get_source_segment(source, branch.body[0]) or ""
                for mode, method in (("decode", "forward_decode"), ("extend", "forward_extend")):
                    if f"is_{mode}(" in test and f"self.{method}(" in body and mode not in out:
                        out[mode] = f"L{branch.lineno}: if {' '.join(test.split())} -> self.{method}(...)"
    return out


def _version(root: pathlib.Path, label: str | None) -> str:
    """The release: from the wheel's name, else a ``sglang-<v>.dist-info`` beside the package, else
    ``sglang/version.py`` (which some wheels ship as 0.0.0.dev0), else the folder's name."""
    if label:
        return label
    for info in sorted(root.glob("sglang-*.dist-info")):
        return info.name.removeprefix("sglang-").removesuffix(".dist-info")
    version_file = root / "sglang" / "version.py"
    found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", version_file.read_text()) if version_file.exists() else None
    return found.group(1) if found and found.group(1) != "0.0.0.dev0" else root.name


def audit(root: pathlib.Path, label: str | None = None) -> dict[str, Any]:
    """The findings for one tree whose ``sglang/`` package lies under ``root`` (``label``: its release)."""
    report: dict[str, Any] = {"root": str(root), "version": _version(root, label),
                              "piecewise_context_manager": (root / PCM).is_file(), "set_forward_context": [],
                              "piecewise_runner_calls": [], "dispatch": {}}
    for path in sorted((root / "sglang" / "srt").rglob("*.py")):
        source = path.read_text(errors="replace")
        if "set_forward_context" not in source and "piecewise_cuda_graph_runner" not in source:
            continue
        tree = ast.parse(source)
        rel = str(path.relative_to(root))
        pcm_here = bool(_IMPORTS_PCM.search(source))
        for call, where in _calls(tree):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            site = {"file": rel, "line": call.lineno, "function": where}
            if name == "set_forward_context" and pcm_here:
                report["set_forward_context"].append(site)
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute) and \
                    func.value.attr == "piecewise_cuda_graph_runner":
                report["piecewise_runner_calls"].append({**site, "method": name})
        if rel.endswith("model_executor/model_runner.py") and report["piecewise_context_manager"]:
            report["dispatch"] = _dispatch(source, tree)
    in_decode = [s for s in report["set_forward_context"]
                 if s["function"].endswith("forward_decode") or pathlib.PurePath(s["file"]).name in DECODE_GRAPH_FILES]
    runner_outside_extend = [c for c in report["piecewise_runner_calls"]
                             if not c["function"].endswith("ModelRunner.forward_extend")]
    report["decode_sets_it"] = bool(in_decode or runner_outside_extend)
    report["verdict"] = ("module absent" if not report["piecewise_context_manager"] else
                         "set in a decode path: " + ", ".join(f"{s['file']}:{s['line']}"
                                                              for s in in_decode + runner_outside_extend)
                         if report["decode_sets_it"] else "never set during a decode forward")
    return report


def _unpack(path: pathlib.Path, into: pathlib.Path) -> tuple[pathlib.Path, str | None]:
    """``(tree, release)``: a folder as it is; a wheel's ``sglang/srt`` Python files unpacked, its release
    read from the file name (``sglang-<release>-<tags>.whl``)."""
    if path.is_dir():
        return path, None
    target = into / path.stem
    with zipfile.ZipFile(path) as wheel:
        wheel.extractall(target, [n for n in wheel.namelist() if n.startswith("sglang/srt/") and n.endswith(".py")])
    return target, path.name.split("-")[1]


def _download(versions: list[str], into: pathlib.Path) -> list[pathlib.Path]:
    wheels = []
    for version in versions:
        folder = into / f"wheel-{version}"
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={version}",
                        "-d", str(folder)], check=True)
        wheels += sorted(folder.glob("sglang-*.whl"))
    return wheels


def markdown(reports: list[dict[str, Any]]) -> str:
    lines = ["| SGLang | `piecewise_context_manager` | `set_forward_context` entered at | piecewise runner called "
             "from | `_forward_raw`: DECODE / EXTEND go to | in decode? |", "|---|---|---|---|---|---|"]
    for r in reports:
        sites = "<br>".join(f"`{s['file'].removeprefix('sglang/srt/')}:{s['line']}` {s['function']}"
                            for s in r["set_forward_context"]) or "-"
        calls = "<br>".join(f"`{c['file'].removeprefix('sglang/srt/')}:{c['line']}` {c['function']} "
                            f"(.{c['method']})" for c in r["piecewise_runner_calls"]) or "-"
        dispatch = "<br>".join(r["dispatch"][mode] for mode in ("decode", "extend") if mode in r["dispatch"]) or "-"
        lines.append(f"| {r['version']} | {'yes' if r['piecewise_context_manager'] else 'no'} | {sites} | "
                     f"{calls} | {dispatch} | {r['verdict']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", type=pathlib.Path, help="unpacked SGLang trees, site-packages or wheels")
    parser.add_argument("--download", nargs="+", default=[], metavar="VERSION",
                        help="pip download these sglang versions (--no-deps) into a temporary folder first")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    if not args.trees and not args.download:
        parser.error("give SGLang trees or wheels, or --download VERSION ...")
    missing = [str(t) for t in args.trees if not (t.is_dir() or (t.suffix == ".whl" and t.is_file()))]
    if missing:
        parser.error(f"not a folder or a .whl file: {missing}")
    with tempfile.TemporaryDirectory(prefix="sglang-audit-") as scratch:
        scratch_dir = pathlib.Path(scratch)
        sources = list(args.trees) + _download(args.download, scratch_dir)
        roots = [_unpack(source, scratch_dir) for source in sources]
        missing = [str(r) for r, _ in roots if not (r / "sglang" / "srt").is_dir()]
        if missing:
            parser.error(f"no sglang/srt package under: {missing}")
        reports = [audit(root, label) for root, label in roots]
    print(json.dumps(reports, indent=1) if args.json else markdown(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
