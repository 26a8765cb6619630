"""The soak's result as tables: one row per arm (requests by outcome, memory, health, time), then the
checks of what must hold."""

from __future__ import annotations

from typing import Any

from oea.soak.checks import memory_bound_mib


def print_result(result: dict[str, Any]) -> None:
    """Print ``session.run``'s result with rich."""
    from rich.table import Table

    from oea.console import wide_console

    console = wide_console()
    arms = Table(title="oea soak: requests per arm")
    for column in ("arm", "engine", "sent", "completed", "refused (status)", "aborted", "failed", "unsent",
                   "RSS after warm-up -> end (MiB)", "growth / bound", "health", "time (s)"):
        arms.add_column(column, justify="left" if column in ("arm", "engine", "refused (status)") else "right")
    for name, arm in result["arms"].items():
        refused = ", ".join(f"{k}: {v}" for k, v in sorted(arm["refused_by_status"].items())) or "-"
        memory = growth = "-"
        if arm.get("rss_growth_mib") is not None:
            memory = f"{arm['rss_after_warmup_mib']:.0f} -> {arm['rss_end_mib']:.0f}"
            growth = f"{arm['rss_growth_mib']:+.1f} / {memory_bound_mib(arm['rss_after_warmup_mib']):.0f}"
        health = arm["health"]
        arms.add_row(name, f"{arm['server']['engine']} {arm['server']['version']}", str(arm["sent"]),
                     str(arm["completed"]), f"{arm['refused']} ({refused})", str(arm["aborted"]), str(arm["failed"]),
                     str(arm["unsent"]), memory, growth,
                     f"{health['samples'] - health['unhealthy']}/{health['samples']} ok", f"{arm['soak_s']:.0f}")
    console.print(arms)
    checks = Table(title="what must hold")
    checks.add_column("check")
    checks.add_column("held")
    checks.add_column("seen")
    for check in result["checks"]:
        held = "yes" if check["held"] else "[bold red]NO[/]" if check.get("verdict", True) else "no (reported)"
        checks.add_row(check["name"], held, check["detail"])
    console.print(checks)
