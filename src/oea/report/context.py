"""What a report section sees: the shared ``ReportContext``, the sizes, the section registry and ``md_table``.

A section is a function ``(ctx: ReportContext) -> str`` returning Markdown; it may read what earlier
sections stored in ``ctx.results``. This module imports nothing else of the project, so any tool
can provide a section without importing the report's driver (``oea.report.build``).
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

CORE_POLICIES: tuple[str, ...] = ("vanilla", "pruned", "oea")


@dataclass(frozen=True)
class ReportSizes:
    """How much work the report does (``quick`` for tests, ``full`` for ``make demo``)."""

    batch_sizes: tuple[int, ...]
    k0s: tuple[int, ...]  # the full k0 grid, simulated at grid_batch_sizes
    grid_batch_sizes: tuple[int, ...]
    curve_k0s: tuple[int, ...]  # k0 values simulated at every batch size (T-vs-B curves, latency)
    extra_policy_k0s: tuple[int, ...]
    num_batches: int
    qwen3_layers: tuple[int, ...] | None
    capture_batch: int
    capture_prompt_tokens: int
    capture_new_tokens: int
    eval_batch_sizes: tuple[int, ...]
    eval_k0s: tuple[int, ...]
    eval_options: tuple[tuple[str, Any], ...] = ()  # extra evaluate() keywords, passed when it accepts them


FULL = ReportSizes(
    batch_sizes=(1, 2, 4, 8, 16, 32, 64), k0s=(2, 3, 4, 5, 6, 7), grid_batch_sizes=(16,), curve_k0s=(3, 5),
    extra_policy_k0s=(3, 5), num_batches=16,
    qwen3_layers=None, capture_batch=16, capture_prompt_tokens=32, capture_new_tokens=32,
    eval_batch_sizes=(4, 16), eval_k0s=(3, 5),
)
QUICK = ReportSizes(
    batch_sizes=(1, 4, 16), k0s=(2, 3, 4), grid_batch_sizes=(16,), curve_k0s=(3,), extra_policy_k0s=(3,),
    num_batches=2, qwen3_layers=(0, 16, 32, 47),
    capture_batch=4, capture_prompt_tokens=16, capture_new_tokens=4, eval_batch_sizes=(4,), eval_k0s=(3,),
    eval_options=(("positions", 4), ("generate_tokens", 0), ("num_batches", 1)),
)


@dataclass
class ReportContext:
    """State shared by the sections: output folder, sizes, console, and collected results."""

    out: pathlib.Path
    sizes: ReportSizes
    seed: int
    console: Any
    quick: bool
    results: dict[str, Any] = field(default_factory=dict)
    plots: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    served: dict[str, Any] | None = None  # oea eval serve / bench serve rows (sections.served.load_served)

    def progress(self, description: str):
        """A rich progress bar on stderr (silent when stderr is not a terminal)."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        return _ProgressCallback(Progress(
            TextColumn(f"[bold]{description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), console=self.console, transient=True, disable=not self.console.is_terminal,
        ))

    def plot(self, path: pathlib.Path) -> str:
        """Record a written plot; returns its Markdown image link (relative to the report)."""
        self.plots.append(path.name)
        return f"![{path.stem}]({path.name})"


class _ProgressCallback:
    """Context manager yielding a ``(done, total)`` callback that drives one progress bar."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.task = progress.add_task("", total=None)

    def __enter__(self) -> Callable[[int, int], None]:
        self.progress.start()
        return lambda done, total: self.progress.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


Section = Callable[[ReportContext], str]
SECTIONS: list[tuple[str, Section]] = []


def register_section(name: str, section: Section, before: str | None = None) -> None:
    """Add ``section`` to the report (at the end, or before the section called ``before``)."""
    names = [n for n, _ in SECTIONS]
    if name in names:
        raise ValueError(f"section {name!r} is already registered; sections: {names}")
    if before is None:
        SECTIONS.append((name, section))
        return
    if before not in names:
        raise ValueError(f"before must be one of {names}, got {before!r}")
    SECTIONS.insert(names.index(before), (name, section))


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats with one decimal unless already strings."""

    def cell(value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
