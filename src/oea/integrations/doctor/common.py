"""The doctor's shared pieces, used by every engine's ``doctor.py``: the check record, running a check,
installed versions and the entry-point checks (the self-tests compare routings with
``oea.routing.same_routing``).

A check is ``{"name": str, "ok": bool, "detail": str}``; ``oea.integrations.doctor.run`` collects them per
engine and prints the report.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
from collections.abc import Callable

from oea.kernels.doctor_gpu import Check, check, installed_version  # the record every doctor shares, defined lowest

__all__ = ["Check", "check", "check_call", "entry_point_checks", "installed_version", "version_tuple"]


def check_call(name: str, fn: Callable[[], str]) -> Check:
    """Run ``fn`` (returns a detail string); a raised exception becomes a failed check.

    ``RuntimeError`` carries an actionable message written for the user and is shown as is; any
    other exception is shown with its type.
    """
    try:
        return check(name, True, fn())
    except RuntimeError as err:
        return check(name, False, str(err))
    except Exception as err:
        return check(name, False, f"{type(err).__name__}: {err}")


def version_tuple(text: str) -> tuple[int, ...]:
    """The first three numbers of a version string: ``"0.5.23rc1"`` -> ``(0, 5, 23)``."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def entry_point_checks(group: str, value: str, expected: object, engine: str,
                       loads_name: str = "entry point loads") -> list[Check]:
    """Is ``value`` (``"module:function"``) registered in the entry-point ``group``, and does it load ``expected``?

    Returns the check "entry point registered" and, when it is registered, ``loads_name``.
    """
    found = [ep for ep in metadata.entry_points(group=group) if ep.value == value]
    if not found:
        return [check("entry point registered", False,
                      f"no {group!r} entry point {value!r}; reinstall oea (pip install -e . or pip install oea) "
                      f"in the interpreter that runs {engine}")]
    checks = [check("entry point registered", True, f"{group}: {found[0].name} = {value}")]
    try:
        loaded = found[0].load()
    except Exception as err:  # an import failure is what this check reports
        return [*checks, check(loads_name, False, f"{type(err).__name__}: {err}")]
    if loaded is not expected:
        return [*checks, check(loads_name, False, f"entry point loads {loaded!r}, not {value}")]
    return [*checks, check(loads_name, True, f"{value} imported")]

