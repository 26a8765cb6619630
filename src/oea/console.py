"""Console helpers shared by the command-line front ends (rich is imported on use)."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def wide_console() -> Any:
    """A rich console; when output is not a terminal, wide enough that tables do not wrap."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=220)


PLAIN_PROGRESS_EVERY_S = 10.0  # a progress line at most this often when stderr is not a terminal


@contextlib.contextmanager
def progress_bar(description: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """Progress of a long command on stderr; yields a ``progress(done, total)`` callback, or ``None``.

    ``enabled`` is False for ``--json`` (and any other quiet mode): nothing is printed. On a terminal: a rich
    bar that disappears when the work is done. Otherwise (a log file, a pipe, CI): a line ``done/total`` with
    the elapsed time at the first callback and then at most every ``PLAIN_PROGRESS_EVERY_S`` seconds, so a
    long run is never silent and a log stays short. Nothing is printed before the first callback, so an
    argument error raised before the work starts stays the only line on stderr. stdout is never touched.
    """
    if not enabled:
        yield None
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn(description), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        task = bar.add_task(description, total=None)
        with bar:
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    start = time.monotonic()
    last: float | None = None

    def plain(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if last is None or now - last >= PLAIN_PROGRESS_EVERY_S:
            last = now
            print(f"{description}: {done}/{total} ({now - start:.0f} s)", file=sys.stderr, flush=True)

    yield plain


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


def format_value(value: Any, digits: int = 1) -> str:
    """A plain table cell: ``-`` for ``None``, a float with ``digits`` decimals, anything else as ``str``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_p_value(p_value: float | None) -> str:
    """A p-value for a table cell (two significant digits); ``-`` where no test ran (e.g. identical rows)."""
    return "-" if p_value is None else f"{p_value:.2g}"


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


SEED_MAX = 2**32 - 1  # numpy's seeds; torch's and random's accept these too


def seed_value(text: str) -> int:
    """``type=`` for ``--seed``: an integer in 0..2**32-1."""
    value = _parse_int(text, f"in 0..{SEED_MAX}")
    if not 0 <= value <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..{SEED_MAX}, got {text!r}")
    return value


seed_value.__name__ = "seed"


def non_empty_text(text: str) -> str:
    """``type=`` for a name that must not be empty or blank (``--name ""``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty name, got {text!r}")
    return text


non_empty_text.__name__ = "non-empty name"


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


# ---------------------------------------------------------------- output paths
# Checked before a command computes anything, so that a path it cannot write is one line naming the flag and
# nothing is written. Writability is probed by creating (and removing) an empty file where the output goes:
# permission bits say nothing for root, nor for read-only or virtual file systems.


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
    absolute = path.absolute()
    return next(p for p in (absolute, *absolute.parents) if p.exists())


def _probe_writable(folder: pathlib.Path, flag: str, given: str) -> None:
    try:
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".oea-write-check-")
    except OSError as err:
        raise ValueError(f"{flag} {given}: cannot write in {folder} ({err.strerror or err})") from None
    os.close(handle)
    os.unlink(probe)


# The file formats a plot is written in, by suffix (matplotlib's, less those that need LaTeX or give raw pixels):
# a path without one of them is refused before any work, rather than renamed or refused by matplotlib after it.
PLOT_SUFFIXES: tuple[str, ...] = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff",
                                  ".webp")


def check_output_file(path: str | os.PathLike[str], flag: str, create_folders: bool = False,
                      suffixes: tuple[str, ...] | None = None) -> pathlib.Path:
    """The file ``path`` can be written: not a folder nor a device or pipe (``/dev/full``), its name ends in one
    of ``suffixes`` (when given), its folder exists (or, with ``create_folders``, can be created) and accepts a
    new file. Raises ``ValueError`` naming ``flag``; returns ``path``."""
    target = pathlib.Path(path)
    given = str(path)
    if target.is_dir():
        raise ValueError(f"{flag} {given}: is a folder; give a file name")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag} {given}: is not a regular file (a device, pipe or socket); give a file path")
    if suffixes is not None and target.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {given}: the file name must end in one of {', '.join(suffixes)} (the format is "
                         f"taken from it), got {target.suffix or 'no suffix'!r}")
    existing = _nearest_existing(target.parent)
    if not existing.is_dir():
        raise ValueError(f"{flag} {given}: {existing} is a file, not a folder")
    if existing != target.parent.absolute() and not create_folders:
        raise ValueError(f"{flag} {given}: folder {target.parent} does not exist")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag} {given}: the file exists and is not writable")
    _probe_writable(existing, flag, given)
    return target


def check_plot_file(path: str | os.PathLike[str], flag: str = "--plot") -> pathlib.Path:
    """``check_output_file`` for a plot: its suffix (one of ``PLOT_SUFFIXES``) names the image format."""
    return check_output_file(path, flag, suffixes=PLOT_SUFFIXES)


def check_output_folder(path: str | os.PathLike[str], flag: str, empty: bool = False) -> pathlib.Path:
    """The folder ``path`` exists or can be created, and accepts new files (and, with ``empty``, holds
    nothing yet). Raises ``ValueError`` naming ``flag``; returns ``path``. Nothing is created."""
    target = pathlib.Path(path)
    given = str(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {given} exists and is not a folder")
    if empty and target.is_dir() and any(target.iterdir()):
        raise ValueError(f"{flag} {given} already exists and is not an empty directory")
    existing = _nearest_existing(target)
    if not existing.is_dir():
        raise ValueError(f"{flag} {given}: {existing} is a file, not a folder")
    _probe_writable(existing, flag, given)
    return target


def add_server_nice(p: argparse.ArgumentParser, example: str) -> None:
    """``--server-nice N`` (restart mode), for ``bench serve`` and ``eval serve`` alike; ``example``: a use."""
    p.add_argument("--server-nice", type=int, metavar="N",
                   help=f"restart mode: scheduling priority of each server and of this client, session autogroup "
                        f"included (-20..19; {example}; below 0 needs root)")
