"""The live checks of the ``oea_*`` Prometheus series on running engine servers: what the servers' ``/metrics``
say against their metrics files, and a real Prometheus server (``scripts/install_prometheus.sh``) scraping them,
through which every query of docs/grafana/oea-dashboard.json and every rule of docs/prometheus/oea-alerts.yml is
run. ``watching`` starts Prometheus (127.0.0.1, its own process group, stopped on leaving the block even on
failure) before the servers' traffic; ``Watch.collect`` gathers everything after it; the tests assert on that.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_venvs import ROOT
from server_harness import free_port, port_of, stopping_servers

from oea.integrations.doctor.live import Sample, parse_exposition

PROMETHEUS = ROOT / ".cache" / "prometheus" / "bin" / "prometheus"
PROMTOOL = ROOT / ".cache" / "prometheus" / "bin" / "promtool"
DASHBOARD = ROOT / "docs" / "grafana" / "oea-dashboard.json"
ALERTS = ROOT / "docs" / "prometheus" / "oea-alerts.yml"
INSTALL = "bash scripts/install_prometheus.sh (make install runs it)"
HANG_GUARD_S = 180.0  # a bound on each poll below, far above what it takes on a loaded 2-core machine
WINDOW = "30m"  # every range of the dashboard and the rules, widened to span the whole test run


def scrape(base_url: str, timeout: float = 30.0) -> list[Sample]:
    """Every sample of a server's ``/metrics``."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as answer:
        return parse_exposition(answer.read().decode())


def _total(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(v for n, have, v in samples if n == name and all(have.get(k) == w for k, w in labels.items()))


def file_counts(rows: list[dict[str, Any]]) -> dict[str, float]:
    """What the metrics file's lines count, under the exported series' names (``oea.integrations.prometheus``)."""
    phase = [r for r in rows if r["decode"] or r["verify"]]
    counts: dict[str, float] = {
        "forwards": len(rows),
        "decode": sum(bool(r["decode"]) for r in rows),
        "verify": sum(bool(r["verify"] and not r["decode"]) for r in rows),
        "rewritten": sum(bool(r["decode"] and r["oea"]) for r in rows),
        "decode_rows": sum(r["rows"] for r in phase),
        "active": sum(sum(r["active"]) for r in phase),
        "active_stock": sum(sum(r.get("active_stock", [])) for r in phase),
    }
    for row in phase:
        if "reason" in row:
            counts[f"reason:{row['reason']}"] = counts.get(f"reason:{row['reason']}", 0) + 1
    return counts


def scraped_counts(samples: list[Sample]) -> dict[str, float]:
    """The same counts from a server's ``oea_*`` samples (zero-valued reasons left out, as the file has none)."""
    counts = {
        "forwards": _total(samples, "oea_forwards_total"),
        "decode": _total(samples, "oea_forwards_total", phase="decode"),
        "verify": _total(samples, "oea_forwards_total", phase="verify"),
        "rewritten": _total(samples, "oea_rewritten_forwards_total"),
        "decode_rows": _total(samples, "oea_decode_rows_total"),
        "active": _total(samples, "oea_active_experts_total"),
        "active_stock": _total(samples, "oea_stock_active_experts_total"),
    }
    for name, labels, value in samples:
        if name == "oea_passthrough_forwards_total" and value:
            counts[f"reason:{labels['reason']}"] = counts.get(f"reason:{labels['reason']}", 0) + value
    return counts


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The whole lines of a metrics file (a line being written is left for the next read)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def settled(base_url: str, metrics_file: Path) -> tuple[list[Sample], list[dict[str, Any]]]:
    """The server's samples and its metrics file's lines once both hold the same forwards: the file's line count
    and the exported ``oea_metrics_file_rows_total`` equal, read after the scrape (the writer appends the lines,
    then exports them, in one flush). Polled; the hang guard bounds it."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        samples = scrape(base_url)
        rows = read_rows(metrics_file)
        written = _total(samples, "oea_metrics_file_rows_total")
        if rows and written == len(rows) == _total(samples, "oea_forwards_total"):
            return samples, rows
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{base_url}: /metrics counted {written} lines and "
                f"{_total(samples, 'oea_forwards_total')} forwards, the file has {len(rows)}"
            )
        time.sleep(0.2)  # polling a condition, not waiting for it


@dataclass
class Watch:
    """A running Prometheus scraping ``targets`` (arm -> base URL)."""

    url: str
    targets: dict[str, str]
    results: dict[str, Any] = field(default_factory=dict)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (``AssertionError`` naming the expression when Prometheus refuses)."""
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(address, timeout=60) as answer:
                found = json.loads(answer.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"Prometheus refused {expr!r}: {err.read().decode(errors='replace')}") from None
        assert found["status"] == "success", (expr, found)
        return found["data"]["result"]

    def instance(self, arm: str) -> str:
        return urllib.parse.urlsplit(self.targets[arm]).netloc

    def wait_scraped(self, totals: dict[str, float]) -> None:
        """Until Prometheus's last scrape of each arm holds ``totals[arm]`` forwards (hang guard bounds it)."""
        deadline = time.monotonic() + HANG_GUARD_S
        for arm, wanted in totals.items():
            expr = f'sum(oea_forwards_total{{instance="{self.instance(arm)}"}})'
            while True:
                got = self.query(expr)
                if got and float(got[0]["value"][1]) == wanted:
                    break
                assert time.monotonic() < deadline, f"Prometheus never scraped {arm}'s {wanted} forwards: {got}"
                time.sleep(0.5)

    def collect(self, metrics_files: dict[str, Path]) -> dict[str, Any]:
        """After the traffic: each arm's settled samples and lines, then every dashboard query and every alert
        rule's value and full expression through Prometheus."""
        arms = {arm: settled(self.targets[arm], path) for arm, path in metrics_files.items()}
        self.wait_scraped({arm: _total(samples, "oea_forwards_total") for arm, (samples, _) in arms.items()})
        out: dict[str, Any] = {
            "arms": {arm: {"scraped": scraped_counts(s), "file": file_counts(r)} for arm, (s, r) in arms.items()}
        }
        dashboard = json.loads(DASHBOARD.read_text())
        out["dashboard"] = {
            f"{panel['title']} / {target['legendFormat']}": self.query(widen(target["expr"]))
            for panel in dashboard["panels"]
            for target in panel["targets"]
        }
        out["alerts"] = {
            rule["alert"]: {
                "value": self.query(widen(value_part(rule["expr"]))),
                "fires": self.query(widen(rule["expr"])),
            }
            for rule in alert_rules()
        }
        out["instances"] = {arm: self.instance(arm) for arm in self.targets}
        return out


def widen(expr: str) -> str:
    """A dashboard query or rule with Grafana's variables filled (every model, every instance) and its ranges
    widened to ``WINDOW``, so that the whole run's traffic is in every window on a slow machine."""
    for old in ("$__rate_interval", "10m", "15m"):
        expr = expr.replace(f"[{old}]", f"[{WINDOW}]")
    return expr.replace("$model_name", ".*").replace("$instance", ".*")


def value_part(expr: str) -> str:
    """The first parenthesised group of a rule (``(VALUE) COMPARISON and on (...) (...)``, the rules' one shape)."""
    start = expr.index("(")
    depth = 0
    for i, char in enumerate(expr[start:], start):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return expr[start : i + 1]
    raise ValueError(f"unbalanced rule expression {expr!r}")


def alert_rules() -> list[dict[str, Any]]:
    import yaml

    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def promtool_check() -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on the alert rules."""
    return subprocess.run(
        [str(PROMTOOL), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=120, check=False
    )


@contextlib.contextmanager
def watching(workdir: Path, servers: dict[str, Any]) -> Iterator[Watch | None]:
    """A Prometheus server scraping ``servers`` (arm -> ``Server``) every second on 127.0.0.1, ready and holding
    a first scrape of each before the block's traffic; stopped by its process group when the block is left.
    None when the binary is missing (the tests then fail in CI and skip elsewhere, naming ``INSTALL``)."""
    if not PROMETHEUS.exists():
        yield None
        return
    from oea.launch.server_process import start_process

    targets = {arm: f"http://127.0.0.1:{port_of(server)}" for arm, server in servers.items()}
    config = workdir / "prometheus.yml"
    config.write_text(
        json.dumps(
            {  # YAML is a superset of JSON
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "oea",
                        "static_configs": [
                            {"targets": [urllib.parse.urlsplit(url).netloc for url in targets.values()]}
                        ],
                    }
                ],
            }
        )
    )
    port = free_port()
    cmd = [
        str(PROMETHEUS),
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    with stopping_servers(what="prometheus") as held:
        held["prometheus"] = start_process(
            cmd, dict(os.environ), f"http://127.0.0.1:{port}", log_path=workdir / "prometheus.log", name="prometheus"
        )
        watch = Watch(f"http://127.0.0.1:{port}", targets)
        deadline = time.monotonic() + HANG_GUARD_S
        while True:  # ready, and a first scrape of every arm (the counters' starting values)
            try:
                up = {r["metric"]["instance"] for r in watch.query("oea_enabled == 1")}
            except (OSError, AssertionError):
                up = set()
            if up >= {watch.instance(arm) for arm in targets}:
                break
            assert held["prometheus"].process.poll() is None, (workdir / "prometheus.log").read_text()
            assert time.monotonic() < deadline, f"Prometheus never scraped {targets}: {up}"
            time.sleep(0.5)
        yield watch
