"""Console helpers shared by the command-line front ends (rich is imported on use)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any


def wide_console() -> Any:
    """A rich console; when output is not a terminal, wide enough that tables do not wrap."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=220)


def format_interval(value: float | None, ci: Sequence[float] | None, digits: int = 1, signed: bool = False) -> str:
    """``value`` with its 95% interval for a table cell; ``-`` for ``None``.

    A symmetric interval (Student t) shows as ``12.3 ±0.4``, an asymmetric one (bootstrap) as
    ``0.51 [0.49, 0.54]``; a missing one (a figure resting on a single item) as ``12.3 (n=1)``.
    """
    if value is None:
        return "-"
    spec = f"{'+' if signed else ''}.{digits}f"
    if ci is None:
        return f"{value:{spec}} (n=1)"
    low, high = ci
    if math.isclose(high - value, value - low, rel_tol=1e-6, abs_tol=1e-12):
        return f"{value:{spec}} ±{(high - low) / 2:.{digits}f}"
    return f"{value:{spec}} [{low:{spec}}, {high:{spec}}]"


# ---------------------------------------------------------------- argparse value types
# Each returns a function for ``add_argument(type=...)``; a bad value becomes argparse's one-line error
# naming the flag, e.g. ``argument --ep: must be an integer >= 1, got '0'``.


def int_at_least(minimum: int) -> Callable[[str], int]:
    """``type=`` for integers >= ``minimum``."""

    def parse(text: str) -> int:
        value = _parse_int(text, f">= {minimum}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def int_between(low: int, high: int) -> Callable[[str], int]:
    """``type=`` for integers in ``low..high``."""

    def parse(text: str) -> int:
        value = _parse_int(text, f"in {low}..{high}")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in {low}..{high}, got {text!r}")
        return value

    parse.__name__ = f"integer in {low}..{high}"
    return parse


def float_between(low: float, high: float | None = None, low_open: bool = False) -> Callable[[str], float]:
    """``type=`` for finite floats >= ``low`` (> ``low`` when ``low_open``) and <= ``high`` when given."""
    allowed = f"{'>' if low_open else '>='} {low}" + ("" if high is None else f" and <= {high}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text!r}")
        return value

    parse.__name__ = f"number {allowed}"
    return parse


def _parse_int(text: str, allowed: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {text!r}") from None


def check_unique(values: Sequence[Any] | None, flag: str) -> None:
    """Raise ``ValueError`` naming ``flag`` when ``values`` repeats an item (e.g. ``--policies oea oea``)."""
    seen: set[Any] = set()
    repeated = [v for v in values or () if v in seen or seen.add(v)]
    if repeated:
        raise ValueError(f"{flag} lists {sorted(set(map(str, repeated)))} more than once; give each value once")


class _SingleValue(argparse.Action):
    """``nargs="+"`` that accepts exactly one value and stores it as a one-item list."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if len(values) != 1:
            parser.error(f"argument {option_string}: this command takes one batch size, got {len(values)} "
                         f"({' '.join(map(str, values))})")
        setattr(namespace, self.dest, list(values))


def add_batch_sizes_argument(
    parser: argparse.ArgumentParser, default: Sequence[int] | None, help: str, single: bool = False,
    legacy_alias: bool = False,
) -> None:
    """``--batch-sizes B [B ...]``, the one spelling every ``oea`` command uses for decode batch sizes.

    ``single``: the command measures one batch size (exactly one value). ``legacy_alias``: also accept
    the command's former ``--batch-size`` spelling (hidden from ``--help``). Values are integers >= 1
    and land in ``args.batch_sizes`` (a list).
    """
    kwargs: dict[str, Any] = {"type": int_at_least(1), "nargs": "+", "metavar": "B"}
    if single:
        kwargs["action"] = _SingleValue
    parser.add_argument("--batch-sizes", default=None if default is None else list(default), help=help, **kwargs)
    if legacy_alias:
        parser.add_argument("--batch-size", dest="batch_sizes", default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                            **kwargs)
