"""``OEA_*`` names that OEA does not read: a typo in a launch command (``OEA_K00=3``) would otherwise serve
without OEA and without a word. The engine plugins and ``maybe_attach`` warn once per name and process with
the closest known name, as ``oea doctor`` reports it.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Mapping

from oea.config.variables import SCRIPT_VARIABLES, VARIABLES

PREFIXES = ("OEA_", "SGLANG_OEA_")
# Every name OEA knows: the table's variables, their aliases and the install scripts' variables.
KNOWN_NAMES: tuple[str, ...] = (*(name for v in VARIABLES for name in (v.name, v.alias) if name), *SCRIPT_VARIABLES)
_warned: set[str] = set()  # names already warned about in this process


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """The ``OEA_*`` / ``SGLANG_OEA_*`` names in ``env`` that OEA does not know, sorted."""
    return sorted(name for name in env if name.startswith(PREFIXES) and name not in KNOWN_NAMES)


def closest_variable(name: str) -> str | None:
    """The known name closest to ``name`` (``OEA_K00`` -> ``OEA_K0``), or None when none is close."""
    close = difflib.get_close_matches(name, KNOWN_NAMES, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_note(names: list[str]) -> str:
    """One line about ``unknown_variables`` ("" when there are none), each with its closest known name."""
    if not names:
        return ""
    said = []
    for name in names:
        close = closest_variable(name)
        said.append(f"{name} (did you mean {close}?)" if close else name)
    one = len(names) == 1
    return (f"unknown variable{'' if one else 's'} {', '.join(said)}: not read by OEA "
            f"(OEA reads {', '.join(name for name in KNOWN_NAMES if name not in SCRIPT_VARIABLES)})")


def warn_unknown_variables(env: Mapping[str, str] | None = None,
                           warn: Callable[[str], object] | None = None) -> str:
    """Warn about the unknown ``OEA_*`` names of ``env`` (default ``os.environ``) not yet warned about in this
    process: through ``warn`` (e.g. an engine's ``log.warning``) or, by default, a ``RuntimeWarning`` at the
    caller's caller. Returns the line ("" when nothing new was unknown). Never raises for a name."""
    env = os.environ if env is None else env
    names = [name for name in unknown_variables(env) if name not in _warned]
    if not names:
        return ""
    _warned.update(names)
    note = unknown_note(names)
    if warn is None:
        warnings.warn(f"oea: {note}", RuntimeWarning, stacklevel=3)
    else:
        warn(f"oea: {note}")
    return note


def forget_warned() -> None:
    """Forget which names were warned about (tests: each starts as a fresh process would)."""
    _warned.clear()
