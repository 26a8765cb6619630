"""``OMP_WAIT_POLICY=PASSIVE`` for the CPU benchmarks that time torch ops on several threads.

Spinning OpenMP workers on a shared machine measure the scheduler, not the op (several times slower,
docs/benchmarks.md), and libgomp reads the policy only at start-up: ``oea bench layer`` and ``oea bench decode``,
started from a shell with the variable unset, re-execute themselves once with it set. The re-executed process
says so when its measurement starts, not before: an argument error it finds stays the first (and only) line
on stderr.
"""

from __future__ import annotations

import os
import pathlib
import sys

POLICY = "OMP_WAIT_POLICY"
_REEXECUTED = "_OEA_PASSIVE_WAIT_REEXEC"  # set for the re-executed process only; not an OEA_* setting


def launched_from_shell(command: tuple[str, str]) -> bool:
    """True when this process is the ``oea`` console script (or ``python -m oea``) running ``command``."""
    launcher = pathlib.Path(sys.argv[0])
    is_oea = launcher.name == "oea" or (launcher.name == "__main__.py" and launcher.parent.name == "oea")
    return is_oea and tuple(sys.argv[1:3]) == command


def reexec_passive(command: tuple[str, str], needed: bool) -> None:
    """Replace this process by the same command with ``OMP_WAIT_POLICY=PASSIVE`` when ``needed`` (CPU, several
    threads), the policy is unset and the command came from a shell; otherwise return. Prints nothing."""
    if needed and POLICY not in os.environ and launched_from_shell(command):
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "oea", *sys.argv[1:]],
                  {**os.environ, POLICY: "PASSIVE", _REEXECUTED: "1"})


def start_note(name: str, needed: bool) -> str | None:
    """The stderr line for the start of the measurement: that this run was re-executed with the passive
    policy, or that the policy is unset where it matters (an in-process call on CPU with several threads)."""
    if os.environ.get(_REEXECUTED) == "1":
        return f"{name}: running with {POLICY}=PASSIVE (set {POLICY} to choose otherwise)"
    if needed and POLICY not in os.environ:
        return (f"{name}: note: {POLICY} is unset, so OpenMP threads spin while they wait; on a shared machine "
                f"set {POLICY}=PASSIVE before Python starts")
    return None
