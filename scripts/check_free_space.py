"""Refuses to start `make install` / `make test` on a disk too full to hold what they will write.

Without it a full disk fails the run minutes in, inside pip, with `OSError: [Errno 28] No space left on device`
in one install log among four that ran at once. Here the run stops before anything is written, with one line
naming the folder, what is free and what the missing environments take.

Sizes measured on a fresh clone (2-core x86-64, torch 2.13.0 CPU, docs/testing.md "Disk"):
.venv 3.1 GiB, .venv-vllm 3.7 GiB, .venv-sglang 3.0 GiB; pytest's and torch inductor's scratch files of one
make test run, and pip's unpacked wheels during the installs, stay under 2 GiB.

Usage: python3 scripts/check_free_space.py [--repo DIR]   (exit 0: enough room, 1: not enough, with the line)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

GIB = 1024**3
# what each environment occupies once installed, rounded up (measured, see the docstring)
ENVIRONMENT_GIB = {".venv": 3.2, ".venv-vllm": 3.8, ".venv-sglang": 3.1}
# pip's unpacked wheels during the installs, pytest's tmp_path folders and torch inductor's cache of one run
SCRATCH_GIB = 2.0


def needed_gib(repo: Path) -> tuple[float, list[str]]:
    """GiB that make test will still write under `repo` and the temp folder, and the environments it must build.

    An environment counts as built when its python exists (the install stamps are checked by make itself).
    """
    missing = [name for name in ENVIRONMENT_GIB if not (repo / name / "bin" / "python").exists()]
    return SCRATCH_GIB + sum(ENVIRONMENT_GIB[name] for name in missing), missing


def filesystem_of(path: Path) -> int:
    """The device number of the filesystem that holds `path`."""
    return os.stat(path).st_dev


def shortfall(repo: Path, temp_dir: Path) -> str | None:
    """The refusal line, or None when there is room.

    The environments go under `repo`, the scratch files under `temp_dir`; on one filesystem they add up.
    """
    need, missing = needed_gib(repo)
    repo_free = shutil.disk_usage(repo).free / GIB
    temp_free = shutil.disk_usage(temp_dir).free / GIB
    same_filesystem = filesystem_of(repo) == filesystem_of(temp_dir)
    builds = f"builds {', '.join(missing)}" if missing else "builds no environment"
    if same_filesystem:
        if repo_free < need:
            return (
                f"check_free_space: {repo_free:.1f} GiB free on the filesystem of {repo} and {temp_dir}; "
                f"make test {builds} and writes scratch files: {need:.1f} GiB needed. Free some space first."
            )
        return None
    env_need = need - SCRATCH_GIB
    if repo_free < env_need:
        return (
            f"check_free_space: {repo_free:.1f} GiB free under {repo}; make test {builds}: "
            f"{env_need:.1f} GiB needed. Free some space first."
        )
    if temp_free < SCRATCH_GIB:
        return (
            f"check_free_space: {temp_free:.1f} GiB free under the temp folder {temp_dir} (TMPDIR); make test "
            f"writes scratch files there: {SCRATCH_GIB:.1f} GiB needed. Free some space or set TMPDIR."
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    line = shortfall(args.repo.resolve(), Path(tempfile.gettempdir()).resolve())
    if line is not None:
        print(line, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
