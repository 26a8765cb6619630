"""The ``oea`` command line: one parser, each subcommand a thin call into a module.

Each area registers its own subcommands through ``register(commands, bench)`` in a small
``cli`` module of its own (parsers only; heavy imports happen inside the handlers), so the
CLI starts fast and areas stay independent.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from oea.models.lab_data import LAB_DATA_MODULE, LAB_INSTALL

# Each module defines ``register(commands, bench)`` adding parsers with ``set_defaults(handler=...)``;
# a handler takes the parsed ``argparse.Namespace`` and returns an exit code.
COMMAND_MODULES: tuple[str, ...] = (
    "oea.bench.routing.cli",
    "oea.traces.cli",
    "oea.sim.cli",
    "oea.report.cli",
    "oea.integrations.doctor.cli",
    "oea.eval.cli",
    "oea.bench.layer.cli",
    "oea.tuning.cli",
    "oea.bench.serve.cli",
    "oea.launch.cli",
    "oea.models.cli",
    "oea.bench.decode.cli",
    "oea.soak.cli",
)


# The top-level modules of the ``oea[lab]`` extra (pyproject.toml; a test keeps the two equal), the tools' data
# package among them. The evidence tools import them; routing, the kernels, the engine plugins, ``oea doctor`` and
# ``oea serve`` never do.
LAB_DEPENDENCIES: frozenset[str] = frozenset({"scipy", "rich", "matplotlib", "httpx", LAB_DATA_MODULE})


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` after a flag's help unless the help already says it, or there is
    nothing to show (``None``, ``False`` of a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if "default" in text.lower() or nothing or not action.option_strings:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``oea CMD: error: argument --flag: ...``),
    exit status 2; every subcommand parser is one of these (argparse builds subparsers of the same class)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full ``oea`` parser with every registered subcommand."""
    parser = Parser(
        prog="oea",
        description="Opportunistic Expert Activation: batch-aware decode-time MoE routing (arXiv:2511.02237).",
    )
    from oea import __version__

    parser.add_argument("--version", action="version", version=f"oea {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench_parser = commands.add_parser("bench", help="benchmarks: routing, MoE layer, serving A/B")
    bench = bench_parser.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_parser.set_defaults(handler=lambda _args: _usage(bench_parser))
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands, bench)
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``oea`` console script."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a bad flag (already reported on stderr in one line)
        return done.code if isinstance(done.code, int) else 2
    handler = getattr(args, "handler", None)
    if handler is None:
        return _usage(parser)
    try:
        return int(handler(args) or 0)
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (keeps the interpreter's final flush quiet)
        return 0
    except ModuleNotFoundError as err:  # an evidence tool run from the lean package: say what to install
        if (err.name or "").split(".")[0] not in LAB_DEPENDENCIES:
            raise
        why = str(err).removesuffix(f": {LAB_INSTALL}")  # the data's loader names the install too: name it once
        print(f"oea {_command(args)}: error: this tool needs the lab extra ({why}): {LAB_INSTALL}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"oea {_command(args)}: error: {message}", file=sys.stderr)
        return 2


def _command(args: argparse.Namespace) -> str:
    """The subcommand's words as typed (``simulate``, ``bench serve``)."""
    return " ".join(part for part in (args.command, getattr(args, "bench_command", None)) if part)


if __name__ == "__main__":
    sys.exit(main())
