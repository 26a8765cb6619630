"""Check that the test suite notices realistic one-line bugs (mutation check).

Each mutation in the catalogue (``scripts/mutations.toml``) replaces one exact snippet (or a list of
them) of one file under ``src/`` in a scratch copy of ``src`` (never in the working tree), runs the
tests it names with ``PYTHONPATH`` pointing at the copy (which wins over the editable install, also in
subprocesses and in the engine venvs' servers), and reports whether a test failed ("killed") or not
("SURVIVED").

    .venv/bin/python scripts/mutation_check.py --list
    .venv/bin/python scripts/mutation_check.py                      # every mutation (long)
    .venv/bin/python scripts/mutation_check.py --only sim-mixed-with-replacement eval-se-over-batches
    .venv/bin/python scripts/mutation_check.py --fast                # only tests outside slow/engine
    .venv/bin/python scripts/mutation_check.py --fast --jobs 2       # two mutations at a time

Exit status: 0 when every mutation run was killed, 1 otherwise. See docs/testing.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    sys.exit("scripts/mutation_check.py needs Python >= 3.11 (tomllib)")

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "scripts" / "mutations.toml"
FAILED_LINE = re.compile(r"^(FAILED|ERROR) (\S+)")  # ERROR (a test that cannot run) is no kill


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str  # relative to src/
    old: str | tuple[str, ...]  # a tuple: several snippets of one file, each replaced by its ``new``
    new: str | tuple[str, ...]
    tests: tuple[str, ...]
    marks: str  # pytest -m expression ("" = every test named)
    why: str


def load_catalogue(path: Path) -> list[Mutation]:
    """Read the TOML catalogue; raises ``ValueError`` naming a malformed entry."""
    data = tomllib.loads(path.read_text())
    mutations = []
    for entry in data.get("mutation", []):
        missing = sorted({"id", "file", "old", "new", "tests"} - set(entry))
        if missing:
            raise ValueError(f"{path}: mutation {entry.get('id', '?')!r} lacks fields {missing}")
        old, new = entry["old"], entry["new"]
        if isinstance(old, list) or isinstance(new, list):
            if not (isinstance(old, list) and isinstance(new, list) and len(old) == len(new) > 0):
                raise ValueError(f"{path}: mutation {entry['id']!r}: old and new must be lists of the same length")
            old, new = tuple(old), tuple(new)
        mutations.append(Mutation(entry["id"], entry["file"], old, new, tuple(entry["tests"]),
                                  entry.get("marks", "not slow and not engine"), entry.get("why", "")))
    ids = [m.id for m in mutations]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise ValueError(f"{path}: duplicated mutation ids {duplicated}")
    return mutations


def apply(mutation: Mutation, src: Path) -> str | None:
    """Apply ``mutation`` to the copy at ``src``; the reason it cannot be applied, or None."""
    target = src / mutation.file
    if not target.is_file():
        return f"{mutation.file} not found"
    text = target.read_text()
    if mutation.old == mutation.new == "":  # identity (baseline run)
        return None
    for old, new in zip(*map(snippets, (mutation.old, mutation.new)), strict=True):
        count = text.count(old)
        if count != 1:
            return f"the snippet occurs {count} times in {mutation.file} (must be exactly once)"
        text = text.replace(old, new)
    target.write_text(text)
    return None


def stale_reasons(mutation: Mutation, root: Path) -> list[str]:
    """Why ``mutation`` can no longer be judged in the tree at ``root`` (empty when it can).

    A snippet must occur exactly once in its file, and each named test file (and test function, for a
    ``file::name`` id; parameters in brackets aside) must exist: a moved test would turn the run into an
    error instead of a verdict.
    """
    reasons = []
    target = root / "src" / mutation.file
    text = target.read_text() if target.is_file() else ""
    for number, old in enumerate(snippets(mutation.old)):
        count = text.count(old)
        if count != 1:
            which = f"snippet {number + 1}" if isinstance(mutation.old, tuple) else "the snippet"
            reasons.append(f"{which} occurs {count} times in {mutation.file} (must be exactly once)")
    for test in mutation.tests:
        path, _, name = test.partition("::")
        test_file = root / path
        if not test_file.is_file():
            reasons.append(f"test file {path} not found")
            continue
        name = name.split("[")[0].split("::")[0]
        defined = rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b"
        if name and not re.search(defined, test_file.read_text(), re.M):
            reasons.append(f"{name} not found in {path}")
    return reasons


def snippets(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """A mutation's ``old`` or ``new`` as a tuple of snippets."""
    return (value,) if isinstance(value, str) else value


def run(mutation: Mutation, python: str, timeout: float) -> tuple[str, str, float]:
    """(status, detail, seconds): status is killed, SURVIVED, error or not-applied."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="oea-mutant-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        reason = apply(mutation, src)
        if reason is not None:
            return "not-applied", reason, 0.0
        env = {**os.environ, "PYTHONPATH": str(src)}
        # find_spec resolves the package as an import would (PYTHONPATH before the editable finder)
        # without running oea/__init__.py, which imports torch (seconds per mutation).
        probe = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('oea').origin)"],
                               env=env, cwd=ROOT, capture_output=True, text=True)
        if not probe.stdout.strip().startswith(str(src)):
            return "error", f"the mutant is not the imported oea: {probe.stdout.strip()} {probe.stderr[-300:]}", 0.0
        command = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests]
        if mutation.marks:
            command += ["-m", mutation.marks]
        try:
            proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "error", f"timed out after {timeout:.0f} s", time.monotonic() - started
    seconds = time.monotonic() - started
    output = proc.stdout + proc.stderr
    failed = [m.group(2) for line in output.splitlines() if (m := FAILED_LINE.match(line)) and m.group(1) == "FAILED"]
    if proc.returncode == 0:
        return "SURVIVED", "all tests passed", seconds
    if proc.returncode == 1 and failed:
        why = next((line[1:].strip() for line in output.splitlines() if line.startswith("E ")), "")
        return "killed", f"{failed[0]}  ({why[:100]})" if why else failed[0], seconds
    tail = output.strip().splitlines()[-3:]
    return "error", f"pytest exit {proc.returncode}: {' | '.join(tail)}", seconds


def baseline_failures(mutations: list[Mutation], python: str, timeout: float) -> set[tuple[tuple[str, ...], str]]:
    """The (tests, marks) selections that fail on the unmutated source (a mutation cannot be judged there)."""
    broken = set()
    for selection in dict.fromkeys((m.tests, m.marks) for m in mutations):
        identity = Mutation("baseline", mutations[0].file, "", "", *selection, "")
        status, detail, _ = run(identity, python, timeout)
        if status != "SURVIVED":
            broken.add(selection)
            print(f"baseline fails ({detail}): {' '.join(selection[0])}", flush=True)
    return broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--catalogue", type=Path, default=CATALOGUE, help="TOML file of mutations")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutation ids")
    parser.add_argument("--fast", action="store_true", help="only mutations whose tests exclude slow/engine ones")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check-snippets", action="store_true",
                        help="only check that every snippet still occurs exactly once (fast; after a refactor)")
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="interpreter for pytest")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per mutation run")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run N mutations at a time (each in its own scratch copy; default 1)")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each distinct test selection unmutated; skip those that already fail")
    parser.add_argument("--markdown", type=Path, metavar="FILE",
                        help="also write the results as a Markdown table (mutation, file, bug, result, killing test)")
    args = parser.parse_args(argv)
    try:
        mutations = load_catalogue(args.catalogue)
    except (ValueError, OSError) as err:  # tomllib.TOMLDecodeError is a ValueError
        parser.error(str(err))
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in mutations})
        if unknown:
            parser.error(f"--only names unknown mutation ids {unknown}; see --list")
        mutations = [m for m in mutations if m.id in args.only]
    if args.fast:
        mutations = [m for m in mutations if m.marks == "not slow and not engine"]
    if args.list:
        for m in mutations:
            print(f"{m.id:40s} {m.file:36s} {' '.join(m.tests)}")
        return 0
    if args.check_snippets:
        stale = 0
        for m in mutations:
            reasons = stale_reasons(m, ROOT)
            stale += bool(reasons)
            for reason in reasons:
                print(f"not-applied {m.id:40s} {reason}")
        print(f"{len(mutations) - stale}/{len(mutations)} snippets apply (and their tests exist)")
        return 0 if stale == 0 else 1
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    broken = baseline_failures(mutations, args.python, args.timeout) if args.baseline else set()

    def judge(m: Mutation) -> tuple[str, str, float]:
        if (m.tests, m.marks) in broken:
            return "error", "its tests fail without the mutation", 0.0
        status, detail, seconds = run(m, args.python, args.timeout)
        print(f"{status:11s} {m.id:40s} {seconds:6.1f} s  {detail}", flush=True)  # as each one ends
        return status, detail, seconds

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is a subprocess: threads suffice
        results = list(pool.map(judge, mutations))
    survivors = 0
    table = ["| mutation | file | the bug | result | first failing test |", "|---|---|---|---|---|"]
    for m, (status, detail, _) in zip(mutations, results, strict=True):  # the catalogue's order
        survivors += status != "killed"
        killer = detail.split("  (")[0] if status == "killed" else detail
        table.append(f"| `{m.id}` | `{m.file}` | {m.why} | {status} | `{killer}` |")
    print(f"{len(mutations) - survivors}/{len(mutations)} mutations killed")
    if args.markdown is not None:
        args.markdown.write_text("\n".join(table) + "\n")
    return 0 if survivors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
