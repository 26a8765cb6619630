"""Compile the Triton routing kernels ahead of time for CUDA targets (no GPU needed) and report per kernel,
target and specialisation the registers, spills and shared memory (``oea.kernels.aot``).

    python scripts/aot_compile.py                 # the full matrix (every served router, dtype, valid or not)
    python scripts/aot_compile.py --slice         # the representative slice `make test` compiles
    python scripts/aot_compile.py --json rows.json --markdown table.md --targets sm_90,sm_120
    python scripts/aot_compile.py --merge rows-sm_80.json rows-sm_90.json ... --markdown table.md  # no compiling

Exit status 1 when any kernel fails to compile, spills, or needs more shared memory than its target has;
each such kernel is named on stderr. The full matrix takes about half an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter's kernels cannot be compiled


def run(specialisations: Sequence, targets: Sequence, progress: bool = False) -> list:
    """``CompileResult`` of every kernel of each specialisation for each target."""
    from oea.kernels.aot import compile_specialisation

    results = []
    for target in targets:
        for specialisation in specialisations:
            for result in compile_specialisation(specialisation, target):
                results.append(result)
                if progress:
                    print(f"{target.name} {specialisation.label} {result.kernel}: "
                          f"{'ok' if result.ok else '; '.join(result.problems)} "
                          f"({result.registers} registers, {result.seconds:.1f} s)", flush=True)
    return results


def from_rows(rows: Sequence[dict]) -> list:
    """``CompileResult`` objects back from ``--json`` rows (targets and specialisations found by name)."""
    from oea.kernels import aot

    targets = {t.name: t for t in aot.TARGETS}
    specialisations = {s.label: s for s in (*aot.matrix(), *aot.SLICE)}
    fields = ("registers", "spill_stores", "spill_loads", "stack", "shared", "num_warps", "seconds", "error")
    return [aot.CompileResult(row["kernel"], targets[row["target"]], specialisations[row["specialisation"]],
                              **{f: row[f] for f in fields}) for row in rows]


def markdown(results: Sequence) -> str:
    """One row per specialisation and kernel: warps, shared memory, registers per target, spills."""
    targets = sorted({r.target.capability: r.target for r in results}.values(), key=lambda t: t.capability)
    rows: dict[tuple[str, str], dict] = {}
    for r in results:
        rows.setdefault((r.specialisation.label, r.kernel), {})[r.target.capability] = r
    head = ["specialisation", "kernel", "warps", "shared (bytes)", *(f"registers {t.name}" for t in targets),
            "spills (bytes)", "compiled"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (label, kernel), per_target in rows.items():
        found = [per_target.get(t.capability) for t in targets]
        done = [r for r in found if r is not None and r.error is None]
        shared = sorted({r.shared for r in done})
        cells = [label, kernel, "/".join(sorted({str(r.num_warps) for r in done})) or "-",
                 "/".join(str(s) for s in shared) or "-",
                 *(("-" if r is None else ("FAILED" if r.error else str(r.registers))) for r in found),
                 str(sum(r.spill_stores + r.spill_loads for r in done)),
                 f"{len(done)}/{len(targets)}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: Sequence, seconds: float) -> str:
    specialisations = {r.specialisation for r in results}
    targets = {r.target.capability for r in results}
    kernels = {r.kernel for r in results}
    failures = sum(r.error is not None for r in results)
    spills = sum(bool(r.spill_stores or r.spill_loads) for r in results)
    over = sum(r.error is None and r.shared > r.target.shared_limit for r in results)
    return (f"aot: {len(kernels)} kernels x {len(targets)} targets x {len(specialisations)} specialisations = "
            f"{len(results)} compilations in {seconds:.0f} s: {failures} compile failures, {spills} with spills, "
            f"{over} over the shared-memory limit; max registers {max((r.registers for r in results), default=0)}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slice", action="store_true", help="only the representative slice (oea.kernels.aot.SLICE)")
    parser.add_argument("--targets", default=None, help="comma-separated, e.g. sm_90,sm_120 (default: all four)")
    parser.add_argument("--json", default=None, help="write every result row to this JSON file")
    parser.add_argument("--markdown", default=None, help="write the table to this file")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="compile nothing: the table and summary of earlier --json files")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from oea.kernels import aot

    args = parse_args(argv)
    targets = list(aot.TARGETS)
    if args.targets:
        known = {t.name: t for t in aot.TARGETS}
        wanted = [name.strip() for name in args.targets.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in known]
        if unknown:
            print(f"aot_compile: --targets: unknown {unknown}; allowed: {sorted(known)}", file=sys.stderr)
            return 2
        targets = [known[name] for name in wanted]
    specialisations = list(aot.SLICE) if args.slice else aot.matrix()
    started = time.perf_counter()
    if args.merge:
        results = from_rows([row for path in args.merge for row in json.loads(pathlib.Path(path).read_text())])
    else:
        results = run(specialisations, targets, progress=True)
    table = markdown(results)
    print(table)
    print(summary(results, time.perf_counter() - started))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([r.row() for r in results], indent=1) + "\n")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table + "\n")
    bad = [r for r in results if not r.ok]
    for r in bad:
        print(f"aot_compile: {r.kernel} {r.target.name} {r.specialisation.label}: {'; '.join(r.problems)}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
