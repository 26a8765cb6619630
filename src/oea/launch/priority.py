"""Scheduling priority for benchmarks on a shared machine.

A nice value alone is not enough on Linux with ``sched_autogroup`` enabled (the default on most
distributions): the scheduler first shares the CPU equally between *sessions* (autogroups) and applies
nice values only inside a session, so a ``nice -n -10`` benchmark still gets one session's share while
other users' test runs, each in a session of its own, take the rest. ``set_priority`` sets both: the
process's nice value and its session's autogroup nice (``/proc/self/autogroup``), which is what the
scheduler weighs between sessions. Below 0 needs root or CAP_SYS_NICE.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")


def has_autogroup() -> bool:
    """Whether this kernel schedules by autogroup: the file exists *and* says something (some containers
    show it empty, and a write there then has no effect)."""
    try:
        return bool(AUTOGROUP.read_text().split())
    except OSError:
        return False


def set_priority(nice: int, flag: str = "--nice") -> None:
    """Give this process (and its session's autogroup, where the kernel has one) priority ``nice`` (-20..19).

    Raises ``ValueError`` naming ``flag`` for a value out of range or one the process may not set.
    """
    if not -20 <= nice <= 19:
        raise ValueError(f"{flag} must be in -20..19, got {nice}")
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        if has_autogroup():
            AUTOGROUP.write_text(str(nice))
    except PermissionError:
        raise ValueError(f"{flag} {nice}: not permitted (below 0 needs root or CAP_SYS_NICE)") from None
