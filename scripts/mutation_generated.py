"""Generated mutation testing of the files a change touched: ``make mutation`` (docs/testing.md, "Generated mutants").

mutmut (pinned in the ``dev`` extra) mutates every function of the chosen files (operators, comparisons,
constants, arguments, return values, ...) and runs, for each mutant, only the fast-suite tests that called that
function in a first stats run. It never touches the working tree: the tracked and untracked files (not the
ignored ones) are copied to a scratch tree under ``.cache/mutation-generated/tree``, mutmut runs there and writes
its ``mutants/`` folder there, and the child processes the tests start import the mutated copy too
(``PYTHONPATH``).

Which files: those under ``src/`` that differ from ``--base`` (``git diff --name-only BASE -- src`` plus
untracked ones), or ``--paths`` (files or folders). Which tests: the fast suite's selection
(``-m "not slow and not engine"``) of the test files that name one of the mutated packages (``oea.soak`` for
``src/oea/soak/checks.py``), or ``--tests``.

Prints the counts per file (killed, survived, timeout, no tests, other) and every survivor with its diff. A
survivor named in docs/testing.md's "Equivalent generated mutants" list is justified; the exit status is 1 when
an unjustified survivor remains, 2 when mutmut itself failed, else 0. ``--keep`` reruns the survivors of the
previous run against the current tests (after writing a test that should kill them) instead of starting again.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One scratch folder per run: two runs at once (two people, two changes) each set their own MUTATION_WORK.
WORK = Path(os.environ.get("MUTATION_WORK") or ROOT / ".cache" / "mutation-generated").resolve()
TREE = WORK / "tree"
DOCS = ROOT / "docs" / "testing.md"
EQUIVALENT_HEADING = "#### Equivalent generated mutants"
FAST_MARKS = "not slow and not engine"
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 37: "type check", -11: "segfault",
          -9: "segfault", None: "not checked"}
COLUMNS = ("killed", "survived", "timeout", "no tests", "not checked", "other")
# tests of the source text itself (line counts, import closure, the wheel's files), not of behaviour: mutmut's
# copies carry every mutant beside the function, so they fail on the unmutated copy
SOURCE_TEXT_TESTS = ("test_architecture.py", "test_lean_package.py", "test_lean_wheel.py")
PROGRESS = re.compile(r"(\d+)/(\d+)\s+🎉 (\d+)\s+🫥 (\d+)\s+⏰ (\d+)\s+🤔 (\d+)\s+🙁 (\d+)")
GENERATED = " # type: ignore # mutmut generated"
MUTANT_NAME = re.compile(r"`(oea(?:\.\w+)+\.x(?:_|ǁ)\S+?__mutmut_\d+)`")


def git(*args: str) -> list[str]:
    """The lines ``git`` prints for ``args``, run in the repository root."""
    out = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line]


def changed_files(base: str) -> list[str]:
    """The Python files under src/ that differ from ``base`` (committed or not) or are new and untracked."""
    names = git("diff", "--name-only", base, "--", "src") + git("ls-files", "--others", "--exclude-standard", "src")
    return sorted({n for n in names if n.endswith(".py") and (ROOT / n).is_file()})


def expand(paths: list[str]) -> list[str]:
    """Files and folders (relative to the repository root) as the Python files under src/ they name."""
    files: set[str] = set()
    for given in paths:
        path = (ROOT / given).resolve()
        if not path.is_relative_to(ROOT / "src"):
            raise SystemExit(f"mutation: {given} is not under src/")
        found = [path] if path.is_file() else sorted(path.rglob("*.py"))
        if not found:
            raise SystemExit(f"mutation: no Python file at {given}")
        files.update(str(f.relative_to(ROOT)) for f in found if f.suffix == ".py")
    return sorted(files)


def package_of(file: str) -> str:
    """The dotted package a source file belongs to (``oea.soak`` for ``src/oea/soak/checks.py``)."""
    return ".".join(Path(file).relative_to("src").parent.parts)


def test_files(files: list[str]) -> list[str]:
    """The test files outside tests/engines that name the package of one of ``files`` (not SOURCE_TEXT_TESTS)."""
    packages = sorted({package_of(f) for f in files} - {"oea"}) or ["oea"]
    pattern = re.compile("|".join(re.escape(p) + r"\b" for p in packages))
    found = [str(t.relative_to(ROOT)) for t in sorted((ROOT / "tests").rglob("test_*.py"))
             if "engines" not in t.parts and t.name not in SOURCE_TEXT_TESTS
             and pattern.search(t.read_text(encoding="utf-8", errors="replace"))]
    return found or ["tests"]


def copy_tree() -> None:
    """The working tree's tracked and untracked, not ignored, files copied to TREE (a fresh copy)."""
    if TREE.exists():
        shutil.rmtree(TREE)
    for name in git("ls-files", "--cached", "--others", "--exclude-standard"):
        source = ROOT / name
        if source.is_file():
            (TREE / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, TREE / name)
    (TREE / "src" / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")


def sync_tests() -> None:
    """The working tree's tests/ copied over TREE's and mutants/'s (``--keep``): new tests are picked up."""
    for target in (TREE / "tests", TREE / "mutants" / "tests"):
        shutil.rmtree(target, ignore_errors=True)
        for name in git("ls-files", "--cached", "--others", "--exclude-standard", "tests"):
            if (ROOT / name).is_file():
                (target / Path(name).relative_to("tests")).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target / Path(name).relative_to("tests"))


def toml_list(values: list[str]) -> str:
    """A TOML array of strings."""
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def configure(files: list[str], tests: list[str], timeout_multiplier: float) -> None:
    """TREE's pyproject.toml given a ``[tool.mutmut]`` section for ``files`` and ``tests``."""
    also_copy = sorted(p.name + ("/" if p.is_dir() else "") for p in TREE.iterdir()
                       if p.name not in ("src", "mutants", "tests", "pyproject.toml"))
    section = f"""
[tool.mutmut]
source_paths = ["src"]
only_mutate = {toml_list(files)}
also_copy = {toml_list(also_copy)}
pytest_add_cli_args = ["-m", "{FAST_MARKS}", "-p", "no:cacheprovider", "-p", "no:xdist", "--timeout", "300"]
pytest_add_cli_args_test_selection = {toml_list(tests)}
timeout_multiplier = {timeout_multiplier}
process_isolation = "fork"
"""
    with open(TREE / "pyproject.toml", "a", encoding="utf-8") as f:
        f.write(section)


# The scratch tree's src/sitecustomize.py, so on the path of every child process a test starts with the mutated
# copy (through PYTHONPATH, set here or by the test itself): they run the mutant under test (MUTANT_UNDER_TEST,
# inherited), but mutmut's own phases (the stats run records which tests call which function, in mutmut's process
# alone) become a plain run of the unmutated functions there.
SITECUSTOMIZE = """import os
if os.environ.get("MUTANT_UNDER_TEST") in ("stats", "list_all_tests", "mutant_generation"):
    os.environ["MUTANT_UNDER_TEST"] = ""
"""


def mutmut(*args: str) -> int:
    """``mutmut args`` run in TREE (the tests' child processes import the mutated copy); its output goes to
    WORK/mutmut.log, with a progress line here each minute and the log's end when it fails. Returns its status."""
    # the folder exists before the interpreter starts: a missing one would be cached as no importer for good and
    # the tests would import the working tree's src/ (the editable install) instead of the mutants
    (TREE / "mutants" / "src").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(TREE / "mutants" / "src"), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    exe = Path(sys.executable).with_name("mutmut")
    log = WORK / "mutmut.log"
    last, shown = "", time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), *args], cwd=TREE, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        while chunk := proc.stdout.read1(65536):  # type: ignore[attr-defined]
            out.write(chunk)
            found = PROGRESS.findall(chunk.decode("utf-8", errors="replace"))
            last = found[-1] if found else last
            if last and time.monotonic() - shown > 60:
                done, total, killed, no_tests, timeout, suspicious, survived = last
                print(f"mutation: {done}/{total} tested: {killed} killed, {survived} survived, {timeout} timeout, "
                      f"{no_tests} no tests, {suspicious} suspicious", flush=True)
                shown = time.monotonic()
    status = proc.wait()
    if status != 0:
        print(log.read_text(encoding="utf-8", errors="replace")[-6000:])
        print(f"mutation: mutmut {args[0]} exited with {status} (whole output: {log})")
    return status


def results() -> dict[str, dict[str, int | None]]:
    """Each mutated file's exit code per mutant name, from mutmut's ``.meta`` files."""
    out = {}
    for meta in sorted((TREE / "mutants" / "src").rglob("*.py.meta")):
        file = str(meta.relative_to(TREE / "mutants"))[: -len(".meta")]
        out[file] = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
    return out


def equivalent_mutants() -> set[str]:
    """The mutant names docs/testing.md's "Equivalent generated mutants" list justifies."""
    text = DOCS.read_text(encoding="utf-8")
    start = text.find(EQUIVALENT_HEADING)
    if start < 0:
        return set()
    end = text.find("\n#", start + len(EQUIVALENT_HEADING))
    return set(MUTANT_NAME.findall(text[start: end if end >= 0 else len(text)]))


@functools.cache
def functions_of(file: str) -> dict[str, str]:
    """The source of each function (mutants and originals) in mutmut's copy of ``file``."""
    source = (TREE / "mutants" / file).read_text(encoding="utf-8")
    lines = source.splitlines()
    return {node.name: "\n".join(lines[node.lineno - 1: node.end_lineno]).replace(node.name, "f", 1)
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def diff_of(name: str, file: str) -> str:
    """The lines one mutant changed (its function in mutmut's copy of ``file`` against the unmutated one)."""
    function = name.rsplit(".", 1)[1]
    bodies = functions_of(file)
    original = bodies.get(function.rsplit("__mutmut_", 1)[0] + "__mutmut_orig", "").splitlines()
    mutant = bodies.get(function, "").splitlines()
    lines = [ln for ln in difflib.unified_diff(original, mutant, lineterm="", n=0)
             if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    return "\n".join("      " + ln.replace(GENERATED, "") for ln in lines)


def report(codes: dict[str, dict[str, int | None]], justified: set[str]) -> tuple[list[str], list[str]]:
    """Prints the counts per file and the survivors; returns the unjustified and the justified survivors."""
    total: Counter[str] = Counter()
    print(f"\n{'file':60} " + " ".join(f"{c:>9}" for c in COLUMNS))
    survivors = []
    file_of = {}
    for file, by_name in codes.items():
        counts: Counter[str] = Counter()
        for name, code in by_name.items():
            status = STATUS.get(code, "other")
            counts[status if status in COLUMNS else "other"] += 1
            if status == "survived":
                survivors.append(name)
                file_of[name] = file
        total += counts
        print(f"{file:60} " + " ".join(f"{counts[c]:>9}" for c in COLUMNS))
    print(f"{'total (' + str(sum(total.values())) + ' mutants)':60} " + " ".join(f"{total[c]:>9}" for c in COLUMNS))
    unjustified = [s for s in survivors if s not in justified]
    equivalent = [s for s in survivors if s in justified]
    if survivors:
        print(f"\nsurvivors: {len(unjustified)} unjustified, {len(equivalent)} named equivalent in docs/testing.md")
    for name in unjustified:
        print(f"  SURVIVED {name}\n{diff_of(name, file_of[name])}")
    for name in equivalent:
        print(f"  equivalent {name}")
    no_tests = [n for by_name in codes.values() for n, c in by_name.items() if STATUS.get(c) == "no tests"]
    if no_tests:
        (WORK / "no-tests.txt").write_text("\n".join(no_tests) + "\n", encoding="utf-8")
        print(f"\n{len(no_tests)} mutants in functions no selected fast test calls: {WORK / 'no-tests.txt'}")
    return unjustified, equivalent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="the commit the change is against (default HEAD~1)")
    parser.add_argument("--paths", nargs="*", default=[], help="files or folders under src/ instead of the change")
    parser.add_argument("--tests", nargs="*", default=[], help="test files or node ids instead of the chosen ones")
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--timeout-multiplier", type=float, default=10.0,
                        help="a mutant times out after this many times its tests' CPU time, doubled (default 10)")
    parser.add_argument("--keep", action="store_true", help="rerun the previous run's survivors against the "
                        "current tests instead of starting again")
    parser.add_argument("--report", action="store_true", help="print the previous run's results, run nothing")
    args = parser.parse_args(argv)

    started = time.monotonic()
    if (args.report or args.keep) and not (TREE / "mutants").is_dir():
        raise SystemExit("mutation: no previous run in " + str(TREE))
    if args.keep:
        survivors = [n for by_name in results().values() for n, c in by_name.items() if STATUS.get(c) == "survived"]
        if survivors:
            sync_tests()
            print(f"mutation: rerunning {len(survivors)} survivors against the current tests", flush=True)
            if mutmut("run", "--max-children", str(args.jobs), *survivors) != 0:
                return 2
    elif not args.report:
        files = expand(args.paths) if args.paths else changed_files(args.base)
        if not files:
            print(f"mutation: no Python file under src/ differs from {args.base}; nothing to mutate")
            return 0
        tests = args.tests or test_files(files)
        print(f"mutation: {len(files)} files, tests: {' '.join(tests)}", flush=True)
        copy_tree()
        configure(files, tests, args.timeout_multiplier)
        if mutmut("run", "--max-children", str(args.jobs)) != 0:
            return 2
    unjustified, _ = report(results(), equivalent_mutants())
    print(f"\nmutation: {time.monotonic() - started:.0f} s; scratch tree {TREE}")
    return 1 if unjustified else 0


if __name__ == "__main__":
    sys.exit(main())
