"""``python -m oea.launch.sglang <args>``: run ``sglang.launch_server`` with the OEA hooks in every process.

For SGLang < 0.5.12, which has no ``sglang.srt.plugins`` entry points. SGLang starts its scheduler
processes with ``multiprocessing`` *spawn*, which discards monkeypatches made in the launcher. Spawn
does, however, re-import the parent's ``__main__`` module in every child (as ``__mp_main__``) before
it runs the child's target. This module is that ``__main__``: its top-level code (below) installs
the hooks, so it runs again in every scheduler, DP controller and detokenizer process. SGLang's own
``__main__`` block then runs through ``runpy`` *without* replacing ``sys.modules["__main__"]``, so
the children keep re-importing this module rather than SGLang's.

On SGLang >= 0.5.12 the installed entry point already does all of this; the launcher then only
runs SGLang (it never installs the hooks twice). ``OEA_K0`` unset: SGLang runs unmodified.
A malformed ``OEA_*`` variable stops the launch with an error naming it (exit status 2).
"""

from __future__ import annotations

import logging
import runpy
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)

SGLANG_MAIN = "sglang.launch_server"


def install_hooks() -> list[str]:
    """Install the OEA hooks in this process when needed; returns the patched targets.

    Raises ``ValueError`` naming the variable when the ``OEA_*`` environment is malformed.
    """
    from oea.config import settings_from_env

    settings = settings_from_env()
    if settings.oea is None:
        return []
    from oea.integrations.sglang import install_without_registry, module_exists

    if not module_exists("sglang"):
        raise ValueError("OEA_K0 is set but sglang is not installed in this interpreter")
    if module_exists("sglang.srt.plugins"):
        return []  # SGLang >= 0.5.12: the `sglang.srt.plugins` entry point installs them in every process

    return install_without_registry(settings)


def main(argv: Sequence[str] | None = None) -> int:
    """Run SGLang's ``launch_server`` main block with ``argv`` (default: ``sys.argv[1:]``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or (args[0] in ("-h", "--help") and len(args) == 1):
        print("usage: python -m oea.launch.sglang <sglang.launch_server arguments>\n"
              "  e.g. OEA_K0=3 python -m oea.launch.sglang --model-path <model> --moe-runner-backend triton",
              file=sys.stderr)
        return 2 if not args else 0
    sys.argv = [SGLANG_MAIN, *args]
    runpy.run_module(SGLANG_MAIN, run_name="__main__", alter_sys=False)
    return 0


try:
    INSTALLED_TARGETS: list[str] = install_hooks()  # top level: runs in the launcher AND every spawned child
except ValueError as _err:
    if __name__ != "__main__":
        raise
    print(f"oea.launch.sglang: error: {_err}", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
